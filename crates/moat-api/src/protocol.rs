//! The host↔agent protocol, defined once: every route the in-sandbox agent serves, with its method,
//! path, query, request body and answer, as data. The agent's router and the daemon's client are
//! both built from it, so a route cannot exist on one side only:
//!
//! * the agent resolves each request with [`resolve`] (404 for an unknown path, 405 for a known path
//!   with another method) and dispatches with an exhaustive `match` on [`Route`];
//! * the daemon addresses the agent only through a [`Call`] (a [`Route`], the process it names, a
//!   query of the route's [`Endpoint::Query`] type), never with a path of its own.
//!
//! The transport is HTTP/2 (prior knowledge) over one byte stream per connection
//! (docs/agent.md); [`AGENT_PROTOCOL_VERSION`](crate::AGENT_PROTOCOL_VERSION) is what `/health`
//! reports.

use http::Method;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::process::ProcessSelector;

/// What a request or an answer carries in its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Nothing (an answer of 204 No Content).
    Empty,
    /// One JSON value of the named type.
    Json(&'static str),
    /// A stream of JSON values of the named type, one per line (`application/x-ndjson`).
    Ndjson(&'static str),
    /// Bytes, streamed (a file, a tar archive, a process's stdin, a TCP connection).
    Bytes,
}

/// One route as data: method, path (with `{process}` where a process selector goes) and what
/// travels each way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    pub route: Route,
    pub method: Method,
    pub path: &'static str,
    /// The query's type (`NoQuery`: none).
    pub query: &'static str,
    pub request: Payload,
    pub answer: Payload,
}

/// A route's types, for the daemon's typed calls and the agent's decoding.
pub trait Endpoint {
    const ROUTE: Route;
    /// The query string's type.
    type Query: Serialize + DeserializeOwned;
    /// The JSON request body's type (`()` when the body is empty or streamed bytes).
    type Body: Serialize + DeserializeOwned;
    /// The JSON answer's type (`()` when the answer is empty or a stream).
    type Answer: Serialize + DeserializeOwned;
}

/// The query of a route that takes none (parameters given anyway are ignored).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoQuery {}

/// `GET /health`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentHealth {
    /// [`AGENT_PROTOCOL_VERSION`](crate::AGENT_PROTOCOL_VERSION) of the agent.
    pub protocol: u32,
    /// The agent's build version.
    pub version: String,
}

/// Query of `POST /tcp`: the port inside the sandbox to connect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpQuery {
    pub port: u16,
}

/// Query of `GET /vm/layer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerQuery {
    /// Freeze the sandbox's processes for as long as the archive is being written.
    #[serde(default)]
    pub freeze: bool,
}

macro_rules! payload {
    (Empty, $t:ty) => {
        Payload::Empty
    };
    (Bytes, $t:ty) => {
        Payload::Bytes
    };
    (Json, $t:ty) => {
        Payload::Json(stringify!($t))
    };
    (Ndjson, $t:ty) => {
        Payload::Ndjson(stringify!($t))
    };
}

macro_rules! protocol {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident: $method:ident $path:literal,
            query $query:ty, body $req:ident $body:ty, answer $ans:ident $answer:ty;
    )*) => {
        /// Every route of the agent.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Route {
            $( $(#[doc = $doc])* $name, )*
        }

        impl Route {
            /// Every route, in the table's order.
            pub const ALL: &'static [Route] = &[$(Route::$name),*];

            /// The route as data.
            pub fn spec(self) -> RouteSpec {
                match self {
                    $(Route::$name => RouteSpec {
                        route: self,
                        method: Method::$method,
                        path: $path,
                        query: stringify!($query),
                        request: payload!($req, $body),
                        answer: payload!($ans, $answer),
                    },)*
                }
            }
        }

        /// One type per route carrying its query, body and answer types ([`Endpoint`]).
        pub mod endpoint {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_imports)]
            use crate::*;
            $(
                $(#[doc = $doc])*
                pub struct $name;
                impl Endpoint for $name {
                    const ROUTE: Route = Route::$name;
                    type Query = $query;
                    type Body = $body;
                    type Answer = $answer;
                }
            )*
        }
    };
}

