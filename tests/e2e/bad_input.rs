//! Every bad input gets a JSON error with the right status and the field it is about.

use moat_api::{ErrorBody, ErrorCode};
use serde_json::json;

use crate::harness::*;

struct Raw {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl Raw {
    fn new() -> Raw {
        let d = shared();
        Raw {
            http: reqwest::Client::new(),
            url: d.url.clone(),
            key: d.api_key(),
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> (u16, Option<ErrorBody>) {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key);
        if let Some(b) = body {
            r = r.header("content-type", "application/json").body(b);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).ok())
    }
}

fn expect(got: (u16, Option<ErrorBody>), status: u16, code: ErrorCode, field: Option<&str>) {
    let (s, body) = got;
    let body = body.unwrap_or_else(|| panic!("status {s}: body is not a JSON error"));
    assert_eq!((s, body.error.code), (status, code), "{body:?}");
    if let Some(f) = field {
        assert_eq!(body.error.field.as_deref(), Some(f), "{body:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_answers() {
    use reqwest::Method;
    let raw = Raw::new();
    let post = |b: serde_json::Value| Some(serde_json::to_vec(&b).unwrap());

    // Auth.
    let resp = raw
        .http
        .get(format!("{}/v1/sandboxes", raw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = raw
        .http
        .get(format!("{}/v1/sandboxes", raw.url))
        .bearer_auth("moat_wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let body: ErrorBody = resp.json().await.unwrap();
    assert_eq!(body.error.code, ErrorCode::Unauthorized);
    // The API also answers on the daemon's unix socket, with the same auth.
    let sock = shared().data_dir.join("api.sock");
    let curl = |args: &[&str]| {
        let o = std::process::Command::new("curl")
            .args(["-s", "--unix-socket"])
            .arg(&sock)
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let health: serde_json::Value = serde_json::from_str(&curl(&["http://moat/healthz"])).unwrap();
    assert_eq!(health["status"], "ok");
    let denied: ErrorBody = serde_json::from_str(&curl(&["http://moat/v1/sandboxes"])).unwrap();
    assert_eq!(denied.error.code, ErrorCode::Unauthorized);
    let listed: serde_json::Value = serde_json::from_str(&curl(&[
        "-H",
        &format!("Authorization: Bearer {}", raw.key),
        "http://moat/v1/sandboxes",
    ]))
    .unwrap();
    assert!(listed["sandboxes"].is_array());
    // Health and the OpenAPI document need no key.
    let doc: serde_json::Value = raw
        .http
        .get(format!("{}/openapi.json", raw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["paths"]["/v1/sandboxes"].is_object());

    // Unknown sandbox / template.
    expect(
        raw.call(
            Method::GET,
            "/v1/sandboxes/sbx_aaaaaaaaaaaaaaaaaaaaaaaaaa",
            None,
        )
        .await,
        404,
        ErrorCode::NotFound,
        Some("id"),
    );
    expect(
        raw.call(Method::DELETE, "/v1/sandboxes/nonsense", None)
            .await,
        404,
        ErrorCode::NotFound,
        Some("id"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"template": "no-such-template"})),
        )
        .await,
        404,
        ErrorCode::NotFound,
        Some("template"),
    );
    expect(
        raw.call(Method::GET, "/v1/templates/nope", None).await,
        404,
        ErrorCode::NotFound,
        Some("name"),
    );

    // Malformed JSON, unknown fields, wrong types, out of range.
    expect(
        raw.call(Method::POST, "/v1/sandboxes", Some(b"{not json".to_vec()))
            .await,
        400,
        ErrorCode::InvalidArgument,
        None,
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"tempalte": "base"})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("tempalte"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"timeout": "soon"})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("timeout"),
    );
    expect(
        raw.call(Method::POST, "/v1/sandboxes", post(json!({"timeout": 0})))
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("timeout"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"timeout": 10_000_000})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("timeout"),
    );
    expect(
        raw.call(Method::POST, "/v1/sandboxes", post(json!({"cpu": 1000})))
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("cpu"),
    );
    expect(
        raw.call(Method::POST, "/v1/sandboxes", post(json!({"memory_mb": 1})))
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("memory_mb"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"isolation": "vm"})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("isolation"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"env": {"A=B": "x"}})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("env.A=B"),
    );
    expect(
        raw.call(
            Method::POST,
            "/v1/sandboxes",
            post(json!({"template": "../etc"})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("template"),
    );
    expect(
        raw.call(Method::GET, "/v1/sandboxes?state=sleeping", None)
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("state"),
    );
    expect(
        raw.call(Method::GET, "/v1/sandboxes?colour=red", None)
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("colour"),
    );

    // Oversized body.
    let big = format!("{{\"metadata\": {{\"k\": \"{}\"}}}}", "x".repeat(2 << 20));
    expect(
        raw.call(Method::POST, "/v1/sandboxes", Some(big.into_bytes()))
            .await,
        413,
        ErrorCode::PayloadTooLarge,
        None,
    );

    // Per-sandbox requests.
    let c = shared_client();
    let s = create(&c, "base").await;
    let base = format!("/v1/sandboxes/{}", s.id);
    expect(
        raw.call(Method::POST, &format!("{base}/processes"), post(json!({})))
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("cmd"),
    );
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/processes"),
            post(json!({"cmd": ["true"], "bogus": 1})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("bogus"),
    );
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/processes"),
            post(json!({"cmd": ["true"], "user": "nobody-here"})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("user"),
    );
    expect(
        raw.call(Method::GET, &format!("{base}/processes/99999/events"), None)
            .await,
        404,
        ErrorCode::NotFound,
        None,
    );
    expect(
        raw.call(
            Method::GET,
            &format!("{base}/files?path=/no/such/file"),
            None,
        )
        .await,
        404,
        ErrorCode::NotFound,
        Some("path"),
    );
    expect(
        raw.call(Method::GET, &format!("{base}/files"), None).await,
        400,
        ErrorCode::InvalidArgument,
        Some("path"),
    );
    expect(
        raw.call(Method::GET, &format!("{base}/fs/list?path=/&depth=x"), None)
            .await,
        400,
        ErrorCode::InvalidArgument,
        Some("depth"),
    );
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/timeout"),
            post(json!({"timeout": 0})),
        )
        .await,
        400,
        ErrorCode::InvalidArgument,
        Some("timeout"),
    );
    // Wrong state: stdin of a process that has no stdin open, a signal to one that exited.
    let out = sh(&c, &s.id, "true").await;
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/processes/{}/signal", out.pid),
            post(json!({"signal": "TERM"})),
        )
        .await,
        409,
        ErrorCode::Conflict,
        None,
    );
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/processes/{}/stdin", out.pid),
            Some(b"x".to_vec()),
        )
        .await,
        409,
        ErrorCode::Conflict,
        None,
    );
    c.delete_sandbox(&s.id).await.unwrap();
    // Gone now.
    expect(
        raw.call(
            Method::POST,
            &format!("{base}/processes"),
            post(json!({"cmd": ["true"]})),
        )
        .await,
        404,
        ErrorCode::NotFound,
        Some("id"),
    );
}
