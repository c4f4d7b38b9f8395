//! The one error shape every endpoint answers with: `{"error": {"code", "message", "field"?}}`.

use serde::{Deserialize, Serialize};

/// Machine-readable error class; each maps to one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the request is malformed or a value is out of range (`field` names it).
    InvalidArgument,
    /// 401: the API key is missing or wrong.
    Unauthorized,
    /// 403: the sandbox's own permissions refuse the operation (e.g. writing a read-only file).
    PermissionDenied,
    /// 404: the sandbox, template, process or path does not exist.
    NotFound,
    /// 409: the object is in a state that does not allow the operation.
    Conflict,
    /// 413: the request body is larger than the limit.
    PayloadTooLarge,
    /// 422: a retried request with an `Idempotency-Key` differs from the first one under that key.
    Unprocessable,
    /// 504: the operation did not finish in time.
    Timeout,
    /// 503: a needed facility is missing on this host (e.g. an isolation tier).
    Unavailable,
    /// 507: the host's disk is nearly full (only what is kept in reserve is left): nothing new is
    /// made until space is freed (sandboxes, snapshots or templates deleted).
    InsufficientStorage,
    /// 500: a bug or an unexpected host failure; the message says what failed.
    Internal,
}

impl ErrorCode {
    /// HTTP status code for this error class.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::Unprocessable => 422,
            ErrorCode::Timeout => 504,
            ErrorCode::Unavailable => 503,
            ErrorCode::InsufficientStorage => 507,
            ErrorCode::Internal => 500,
        }
    }

    /// Error class for an HTTP status (used by clients that only see the status).
    pub fn from_status(status: u16) -> ErrorCode {
        match status {
            400 => ErrorCode::InvalidArgument,
            422 => ErrorCode::Unprocessable,
            401 => ErrorCode::Unauthorized,
            403 => ErrorCode::PermissionDenied,
            404 => ErrorCode::NotFound,
            409 => ErrorCode::Conflict,
            413 => ErrorCode::PayloadTooLarge,
            504 => ErrorCode::Timeout,
            503 => ErrorCode::Unavailable,
            507 => ErrorCode::InsufficientStorage,
            _ => ErrorCode::Internal,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
    /// The request field (JSON key, query parameter or path segment) the error is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// Body of every non-2xx response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message: message.into(),
                field: None,
            },
        }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.error.field = Some(field.into());
        self
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error.field {
            Some(field) => write!(f, "{} ({field})", self.error.message),
            None => write!(f, "{}", self.error.message),
        }
    }
}

impl std::error::Error for ErrorBody {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_shape() {
        let body = ErrorBody::new(ErrorCode::NotFound, "sandbox sbx_1 not found").with_field("id");
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {"code": "not_found", "message": "sandbox sbx_1 not found", "field": "id"}})
        );
        assert_eq!(ErrorCode::NotFound.status(), 404);
        assert_eq!(ErrorCode::from_status(409), ErrorCode::Conflict);
    }
}