protocol! {
    /// Whether the agent is up, and the protocol it speaks.
    Health: GET "/health", query NoQuery, body Empty (), answer Json AgentHealth;
    /// Merges variables into the environment of processes started from now on (204).
    SetEnv: POST "/env", query NoQuery, body Json EnvUpdate, answer Empty ();
    /// The sandbox's per-process limits and defaults (204).
    Configure: POST "/config", query NoQuery, body Json AgentConfig, answer Empty ();
    /// Running processes and the most recent exited ones.
    ListProcesses: GET "/processes", query NoQuery, body Empty (), answer Json ProcessList;
    /// Every process start and exit since the agent started, in order (the newest kept).
    Journal: GET "/journal", query JournalQuery, body Empty (),
        answer Json ProcessJournal;
    /// Starts a process: its events as NDJSON (`ProcessEvent`) to its exit, or with `background`
    /// a 201 with its `ProcessInfo`.
    StartProcess: POST "/processes", query NoQuery, body Json StartProcessRequest,
        answer Ndjson ProcessEvent;
    /// Re-attaches to a process: its kept output (unless `replay=false`), then live output, then
    /// its exit.
    ProcessEvents: GET "/processes/{process}/events", query AttachQuery, body Empty (),
        answer Ndjson ProcessEvent;
    /// Writes the body, streamed, to the process's stdin (204).
    ProcessStdin: POST "/processes/{process}/stdin", query NoQuery, body Bytes (), answer Empty ();
    /// Closes the process's stdin (204).
    ProcessCloseStdin: POST "/processes/{process}/close-stdin", query NoQuery, body Empty (),
        answer Empty ();
    /// Signals the process's group (204).
    ProcessSignal: POST "/processes/{process}/signal", query NoQuery,
        body Json SignalRequest, answer Empty ();
    /// Resizes the process's PTY (204).
    ProcessResize: POST "/processes/{process}/resize", query NoQuery, body Json PtySize,
        answer Empty ();
    /// A file's bytes, streamed.
    ReadFile: GET "/files", query PathQuery, body Empty (), answer Bytes ();
    /// Writes a file from the streamed body, replacing it atomically.
    WriteFile: PUT "/files", query WriteQuery, body Bytes (), answer Json EntryInfo;
    /// Describes a path (not following a final symlink).
    Stat: GET "/fs/stat", query PathQuery, body Empty (), answer Json EntryInfo;
    /// Whether a path exists.
    Exists: GET "/fs/exists", query PathQuery, body Empty (),
        answer Json ExistsResponse;
    /// Lists a directory to a depth.
    ListDir: GET "/fs/list", query ListQuery, body Empty (), answer Json DirListing;
    /// Makes a directory and its parents.
    Mkdir: POST "/fs/mkdir", query NoQuery, body Json MkdirRequest,
        answer Json MkdirResponse;
    /// Renames or moves a path.
    Rename: POST "/fs/rename", query NoQuery, body Json RenameRequest,
        answer Json EntryInfo;
    /// Removes a file or a directory (204).
    Remove: DELETE "/fs", query RemoveQuery, body Empty (), answer Empty ();
    /// A directory (or file) as a tar stream.
    DownloadTar: GET "/fs/tar", query PathQuery, body Empty (), answer Bytes ();
    /// Unpacks the streamed tar body into a directory (204).
    UploadTar: PUT "/fs/tar", query PathQuery, body Bytes (), answer Empty ();
    /// inotify events of a directory as NDJSON, until the caller goes away.
    Watch: GET "/fs/watch", query WatchQuery, body Empty (), answer Ndjson FsEvent;
    /// A byte stream both ways to a TCP port inside the sandbox.
    Tcp: POST "/tcp", query TcpQuery, body Bytes (), answer Bytes ();
    /// microvm tier: freezes (and syncs) or thaws the sandbox's processes (204).
    VmFreeze: POST "/vm/freeze", query NoQuery, body Json guest::FreezeRequest,
        answer Empty ();
    /// microvm tier: sets the guest's wall clock (204).
    VmClock: POST "/vm/clock", query NoQuery, body Json guest::ClockRequest,
        answer Empty ();
    /// microvm tier: gives the guest's `eth0` another address, or none (204).
    VmNetwork: POST "/vm/network", query NoQuery, body Json guest::NetworkRequest,
        answer Empty ();
    /// microvm tier: the guest's writable layer as a tar stream.
    VmLayer: GET "/vm/layer", query LayerQuery, body Empty (), answer Bytes ();
}

