//! E2B's control plane (api.e2b.app) on moat's sandboxes: create (`/v2/sandboxes`, and v1's
//! `/sandboxes`), list with E2B's paging and metadata filter, info, kill, timeout, connect and
//! resume, pause, metrics, snapshots, fork and network. Errors are E2B's `{"code", "message"}`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use moat_api::{CreateSandboxRequest, NetworkPolicy, Sandbox, SandboxState};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{E2b, CLIENT_ID, ENVD_VERSION};
use crate::api::error::ApiError;
use crate::error::Error;

/// An E2B REST error (`{"code": <status>, "message"}`), from moat's own.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    super::envd::http_error(status, message)
}

/// moat's error (the core's, or the REST edge's) as E2B's: the REST status, the field in the message.
fn from_api(e: impl Into<ApiError>) -> Response {
    let e: ApiError = e.into();
    let status =
        StatusCode::from_u16(e.0.error.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut message = e.0.error.message;
    if let Some(f) = e.0.error.field {
        message = format!("{f}: {message}");
    }
    error(status, message)
}

/// The API key E2B's SDKs send (`X-API-KEY`): moat's key, as it is or with E2B's `e2b_` prefix, or
/// its E2B form (`<data_dir>/e2b-api-key`, [`super::e2b_api_key`]).
fn key_ok(e: &E2b, headers: &http::HeaderMap) -> bool {
    let given = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .map(str::trim);
    let key = e.app.api_key.as_bytes();
    given.is_some_and(|g| {
        let plain = g
            .strip_prefix("e2b_")
            .filter(|r| r.len() == key.len())
            .unwrap_or(g);
        // Both compared, always: the time taken says nothing about which form was close.
        let a = crate::api::constant_time_eq(plain.as_bytes(), key);
        let b = crate::api::constant_time_eq(g.as_bytes(), e.key.as_bytes());
        a | b
    })
}

pub(super) async fn handle(e: &Arc<E2b>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    if path == "/health" {
        return StatusCode::OK.into_response();
    }
    if !key_ok(e, req.headers()) {
        e.audit(
            crate::audit::ANONYMOUS.into(),
            format!("e2b {method} {path}"),
            None,
            401,
        )
        .await;
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key: send X-API-KEY with moat's API key (E2B_API_KEY, the file api-key in moat's data dir)",
        );
    }
    let segs: Vec<String> = path.trim_matches('/').split('/').map(percent).collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let query = req.uri().query().map(str::to_string);
    let idempotency_key = req
        .headers()
        .get(crate::sandboxes::IDEMPOTENCY_KEY)
        .map(|v| v.to_str().map(str::to_string));
    let body = req.into_body();
    let (resp, sandbox) = match (method.clone(), segs.as_slice()) {
        (http::Method::POST, ["v2", "sandboxes"] | ["sandboxes"]) => match create(e, body, idempotency_key).await {
            Ok((r, id)) => (r, Some(id)),
            Err(r) => (r, None),
        },
        (http::Method::GET, ["v2", "sandboxes"]) => (list(e, query.as_deref(), true), None),
        (http::Method::GET, ["sandboxes"]) => (list(e, query.as_deref(), false), None),
        (http::Method::GET, ["sandboxes", id]) => (detail(e, id), Some(id.to_string())),
        (http::Method::DELETE, ["sandboxes", id]) => (kill(e, id).await, Some(id.to_string())),
        (http::Method::POST, ["sandboxes", id, "timeout"]) => {
            (set_timeout(e, id, body).await, Some(id.to_string()))
        }
        (http::Method::POST, ["sandboxes", id, "refreshes"]) => {
            (refresh(e, id, body).await, Some(id.to_string()))
        }
        (http::Method::POST, ["v2", "sandboxes", id, "connect"] | ["sandboxes", id, "connect"]) => {
            (connect(e, id, body, false).await, Some(id.to_string()))
        }
        (http::Method::POST, ["sandboxes", id, "resume"]) => {
            (connect(e, id, body, true).await, Some(id.to_string()))
        }
        (http::Method::POST, ["sandboxes", id, "pause"]) => (pause(e, id).await, Some(id.to_string())),
        (http::Method::GET, ["sandboxes", id, "metrics"]) => (metrics(e, id).await, Some(id.to_string())),
        (http::Method::POST, ["sandboxes", id, "snapshots"]) => {
            (snapshot(e, id, body).await, Some(id.to_string()))
        }
        (http::Method::GET, ["snapshots"]) => (list_snapshots(e, query.as_deref()), None),
        (http::Method::DELETE, ["templates", name]) => (delete_template(e, name).await, None),
        (http::Method::GET, ["templates"]) => (list_templates(e), None),
        (http::Method::POST, ["sandboxes", id, "fork"]) => (fork(e, id, body).await, Some(id.to_string())),
        (http::Method::PUT, ["sandboxes", id, "network"]) => {
            (set_network(e, id, body).await, Some(id.to_string()))
        }
        (_, ["templates", ..]) | (_, ["v2", "templates", ..]) | (_, ["v3", "templates", ..]) => (
            error(
                StatusCode::NOT_IMPLEMENTED,
                "template builds through E2B's API are not supported by moat: build templates with `moat template build NAME -f moat.toml` (docs/templates.md) and name them in templateID",
            ),
            None,
        ),
        _ => (
            error(StatusCode::NOT_FOUND, format!("no E2B endpoint {method} {path}")),
            None,
        ),
    };
    let actor = crate::audit::key_id(&e.app.api_key);
    e.audit(
        actor,
        format!("e2b {method} {path}"),
        sandbox.as_deref(),
        resp.status().as_u16(),
    )
    .await;
    resp
}

