//! The code interpreter's API (port 49999 of an E2B code-interpreter sandbox) on moat's code
//! contexts (`crate::code`): `POST /execute` streams E2B's JSON lines (`stdout`, `stderr`, `result`,
//! `error`, `number_of_executions`, `end_of_execution`); `/contexts` creates, lists, restarts and
//! removes contexts.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::StatusCode;
use moat_api::{CodeEvent, CodeLanguage, RunCodeRequest};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::E2b;
use crate::api::constant_time_eq;
use crate::code;
use crate::error::Error;

/// Seconds a cell may run: E2B's timeout is the client's (it stops reading), so the server's is long.
const CELL_TIMEOUT: f64 = 1800.0;

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    // The code interpreter's errors are plain text bodies in E2B's server; the SDK shows the text.
    (status, message.into()).into_response()
}

fn language(s: Option<&str>) -> Result<CodeLanguage, Response> {
    match s.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("python") | Some("python3") => Ok(CodeLanguage::Python),
        Some("js") | Some("javascript") => Ok(CodeLanguage::Javascript),
        Some("bash") | Some("sh") => Ok(CodeLanguage::Bash),
        Some(other) => Err(error(
            StatusCode::BAD_REQUEST,
            format!("language {other} is not supported by this server (moat runs python, javascript and bash)"),
        )),
    }
}

fn context_json(c: &moat_api::CodeContext) -> Value {
    json!({"id": c.id, "language": c.language.as_str(), "cwd": c.cwd})
}

pub(super) async fn handle(e: &Arc<E2b>, id: &str, req: Request) -> Response {
    let sbx = match e.app.sandboxes.get(id) {
        Ok(s) => s,
        Err(err) => {
            return error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} was not found: {}", err),
            )
        }
    };
    let token = sbx.access_token.as_bytes();
    let given = ["x-access-token", "e2b-traffic-access-token"]
        .iter()
        .filter_map(|h| req.headers().get(*h).and_then(|v| v.to_str().ok()))
        .any(|t| !token.is_empty() && constant_time_eq(t.trim().as_bytes(), token));
    if !given {
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong E2B-Traffic-Access-Token / X-Access-Token",
        );
    }
    let agent = match e.app.sandboxes.agent(id).await {
        Ok(a) => a,
        Err(err) => return error(StatusCode::BAD_GATEWAY, err.to_string()),
    };
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let body = req.into_body();
    let resp = match (method.clone(), segs.as_slice()) {
        (http::Method::GET, ["health"] | [""]) => (StatusCode::OK, "OK").into_response(),
        (http::Method::POST, ["execute"]) => execute(e, id, agent, body).await,
        (http::Method::POST, ["contexts"]) => create_context(e, id, &agent, body).await,
        (http::Method::GET, ["contexts"]) => match code::list(&agent).await {
            Ok(list) => {
                axum::Json(list.iter().map(context_json).collect::<Vec<_>>()).into_response()
            }
            Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
        },
        (http::Method::POST, ["contexts", ctx, "restart"]) => {
            match code::get(&agent, ctx, "context").await {
                Ok(c) => match code::restart(&agent, id, &c).await {
                    Ok(c) => axum::Json(context_json(&c)).into_response(),
                    Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
                },
                Err(_) => error(StatusCode::NOT_FOUND, format!("Context {ctx} not found")),
            }
        }
        (http::Method::DELETE, ["contexts", ctx]) => {
            match code::get(&agent, ctx, "context").await {
                Ok(c) => match code::delete(&agent, id, &c).await {
                    Ok(()) => StatusCode::NO_CONTENT.into_response(),
                    Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
                },
                Err(_) => error(StatusCode::NOT_FOUND, format!("Context {ctx} not found")),
            }
        }
        _ => error(
            StatusCode::NOT_FOUND,
            format!("no code interpreter endpoint {method} {path}"),
        ),
    };
    if method != http::Method::GET {
        let actor = format!("sandbox-token:{}", &id[..id.len().min(12)]);
        e.audit(
            actor,
            format!("e2b code {method} {path}"),
            Some(id),
            resp.status().as_u16(),
        )
        .await;
    }
    resp
}

#[derive(Debug, Default, Deserialize)]
struct Execute {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<std::collections::BTreeMap<String, String>>,
}

async fn read_json<T: serde::de::DeserializeOwned + Default>(body: Body) -> Result<T, Response> {
    let bytes = crate::api::extract::read_limited(body, 16 << 20)
        .await
        .map_err(|err| error(StatusCode::PAYLOAD_TOO_LARGE, err.0.error.message))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes)
        .map_err(|err| error(StatusCode::BAD_REQUEST, format!("invalid body: {err}")))
}

