//! The E2B-compatible API (docs/e2b.md): E2B's control plane (`/v2/sandboxes`, ...), the
//! in-sandbox `envd` API (Connect RPC `process.Process` and `filesystem.Filesystem`, `/files`,
//! `/health`) and the code interpreter's (`/execute`, `/contexts`), answered on a listener of their
//! own and translated to moat's sandboxes, agent and code contexts: there is no second
//! implementation of anything. E2B's official SDKs work against it when `E2B_API_URL` and
//! `E2B_SANDBOX_URL` both point at that listener: every request to a sandbox then carries the
//! `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers, which route it (49983 envd, 49999 the code
//! interpreter, any other port to that port inside the sandbox); requests without them are the
//! control plane's.

// The handlers' errors are the finished HTTP answers (E2B's error bodies), returned as they are.
#![allow(clippy::result_large_err)]

mod code;
mod connect;
mod control;
mod envd;
mod filesystem;
mod process;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::response::Response;
use axum::Router;

use crate::agent::AgentClient;
use crate::api::AppState;

/// envd's port inside an E2B sandbox.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port inside an E2B sandbox.
pub const CODE_PORT: u16 = 49999;
/// The envd version moat answers as: the level whose features moat implements. E2B's SDKs gate
/// newer features on it (file metadata needs 0.6.2, watch events with entries 0.6.3), and refuse
/// them on their own side with a clear error, which is what moat wants for what it lacks.
pub const ENVD_VERSION: &str = "0.5.7";
/// `clientID` of every sandbox (E2B's SDKs require the field and use nothing of it).
pub const CLIENT_ID: &str = "moat";

/// The E2B front's state: moat's own, plus per-sandbox caches.
pub struct E2b {
    pub app: Arc<AppState>,
    /// Each sandbox's /etc/passwd and /etc/group, for E2B's default user, home directories and the
    /// owner names of files.
    ids: Mutex<HashMap<String, Arc<Ids>>>,
    watchers: filesystem::Watchers,
    /// Sandbox hosts are `{port}-{id}.{domain}` (E2B's `get_host`); lower case, may carry a port.
    pub domain: String,
    /// The API key in E2B's form ([`e2b_api_key`]).
    key: String,
}

impl E2b {
    pub fn new(app: Arc<AppState>, domain: String) -> Arc<E2b> {
        Arc::new(E2b {
            ids: Mutex::new(HashMap::new()),
            watchers: filesystem::Watchers::default(),
            domain,
            key: e2b_api_key(&app.api_key),
            app,
        })
    }

    /// The sandbox port a `Host` of the form `{port}-{id}.{domain}` names (E2B's sandbox hosts).
    fn host_target(&self, headers: &http::HeaderMap) -> Option<(String, u16)> {
        host_target(
            &self.domain,
            headers.get(http::header::HOST)?.to_str().ok()?,
        )
    }

    /// Records an E2B request in moat's audit log (actor, `e2b METHOD path`, sandbox, status).
    async fn audit(&self, actor: String, action: String, sandbox: Option<&str>, status: u16) {
        self.app
            .audit
            .record(crate::audit::NewEntry {
                at_ms: crate::clock::now_ms(),
                actor,
                action,
                sandbox_id: sandbox.map(str::to_string),
                status: Some(i64::from(status)),
                detail: serde_json::json!({"api": "e2b"}),
            })
            .await;
    }

    /// A sandbox's users and groups (read once through its agent).
    async fn ids(&self, id: &str, agent: &AgentClient) -> Arc<Ids> {
        if let Some(p) = self.lock_ids().get(id) {
            return p.clone();
        }
        let ids = Arc::new(Ids {
            passwd: read_small_file(agent, "/etc/passwd")
                .await
                .unwrap_or_default(),
            group: read_small_file(agent, "/etc/group")
                .await
                .unwrap_or_default(),
        });
        let mut m = self.lock_ids();
        if m.len() > 4096 {
            m.clear();
        }
        m.insert(id.to_string(), ids.clone());
        ids
    }

