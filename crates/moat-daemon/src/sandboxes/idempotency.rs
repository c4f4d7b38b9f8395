//! Idempotent creates: a create sent with an `Idempotency-Key` and retried (its answer lost to a
//! dropped connection, a timeout, a proxy) returns the sandbox the first one made instead of making
//! a second. The key, a digest of the request and the sandbox are kept 24 h; a retry with the same
//! key and another request is refused (422), as Stripe's and IETF's idempotency keys are.

use std::sync::Arc;

use moat_api::{CreateSandboxRequest, Sandbox, SandboxState};
use sha2::{Digest, Sha256};

use super::causes::KEEP_ENDED_MS;
use super::core::detached;
use super::lifecycle::Lifecycle;
use crate::clock::now_ms;
use crate::error::Error;

/// The header (and the field named in its errors).
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// Checks a key: 1 to 255 visible ASCII characters.
pub fn check_key(key: &str) -> Result<(), Error> {
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::invalid(
            IDEMPOTENCY_KEY,
            "an Idempotency-Key is 1 to 255 visible ASCII characters (a UUID, for example)",
        ));
    }
    Ok(())
}

impl Lifecycle {
    /// Creates a sandbox once for `key`: a retry with the same request returns the first one's
    /// sandbox (`true`: replayed). Runs to its end whatever the caller does, so that the key is
    /// recorded with the sandbox even when the caller went away before the answer.
    pub async fn create_once(
        self: &Arc<Self>,
        key: &str,
        req: CreateSandboxRequest,
    ) -> Result<(Sandbox, bool), Error> {
        check_key(key)?;
        // Secret values stay out of what is kept of the request, even hashed: a retry is the same
        // request whatever values it carries.
        let mut kept = req.clone();
        for s in &mut kept.secrets {
            s.value.clear();
        }
        let digest = hex::encode(Sha256::digest(
            serde_json::to_vec(&kept).map_err(|e| Error::internal(format!("encode: {e}")))?,
        ));
        let lock = {
            let mut m = self
                .keys_in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            m.entry(key.to_string()).or_default().clone()
        };
        let (this, key) = (self.clone(), key.to_string());
        detached(async move {
            let held = lock.lock().await;
            let out = this.create_under(&key, &digest, req).await;
            drop(held);
            let mut m = this
                .keys_in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Only the map and this task hold it: no other create waits on the key.
            if Arc::strong_count(&lock) == 2 {
                m.remove(&key);
            }
            out
        })
        .await
    }

    async fn create_under(
        self: &Arc<Self>,
        key: &str,
        digest: &str,
        req: CreateSandboxRequest,
    ) -> Result<(Sandbox, bool), Error> {
        if let Some((first, id)) = self.db.idempotency(key)? {
            if first != digest {
                return Err(Error::Unprocessable(format!(
                    "Idempotency-Key {key:?} was used for another request (sandbox {id}); a retry \
                     must send the same request, or a new key"
                )));
            }
            return match self.inspect(&id).await {
                // It ended without a request: a replay answering 201 with a sandbox that can
                // no longer be used would read as a success; say what became of it instead.
                Ok(s) if s.state == SandboxState::Ended => {
                    let why = s.ended.map_or_else(String::new, |c| {
                        format!(" at {} ({}): {}", c.at, c.reason.as_str(), c.message)
                    });
                    Err(Error::conflict(format!(
                        "sandbox {id}, made under Idempotency-Key {key:?}, ended{why}; use a new \
                         key to create another"
                    )))
                }
                Ok(s) => Ok((s, true)),
                Err(Error::NotFound { .. }) => Err(Error::conflict(format!(
                    "sandbox {id}, made under Idempotency-Key {key:?}, was deleted; use a new key \
                     to create another"
                ))),
                Err(e) => Err(e),
            };
        }
        let s = self.create_now(req).await?;
        let now = now_ms();
        if let Err(e) = self
            .db
            .put_idempotency(key, digest, &s.id, now)
            .and_then(|()| self.db.prune_ended(now - KEEP_ENDED_MS))
        {
            tracing::error!(sandbox = %s.id, "record its Idempotency-Key: {e:#}");
        }
        Ok((s, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_short_visible_ascii() {
        assert!(check_key("6f1c2a9e-0b7d-4c1e-9d3a-1f2e3d4c5b6a").is_ok());
        for bad in ["", "with space", "é", &"k".repeat(256)] {
            let e = check_key(bad).unwrap_err();
            assert_eq!(e.field(), Some(IDEMPOTENCY_KEY), "{bad:?}");
        }
    }
}