/// A path segment or filter part, percent-decoded (the SDK quotes snapshot ids in
/// `DELETE /templates/{id}`).
fn percent(s: &str) -> String {
    super::percent_decode(s)
}

async fn json_body<T: serde::de::DeserializeOwned + Default>(body: Body) -> Result<T, Response> {
    let bytes = crate::api::extract::read_limited(body, 1 << 20)
        .await
        .map_err(from_api)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de).map_err(|err| {
        error(
            StatusCode::BAD_REQUEST,
            format!("{}: {}", err.path(), err.inner()),
        )
    })
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID", default)]
    template_id: Option<String>,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "allow_internet_access", default)]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    auto_pause: Option<bool>,
    #[serde(default)]
    auto_resume: Option<AutoResume>,
    #[serde(default)]
    network: Option<NetworkConfig>,
    #[serde(default)]
    mcp: Option<Value>,
    #[serde(default)]
    iam: Option<Value>,
    #[serde(default)]
    volume_mounts: Option<Vec<Value>>,
}

#[derive(Debug, Default, Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// `network` of a create, and `PUT /sandboxes/{id}/network`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkConfig {
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    #[serde(default)]
    deny_out: Option<Vec<String>>,
    #[serde(default)]
    allow_public_traffic: Option<bool>,
    #[serde(rename = "allow_internet_access", default)]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    dns_servers: Option<Vec<String>>,
    #[serde(default)]
    egress_proxy: Option<Value>,
    #[serde(default)]
    rules: Option<Value>,
    #[serde(default)]
    mask_request_host: Option<Value>,
    #[serde(default)]
    https_ports: Option<Vec<Value>>,
}

impl NetworkConfig {
    /// What moat has no equivalent for, named (E2B's answer to an unsupported feature: a 400).
    fn unsupported(&self) -> Option<&'static str> {
        if self.dns_servers.as_ref().is_some_and(|v| !v.is_empty()) {
            return Some("network.dnsServers");
        }
        if self.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
            return Some("network.egressProxy");
        }
        if self
            .rules
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &json!({}))
        {
            return Some("network.rules");
        }
        if self
            .mask_request_host
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Some("network.maskRequestHost");
        }
        if self.https_ports.as_ref().is_some_and(|v| !v.is_empty()) {
            return Some("network.httpsPorts");
        }
        None
    }

    /// moat's egress policy: E2B's allow beats deny, `allow_internet_access: false` = deny 0.0.0.0/0.
    fn policy(&self, internet: Option<bool>) -> NetworkPolicy {
        let mut deny_out = self.deny_out.clone().unwrap_or_default();
        let internet = internet.or(self.allow_internet_access).unwrap_or(true);
        if !internet && !deny_out.iter().any(|d| d == "0.0.0.0/0") {
            deny_out.push("0.0.0.0/0".into());
        }
        NetworkPolicy {
            allow_internet: internet,
            allow_out: self.allow_out.clone().unwrap_or_default(),
            deny_out,
            ..Default::default()
        }
    }
}

