//! The audit log.

use moat_api::{AuditEntry, AuditList, AuditQuery};
use reqwest::Method;

use crate::{Client, Result};

impl Client {
    /// `GET /v1/audit`: entries matching `q`, oldest first (`q.format` is ignored: always JSON).
    pub async fn audit(&self, q: &AuditQuery) -> Result<Vec<AuditEntry>> {
        let q = AuditQuery {
            format: None,
            ..q.clone()
        };
        let list: AuditList = self
            .send_json(self.request(Method::GET, &["v1", "audit"]).query(&q))
            .await?;
        Ok(list.entries)
    }

    /// `GET /v1/sandboxes/{id}/audit`: the entries of one sandbox (also after it was deleted).
    pub async fn sandbox_audit(&self, id: &str, q: &AuditQuery) -> Result<Vec<AuditEntry>> {
        let q = AuditQuery {
            format: None,
            sandbox: None,
            ..q.clone()
        };
        let list: AuditList = self
            .send_json(
                self.request(Method::GET, &["v1", "sandboxes", id, "audit"])
                    .query(&q),
            )
            .await?;
        Ok(list.entries)
    }
}
