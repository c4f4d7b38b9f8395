//! Sandbox lifecycle endpoints.

use std::collections::BTreeMap;

use moat_api::{CreateSandboxRequest, Sandbox, SandboxList, SandboxState, SetTimeoutRequest};
use reqwest::Method;

use crate::{Client, Result};

/// Filter of [`Client::list_sandboxes`]; every given condition must match.
#[derive(Debug, Clone, Default)]
pub struct SandboxFilter {
    pub state: Option<SandboxState>,
    /// Metadata labels that must all be present with these values.
    pub metadata: BTreeMap<String, String>,
}

impl SandboxFilter {
    /// Query pairs: `state=...` and one `metadata=key=value` per label.
    pub fn query(&self) -> Vec<(&'static str, String)> {
        let mut q = Vec::new();
        if let Some(state) = self.state {
            q.push(("state", state.as_str().to_string()));
        }
        for (k, v) in &self.metadata {
            q.push(("metadata", format!("{k}={v}")));
        }
        q
    }
}

impl Client {
    /// `POST /v1/sandboxes`
    pub async fn create_sandbox(&self, req: &CreateSandboxRequest) -> Result<Sandbox> {
        self.send_json(self.request(Method::POST, &["v1", "sandboxes"]).json(req))
            .await
    }

    /// `POST /v1/sandboxes` with an `Idempotency-Key`: a retry with the same key and request
    /// returns the sandbox the first one made (for 24 h); another request under the key is a 422.
    pub async fn create_sandbox_once(
        &self,
        key: &str,
        req: &CreateSandboxRequest,
    ) -> Result<Sandbox> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes"])
                .header("Idempotency-Key", key)
                .json(req),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}`: a live sandbox, or one that ended without a request in the last
    /// 24 h (`state: ended`, `ended` saying why).
    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox> {
        self.send_json(self.request(Method::GET, &["v1", "sandboxes", id]))
            .await
    }

    /// `GET /v1/sandboxes/{id}/stats`: live usage and limits.
    pub async fn sandbox_stats(&self, id: &str) -> Result<moat_api::SandboxStats> {
        self.send_json(self.request(Method::GET, &["v1", "sandboxes", id, "stats"]))
            .await
    }

    /// `GET /v1/sandboxes?state=&metadata=k=v...`
    pub async fn list_sandboxes(&self, filter: &SandboxFilter) -> Result<Vec<Sandbox>> {
        let list: SandboxList = self
            .send_json(
                self.request(Method::GET, &["v1", "sandboxes"])
                    .query(&filter.query()),
            )
            .await?;
        Ok(list.sandboxes)
    }

    /// `DELETE /v1/sandboxes/{id}`
    pub async fn delete_sandbox(&self, id: &str) -> Result<()> {
        self.send_empty(self.request(Method::DELETE, &["v1", "sandboxes", id]))
            .await
    }

    /// `GET /v1/sandboxes/{id}/network`
    pub async fn get_network(&self, id: &str) -> Result<moat_api::NetworkInfo> {
        self.send_json(self.request(Method::GET, &["v1", "sandboxes", id, "network"]))
            .await
    }

    /// `PUT /v1/sandboxes/{id}/network`: replace the egress policy.
    pub async fn set_network(
        &self,
        id: &str,
        policy: &moat_api::NetworkPolicy,
    ) -> Result<moat_api::NetworkInfo> {
        self.send_json(
            self.request(Method::PUT, &["v1", "sandboxes", id, "network"])
                .json(policy),
        )
        .await
    }

    /// `PUT /v1/sandboxes/{id}/secrets/{name}`: declares or rotates a secret of the sandbox.
    pub async fn put_secret(
        &self,
        id: &str,
        spec: &moat_api::SecretSpec,
    ) -> Result<moat_api::SecretInfo> {
        self.send_json(
            self.request(Method::PUT, &["v1", "sandboxes", id, "secrets", &spec.name])
                .json(spec),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/secrets`: the secrets that apply to it (names, hosts and
    /// placeholders; never values).
    pub async fn secrets(&self, id: &str) -> Result<Vec<moat_api::SecretInfo>> {
        let l: moat_api::SecretList = self
            .send_json(self.request(Method::GET, &["v1", "sandboxes", id, "secrets"]))
            .await?;
        Ok(l.secrets)
    }

    /// `PUT /v1/secrets/{name}`: a daemon-wide secret.
    pub async fn put_daemon_secret(
        &self,
        spec: &moat_api::SecretSpec,
    ) -> Result<moat_api::SecretInfo> {
        self.send_json(
            self.request(Method::PUT, &["v1", "secrets", &spec.name])
                .json(spec),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/network/log`: connection log entries, oldest first (`follow` is
    /// ignored here; see [`Client::follow_network_log`]).
    pub async fn network_log(
        &self,
        id: &str,
        q: &moat_api::NetworkLogQuery,
    ) -> Result<Vec<moat_api::NetworkLogEntry>> {
        let q = moat_api::NetworkLogQuery {
            follow: None,
            ..q.clone()
        };
        let log: moat_api::NetworkLog = self
            .send_json(
                self.request(Method::GET, &["v1", "sandboxes", id, "network", "log"])
                    .query(&q),
            )
            .await?;
        Ok(log.entries)
    }

    /// `GET /v1/sandboxes/{id}/network/log?follow=true`: the stored entries, then new ones as they
    /// are logged, until the sandbox is gone.
    pub async fn follow_network_log(
        &self,
        id: &str,
        q: &moat_api::NetworkLogQuery,
    ) -> Result<crate::EventStream<moat_api::NetworkLogEntry>> {
        let q = moat_api::NetworkLogQuery {
            follow: Some(true),
            ..q.clone()
        };
        let resp = self
            .send(
                self.request(Method::GET, &["v1", "sandboxes", id, "network", "log"])
                    .query(&q),
            )
            .await?;
        Ok(crate::ndjson_response(resp))
    }

    /// `GET /v1/sandboxes/{id}/network/proposal`
    pub async fn network_proposal(&self, id: &str) -> Result<moat_api::NetworkProposal> {
        self.send_json(self.request(Method::GET, &["v1", "sandboxes", id, "network", "proposal"]))
            .await
    }

    /// `GET /v1/templates/{name}/network/proposal`
    pub async fn template_network_proposal(&self, name: &str) -> Result<moat_api::NetworkProposal> {
        self.send_json(self.request(
            Method::GET,
            &["v1", "templates", name, "network", "proposal"],
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/timeout`: the sandbox now expires `timeout_secs` from now.
    pub async fn set_timeout(&self, id: &str, timeout_secs: u64) -> Result<Sandbox> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "timeout"])
                .json(&SetTimeoutRequest {
                    timeout: timeout_secs,
                }),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_query() {
        let mut f = SandboxFilter {
            state: Some(SandboxState::Running),
            ..Default::default()
        };
        f.metadata.insert("a".into(), "1".into());
        f.metadata.insert("b".into(), "x=y".into());
        let q = f.query();
        assert_eq!(
            q,
            vec![
                ("state", "running".to_string()),
                ("metadata", "a=1".to_string()),
                ("metadata", "b=x=y".to_string())
            ]
        );
        let encoded = serde_urlencoded_like(&q);
        assert_eq!(encoded, "state=running&metadata=a%3D1&metadata=b%3Dx%3Dy");
    }

    fn serde_urlencoded_like(q: &[(&str, String)]) -> String {
        let c = Client::new("http://h", "k").unwrap();
        let req = c
            .request(Method::GET, &["v1", "sandboxes"])
            .query(q)
            .build()
            .unwrap();
        req.url().query().unwrap_or_default().to_string()
    }
}
