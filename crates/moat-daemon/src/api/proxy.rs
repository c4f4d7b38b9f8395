//! Per-sandbox process and file endpoints. The agent inside the sandbox implements them over the
//! host↔agent protocol; the daemon checks the caller, the sandbox and JSON bodies, then streams requests
//! and answers through unchanged, so HTTP/2 flow control reaches from the client to the sandbox and
//! nothing is buffered whole in the daemon.

use axum::body::Body;
use axum::extract::{Path, Request};
use axum::response::Response;
use moat_api::*;
use serde::de::DeserializeOwned;

use moat_api::protocol::{endpoint, Call, Endpoint, Payload};

use super::error::{from_serde_path, ApiError, ApiResult};
use super::St;
use crate::api::extract::{parse_json, read_limited, MAX_JSON_BODY};

/// Forwards a request of endpoint `E` to the sandbox's agent: the process selector and the query
/// are checked first (400 naming the field), then the sandbox (404/409), then a JSON body (400
/// naming the field, 413 when too big). The body streams through unchanged otherwise, and so does
/// the agent's answer, whatever its status.
async fn forward<E: Endpoint>(
    st: &St,
    id: &str,
    process: Option<&str>,
    req: Request,
) -> ApiResult<Response> {
    let sel = process.map(check_selector).transpose()?;
    let query: E::Query = check_query(&req)?;
    let agent = st.sandboxes.agent(id).await?;
    let call = Call::new::<E>(sel.as_ref(), &query).map_err(ApiError::internal)?;
    let (parts, body) = req.into_parts();
    let ct = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match E::ROUTE.spec().request {
        Payload::Json(_) => {
            let bytes = read_limited(
                body,
                MAX_JSON_BODY.load(std::sync::atomic::Ordering::Relaxed),
            )
            .await?;
            // What was read (with whole floats as integers, say) is what the agent is sent.
            let parsed = parse_json::<E::Body>(&bytes)?;
            Body::from(serde_json::to_vec(&parsed).map_err(ApiError::internal)?)
        }
        _ => body,
    };
    let resp = match agent.send(&call, ct.as_deref(), body).await {
        Ok(r) => r,
        Err(e) => return Err(st.sandboxes.agent_failed(id, e).await.into()),
    };
    let (parts, incoming) = resp.into_parts();
    let mut out = Response::builder().status(parts.status);
    for h in [http::header::CONTENT_TYPE, http::header::CONTENT_LENGTH] {
        if let Some(v) = parts.headers.get(&h) {
            out = out.header(h, v);
        }
    }
    let events = matches!(E::ROUTE.spec().answer, Payload::Ndjson(_))
        && parts.status == http::StatusCode::OK;
    let body = if events {
        let values = st.sandboxes.secret_values(id);
        let redact = (!values.is_empty()).then(|| Redactor::new(values));
        ended_events(id.to_string(), incoming, redact)
    } else {
        Body::new(incoming)
    };
    out.body(body).map_err(ApiError::internal)
}