impl Route {
    pub fn method(self) -> Method {
        self.spec().method
    }

    /// Whether the route's path names a process (`{process}`).
    pub fn takes_process(self) -> bool {
        self.spec().path.contains("{process}")
    }

    /// The route's path, with `process` in its `{process}` segment. None when the route names a
    /// process and none is given, or names none and one is.
    pub fn path(self, process: Option<&ProcessSelector>) -> Option<String> {
        let template = self.spec().path;
        match (template.contains("{process}"), process) {
            (true, Some(p)) => Some(template.replace("{process}", &p.to_string())),
            (false, None) => Some(template.to_string()),
            _ => None,
        }
    }
}

/// What a request's method and path resolve to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved<'a> {
    /// A route, and the path's `{process}` segment when it has one (unparsed: the handler says
    /// what is wrong with it).
    Found {
        route: Route,
        process: Option<&'a str>,
    },
    /// The path is a route's, the method is not: 405, with the methods the path takes.
    MethodNotAllowed(Vec<Method>),
    /// No route has this path: 404.
    NotFound,
}

/// Resolves a request's method and path (without its query) against the table.
pub fn resolve<'a>(method: &Method, path: &'a str) -> Resolved<'a> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut allowed = Vec::new();
    for &route in Route::ALL {
        let spec = route.spec();
        let tpl: Vec<&str> = spec.path.trim_start_matches('/').split('/').collect();
        if tpl.len() != segs.len() {
            continue;
        }
        let mut process = None;
        let fits = tpl.iter().zip(&segs).all(|(t, s)| {
            if *t == "{process}" {
                process = Some(*s);
                !s.is_empty()
            } else {
                t == s
            }
        });
        if !fits {
            continue;
        }
        if spec.method == *method {
            return Resolved::Found { route, process };
        }
        allowed.push(spec.method);
    }
    if allowed.is_empty() {
        Resolved::NotFound
    } else {
        Resolved::MethodNotAllowed(allowed)
    }
}

/// One request to the agent as the daemon makes it: a route, the process its path names, and its
/// query string (already encoded from the route's query type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub route: Route,
    pub process: Option<ProcessSelector>,
    pub query: Option<String>,
}

/// Why a [`Call`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError(pub String);

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CallError {}

impl Call {
    /// A call of endpoint `E` with `query` encoded (nothing for a query that encodes empty).
    pub fn new<E: Endpoint>(
        process: Option<&ProcessSelector>,
        query: &E::Query,
    ) -> Result<Call, CallError> {
        let q = serde_urlencoded::to_string(query)
            .map_err(|e| CallError(format!("encode the query of {:?}: {e}", E::ROUTE)))?;
        Call::raw(E::ROUTE, process, (!q.is_empty()).then_some(q))
    }

    /// A call with an already encoded query (the REST API passes its caller's through, checked).
    pub fn raw(
        route: Route,
        process: Option<&ProcessSelector>,
        query: Option<String>,
    ) -> Result<Call, CallError> {
        if route.takes_process() != process.is_some() {
            return Err(CallError(format!(
                "{route:?} {} a process",
                if route.takes_process() {
                    "needs"
                } else {
                    "takes no"
                }
            )));
        }
        Ok(Call {
            route,
            process: process.cloned(),
            query: query.filter(|q| !q.is_empty()),
        })
    }

