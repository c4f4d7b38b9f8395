//! Code interpreter: stateful cells in a kernel that lives in the sandbox, with rich results
//! (`/v1/sandboxes/{id}/code`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Language of a code context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum CodeLanguage {
    #[default]
    Python,
    Javascript,
    Bash,
}

impl CodeLanguage {
    pub fn as_str(self) -> &'static str {
        match self {
            CodeLanguage::Python => "python",
            CodeLanguage::Javascript => "javascript",
            CodeLanguage::Bash => "bash",
        }
    }
}

impl std::fmt::Display for CodeLanguage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `POST /v1/sandboxes/{id}/code`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RunCodeRequest {
    /// The cell's source; must not be empty.
    pub code: String,
    /// Language of the default context to use when `context_id` is absent (default `python`). With
    /// `context_id` it must match the context's language when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<CodeLanguage>,
    /// A context from `POST .../code/contexts`; the language's default context when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// Seconds before the cell is interrupted (the context and its state survive); default 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Environment variables set while the cell runs (python, javascript); exported in bash.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// A rich result: the value of the cell's last expression (`is_main_result`) or something displayed
/// during the cell (a matplotlib figure, `display(obj)`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CodeResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub markdown: Option<String>,
    /// PNG image, standard base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub png: Option<String>,
    /// JPEG image, standard base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jpeg: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub svg: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub json: Option<serde_json::Value>,
    #[serde(default)]
    pub is_main_result: bool,
}

/// An exception the cell raised (or `TimeoutError` when its timeout interrupted it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CodeError {
    pub name: String,
    pub value: String,
    pub traceback: String,
}

/// One line of `POST .../code`'s NDJSON answer; `end` is always last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CodeEvent {
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Result(CodeResult),
    Error(CodeError),
    End {
        /// How many cells this context has run, this one included.
        execution_count: u64,
        duration_ms: u64,
    },
}

/// `POST /v1/sandboxes/{id}/code/contexts`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateCodeContextRequest {
    /// Default `python`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<CodeLanguage>,
    /// Working directory the kernel starts in (must exist); `/root` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A code context: one kernel process in the sandbox with its own state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CodeContext {
    pub id: String,
    pub language: CodeLanguage,
    /// The directory the kernel started in.
    pub cwd: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CodeContextList {
    pub contexts: Vec<CodeContext>,
}

/// Context ids: 1–48 characters of `[A-Za-z0-9_-]`.
pub fn validate_context_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 48 {
        return Err("context id must be 1 to 48 characters".into());
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err("context id may hold only letters, digits, '_' and '-'".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let ev = CodeEvent::Result(CodeResult {
            text: Some("2".into()),
            is_main_result: true,
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"type":"result","text":"2","is_main_result":true}"#
        );
        let end: CodeEvent =
            serde_json::from_str(r#"{"type":"end","execution_count":3,"duration_ms":5}"#).unwrap();
        assert_eq!(
            end,
            CodeEvent::End {
                execution_count: 3,
                duration_ms: 5
            }
        );
        let req: RunCodeRequest =
            serde_json::from_str(r#"{"code":"1","language":"bash"}"#).unwrap();
        assert_eq!(req.language, Some(CodeLanguage::Bash));
        assert!(
            serde_json::from_str::<RunCodeRequest>(r#"{"code":"1","language":"ruby"}"#).is_err()
        );
        assert!(validate_context_id("default-python").is_ok());
        assert!(validate_context_id("a/b").is_err());
    }
}
