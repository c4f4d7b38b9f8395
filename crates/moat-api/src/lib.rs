//! Types shared by the moat daemon, the in-sandbox agent, the CLI and the Rust client.
//!
//! The daemon's OpenAPI document is generated from these types (feature `openapi`), so a change here is
//! a change of the public API. The agent speaks the same per-sandbox types over the host↔agent channel,
//! which is why process and file types live here and not in the daemon.

pub mod audit;
pub mod build;
pub mod checkpoint;
pub mod code;
pub mod error;
pub mod files;
pub mod guest;
pub mod network;
pub mod process;
pub mod protocol;
pub mod sandbox;
pub mod secret;
pub mod snapshot;
pub mod template;

pub use audit::*;
pub use build::*;
pub use checkpoint::unix_sockets_bound_to_paths;
pub use code::*;
pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use files::*;
pub use network::*;
pub use process::*;
pub use sandbox::*;
pub use secret::*;
pub use snapshot::*;
pub use template::*;

/// Version of the host↔agent protocol; the daemon refuses an agent that reports another one.
/// 3: the process journal (`GET /journal`).
pub const AGENT_PROTOCOL_VERSION: u32 = 3;

/// Content type of streamed event responses: one JSON object per line.
pub const NDJSON: &str = "application/x-ndjson";
