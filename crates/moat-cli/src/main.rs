//! `moat`: the command-line interface of the moat sandbox daemon.

mod audit;
mod build;
mod cli;
mod code;
mod cp;
mod exec;
mod output;
mod parse;
mod sandbox;
mod shell;
mod snapshot;
mod template;

use clap::Parser;

use cli::{Cli, Command};

fn main() {
    // Must come first: the daemon re-executes this binary as a single-threaded namespace-init helper.
    if let Some(code) = moat_daemon::maybe_sandbox_init() {
        std::process::exit(code)
    }
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        restore_sigpipe();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1)
        }
    };
    let code = runtime.block_on(dispatch(cli));
    output::flush();
    // Exit without dropping the runtime: a blocking stdin reader may still be parked in read(2).
    std::process::exit(code)
}

/// Rust ignores SIGPIPE, which turns `moat ls | head` into a write error; restore the default so a
/// closed output pipe ends the CLI quietly, like other Unix tools. Never for `serve`: the daemon writes
/// to unix sockets of agents that may die at any moment, and tokio writes those with plain write(2).
fn restore_sigpipe() {
    // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Runs one command; returns the process exit code.
async fn dispatch(cli: Cli) -> i32 {
    let result = match cli.command {
        Command::Serve(args) => return serve(args).await,
        command => run_client_command(&cli.global, command).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            output::print_error(&e);
            1
        }
    }
}

async fn serve(args: moat_daemon::ServeArgs) -> i32 {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match moat_daemon::serve(args).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

async fn run_client_command(global: &cli::Global, command: Command) -> anyhow::Result<i32> {
    let client = moat_client::Client::configured(global.url.as_deref(), global.api_key.as_deref())?;
    let json = global.json;
    match command {
        Command::Serve(_) => unreachable!("handled by dispatch"),
        Command::Create(args) => sandbox::create(&client, &args, json).await,
        Command::Ls(args) => sandbox::list(&client, &args, json).await,
        Command::Inspect { id } => sandbox::inspect(&client, &id).await,
        Command::Rm { ids, all } => sandbox::remove(&client, &ids, all, json).await,
        Command::Timeout { id, secs } => sandbox::set_timeout(&client, &id, secs, json).await,
        Command::Pause { id } => snapshot::pause(&client, &id, json).await,
        Command::Resume { id, timeout } => snapshot::resume(&client, &id, timeout, json).await,
        Command::Reset { id, snapshot } => snapshot::reset(&client, &id, snapshot, json).await,
        Command::Snapshot(cmd) => snapshot::dispatch(&client, cmd, json).await,
        Command::Fork(args) => snapshot::fork(&client, &args, json).await,
        Command::System(cli::SystemCommand::Df) => snapshot::df(&client, json).await,
        Command::System(cli::SystemCommand::Prune) => template::prune(&client, json).await,
        Command::Network { id, net } => sandbox::network(&client, &id, &net, json).await,
        Command::NetworkLog {
            id,
            follow,
            decision,
            limit,
        } => sandbox::network_log(&client, &id, follow, decision, limit, json).await,
        Command::NetworkProposal { id, template } => {
            sandbox::network_proposal(&client, id, template, json).await
        }
        Command::Ps { id } => exec::ps(&client, &id, json).await,
        Command::Stats { id } => sandbox::stats(&client, id.as_deref(), json).await,
        Command::Kill {
            id,
            process,
            signal,
        } => exec::kill(&client, &id, &process, &signal).await,
        Command::Exec(args) => exec::exec(&client, &args, json).await,
        Command::Run(args) => exec::run(&client, &args).await,
        Command::Shell { id, user, cmd } => shell::shell(&client, &id, user, cmd).await,
        Command::Cp { src, dst } => cp::cp(&client, &src, &dst).await,
        Command::Template(cmd) => template::dispatch(&client, cmd, json).await,
        Command::Code(args) => code::run(&client, &args, json).await,
        Command::Audit(args) => audit::run(&client, &args, json).await,
        Command::Mcp => moat_mcp::serve_stdio(client).await.map(|()| 0),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn client_defaults_match_the_daemon() {
        use std::path::Path;
        assert_eq!(moat_client::DEFAULT_URL, moat_daemon::config::DEFAULT_URL);
        assert_eq!(
            moat_client::DEFAULT_DATA_DIR,
            moat_daemon::config::DEFAULT_DATA_DIR
        );
        let dir = Path::new("/x");
        assert_eq!(
            moat_client::api_key_path(dir),
            moat_daemon::config::api_key_path(dir)
        );
    }
}