fn unsupported(what: &str) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        format!("{what} is not supported by this server (moat)"),
    )
}

/// moat's template for an E2B template id: a snapshot by id or name, else a template
/// (`code-interpreter-v1`, the code interpreter SDK's default, is moat's `code-interpreter`).
fn resolve_template(e: &E2b, t: &str) -> (Option<String>, Option<String>) {
    if let Ok(s) = e.app.snapshots.get(t) {
        return (None, Some(s.id));
    }
    let known = |n: &str| e.app.templates.exists(n);
    let name = match t {
        "code-interpreter-v1" | "code-interpreter-stateful" if !known(t) => "code-interpreter",
        other => other,
    };
    (Some(name.to_string()), None)
}

/// E2B's `Sandbox` (create, connect, fork answers).
fn sandbox_json(e: &E2b, s: &Sandbox, template_id: &str) -> Value {
    json!({
        "templateID": template_id,
        "sandboxID": s.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": s.access_token,
        "trafficAccessToken": s.access_token,
        "domain": e.domain,
    })
}

fn template_id_of(s: &Sandbox) -> String {
    s.metadata
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| s.template.clone())
}

/// The E2B template id a sandbox was created with (kept beside moat's own template name, which may
/// differ: `code-interpreter-v1` runs moat's `code-interpreter`).
const TEMPLATE_LABEL: &str = "e2b.template";

async fn create(
    e: &Arc<E2b>,
    body: Body,
    idempotency_key: Option<Result<String, http::header::ToStrError>>,
) -> Result<(Response, String), Response> {
    let key = idempotency_key.transpose().map_err(|_| {
        error(
            StatusCode::BAD_REQUEST,
            "Idempotency-Key: an Idempotency-Key is visible ASCII",
        )
    })?;
    let req: NewSandbox = json_body(body).await?;
    let template_id = req.template_id.clone().unwrap_or_else(|| "base".into());
    if req.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("mcp"));
    }
    if req.iam.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("iam"));
    }
    if req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(unsupported("volumeMounts"));
    }
    let net = req.network.unwrap_or_default();
    if let Some(what) = net.unsupported() {
        return Err(unsupported(what));
    }
    let (template, snapshot) = resolve_template(e, &template_id);
    let mut metadata = req.metadata.unwrap_or_default();
    metadata.insert(TEMPLATE_LABEL.into(), template_id.clone());
    let wants_network = req.allow_internet_access.is_some()
        || net.allow_out.is_some()
        || net.deny_out.is_some()
        || net.allow_internet_access.is_some();
    let network_on = e.app.sandboxes.networking_default();
    let network = match (wants_network, network_on) {
        (true, true) => Some(net.policy(req.allow_internet_access)),
        // A daemon without sandbox networking: "no internet" is what every sandbox has already.
        // `allow_internet_access: true` and nothing else is E2B's default, which older SDK releases
        // send on every create (2.25.0 does): the daemon's default, like an absent field.
        (true, false)
            if req.allow_internet_access == Some(true)
                && net.allow_out.is_none()
                && net.deny_out.is_none()
                && net.allow_internet_access.is_none() =>
        {
            None
        }
        (true, false)
            if !net.policy(req.allow_internet_access).allow_internet
                && net.allow_out.as_ref().is_none_or(|a| a.is_empty()) =>
        {
            None
        }
        (true, false) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "network: sandbox networking is off on this daemon (moat serve --network none)",
            ))
        }
        _ => None,
    };
    let create = CreateSandboxRequest {
        template,
        snapshot,
        timeout: req.timeout,
        metadata,
        env: req.env_vars.unwrap_or_default(),
        on_timeout: req.auto_pause.map(|p| {
            if p {
                moat_api::OnTimeout::Pause
            } else {
                moat_api::OnTimeout::Kill
            }
        }),
        network,
        // E2B's ports are public unless `allowPublicTraffic: false` (then they need the
        // sandbox's traffic token), and so are those of a sandbox made through this API.
        allow_public_traffic: Some(net.allow_public_traffic.unwrap_or(true)),
        // E2B's `lifecycle.auto_resume`: a paused sandbox wakes on a request or port traffic.
        auto_resume: req.auto_resume.as_ref().map(|a| a.enabled),
        ..Default::default()
    };
    let made = match key {
        Some(k) => e
            .app
            .sandboxes
            .create_once(&k, create)
            .await
            .map(|(s, _)| s),
        None => e.app.sandboxes.create(create).await,
    };
    let s = made.map_err(|err| {
        let not_found = matches!(err, Error::NotFound { .. }) || err.field() == Some("template");
        if not_found {
            error(
                StatusCode::NOT_FOUND,
                format!("template '{template_id}' not found: {}", err),
            )
        } else {
            from_api(err)
        }
    })?;
    let id = s.id.clone();
    Ok((
        (
            StatusCode::CREATED,
            axum::Json(sandbox_json(e, &s, &template_id)),
        )
            .into_response(),
        id,
    ))
}

