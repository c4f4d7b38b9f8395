//! A fake agent for unit tests: the protocol's route table served in-process over an in-memory
//! byte stream, with processes, environment and files kept in memory. It records every call and
//! can be told to misbehave (never become ready, refuse its configuration, fail the start
//! command). Routes it does not model answer 501, so a test that reaches one says so.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use moat_api::protocol::{resolve, AgentHealth, Resolved, Route};
use moat_api::{
    AgentConfig, EnvUpdate, ErrorBody, ErrorCode, ExistsResponse, ExitStatus, PathQuery,
    ProcessEvent, ProcessInfo, ProcessList, ProcessSelector, StartProcessRequest,
};

use super::wire::AgentStream;

/// One request the fake agent answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub route: Route,
    pub process: Option<String>,
    pub query: Option<String>,
    pub body: Bytes,
}

/// How the fake agent misbehaves.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// `/health` answers 503 (the agent never becomes ready).
    pub not_ready: bool,
    /// `/config` is refused.
    pub refuse_config: bool,
    /// Background processes with this tag exit at once with code 1 (a start command that fails).
    pub failing_tag: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<Recorded>,
    env: BTreeMap<String, String>,
    config: Option<AgentConfig>,
    processes: Vec<ProcessInfo>,
    /// The process journal: each start, and each exit (the fake's commands end at once).
    journal: Vec<moat_api::JournalRecord>,
    files: BTreeSet<String>,
    faults: Faults,
}

/// An agent living in the test's process.
#[derive(Clone, Default)]
pub struct FakeAgent {
    state: Arc<Mutex<State>>,
}

type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode, body: impl Into<Bytes>, ct: &'static str) -> Answer {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(ct),
    );
    r
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Answer {
    answer(
        status,
        serde_json::to_vec(v).unwrap_or_default(),
        "application/json",
    )
}

fn error(status: StatusCode, code: ErrorCode, message: &str) -> Answer {
    json(status, &ErrorBody::new(code, message))
}

fn no_content() -> Answer {
    answer(StatusCode::NO_CONTENT, Bytes::new(), "application/json")
}

fn ndjson(events: &[ProcessEvent]) -> Answer {
    let mut out = Vec::new();
    for e in events {
        out.extend(serde_json::to_vec(e).unwrap_or_default());
        out.push(b'\n');
    }
    answer(StatusCode::OK, out, moat_api::NDJSON)
}

impl FakeAgent {
    pub fn new() -> FakeAgent {
        FakeAgent::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets how the agent misbehaves from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.state().faults = faults;
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Recorded> {
        self.state().calls.clone()
    }

    /// The routes called so far, in order.
    pub fn routes(&self) -> Vec<Route> {
        self.state().calls.iter().map(|c| c.route).collect()
    }

    /// The environment `POST /env` gave it.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.state().env.clone()
    }

    /// The last configuration `POST /config` gave it.
    pub fn config(&self) -> Option<AgentConfig> {
        self.state().config.clone()
    }

    /// Makes `path` exist inside the sandbox (for `/fs/exists`).
    pub fn add_file(&self, path: &str) {
        self.state().files.insert(path.to_string());
    }