/// A process's event stream as the agent sends it, ended by an `error` event when it breaks (or
/// ends) before the process's `exit`: a client reading the stream learns that the process's end is
/// unknown and why, instead of a stream that stops.
fn ended_events(id: String, incoming: hyper::body::Incoming, redact: Option<Redactor>) -> Body {
    use futures::StreamExt;
    let frames = http_body_util::BodyStream::new(incoming);
    let state = (frames, LastLine::default(), false, redact);
    let stream = futures::stream::unfold(state, move |(mut frames, mut last, done, mut redact)| {
        let id = id.clone();
        async move {
            if done {
                return None;
            }
            let broke = match frames.next().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let data = match redact.as_mut() {
                            Some(r) => r.feed(&data),
                            None => data,
                        };
                        last.feed(&data);
                        return Some((
                            Ok::<_, std::convert::Infallible>(data),
                            (frames, last, false, redact),
                        ));
                    }
                    Err(_) => {
                        return Some((Ok(bytes::Bytes::new()), (frames, last, false, redact)))
                    }
                },
                None if redact.as_ref().is_some_and(|r| !r.partial.is_empty()) => {
                    let rest = redact.as_mut().map(Redactor::finish).unwrap_or_default();
                    last.feed(&rest);
                    return Some((Ok(rest), (frames, last, false, redact)));
                }
                Some(Err(e)) => format!("the connection to sandbox {id}'s agent broke: {e}"),
                None if last.exit => return None,
                None => format!("sandbox {id}'s agent ended the stream"),
            };
            let ev = ProcessEvent::Error {
                message: format!("{broke} before the process's exit was known (the sandbox may have ended: GET /v1/sandboxes/{id})"),
            };
            let mut line = serde_json::to_vec(&ev).unwrap_or_default();
            if !last.at_line_start() {
                line.insert(0, b'\n');
            }
            line.push(b'\n');
            Some((Ok(bytes::Bytes::from(line)), (frames, last, true, redact)))
        }
    });
    Body::from_stream(stream)
}

fn replace_all(b: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    if from.is_empty() || memchr::memmem::find(b, from).is_none() {
        return b.to_vec();
    }
    let mut out = Vec::with_capacity(b.len());
    let mut rest = b;
    while let Some(i) = memchr::memmem::find(rest, from) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(to);
        rest = &rest[i + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// Takes a sandbox's secret values out of its processes' output events, should one ever get
/// there (docs/secrets.md): each is replaced by `[secret NAME]` in the event's text or bytes.
/// Works on whole lines (events); a value cut between two output chunks is not seen.
struct Redactor {
    values: Vec<(String, String)>,
    partial: Vec<u8>,
}

impl Redactor {
    fn new(values: Vec<(String, String)>) -> Redactor {
        Redactor {
            values,
            partial: Vec::new(),
        }
    }

    fn redact_bytes(&self, b: &[u8]) -> Vec<u8> {
        let mut out = b.to_vec();
        for (name, value) in &self.values {
            out = replace_all(
                &out,
                value.as_bytes(),
                format!("[secret {name}]").as_bytes(),
            );
        }
        out
    }

    /// One event line, rewritten in place (its keys keep their order: clients read `type` first):
    /// a value in its text as JSON writes it, and in its bytes (`data_b64`).
    fn line(&self, line: &[u8]) -> Vec<u8> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut out = line.to_vec();
        for (name, value) in &self.values {
            let esc = serde_json::to_string(value).unwrap_or_default();
            let esc = esc.get(1..esc.len().saturating_sub(1)).unwrap_or("");
            out = replace_all(&out, esc.as_bytes(), format!("[secret {name}]").as_bytes());
        }
        if memchr::memmem::find(&out, b"\"data_b64\"").is_some() {
            let old = serde_json::from_slice::<serde_json::Value>(&out)
                .ok()
                .and_then(|v| {
                    v.get("data_b64")
                        .and_then(|d| d.as_str())
                        .map(str::to_string)
                });
            if let Some(old) = old {
                if let Ok(d) = b64.decode(&old) {
                    let r = self.redact_bytes(&d);
                    if r != d {
                        out = replace_all(&out, old.as_bytes(), b64.encode(r).as_bytes());
                    }
                }
            }
        }
        out
    }

    /// The whole lines of what came so far, redacted.
    fn feed(&mut self, data: &[u8]) -> bytes::Bytes {
        self.partial.extend_from_slice(data);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return bytes::Bytes::new();
        };
        let whole: Vec<u8> = self.partial.drain(..=end).collect();
        let mut out = Vec::with_capacity(whole.len());
        for l in whole.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            out.extend(self.line(l));
            out.push(b'\n');
        }
        bytes::Bytes::from(out)
    }

    fn finish(&mut self) -> bytes::Bytes {
        let rest = std::mem::take(&mut self.partial);
        bytes::Bytes::from(self.line(&rest))
    }
}