/// E2B's `ListedSandbox` / `SandboxDetail`.
fn listed(e: &E2b, s: &Sandbox, detail: bool) -> Value {
    let mut metadata = s.metadata.clone();
    metadata.remove(TEMPLATE_LABEL);
    let mut v = json!({
        "templateID": template_id_of(s),
        "alias": template_id_of(s),
        "sandboxID": s.id,
        "clientID": CLIENT_ID,
        "startedAt": s.created_at,
        "endAt": s.expires_at,
        "cpuCount": s.cpu.ceil().max(1.0) as i64,
        "memoryMB": s.memory_mb,
        "diskSizeMB": if s.limits.disk_mb > 0 { s.limits.disk_mb } else { e.app.sandboxes.host_disk_mb() },
        "metadata": metadata,
        "state": if s.state == SandboxState::Paused { "paused" } else { "running" },
        "envdVersion": ENVD_VERSION,
    });
    if detail {
        v["envdAccessToken"] = json!(s.access_token);
        v["domain"] = json!(e.domain);
        v["allowInternetAccess"] = json!(s.network.as_ref().map(|n| n.policy.allow_internet));
        v["lifecycle"] = json!({
            "autoResume": s.auto_resume,
            "onTimeout": s.on_timeout.as_str(),
        });
        if let Some(n) = &s.network {
            v["network"] = json!({
                "allowOut": n.policy.allow_out,
                "denyOut": n.policy.deny_out,
                "allowPublicTraffic": s.allow_public_traffic,
            });
        }
    }
    v
}