    fn lock_ids(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Ids>>> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Who an envd call acts as: the user of `Authorization: Basic base64("name:")`, else the
    /// sandbox's default — its template's user, else `user` (E2B's default) where the sandbox has
    /// one, else root.
    async fn user_of(
        &self,
        id: &str,
        agent: &AgentClient,
        headers: &http::HeaderMap,
        query_user: Option<&str>,
    ) -> Result<User, String> {
        let ids = self.ids(id, agent).await;
        let passwd = &ids.passwd;
        // envd's Connect calls name the user in Basic auth; its `/files` in `?username=` (what the
        // SDK's `files.read/write(..., user=)` sends).
        let asked = basic_auth_user(headers)
            .or_else(|| query_user.filter(|u| !u.is_empty()).map(str::to_string));
        let name = match &asked {
            Some(n) => n.clone(),
            None => {
                let configured = self.app.sandboxes.runtime(id).ok().and_then(|r| r.user);
                match configured {
                    Some(u) => u,
                    None if passwd_home(passwd, "user").is_some() => "user".into(),
                    None => "root".into(),
                }
            }
        };
        match passwd_home(passwd, &name) {
            Some(home) => Ok(User { name, home }),
            None if name == "root" => Ok(User {
                name,
                home: "/root".into(),
            }),
            None => Err(format!("invalid username: '{name}'")),
        }
    }
}

/// The API key as E2B's SDKs want it: `e2b_` followed by hex digits (releases from 2.25.0 to
/// before the check was relaxed refuse any other form before sending it). moat's generated keys
/// are `moat_` + hex: the same hex after `e2b_`. A key of another form (set by hand) gives
/// `e2b_` + the first 40 hex digits of its SHA-256: a credential for this API derived from it,
/// which does not reveal it.
pub fn e2b_api_key(api_key: &str) -> String {
    match api_key.strip_prefix("moat_") {
        Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
            format!("e2b_{}", h.to_ascii_lowercase())
        }
        _ => {
            use sha2::Digest;
            let d = sha2::Sha256::digest(format!("moat e2b api key:{api_key}").as_bytes());
            format!("e2b_{}", &hex::encode(d)[..40])
        }
    }
}

/// `{port}-{id}.{domain}` → (id, port); None for any other host.
fn host_target(domain: &str, host: &str) -> Option<(String, u16)> {
    let host = host.trim().to_ascii_lowercase();
    let first = host.strip_suffix(domain)?.strip_suffix('.')?;
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    (port > 0 && crate::ids::valid_sandbox_id(id)).then(|| (id.to_string(), port))
}

/// A sandbox's /etc/passwd and /etc/group.
#[derive(Debug, Default)]
pub struct Ids {
    pub passwd: String,
    pub group: String,
}

impl Ids {
    /// The name of uid (or gid, with `group`), or the number when it has none.
    pub fn name(&self, id: u32, group: bool) -> String {
        let text = if group { &self.group } else { &self.passwd };
        text.lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() >= 3 && f[2] == id.to_string()).then(|| f[0].to_string())
            })
            .unwrap_or_else(|| id.to_string())
    }
}

/// A user inside a sandbox: the name moat's agent takes and the directory relative paths start in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub home: String,
}

impl User {
    /// An E2B path inside the sandbox: absolute as given, `~` and relative ones from the home.
    pub fn resolve(&self, path: &str) -> String {
        if path.starts_with('/') {
            path.to_string()
        } else if path == "~" {
            self.home.clone()
        } else if let Some(rest) = path.strip_prefix("~/") {
            format!("{}/{rest}", self.home.trim_end_matches('/'))
        } else if path.is_empty() {
            self.home.clone()
        } else {
            format!("{}/{path}", self.home.trim_end_matches('/'))
        }
    }
}

/// Decodes `%XX` escapes (and nothing else: `+`, `&` and `=` stay as they are). httpx writes
/// multipart file names this way, and E2B's SDKs quote path segments and metadata filters.
pub(crate) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The name in `Authorization: Basic base64("name:")` (how E2B's SDKs say which user).
fn basic_auth_user(headers: &http::HeaderMap) -> Option<String> {
    use base64::Engine;
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let b64 = v.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let name = s.split(':').next()?.to_string();
    (!name.is_empty()).then_some(name)
}

/// The home directory of `name` in passwd text.
fn passwd_home(passwd: &str, name: &str) -> Option<String> {
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 7 && f[0] == name).then(|| f[5].to_string())
    })
}

/// A small file of the sandbox, as text.
async fn read_small_file(agent: &AgentClient, path: &str) -> Option<String> {
    let resp = agent.read_file(path).await.ok()?;
    let bytes = crate::agent::wire::read_all(resp, 1 << 20).await.ok()?;
    String::from_utf8(bytes.to_vec()).ok()
}

/// The E2B API's router: one handler that routes by E2B's sandbox headers.
pub fn router(e2b: Arc<E2b>) -> Router {
    Router::new().fallback(dispatch).with_state(e2b)
}