/// Whether the last whole line of an NDJSON event stream was the `exit` event (each event's
/// `type` is its first key).
#[derive(Default)]
struct LastLine {
    /// The first bytes of the line being read.
    head: Vec<u8>,
    /// Bytes of the line being read so far.
    len: usize,
    exit: bool,
}

impl LastLine {
    const EXIT: &'static [u8] = br#"{"type":"exit""#;

    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let (part, ended) = match data.iter().position(|b| *b == b'\n') {
                Some(i) => (&data[..i], Some(i)),
                None => (data, None),
            };
            let room = Self::EXIT.len().saturating_sub(self.head.len());
            self.head.extend_from_slice(&part[..part.len().min(room)]);
            self.len += part.len();
            match ended {
                Some(i) => {
                    if self.len > 0 {
                        self.exit = self.head.starts_with(Self::EXIT);
                    }
                    self.head.clear();
                    self.len = 0;
                    data = &data[i + 1..];
                }
                None => break,
            }
        }
    }

    fn at_line_start(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_events_lose_secret_values_and_keep_their_order() {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut r = Redactor::new(vec![("TOKEN".into(), "s3cr\"et".into())]);
        let text = br#"{"type":"stdout","data":"a s3cr\"et b"}"#.to_vec();
        let bytes = format!(
            r#"{{"type":"stderr","data_b64":"{}"}}"#,
            b64.encode(b"x s3cr\"et y")
        );
        let mut input = text.clone();
        input.push(b'\n');
        input.extend_from_slice(bytes.as_bytes());
        input.extend_from_slice(b"\n{\"type\":\"exit\"");
        let (a, b) = input.split_at(10);
        let mut out = r.feed(a).to_vec();
        out.extend_from_slice(&r.feed(b));
        out.extend_from_slice(&r.finish());
        let out = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], r#"{"type":"stdout","data":"a [secret TOKEN] b"}"#);
        assert_eq!(
            lines[1],
            format!(
                r#"{{"type":"stderr","data_b64":"{}"}}"#,
                b64.encode(b"x [secret TOKEN] y")
            )
        );
        assert_eq!(lines[2], r#"{"type":"exit""#);
    }

    #[test]
    fn the_exit_line_is_seen_across_chunks() {
        let mut l = LastLine::default();
        l.feed(b"{\"type\":\"start\",\"pid\":1}\n{\"type\":\"ex");
        assert!(!l.exit && !l.at_line_start());
        l.feed(b"it\",\"exit_code\":0}");
        assert!(!l.exit, "a line counts once it is whole");
        l.feed(b"\n");
        assert!(l.exit && l.at_line_start());
        l.feed(b"{\"type\":\"stdout\",\"data\":\"x\"}\n");
        assert!(!l.exit);
    }
}

/// A query string parsed as `T` (400 naming the field).
fn check_query<T: DeserializeOwned>(req: &Request) -> ApiResult<T> {
    let q = req.uri().query().unwrap_or("");
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(q.as_bytes()));
    serde_path_to_error::deserialize::<_, T>(de).map_err(|e| from_serde_path(e, "query"))
}

fn check_selector(sel: &str) -> ApiResult<ProcessSelector> {
    ProcessSelector::parse(sel).map_err(|m| ApiError::invalid("process", m))
}

/// Start a process. Streams its events as NDJSON unless `background` is set.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", tag = "processes", params(("id" = String, Path)),
    request_body = StartProcessRequest,
    responses((status = 200, description = "NDJSON stream: start, stdout/stderr/pty/dropped, exit", content_type = "application/x-ndjson", body = ProcessEvent),
              (status = 201, description = "background process started", body = ProcessInfo),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn start_process(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::StartProcess>(&st, &id, None, req).await
}

/// Running processes and the most recent exited ones.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", tag = "processes", params(("id" = String, Path)),
    responses((status = 200, body = ProcessList), (status = 404, body = ErrorBody)))]
