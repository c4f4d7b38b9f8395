//! Exposed ports: HTTP and WebSocket relayed to servers inside a sandbox, in the path and host forms,
//! guarded by the API key or the sandbox's access token unless public. The relay goes through the
//! agent, so it works on the shared daemon, which runs without sandbox networking.

use futures::{SinkExt, StreamExt};
use moat_api::CreateSandboxRequest;
use moat_client::{Client, WriteOptions};
use tokio_tungstenite::tungstenite::{client::IntoClientRequest, Message};

use crate::harness::*;

/// An HTTP server on 8000 that answers with what it got (path, headers, body) and a WebSocket echo
/// server on 8001, in plain Python (no packages).
const SERVER: &str = r#"
import base64, hashlib, http.server, json, socket, struct, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def ws(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    head = data.split(b"\r\n\r\n")[0].decode()
    key = [l.split(":", 1)[1].strip() for l in head.split("\r\n") if l.lower().startswith("sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
    conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Accept: %s\r\n\r\n" % acc).encode())
    def recvn(n):
        b = b""
        while len(b) < n:
            c = conn.recv(n - len(b))
            if not c:
                raise EOFError
            b += c
        return b
    while True:
        h = recvn(2)
        op, ln = h[0] & 15, h[1] & 127
        if ln == 126:
            ln = struct.unpack(">H", recvn(2))[0]
        elif ln == 127:
            ln = struct.unpack(">Q", recvn(8))[0]
        mask = recvn(4)
        p = bytes(b ^ mask[i % 4] for i, b in enumerate(recvn(ln)))
        if op == 8:
            conn.sendall(b"\x88\x00")
            return
        if op == 1:
            out = b"echo:" + p
            hdr = bytes([0x81, len(out)]) if len(out) < 126 else bytes([0x81, 126]) + struct.pack(">H", len(out))
            conn.sendall(hdr + out)
def ws_server():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 8001))
    s.listen()
    while True:
        c, _ = s.accept()
        threading.Thread(target=ws, args=(c,), daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.reply(b"")
    def do_POST(self):
        self.reply(self.rfile.read(int(self.headers.get("content-length", 0))))
    def reply(self, body):
        out = json.dumps({"path": self.path, "method": self.command, "body": body.decode(),
                          "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a):
        pass
threading.Thread(target=ws_server, daemon=True).start()
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"#;

async fn start_servers(c: &Client, id: &str) {
    c.write_file(
        id,
        "/root/srv.py",
        SERVER.as_bytes().to_vec(),
        &WriteOptions::default(),
    )
    .await
    .unwrap();
    c.start_process_background(
        id,
        &moat_api::StartProcessRequest {
            command: Some("python3 /root/srv.py".into()),
            background: true,
            tag: Some("srv".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    for _ in 0..100 {
        let out = sh(c, id, "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8001)); socket.create_connection((\"127.0.0.1\", 8000))'").await;
        if out.exit.exit_code == Some(0) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the test servers did not start");
}

#[tokio::test(flavor = "multi_thread")]
async fn ports_relay_http_and_websocket_with_access_control() {
    let d = shared();
    let c = d.client();
    let sbx = create(&c, "base").await;
    assert_eq!(sbx.access_token.len(), 32, "{sbx:?}");
    assert!(!sbx.allow_public_traffic);
    start_servers(&c, &sbx.id).await;
    let http = reqwest::Client::new();
    let base = format!("{}/v1/sandboxes/{}/ports", d.url, sbx.id);

    // Path form with the API key: method, path, query and body arrive; moat's credentials do not.
    let resp = http
        .post(format!("{base}/8000/some/path?x=1&moat_access_token=nope"))
        .bearer_auth(d.api_key())
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(got["path"], "/some/path?x=1");
    assert_eq!(got["method"], "POST");
    assert_eq!(got["body"], "payload");
    assert!(got["headers"].get("authorization").is_none(), "{got}");

    // No credentials, a wrong token: 401. The sandbox's token (header): through, and not forwarded.
    let resp = http.get(format!("{base}/8000/")).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http
        .get(format!("{base}/8000/"))
        .header("x-moat-access-token", "wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let resp = http
        .get(format!("{base}/8000/"))
        .header("x-moat-access-token", &sbx.access_token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got: serde_json::Value = resp.json().await.unwrap();
    assert!(got["headers"].get("x-moat-access-token").is_none(), "{got}");

    // Host form, as a browser uses it: the token in the query sets a cookie; the cookie then suffices.
    let host = format!("8000-{}.preview.localhost", sbx.id);
    let resp = http
        .get(format!(
            "{}/app?moat_access_token={}",
            d.url, sbx.access_token
        ))
        .header("host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let cookie = resp
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let got: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(got["path"], "/app");
    // Any path, even one that looks like moat's API, goes to the sandbox.
    let resp = http
        .get(format!("{}/v1/sandboxes", d.url))
        .header("host", &host)
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(got["path"], "/v1/sandboxes");
    let resp = http
        .get(format!("{}/", d.url))
        .header("host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    // WebSocket through the relay.
    let mut req = format!(
        "ws://127.0.0.1:{}/v1/sandboxes/{}/ports/8001/",
        d.port, sbx.id
    )
    .into_client_request()
    .unwrap();
    req.headers_mut()
        .insert("x-moat-access-token", sbx.access_token.parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    for i in 0..3 {
        ws.send(Message::Text(format!("hello {i}"))).await.unwrap();
        let m = ws.next().await.unwrap().unwrap();
        assert_eq!(m.into_text().unwrap(), format!("echo:hello {i}"));
    }
    ws.close(None).await.unwrap();

    // Nothing listening: a clear 503.
    let resp = http
        .get(format!("{base}/9/"))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let body: moat_api::ErrorBody = resp.json().await.unwrap();
    assert!(body.error.message.contains("port 9"), "{body:?}");
    let resp = http
        .get(format!("{base}/70000/"))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    c.delete_sandbox(&sbx.id).await.unwrap();

    // A public sandbox needs no token.
    let public = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(120),
            allow_public_traffic: Some(true),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(public.allow_public_traffic);
    start_servers(&c, &public.id).await;
    let resp = http
        .get(format!(
            "{}/v1/sandboxes/{}/ports/8000/open",
            d.url, public.id
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    c.delete_sandbox(&public.id).await.unwrap();
}