    /// A byte stream to this agent: the daemon's end of a new connection.
    pub fn connect(&self) -> AgentStream {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let this = self.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let this = this.clone();
                async move { Ok::<_, Infallible>(this.handle(req).await) }
            });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(theirs), svc)
                .await;
        });
        Box::pin(ours)
    }

    async fn handle(&self, req: Request<Incoming>) -> Answer {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let path = parts.uri.path().to_string();
        let query = parts.uri.query().map(str::to_string);
        let (route, process) = match resolve(&parts.method, &path) {
            Resolved::Found { route, process } => (route, process.map(str::to_string)),
            Resolved::MethodNotAllowed(_) => {
                return error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    ErrorCode::InvalidArgument,
                    "method not allowed",
                )
            }
            Resolved::NotFound => {
                return error(StatusCode::NOT_FOUND, ErrorCode::NotFound, "no endpoint")
            }
        };
        let mut st = self.state();
        st.calls.push(Recorded {
            route,
            process: process.clone(),
            query: query.clone(),
            body: body.clone(),
        });
        match route {
            Route::Health if st.faults.not_ready => error(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::Unavailable,
                "not ready",
            ),
            Route::Health => json(
                StatusCode::OK,
                &AgentHealth {
                    protocol: moat_api::AGENT_PROTOCOL_VERSION,
                    version: "fake".into(),
                },
            ),
            Route::SetEnv => match serde_json::from_slice::<EnvUpdate>(&body) {
                Ok(u) => {
                    st.env.extend(u.env);
                    no_content()
                }
                Err(e) => error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidArgument,
                    &e.to_string(),
                ),
            },
            Route::Configure if st.faults.refuse_config => error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidArgument,
                "configuration refused",
            ),
            Route::Configure => match serde_json::from_slice::<AgentConfig>(&body) {
                Ok(c) => {
                    st.config = Some(c);
                    no_content()
                }
                Err(e) => error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidArgument,
                    &e.to_string(),
                ),
            },
            Route::Journal => {
                let after = query
                    .as_deref()
                    .and_then(|q| serde_urlencoded::from_str::<moat_api::JournalQuery>(q).ok())
                    .and_then(|q| q.after)
                    .unwrap_or(0);
                json(
                    StatusCode::OK,
                    &moat_api::ProcessJournal {
                        epoch: "fake".into(),
                        first_seq: 1,
                        next_seq: st.journal.len() as u64 + 1,
                        records: st
                            .journal
                            .iter()
                            .filter(|r| r.seq > after)
                            .cloned()
                            .collect(),
                    },
                )
            }
            Route::ListProcesses => json(
                StatusCode::OK,
                &ProcessList {
                    processes: st.processes.clone(),
                },
            ),
            Route::StartProcess => {
                let Ok(req) = serde_json::from_slice::<StartProcessRequest>(&body) else {
                    return error(
                        StatusCode::BAD_REQUEST,
                        ErrorCode::InvalidArgument,
                        "bad process request",
                    );
                };
                let fails = req.tag.is_some() && req.tag == st.faults.failing_tag;
                let exit = ExitStatus {
                    exit_code: Some(if fails { 1 } else { 0 }),
                    ..Default::default()
                };
                let pid = 100 + st.processes.len() as u32;
                let info = ProcessInfo {
                    pid,
                    tag: req.tag.clone(),
                    cmd: req.cmd.clone().unwrap_or_else(|| {
                        vec![
                            "/bin/sh".into(),
                            "-c".into(),
                            req.command.clone().unwrap_or_default(),
                        ]
                    }),
                    env: req.env.clone(),
                    cwd: req.cwd.clone().unwrap_or_else(|| "/root".into()),
                    user: req.user.clone().unwrap_or_else(|| "root".into()),
                    pty: false,
                    stdin_open: req.stdin,
                    running: req.background && !fails,
                    exit: (!req.background || fails).then(|| exit.clone()),
                    started_at_us: 0,
                };
                st.processes.push(info.clone());
                let mut started = ProcessInfo {
                    running: true,
                    exit: None,
                    ..info.clone()
                };
                started.stdin_open = req.stdin;
                for (event, process) in [
                    (moat_api::JournalEvent::Start, Some(started)),
                    (
                        moat_api::JournalEvent::Exit,
                        info.exit.is_some().then(|| info.clone()),
                    ),
                ] {
                    if let Some(process) = process {
                        let seq = st.journal.len() as u64 + 1;
                        st.journal.push(moat_api::JournalRecord {
                            seq,
                            event,
                            at_us: seq,
                            process,
                        });
                    }
                }
                if req.background {
                    json(StatusCode::CREATED, &info)
                } else {
                    ndjson(&[
                        ProcessEvent::Start { pid, tag: req.tag },
                        ProcessEvent::Exit(exit),
                    ])
                }
            }
            Route::ProcessEvents => {
                let sel = process
                    .as_deref()
                    .and_then(|p| ProcessSelector::parse(p).ok());
                let found = st.processes.iter().find(|p| match &sel {
                    Some(ProcessSelector::Pid(pid)) => p.pid == *pid,
                    Some(ProcessSelector::Tag(t)) => p.tag.as_ref() == Some(t),
                    None => false,
                });
                match found {
                    Some(p) => {
                        let mut evs = vec![ProcessEvent::Start {
                            pid: p.pid,
                            tag: p.tag.clone(),
                        }];
                        evs.extend(p.exit.clone().map(ProcessEvent::Exit));
                        ndjson(&evs)
                    }
                    None => error(StatusCode::NOT_FOUND, ErrorCode::NotFound, "no process"),
                }
            }
            Route::Exists => {
                let q: Option<PathQuery> = query
                    .as_deref()
                    .and_then(|q| serde_urlencoded::from_str(q).ok());
                let exists = q.is_some_and(|q| st.files.contains(&q.path));
                json(StatusCode::OK, &ExistsResponse { exists })
            }
            other => error(
                StatusCode::NOT_IMPLEMENTED,
                ErrorCode::Internal,
                &format!("the fake agent does not model {other:?}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::AgentClient;

    fn client(fake: &FakeAgent) -> AgentClient {
        let f = fake.clone();
        AgentClient::new(
            "sbx_test",
            Arc::new(move || {
                let f = f.clone();
                Box::pin(async move { Ok(f.connect()) })
            }),
        )
    }

    #[tokio::test]
    async fn typed_calls_reach_the_fake_agent_through_the_route_table() {
        let fake = FakeAgent::new();
        let c = client(&fake);
        c.wait_ready(std::time::Duration::from_secs(2))
            .await
            .unwrap();
        c.set_env(&[("A".to_string(), "1".to_string())].into())
            .await
            .unwrap();
        let info = c
            .start_background(&StartProcessRequest {
                command: Some("sleep 1".into()),
                tag: Some("bg".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(info.running);
        let exit = c
            .run_streamed(
                &StartProcessRequest {
                    command: Some("true".into()),
                    ..Default::default()
                },
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(exit.exit_code, Some(0));
        assert_eq!(c.processes().await.unwrap().processes.len(), 2);
        fake.add_file("/ready");
        assert!(c.exists("/ready").await.unwrap());
        assert!(!c.exists("/nope").await.unwrap());
        // A route the fake does not model is a refusal the caller sees as such.
        let err = c.stat("/x").await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::NOT_IMPLEMENTED));
        assert_eq!(fake.env()["A"], "1");
        assert_eq!(
            fake.routes(),
            [
                Route::Health,
                Route::SetEnv,
                Route::StartProcess,
                Route::StartProcess,
                Route::ListProcesses,
                Route::Exists,
                Route::Exists,
                Route::Stat
            ]
        );
        assert_eq!(fake.calls()[5].query.as_deref(), Some("path=%2Fready"));
    }

    #[tokio::test]
    async fn an_agent_that_is_never_ready_times_out() {
        let fake = FakeAgent::new();
        fake.set_faults(Faults {
            not_ready: true,
            ..Default::default()
        });
        let err = client(&fake)
            .wait_ready(std::time::Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(
            matches!(err, crate::agent::AgentError::Unreachable(_)),
            "{err}"
        );
        assert!(err.to_string().contains("not ready"), "{err}");
    }
}
