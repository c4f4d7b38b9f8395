//! A live sandbox's secrets (docs/secrets.md): declared, rotated, listed and removed through the
//! API. A secret added to a sandbox made without any gets the sandbox's authority installed then,
//! and its placeholder in the environment of processes started from then on.

use moat_api::{SecretInfo, SecretSpec};

use super::lifecycle::Lifecycle;
use crate::error::Error;
use crate::secrets::Scope;

impl Lifecycle {
    fn with_network(&self, id: &str) -> Result<crate::db::SandboxRecord, Error> {
        let rec = self.record(id)?;
        if rec.network.is_none() {
            return Err(Error::conflict(format!(
                "sandbox {id} has no network: secrets travel only through its egress proxy"
            )));
        }
        Ok(rec)
    }

    /// Declares or rotates secret `spec` of sandbox `id`: new connections use the new value.
    pub async fn put_secret(&self, id: &str, spec: &SecretSpec) -> Result<SecretInfo, Error> {
        let rec = self.with_network(id)?;
        let had_ca = self.vault.ca_pem(id).is_some();
        let mut info = self.vault.put(&Scope::Sandbox(id.into()), spec)?;
        let placeholder = self.vault.placeholder(id, &spec.name)?;
        let agent = self.agent(id).await?;
        if !had_ca {
            let ca = self.vault.ensure_ca(id)?;
            let config = moat_api::AgentConfig {
                egress_ca: Some(ca),
                ..Default::default()
            };
            if let Err(e) = agent.configure(&config).await {
                return Err(self.agent_failed(id, e).await);
            }
        }
        let env = [(spec.name.clone(), placeholder.clone())].into();
        if let Err(e) = agent.set_env(&env).await {
            return Err(self.agent_failed(id, e).await);
        }
        tracing::info!(sandbox = id, secret = %spec.name, template = %rec.template, "secret set");
        info.placeholder = Some(placeholder);
        Ok(info)
    }

    /// The secrets that apply to sandbox `id` (its own, its template's, the daemon's), no values.
    pub fn secrets_of(&self, id: &str) -> Result<Vec<SecretInfo>, Error> {
        let rec = self.record(id)?;
        self.vault.list_for(id, &rec.template)
    }

    /// The secret values (with their names) of sandbox `id`, for redacting its output; none when
    /// it has no secrets.
    pub fn secret_values(&self, id: &str) -> Vec<(String, String)> {
        match self.record(id) {
            Ok(rec) if rec.network.is_some() => self.vault.values_for(id, &rec.template),
            _ => Vec::new(),
        }
    }

    /// Ends sandbox `id` because its policy says so (`killed_by_policy`, kept 24 h with `message`).
    pub async fn end_by_policy(&self, id: &str, message: String) -> Result<(), Error> {
        let rec = self.record(id)?;
        if rec.state == moat_api::SandboxState::Starting {
            return Err(Error::conflict(format!("sandbox {id} is still starting")));
        }
        self.end(rec, moat_api::Reason::KilledByPolicy, message)
            .await
            .map_err(|e| Error::internal(format!("end sandbox {id}: {e:#}")))
    }

    /// Removes sandbox `id`'s own secret `name` (its placeholder then goes nowhere).
    pub fn delete_secret(&self, id: &str, name: &str) -> Result<(), Error> {
        self.record(id)?;
        self.vault.delete(&Scope::Sandbox(id.into()), name)
    }
}