pub async fn list_processes(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::ListProcesses>(&st, &id, None, req).await
}

/// Re-attach to a process: its kept output (unless `replay=false`), then live output, then its exit.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}/events", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path, description = "pid or tag"), AttachQuery),
    responses((status = 200, content_type = "application/x-ndjson", body = ProcessEvent), (status = 404, body = ErrorBody)))]
pub async fn process_events(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward::<endpoint::ProcessEvents>(&st, &id, Some(&process), req).await
}

/// Write the request body to the process's stdin (streamed; it may stay open as long as needed).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/stdin", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, description = "stdin not open", body = ErrorBody)))]
pub async fn process_stdin(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward::<endpoint::ProcessStdin>(&st, &id, Some(&process), req).await
}

/// Close the process's stdin (EOF).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/close-stdin", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn process_close_stdin(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward::<endpoint::ProcessCloseStdin>(&st, &id, Some(&process), req).await
}

/// Send a signal to the process's group.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/signal", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)), request_body = SignalRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn process_signal(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward::<endpoint::ProcessSignal>(&st, &id, Some(&process), req).await
}

/// Resize the process's PTY.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/resize", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)), request_body = PtySize,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 409, description = "not a PTY", body = ErrorBody)))]
pub async fn process_resize(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward::<endpoint::ProcessResize>(&st, &id, Some(&process), req).await
}

/// Download a file (streamed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn read_file(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::ReadFile>(&st, &id, None, req).await
}

/// Upload a file (streamed, any size); it replaces the target atomically.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = EntryInfo), (status = 400, body = ErrorBody)))]
pub async fn write_file(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::WriteFile>(&st, &id, None, req).await
}

/// Describe a path (not following a final symlink).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/stat", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn stat(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Stat>(&st, &id, None, req).await
}

/// Whether a path exists.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/exists", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = ExistsResponse)))]
pub async fn exists(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Exists>(&st, &id, None, req).await
}

/// List a directory, to `depth` levels.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/list", tag = "files", params(("id" = String, Path), ListQuery),
    responses((status = 200, body = DirListing), (status = 404, body = ErrorBody)))]
pub async fn list_dir(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::ListDir>(&st, &id, None, req).await
}

/// Create a directory and its parents.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fs/mkdir", tag = "files", params(("id" = String, Path)),
    request_body = MkdirRequest, responses((status = 201, body = MkdirResponse, description = "created"),
        (status = 200, body = MkdirResponse, description = "the directory existed already"), (status = 409, body = ErrorBody)))]
pub async fn mkdir(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Mkdir>(&st, &id, None, req).await
}

/// Rename or move a path.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fs/rename", tag = "files", params(("id" = String, Path)),
    request_body = RenameRequest, responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn rename(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Rename>(&st, &id, None, req).await
}

/// Remove a file or directory (`recursive` for a non-empty one).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/fs", tag = "files", params(("id" = String, Path), RemoveQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Remove>(&st, &id, None, req).await
}

/// Download a directory (or file) as a tar stream.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/tar", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/x-tar", body = Vec<u8>), (status = 404, body = ErrorBody)))]
pub async fn download_tar(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::DownloadTar>(&st, &id, None, req).await
}

/// Unpack a tar stream into a directory.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/fs/tar", tag = "files", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 204), (status = 400, body = ErrorBody)))]
pub async fn upload_tar(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::UploadTar>(&st, &id, None, req).await
}

/// Watch a directory: inotify events as NDJSON until the client disconnects.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/watch", tag = "files", params(("id" = String, Path), WatchQuery),
    responses((status = 200, content_type = "application/x-ndjson", body = FsEvent), (status = 404, body = ErrorBody)))]
pub async fn watch(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward::<endpoint::Watch>(&st, &id, None, req).await
}
