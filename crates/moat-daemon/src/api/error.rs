//! API errors: every failure becomes an HTTP status with `{"error": {"code", "message", "field"?}}`.
//! The core's [`Error`] is turned into one here and nowhere else: this is where a status is chosen.

use axum::response::{IntoResponse, Response};
use moat_api::{ErrorBody, ErrorCode};

use crate::agent::AgentError;
use crate::error::Error;
use crate::sandboxes::IDEMPOTENCY_KEY;
use crate::tier::TierError;

#[derive(Debug)]
pub struct ApiError(pub ErrorBody);

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError(ErrorBody::new(code, message))
    }

    pub fn invalid(field: &str, message: impl Into<String>) -> ApiError {
        ApiError(ErrorBody::new(ErrorCode::InvalidArgument, message).with_field(field))
    }

    pub fn not_found(field: &str, message: impl Into<String>) -> ApiError {
        ApiError(ErrorBody::new(ErrorCode::NotFound, message).with_field(field))
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Conflict, message)
    }

    pub fn internal(err: impl std::fmt::Display) -> ApiError {
        ApiError::new(ErrorCode::Internal, err.to_string())
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> ApiError {
        ApiError::from(Error::Internal(e))
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let with_field = |code, field: String, message: String| {
            let body = ErrorBody::new(code, message);
            ApiError(if field.is_empty() {
                body
            } else {
                body.with_field(&field)
            })
        };
        match e {
            Error::Invalid { field, message } => {
                with_field(ErrorCode::InvalidArgument, field, message)
            }
            Error::NotFound { field, message } => with_field(ErrorCode::NotFound, field, message),
            Error::Conflict(m) => ApiError::new(ErrorCode::Conflict, m),
            Error::Unavailable { field, message } => {
                with_field(ErrorCode::Unavailable, field, message)
            }
            Error::Limit(m) => ApiError::new(ErrorCode::Unavailable, m),
            Error::Unprocessable(m) => {
                ApiError(ErrorBody::new(ErrorCode::Unprocessable, m).with_field(IDEMPOTENCY_KEY))
            }
            Error::NoSpace(m) => ApiError::new(ErrorCode::InsufficientStorage, m),
            // A refusal is written for the user: it says what and why.
            Error::Tier {
                source: TierError::Refused(m),
                ..
            } => ApiError::new(ErrorCode::Conflict, m),
            Error::Tier {
                what,
                source: TierError::Unsupported(m),
            } => ApiError::new(ErrorCode::Unavailable, format!("{what}: {m}")),
            Error::Agent(AgentError::Refused { body, .. }) => ApiError(body),
            e @ (Error::Tier { .. } | Error::Agent(_) | Error::Storage(_) | Error::Internal(_)) => {
                // The daemon's own failures: logged with their cause, answered 500.
                tracing::error!("{e}");
                ApiError::new(ErrorCode::Internal, e.to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = http::StatusCode::from_u16(self.0.error.code.status())
            .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        let note = ErrorNote {
            message: self.0.error.message.clone(),
            field: self.0.error.field.clone(),
        };
        let mut r = (status, axum::Json(self.0)).into_response();
        r.extensions_mut().insert(note);
        r
    }
}

/// An error answer's message and field, kept on the response for the audit log (which never reads
/// response bodies).
#[derive(Debug, Clone)]
pub struct ErrorNote {
    pub message: String,
    pub field: Option<String>,
}

/// Turns a serde error (with its path) into a 400 naming the field.
pub fn from_serde_path(
    err: serde_path_to_error::Error<impl std::fmt::Display>,
    what: &str,
) -> ApiError {
    let path = err.path().to_string();
    let msg = err.inner().to_string();
    // serde reports an unknown field at the enclosing object; the message names the field itself.
    let field = match msg.split('`').nth(1) {
        Some(f) if msg.starts_with("unknown field") => {
            if path == "." || path.is_empty() {
                f.to_string()
            } else if path == f || path.ends_with(&format!(".{f}")) {
                path
            } else {
                format!("{path}.{f}")
            }
        }
        _ if path == "." || path.is_empty() => match msg.split('`').nth(1) {
            Some(f) if msg.starts_with("missing field") => f.to_string(),
            _ => String::new(),
        },
        _ => path,
    };
    // A secret's value is never repeated back, not even one of the wrong type (serde quotes it).
    let secret_value =
        field == "value" || (field.starts_with("secrets[") && field.ends_with(".value"));
    let message = if secret_value {
        format!("invalid {what}: a secret's value is a string")
    } else {
        format!("invalid {what}: {msg}")
    };
    if field.is_empty() {
        ApiError::new(ErrorCode::InvalidArgument, message)
    } else {
        ApiError::invalid(&field, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_value_of_the_wrong_type_is_not_repeated() {
        for (body, field) in [
            (
                r#"{"secrets":[{"name":"X","value":918273645,"hosts":["a.example"]}]}"#,
                "secrets[0].value",
            ),
            (r#"{"value":918273645,"hosts":["a.example"]}"#, "value"),
        ] {
            let de = &mut serde_json::Deserializer::from_str(body);
            let err = if field == "value" {
                serde_path_to_error::deserialize::<_, moat_api::SecretSpec>(de).map(|_| ())
            } else {
                serde_path_to_error::deserialize::<_, moat_api::CreateSandboxRequest>(de)
                    .map(|_| ())
            }
            .unwrap_err();
            let e = from_serde_path(err, "body");
            assert_eq!(e.0.error.field.as_deref(), Some(field));
            assert!(
                !e.0.error.message.contains("918273645"),
                "{}",
                e.0.error.message
            );
        }
    }
}
