//! The core's errors: what lifecycle, templates, snapshots, builds, the code interpreter and the
//! logs return. No HTTP here: the fronts (`api`, `e2b`, `api::mcp`) each turn an [`Error`] into
//! their own answer in one place (`api::error` chooses the REST status).

use crate::agent::AgentError;
use crate::db::StoreError;
use crate::tier::TierError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A value the caller gave is refused; `field` names it (empty: the request as a whole).
    #[error("{message}")]
    Invalid { field: String, message: String },
    /// What the request names does not exist; `field` names where it was named.
    #[error("{message}")]
    NotFound { field: String, message: String },
    /// The object's state does not allow the operation (a paused sandbox, a name taken).
    #[error("{0}")]
    Conflict(String),
    /// Something the operation needs is missing on this host (a tier, a kind of snapshot);
    /// `field` names the request field that asked for it.
    #[error("{message}")]
    Unavailable { field: String, message: String },
    /// A retried request differs from the first one made under the same idempotency key.
    #[error("{0}")]
    Unprocessable(String),
    /// A limit of the host was reached (every sandbox slot taken).
    #[error("{0}")]
    Limit(String),
    /// The host's disk is nearly full (down to its reserve): nothing new is made.
    #[error("{0}")]
    NoSpace(String),
    /// An isolation tier failed or refused, with its cause.
    #[error("{what}: {source}")]
    Tier { what: String, source: TierError },
    /// A sandbox's agent failed or refused.
    #[error("{0}")]
    Agent(#[from] AgentError),
    /// The store failed: the daemon's failure, never the caller's.
    #[error("{0}")]
    Storage(StoreError),
    /// Anything else: an unexpected host failure or a bug.
    #[error("{0:#}")]
    Internal(#[from] anyhow::Error),
}

impl Error {
    pub fn invalid(field: &str, message: impl Into<String>) -> Error {
        Error::Invalid {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub fn not_found(field: &str, message: impl Into<String>) -> Error {
        Error::NotFound {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub fn conflict(message: impl Into<String>) -> Error {
        Error::Conflict(message.into())
    }

    pub fn unavailable(field: &str, message: impl Into<String>) -> Error {
        Error::Unavailable {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub fn internal(message: impl std::fmt::Display) -> Error {
        Error::Internal(anyhow::anyhow!("{message}"))
    }

    /// The request field the error is about, if it names one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::Invalid { field, .. }
            | Error::NotFound { field, .. }
            | Error::Unavailable { field, .. }
                if !field.is_empty() =>
            {
                Some(field)
            }
            _ => None,
        }
    }

    /// A tier's failure in doing `what` (a refusal stays a refusal).
    pub fn tier(what: impl Into<String>, source: impl Into<TierError>) -> Error {
        Error::Tier {
            what: what.into(),
            source: source.into(),
        }
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Error {
        match e {
            StoreError::NoFreeSlot(_) => Error::Limit(e.to_string()),
            e => Error::Storage(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_host_is_a_limit_and_a_broken_store_is_storage() {
        assert!(matches!(
            Error::from(StoreError::NoFreeSlot(4)),
            Error::Limit(m) if m == "all 4 sandbox slots are in use"
        ));
        assert!(matches!(
            Error::from(StoreError::Poisoned),
            Error::Storage(StoreError::Poisoned)
        ));
    }
}
