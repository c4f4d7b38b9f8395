//! The client's error type.

use moat_api::{ErrorBody, ErrorCode};

/// Everything a [`crate::Client`] call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The daemon answered with a non-2xx status. `body` is the parsed `{"error": ...}` body, or one
    /// synthesised from the status and the response text when the body was not the API's JSON shape.
    #[error("{body}")]
    Api { status: u16, body: ErrorBody },
    /// The request could not be sent or the response could not be read.
    #[error("HTTP error: {0}")]
    Http(#[from] reqwest::Error),
    /// A local I/O failure.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A response (or a line of a streamed response) was not what the API promises.
    #[error("cannot decode response: {0}")]
    Decode(String),
    /// The client is misconfigured (URL, API key).
    #[error("{0}")]
    Config(String),
    /// The WebSocket handshake or connection failed.
    #[error("WebSocket error: {0}")]
    WebSocket(#[from] Box<tokio_tungstenite::tungstenite::Error>),
}

impl Error {
    /// The API error code, when the daemon answered with an error body.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Api { body, .. } => Some(body.error.code),
            _ => None,
        }
    }

    /// True when the daemon said 404 (sandbox, process, template or path not found).
    pub fn is_not_found(&self) -> bool {
        self.code() == Some(ErrorCode::NotFound)
    }

    /// Builds an [`Error::Api`] from a status and a response body.
    pub fn from_response_body(status: u16, text: &str) -> Error {
        let body = match serde_json::from_str::<ErrorBody>(text) {
            Ok(body) => body,
            Err(_) => {
                let trimmed = text.trim();
                let message = if trimmed.is_empty() {
                    format!("HTTP status {status}")
                } else {
                    format!("HTTP status {status}: {trimmed}")
                };
                ErrorBody::new(ErrorCode::from_status(status), message)
            }
        };
        Error::Api { status, body }
    }
}

impl From<tokio_tungstenite::tungstenite::Error> for Error {
    fn from(e: tokio_tungstenite::tungstenite::Error) -> Self {
        Error::WebSocket(Box::new(e))
    }
}

/// `Result` with the client's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_error_json_and_text() {
        let e = Error::from_response_body(
            404,
            r#"{"error":{"code":"not_found","message":"sandbox x not found","field":"id"}}"#,
        );
        assert!(e.is_not_found());
        assert_eq!(e.to_string(), "sandbox x not found (id)");

        let e = Error::from_response_body(502, "bad gateway\n");
        assert_eq!(e.code(), Some(ErrorCode::Internal));
        assert_eq!(e.to_string(), "HTTP status 502: bad gateway");

        let e = Error::from_response_body(409, "");
        assert_eq!(e.code(), Some(ErrorCode::Conflict));
        assert_eq!(e.to_string(), "HTTP status 409");
    }
}