async fn dispatch(State(e): State<Arc<E2b>>, req: Request) -> Response {
    let sandbox = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // E2B's two ways of naming a sandbox's port: its headers (with E2B_SANDBOX_URL), or the host
    // `sbx.get_host(port)` gave (`{port}-{id}.{domain}`).
    let target = match sandbox {
        Some(id) => {
            let port = req
                .headers()
                .get("e2b-sandbox-port")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u16>().ok())
                .unwrap_or(ENVD_PORT);
            Some((id, port))
        }
        None => e.host_target(req.headers()),
    };
    match target {
        Some((id, port)) => match port {
            ENVD_PORT => envd::handle(&e, &id, req).await,
            CODE_PORT => code::handle(&e, &id, req).await,
            p => envd::other_port(&e, &id, p, req).await,
        },
        None if req.uri().path() == "/files" && envd::is_signed(req.uri().query()) => {
            envd::signed_files(&e, req).await
        }
        None => control::handle(&e, req).await,
    }
}

/// Serves the E2B API on `addr` until the daemon stops.
pub async fn serve(
    e2b: Arc<E2b>,
    addr: std::net::SocketAddr,
    gate: Arc<crate::api::serve::Gate>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("E2B API: listen on {addr}: {e}"))?;
    tracing::info!(addr = %addr, "E2B-compatible API listening (E2B_API_URL=E2B_SANDBOX_URL=http://{addr})");
    crate::api::serve::serve(
        crate::api::serve::Listener::Tcp(listener),
        router(e2b),
        gate,
        stdin_stream,
        shutdown,
    )
    .await;
    Ok(())
}

/// envd's client stream of a process's input, which may stay quiet as long as the process runs.
fn stdin_stream(parts: &http::request::Parts) -> bool {
    parts.uri.path() == "/process.Process/StreamInput"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_hosts_of_the_domain_only() {
        let id = "sbx_abcdefghijklmnopqrstuvwx23";
        assert!(crate::ids::valid_sandbox_id(id));
        let d = "localhost:6629";
        assert_eq!(
            host_target(d, &format!("8000-{id}.localhost:6629")),
            Some((id.into(), 8000))
        );
        // Host names are case-insensitive.
        assert_eq!(
            host_target(d, &format!("8000-{}.LOCALHOST:6629", id.to_uppercase())),
            Some((id.into(), 8000))
        );
        for other in [
            format!("8000-{id}.localhost:6630"),
            format!("8000-{id}.example.com"),
            format!("8000-{id}localhost:6629"),
            format!("0-{id}.localhost:6629"),
            format!("x-{id}.localhost:6629"),
            "8000-nope.localhost:6629".to_string(),
            "localhost:6629".to_string(),
        ] {
            assert_eq!(host_target(d, &other), None, "{other}");
        }
    }

    #[test]
    fn the_e2b_form_of_a_key_is_e2b_and_hex() {
        assert_eq!(e2b_api_key("moat_00ff"), "e2b_00ff");
        assert_eq!(e2b_api_key("moat_00FF"), "e2b_00ff");
        for other in ["a hand-made key", "moat_not-hex", "moat_"] {
            let k = e2b_api_key(other);
            assert!(k.starts_with("e2b_") && k.len() == 44, "{k}");
            assert!(k[4..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!k.contains(other));
        }
        assert_ne!(e2b_api_key("one"), e2b_api_key("two"));
    }

    #[test]
    fn users_and_paths() {
        let mut h = http::HeaderMap::new();
        assert_eq!(basic_auth_user(&h), None);
        h.insert(
            http::header::AUTHORIZATION,
            "Basic cm9vdDo=".parse().unwrap(),
        );
        assert_eq!(basic_auth_user(&h).as_deref(), Some("root"));
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n";
        assert_eq!(passwd_home(passwd, "user").as_deref(), Some("/home/user"));
        assert_eq!(passwd_home(passwd, "nobody"), None);
        let ids = Ids {
            passwd: passwd.into(),
            group: "root:x:0:\nstaff:x:50:\n".into(),
        };
        assert_eq!(ids.name(1000, false), "user");
        assert_eq!(ids.name(50, true), "staff");
        assert_eq!(ids.name(77, true), "77");
        let u = User {
            name: "user".into(),
            home: "/home/user".into(),
        };
        assert_eq!(u.resolve("/etc/x"), "/etc/x");
        assert_eq!(u.resolve("a/b"), "/home/user/a/b");
        assert_eq!(u.resolve("~/c"), "/home/user/c");
        assert_eq!(u.resolve("~"), "/home/user");
        assert_eq!(
            percent_decode("/home/user/a%22b.txt"),
            "/home/user/a\"b.txt"
        );
        assert_eq!(percent_decode("/tmp/50%"), "/tmp/50%");
        assert_eq!(percent_decode("a+b&c=d"), "a+b&c=d");
    }
}
