//! Request extractors whose failures name the offending field: JSON bodies (with a size limit → 413,
//! unknown fields → 400) and query strings.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use http::request::Parts;
use moat_api::ErrorCode;
use serde::de::DeserializeOwned;

use super::error::{from_serde_path, ApiError};

/// Largest JSON body accepted (set from the daemon config at start).
pub static MAX_JSON_BODY: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(1 << 20);

/// A JSON body parsed with field-precise errors.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        // The content type is not checked: curl's default (form-urlencoded) would make every first try
        // fail, and a body that is not JSON is reported precisely anyway.
        let limit = MAX_JSON_BODY.load(std::sync::atomic::Ordering::Relaxed);
        let bytes = read_limited(req.into_body(), limit).await?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// Reads a whole body, answering 413 past `limit` bytes.
pub async fn read_limited(body: Body, limit: usize) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<http_body_util::LengthLimitError>())
            .is_some()
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!("request body is larger than {limit} bytes"),
            )
        } else {
            ApiError::invalid("body", format!("could not read request body: {e}"))
        }
    })
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::invalid(
            "body",
            "request body is empty; expected a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| from_serde_path(e, "JSON body"))
}

/// A query string parsed with field-precise errors.
pub struct QueryArgs<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryArgs<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let q = parts.uri.query().unwrap_or("");
        let de = serde_urlencoded::Deserializer::new(form_urlencoded_parse(q));
        serde_path_to_error::deserialize(de)
            .map(QueryArgs)
            .map_err(|e| from_serde_path(e, "query"))
    }
}

fn form_urlencoded_parse(q: &str) -> form_urlencoded::Parse<'_> {
    form_urlencoded::parse(q.as_bytes())
}

/// All values of a repeatable query parameter.
pub fn query_values(parts_query: Option<&str>, key: &str) -> Vec<String> {
    form_urlencoded::parse(parts_query.unwrap_or("").as_bytes())
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
        .collect()
}