async fn execute(e: &E2b, id: &str, agent: Arc<crate::agent::AgentClient>, body: Body) -> Response {
    let req: Execute = match read_json(body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if req.context_id.is_some() && req.language.is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "give context_id or language, not both",
        );
    }
    let lang = match req.context_id {
        Some(_) => None,
        None => match language(req.language.as_deref()) {
            Ok(l) => Some(l),
            Err(r) => return r,
        },
    };
    let run = RunCodeRequest {
        code: req.code,
        language: lang,
        context_id: req.context_id.clone(),
        timeout: Some(CELL_TIMEOUT),
        env: req.env_vars.unwrap_or_default(),
    };
    let ctx = match code::prepare(&agent, id, &run).await {
        Ok(c) => c,
        Err(Error::NotFound { .. }) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("Context {} not found", run.context_id.unwrap_or_default()),
            )
        }
        Err(err) => return error(StatusCode::BAD_REQUEST, err.to_string()),
    };
    e.app.audit.watch(id);
    let (tx, mut rx) = mpsc::channel::<CodeEvent>(256);
    // E2B's timeout for a cell is the client's: when it stops reading, the cell is interrupted
    // (the forwarder below lets go of the events as soon as the client is gone, output or not).
    tokio::spawn(code::run(
        agent,
        id.to_string(),
        ctx,
        run,
        tx,
        code::Abandoned::Interrupted,
    ));
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(256);
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = out_tx.closed() => return,
            };
            let Some(ev) = ev else { return };
            for line in lines(&ev) {
                let mut b = serde_json::to_vec(&line).unwrap_or_default();
                b.push(b'\n');
                if out_tx.send(Bytes::from(b)).await.is_err() {
                    return;
                }
            }
        }
    });
    Response::builder()
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(futures::StreamExt::map(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
            Ok::<_, std::convert::Infallible>,
        )))
        .unwrap_or_else(|err| error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))
}

/// E2B's lines for one of moat's code events.
fn lines(ev: &CodeEvent) -> Vec<Value> {
    let now = crate::clock::rfc3339(crate::clock::now_ms());
    match ev {
        CodeEvent::Stdout { data } => {
            vec![json!({"type": "stdout", "text": data, "timestamp": now})]
        }
        CodeEvent::Stderr { data } => {
            vec![json!({"type": "stderr", "text": data, "timestamp": now})]
        }
        CodeEvent::Result(r) => {
            let mut v = serde_json::to_value(r).unwrap_or_else(|_| json!({}));
            v["type"] = json!("result");
            v["is_main_result"] = json!(r.is_main_result);
            v["extra"] = json!({});
            vec![v]
        }
        CodeEvent::Error(err) => vec![json!({
            "type": "error", "name": err.name, "value": err.value, "traceback": err.traceback,
        })],
        CodeEvent::End {
            execution_count, ..
        } => vec![
            json!({"type": "number_of_executions", "execution_count": execution_count}),
            json!({"type": "end_of_execution"}),
        ],
    }
}

#[derive(Debug, Default, Deserialize)]
struct NewContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

async fn create_context(
    e: &E2b,
    id: &str,
    agent: &crate::agent::AgentClient,
    body: Body,
) -> Response {
    let req: NewContext = match read_json(body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let lang = match language(req.language.as_deref()) {
        Ok(l) => l,
        Err(r) => return r,
    };
    // E2B's contexts start in the sandbox user's home.
    let cwd = match req.cwd {
        Some(c) => Some(c),
        None => e
            .user_of(id, agent, &http::HeaderMap::new(), None)
            .await
            .ok()
            .map(|u| u.home),
    };
    let ctx_id = format!("ctx_{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    match code::start(agent, &ctx_id, lang, cwd).await {
        Ok(c) => axum::Json(context_json(&c)).into_response(),
        Err(err) if matches!(err, Error::Invalid { .. }) => {
            error(StatusCode::BAD_REQUEST, err.to_string())
        }
        Err(err) => error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_e2b_lines() {
        let r = lines(&CodeEvent::Result(moat_api::CodeResult {
            text: Some("2".into()),
            png: Some("iVBOR".into()),
            is_main_result: true,
            ..Default::default()
        }));
        assert_eq!(r[0]["type"], "result");
        assert_eq!(r[0]["text"], "2");
        assert_eq!(r[0]["png"], "iVBOR");
        assert_eq!(r[0]["is_main_result"], true);
        let end = lines(&CodeEvent::End {
            execution_count: 3,
            duration_ms: 1,
        });
        assert_eq!(end[0]["execution_count"], 3);
        assert_eq!(end[1]["type"], "end_of_execution");
        assert!(language(Some("r")).is_err());
        assert_eq!(language(Some("JS")).ok(), Some(CodeLanguage::Javascript));
    }
}