    /// The request's path and query.
    pub fn path_and_query(&self) -> String {
        // `raw` checked that the route and the process agree.
        let path = self
            .route
            .path(self.process.as_ref())
            .unwrap_or_else(|| self.route.spec().path.to_string());
        match &self.query {
            Some(q) => format!("{path}?{q}"),
            None => path,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_resolves_from_its_own_path() {
        let sel = ProcessSelector::Tag("web".into());
        for &r in Route::ALL {
            let path = r.path(r.takes_process().then_some(&sel)).unwrap();
            match resolve(&r.method(), &path) {
                Resolved::Found { route, process } => {
                    assert_eq!(route, r, "{path}");
                    assert_eq!(process, r.takes_process().then_some("web"), "{path}");
                }
                other => panic!("{path}: {other:?}"),
            }
        }
    }

    #[test]
    fn routes_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &r in Route::ALL {
            let s = r.spec();
            assert!(seen.insert((s.method.clone(), s.path)), "{s:?} twice");
        }
    }

    #[test]
    fn wrong_method_and_unknown_path() {
        assert_eq!(
            resolve(&Method::DELETE, "/processes"),
            Resolved::MethodNotAllowed(vec![Method::GET, Method::POST])
        );
        assert_eq!(
            resolve(&Method::GET, "/vm/network"),
            Resolved::MethodNotAllowed(vec![Method::POST])
        );
        assert_eq!(resolve(&Method::GET, "/nope"), Resolved::NotFound);
        assert_eq!(
            resolve(&Method::GET, "/processes/7/nope"),
            Resolved::NotFound
        );
        assert_eq!(
            resolve(&Method::GET, "/processes//events"),
            Resolved::NotFound
        );
        assert_eq!(
            resolve(&Method::GET, "/processes/7/events"),
            Resolved::Found {
                route: Route::ProcessEvents,
                process: Some("7")
            }
        );
    }

    #[test]
    fn calls_encode_their_query_and_process() {
        let c = Call::new::<endpoint::ReadFile>(
            None,
            &crate::PathQuery {
                path: "/tmp/a b&c".into(),
            },
        )
        .unwrap();
        assert_eq!(c.path_and_query(), "/files?path=%2Ftmp%2Fa+b%26c");
        let w = Call::new::<endpoint::WriteFile>(
            None,
            &crate::WriteQuery {
                path: "/f".into(),
                mode: None,
                user: Some("user".into()),
            },
        )
        .unwrap();
        assert_eq!(w.path_and_query(), "/files?path=%2Ff&user=user");
        let h = Call::new::<endpoint::Health>(None, &NoQuery {}).unwrap();
        assert_eq!(h.path_and_query(), "/health");
        let e = Call::new::<endpoint::ProcessEvents>(
            Some(&ProcessSelector::Pid(42)),
            &crate::AttachQuery {
                replay: Some(false),
            },
        )
        .unwrap();
        assert_eq!(e.path_and_query(), "/processes/42/events?replay=false");
        assert!(Call::new::<endpoint::ProcessEvents>(None, &Default::default()).is_err());
        assert!(
            Call::new::<endpoint::Health>(Some(&ProcessSelector::Pid(1)), &NoQuery {}).is_err()
        );
    }

    #[test]
    fn the_table_names_what_travels() {
        let s = Route::WriteFile.spec();
        assert_eq!(s.method, Method::PUT);
        assert_eq!(s.query, "WriteQuery");
        assert_eq!(s.request, Payload::Bytes);
        assert_eq!(s.answer, Payload::Json("EntryInfo"));
        assert_eq!(Route::Remove.spec().answer, Payload::Empty);
    }
}