fn list(e: &E2b, query: Option<&str>, v2: bool) -> Response {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let filter = match get("metadata").map(|m| metadata_filter(&m)) {
        Some(Ok(f)) => f,
        Some(Err(msg)) => return error(StatusCode::BAD_REQUEST, msg),
        None => BTreeMap::new(),
    };
    let states: Vec<String> = get("state")
        .map(|s| {
            s.split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect()
        })
        .unwrap_or_else(|| {
            if v2 {
                vec!["running".into(), "paused".into()]
            } else {
                vec!["running".into()]
            }
        });
    for s in &states {
        if s != "running" && s != "paused" {
            return error(
                StatusCode::BAD_REQUEST,
                format!("state {s:?} must be running or paused"),
            );
        }
    }
    let limit = match get("limit").map(|l| l.parse::<usize>()) {
        None => 100,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        _ => return error(StatusCode::BAD_REQUEST, "limit must be 1..=100"),
    };
    let offset = match get("nextToken")
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<usize>())
    {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "nextToken is not one this server gave",
            )
        }
    };
    let template = get("template");
    let started_after = get("startedAfter");
    let all = match e.app.sandboxes.list(&Default::default()) {
        Ok(a) => a,
        Err(err) => return from_api(err),
    };
    let mut matching: Vec<&Sandbox> = all
        .iter()
        .filter(|s| {
            !s.metadata
                .contains_key(crate::sandboxes::builds::BUILD_LABEL)
        })
        .filter(|s| {
            let st = if s.state == SandboxState::Paused {
                "paused"
            } else if s.state == SandboxState::Running {
                "running"
            } else {
                ""
            };
            states.iter().any(|x| x == st)
        })
        .filter(|s| filter.iter().all(|(k, v)| s.metadata.get(k) == Some(v)))
        .filter(|s| {
            template
                .as_ref()
                .is_none_or(|t| &template_id_of(s) == t || &s.template == t)
        })
        .filter(|s| {
            started_after
                .as_ref()
                .is_none_or(|t| later_or_equal(&s.created_at, t))
        })
        .collect();
    matching.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    if get("order").as_deref() != Some("asc") {
        matching.reverse();
    }
    if !v2 {
        let items: Vec<Value> = matching.iter().map(|s| listed(e, s, false)).collect();
        return axum::Json(items).into_response();
    }
    let page: Vec<Value> = matching
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| listed(e, s, false))
        .collect();
    let mut resp = axum::Json(page).into_response();
    if offset + limit < matching.len() {
        if let Ok(v) = http::HeaderValue::from_str(&(offset + limit).to_string()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    resp
}

/// Whether RFC 3339 time `a` is at or after `b` (both parsed; unparseable ones compare as text).
fn later_or_equal(a: &str, b: &str) -> bool {
    match (humantime::parse_rfc3339_weak(a), parse_iso(b)) {
        (Ok(x), Some(y)) => x >= y,
        _ => a >= b,
    }
}

/// `datetime.isoformat()`'s forms: `2024-01-01T00:00:00+00:00`, with or without fractions.
fn parse_iso(s: &str) -> Option<std::time::SystemTime> {
    let s = s.trim();
    let (base, offset_secs) = match s.rfind(['+', '-']) {
        Some(i) if i > 10 => {
            let (b, off) = s.split_at(i);
            let sign = if off.starts_with('-') { -1 } else { 1 };
            let hm: Vec<&str> = off[1..].split(':').collect();
            let h: i64 = hm.first()?.parse().ok()?;
            let m: i64 = hm.get(1).map_or(Some(0), |m| m.parse().ok())?;
            (b, sign * (h * 3600 + m * 60))
        }
        _ => (s.trim_end_matches('Z'), 0),
    };
    let t = humantime::parse_rfc3339_weak(base).ok()?;
    let shift = std::time::Duration::from_secs(offset_secs.unsigned_abs());
    Some(if offset_secs >= 0 {
        t - shift
    } else {
        t + shift
    })
}

/// E2B's metadata filter: `k=v&k2=v2` with keys and values percent-encoded (the SDK encodes the whole
/// thing again, and the query once more).
fn metadata_filter(m: &str) -> Result<BTreeMap<String, String>, String> {
    let once = percent(m);
    let mut out = BTreeMap::new();
    for pair in once.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("metadata filter {pair:?} is not key=value"))?;
        out.insert(percent(k), percent(v));
    }
    Ok(out)
}

fn detail(e: &E2b, id: &str) -> Response {
    match e.app.sandboxes.get(id) {
        Ok(s) => axum::Json(listed(e, &s, true)).into_response(),
        Err(err) => not_found_or(err, id),
    }
}

fn not_found_or(err: Error, id: &str) -> Response {
    if matches!(err, Error::NotFound { .. }) {
        error(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
    } else {
        from_api(err)
    }
}

async fn kill(e: &E2b, id: &str) -> Response {
    match e.app.sandboxes.delete(id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => not_found_or(err, id),
    }
}

#[derive(Debug, Default, Deserialize)]
struct Timeout {
    #[serde(default)]
    timeout: Option<u64>,
}

async fn set_timeout(e: &E2b, id: &str, body: Body) -> Response {
    let t: Timeout = match json_body(body).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let Some(timeout) = t.timeout else {
        return error(StatusCode::BAD_REQUEST, "timeout is missing");
    };
    match e.app.sandboxes.set_timeout(id, timeout) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => not_found_or(err, id),
    }
}

#[derive(Debug, Default, Deserialize)]
struct Refresh {
    #[serde(default)]
    duration: Option<u64>,
}

