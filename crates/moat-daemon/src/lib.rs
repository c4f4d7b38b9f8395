//! The moat daemon: REST API, sandbox lifecycle, isolation tiers and the host mechanisms under them.

pub mod config;
pub mod template;

pub use config::ServeArgs;

/// Runs the daemon until SIGINT/SIGTERM.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not yet")
}

/// The container tier starts each sandbox through a fresh, single-threaded copy of the `moat` binary
/// (`moat __sandbox-init ...`). Call this first thing in `main`, before any runtime or thread starts:
/// it returns `Some(exit_code)` when this process is such an init helper.
pub fn maybe_sandbox_init() -> Option<i32> {
    None
}
