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
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object ({...})",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).or_else(|first| {
        // JSON has one number type: `31.0` is the integer 31 to most clients (JavaScript's
        // JSON.stringify writes whole floats without a fraction, Python's json does not). A body
        // refused as it is is read again with whole floats as integers; the first error stands
        // when that does not help.
        let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(bytes) else {
            return Err(from_serde_path(first, "JSON body"));
        };
        if !integral_floats_to_integers(&mut v) {
            return Err(from_serde_path(first, "JSON body"));
        }
        serde_path_to_error::deserialize(v).map_err(|_| from_serde_path(first, "JSON body"))
    })
}

/// Turns every float without a fraction (within i64/u64) into an integer; whether any was.
fn integral_floats_to_integers(v: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => {
            let Some(f) = n.as_f64() else { return false };
            if f.fract() != 0.0 || !f.is_finite() {
                return false;
            }
            let whole = if f >= 0.0 && f < u64::MAX as f64 {
                serde_json::Number::from(f as u64)
            } else if f < 0.0 && f >= i64::MIN as f64 {
                serde_json::Number::from(f as i64)
            } else {
                return false;
            };
            *n = whole;
            true
        }
        Value::Array(a) => a
            .iter_mut()
            .fold(false, |any, x| integral_floats_to_integers(x) | any),
        Value::Object(o) => o
            .values_mut()
            .fold(false, |any, x| integral_floats_to_integers(x) | any),
        _ => false,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal<T: DeserializeOwned + std::fmt::Debug>(body: &str) -> moat_api::ErrorDetail {
        match parse_json::<T>(body.as_bytes()) {
            Ok(v) => panic!("{body} was taken as {v:?}"),
            Err(e) => e.0.error,
        }
    }

    #[test]
    fn a_body_is_an_object() {
        for body in ["[]", "3", "\"x\"", "null", " true"] {
            let e = refusal::<moat_api::ResumeRequest>(body);
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{body}");
            assert_eq!(e.field.as_deref(), Some("body"), "{body}");
        }
        let ok: moat_api::ResumeRequest = parse_json(b" \n{}").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(ok.timeout, None);
    }

    #[test]
    fn integral_floats_are_integers() {
        let r: moat_api::SetTimeoutRequest =
            parse_json(b"{\"timeout\": 31.0}").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(r.timeout, 31);
        let r: moat_api::CreateSandboxRequest =
            parse_json(b"{\"memory_mb\": 5e2, \"cpu\": 1.0}").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((r.memory_mb, r.cpu), (Some(500), Some(1.0)));
        // A fraction is still refused, naming the field.
        let e = refusal::<moat_api::SetTimeoutRequest>("{\"timeout\": 31.5}");
        assert_eq!(e.field.as_deref(), Some("timeout"));
        // As is a whole number out of the field's range.
        let e = refusal::<moat_api::SetTimeoutRequest>("{\"timeout\": -1.0}");
        assert_eq!(e.field.as_deref(), Some("timeout"));
    }
}