/// v1's keep-alive: the timeout becomes `duration` seconds from now (at least what is left).
async fn refresh(e: &E2b, id: &str, body: Body) -> Response {
    let r: Refresh = match json_body(body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    match e
        .app
        .sandboxes
        .set_timeout(id, r.duration.unwrap_or(60).max(1))
    {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => not_found_or(err, id),
    }
}

/// `connect` (and v1 `resume`): a paused sandbox is resumed; a running one gets the timeout, when
/// given. Answers E2B's `Sandbox`.
async fn connect(e: &E2b, id: &str, body: Body, resume_only: bool) -> Response {
    let t: Timeout = match json_body(body).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let s = match e.app.sandboxes.get(id) {
        Ok(s) => s,
        Err(err) => return not_found_or(err, id),
    };
    let status = if s.state == SandboxState::Paused {
        let resumed = e
            .app
            .sandboxes
            .resume(id, moat_api::ResumeRequest { timeout: t.timeout })
            .await;
        if let Err(err) = resumed {
            return from_api(err);
        }
        StatusCode::CREATED
    } else if resume_only {
        return error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        );
    } else {
        if let Some(timeout) = t.timeout {
            // Connect only ever extends: E2B keeps the later of the two ends.
            let left = humantime::parse_rfc3339_weak(&s.expires_at)
                .ok()
                .and_then(|end| end.duration_since(std::time::SystemTime::now()).ok())
                .map_or(0, |d| d.as_secs());
            if timeout > left {
                if let Err(err) = e.app.sandboxes.set_timeout(id, timeout) {
                    return from_api(err);
                }
            }
        }
        StatusCode::OK
    };
    match e.app.sandboxes.get(id) {
        Ok(s) => (status, axum::Json(sandbox_json(e, &s, &template_id_of(&s)))).into_response(),
        Err(err) => from_api(err),
    }
}

async fn pause(e: &E2b, id: &str) -> Response {
    match e.app.sandboxes.pause(id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) if matches!(err, Error::Conflict(_)) => {
            error(StatusCode::CONFLICT, err.to_string())
        }
        Err(err) => not_found_or(err, id),
    }
}

async fn metrics(e: &E2b, id: &str) -> Response {
    let st = match e.app.sandboxes.stats(id).await {
        Ok(s) => s,
        Err(err) => return not_found_or(err, id),
    };
    let now = crate::clock::now_ms();
    let cpus = st.limits.cpu.ceil().max(1.0);
    let disk_total = if st.limits.disk_mb > 0 {
        st.limits.disk_mb << 20
    } else {
        e.app.sandboxes.host_disk_mb() << 20
    };
    let m = json!([{
        "timestamp": crate::clock::rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": cpus as i64,
        "cpuUsedPct": (st.cpu_cores / cpus * 1000.0).round() / 10.0,
        "memUsed": st.memory_bytes,
        "memTotal": st.limits.memory_mb << 20,
        "memCache": 0,
        "diskUsed": st.disk_bytes,
        "diskTotal": disk_total,
    }]);
    axum::Json(m).into_response()
}

#[derive(Debug, Default, Deserialize)]
struct NewSnapshot {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    memory: Option<bool>,
}

fn snapshot_json(s: &moat_api::Snapshot) -> Value {
    json!({"snapshotID": s.id, "names": s.name.iter().collect::<Vec<_>>()})
}

