//! `/v1/sandboxes/{id}/network/log` and the allow-list proposals: the connection log over HTTP.

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use moat_api::{NetworkLog, NetworkLogEntry, NetworkLogQuery, NetworkProposal};
use tokio::sync::broadcast::error::RecvError;

use super::error::{ApiError, ApiResult};
use super::St;

fn parse_query(req: &Request) -> ApiResult<NetworkLogQuery> {
    let q = req.uri().query().unwrap_or("");
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(q.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| crate::api::error::from_serde_path(e, "query"))
}

fn check_id(id: &str) -> ApiResult<()> {
    if crate::ids::valid_sandbox_id(id) {
        Ok(())
    } else {
        Err(ApiError::not_found(
            "id",
            format!("sandbox {id:?} not found"),
        ))
    }
}

/// A sandbox's connection log: every TCP connection and DNS question, with the decision and the rule
/// that made it, oldest first (also after the sandbox was deleted). With `follow=true` the answer
/// stays open and streams entries as JSON lines as they are logged, until the sandbox is gone.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network/log", tag = "network",
    params(("id" = String, Path), NetworkLogQuery),
    responses((status = 200, description = "the entries; with follow=true an NDJSON stream of NetworkLogEntry",
               content((NetworkLog = "application/json"), (moat_api::NetworkLogEntry = "application/x-ndjson"))),
              (status = 400, body = moat_api::ErrorBody), (status = 404, body = moat_api::ErrorBody)))]
pub async fn log(State(st): St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_id(&id)?;
    let q = parse_query(&req)?;
    if q.follow != Some(true) {
        let entries = st.netlog.query(Some(&id), None, &q, false).await?;
        return Ok(Json(NetworkLog { entries }).into_response());
    }
    // Subscribe first, then read what is stored: nothing falls between the two.
    let mut live = st.netlog.subscribe();
    let first = NetworkLogQuery {
        limit: Some(crate::netlog::MAX_LIMIT),
        follow: None,
        ..q.clone()
    };
    let stored = st.netlog.query(Some(&id), None, &first, false).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<NetworkLogEntry>(256);
    tokio::spawn(async move {
        let mut last = q.after.unwrap_or(0);
        let wanted = |e: &NetworkLogEntry, last: i64| {
            e.sandbox_id == id && e.id > last && q.decision.is_none_or(|d| d == e.decision)
        };
        for e in stored {
            last = e.id;
            if tx.send(e).await.is_err() {
                return;
            }
        }
        let mut gone = tokio::time::interval(std::time::Duration::from_secs(2));
        loop {
            tokio::select! {
                r = live.recv() => match r {
                    Ok(e) if wanted(&e, last) => {
                        last = e.id;
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    // Fell behind: catch up from the database.
                    Err(RecvError::Lagged(_)) => {
                        let again = NetworkLogQuery { after: Some(last), limit: Some(crate::netlog::MAX_LIMIT), ..first.clone() };
                        let Ok(rows) = st.netlog.query(Some(&id), None, &again, false).await else { return };
                        for e in rows {
                            last = e.id;
                            if tx.send(e).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(RecvError::Closed) => return,
                },
                _ = gone.tick() => {
                    if tx.is_closed() || st.sandboxes.get(&id).is_err() {
                        return;
                    }
                }
            }
        }
    });
    super::ndjson_response(rx)
}

/// The tightest egress policy that would have allowed everything this sandbox did (internet off; in
/// `allow_out` a group, domain or address per destination seen). Run the sandbox with
/// `mode: "audit"` first to see what a policy would refuse without refusing it.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network/proposal", tag = "network",
    params(("id" = String, Path)),
    responses((status = 200, body = NetworkProposal), (status = 404, body = moat_api::ErrorBody)))]
pub async fn proposal(State(st): St, Path(id): Path<String>) -> ApiResult<Json<NetworkProposal>> {
    check_id(&id)?;
    Ok(Json(st.netlog.proposal(Some(&id), None).await?))
}

/// The same over every sandbox started from a template (its sandboxes' logs together).
#[utoipa::path(get, path = "/v1/templates/{name}/network/proposal", tag = "network",
    params(("name" = String, Path)),
    responses((status = 200, body = NetworkProposal), (status = 404, body = moat_api::ErrorBody)))]
pub async fn template_proposal(
    State(st): St,
    Path(name): Path<String>,
) -> ApiResult<Json<NetworkProposal>> {
    st.templates.get(&name)?;
    Ok(Json(st.netlog.proposal(None, Some(&name)).await?))
}