async fn snapshot(e: &E2b, id: &str, body: Body) -> Response {
    let req: NewSnapshot = match json_body(body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let kind = req.memory.map(|m| {
        if m {
            moat_api::SnapshotKind::Full
        } else {
            moat_api::SnapshotKind::Filesystem
        }
    });
    let made = e
        .app
        .snapshots
        .snapshot(
            id,
            moat_api::CreateSnapshotRequest {
                name: req.name,
                kind,
                metadata: BTreeMap::new(),
            },
        )
        .await;
    match made {
        Ok(s) => (StatusCode::CREATED, axum::Json(snapshot_json(&s))).into_response(),
        Err(err) => not_found_or(err, id),
    }
}

fn list_snapshots(e: &E2b, query: Option<&str>) -> Response {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let (sandbox, name) = (get("sandboxID"), get("name"));
    match e.app.snapshots.list() {
        Ok(all) => {
            let v: Vec<Value> = all
                .iter()
                .filter(|s| sandbox.as_ref().is_none_or(|x| &s.sandbox_id == x))
                .filter(|s| name.as_ref().is_none_or(|x| s.name.as_ref() == Some(x)))
                .map(snapshot_json)
                .collect();
            axum::Json(v).into_response()
        }
        Err(err) => from_api(err),
    }
}

/// `DELETE /templates/{id}`: E2B deletes snapshots (and templates) this way.
async fn delete_template(e: &E2b, name: &str) -> Response {
    if e.app.snapshots.get(name).is_ok() {
        return match e.app.snapshots.delete(name) {
            Ok(()) => StatusCode::NO_CONTENT.into_response(),
            Err(err) => from_api(err),
        };
    }
    match e.app.templates.delete(name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(Error::NotFound { .. }) => error(
            StatusCode::NOT_FOUND,
            format!("template or snapshot {name} not found"),
        ),
        Err(err) => from_api(err),
    }
}

fn list_templates(e: &E2b) -> Response {
    match e.app.templates.list() {
        Ok(all) => {
            let v: Vec<Value> = all
                .iter()
                .map(|t| {
                    json!({
                        "templateID": t.name,
                        "aliases": [t.name],
                        "names": [t.name],
                        "public": false,
                        "buildStatus": serde_json::to_value(t.status).unwrap_or(Value::Null),
                        "createdAt": t.created_at,
                        "updatedAt": t.created_at,
                        "diskSizeMB": t.size_bytes >> 20,
                        "envdVersion": ENVD_VERSION,
                    })
                })
                .collect();
            axum::Json(v).into_response()
        }
        Err(err) => from_api(err),
    }
}

#[derive(Debug, Default, Deserialize)]
struct ForkRequest {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    count: Option<u32>,
}

/// E2B's fork of a running sandbox: moat snapshots its filesystem and starts the copies from it
/// (the snapshot is removed again; the copies keep its layers). Their processes start fresh.
async fn fork(e: &E2b, id: &str, body: Body) -> Response {
    let req: ForkRequest = match json_body(body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let count = req.count.unwrap_or(1);
    if !(1..=20).contains(&count) {
        return error(StatusCode::BAD_REQUEST, "count must be 1..=20");
    }
    let source = match e.app.sandboxes.get(id) {
        Ok(s) => s,
        Err(err) => return not_found_or(err, id),
    };
    let snap = match e
        .app
        .snapshots
        .snapshot(id, moat_api::CreateSnapshotRequest::default())
        .await
    {
        Ok(s) => s,
        Err(err) => return not_found_or(err, id),
    };
    let mut metadata = source.metadata.clone();
    metadata.retain(|k, _| !k.starts_with("moat."));
    let forked = e
        .app
        .snapshots
        .fork(
            &snap.id,
            moat_api::ForkRequest {
                count,
                timeout: req.timeout,
                metadata,
                ..Default::default()
            },
        )
        .await;
    if let Err(err) = e.app.snapshots.delete(&snap.id) {
        tracing::warn!(snapshot = %snap.id, "remove the fork's snapshot: {}", err.to_string());
    }
    match forked {
        Ok(list) => {
            let t = template_id_of(&source);
            let v: Vec<Value> = list
                .iter()
                .map(|s| json!({"sandbox": sandbox_json(e, s, &t)}))
                .collect();
            (StatusCode::CREATED, axum::Json(v)).into_response()
        }
        Err(err) => from_api(err),
    }
}

async fn set_network(e: &E2b, id: &str, body: Body) -> Response {
    let net: NetworkConfig = match json_body(body).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    if let Some(what) = net.unsupported() {
        return unsupported(what);
    }
    match e.app.sandboxes.set_network(id, net.policy(None)).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => not_found_or(err, id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_like_e2bs() {
        // What the SDK sends for {"user id": "a&b=c", "k": "v"}, after the server decoded the query.
        let f = metadata_filter("user%2520id=a%2526b%253Dc&k=v").unwrap();
        assert_eq!(f.get("user id").map(String::as_str), Some("a&b=c"));
        assert_eq!(f.get("k").map(String::as_str), Some("v"));
        assert!(metadata_filter("nokey").is_err());
    }

    #[test]
    fn network_policies() {
        let n = NetworkConfig {
            allow_out: Some(vec!["1.1.1.1".into()]),
            ..Default::default()
        };
        let p = n.policy(Some(false));
        assert!(!p.allow_internet);
        assert_eq!(p.deny_out, vec!["0.0.0.0/0"]);
        assert_eq!(p.allow_out, vec!["1.1.1.1"]);
        assert!(NetworkConfig {
            dns_servers: Some(vec!["1.1.1.1".into()]),
            ..Default::default()
        }
        .unsupported()
        .is_some());
    }

    #[test]
    fn iso_times() {
        let a = parse_iso("2024-01-01T01:00:00+01:00").unwrap();
        let b = parse_iso("2024-01-01T00:00:00Z").unwrap();
        assert_eq!(a, b);
        assert!(later_or_equal(
            "2024-01-01T00:00:01Z",
            "2024-01-01T00:00:00+00:00"
        ));
        assert!(!later_or_equal(
            "2023-12-31T23:59:59Z",
            "2024-01-01T00:00:00+00:00"
        ));
    }
}
