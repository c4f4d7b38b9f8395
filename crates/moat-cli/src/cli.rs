//! Command-line definitions (clap derive).

use clap::{Args, Parser, Subcommand};
use moat_api::{Isolation, SandboxState};

use crate::parse::parse_kv;

/// moat: a self-hosted sandbox for AI agents.
#[derive(Debug, Parser)]
#[command(name = "moat", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// URL of the moat daemon.
    #[arg(long, global = true, env = "MOAT_URL")]
    pub url: Option<String>,
    /// API key; read from <MOAT_DATA_DIR>/api-key (default /var/lib/moat/api-key) when absent.
    #[arg(long, global = true, env = "MOAT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print machine-readable JSON instead of tables and plain text.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon (REST API on 127.0.0.1:6628 by default).
    Serve(moat_daemon::ServeArgs),
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// List sandboxes.
    #[command(alias = "list")]
    Ls(LsArgs),
    /// Show a sandbox as JSON.
    Inspect { id: String },
    /// Delete sandboxes.
    #[command(alias = "delete")]
    Rm {
        /// Sandbox ids.
        #[arg(required_unless_present = "all")]
        ids: Vec<String>,
        /// Delete every sandbox.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
    /// Make a sandbox expire SECS seconds from now.
    Timeout { id: String, secs: u64 },
    /// Freeze every process of a sandbox (no CPU, memory and files kept; it does not expire).
    Pause { id: String },
    /// Resume a paused sandbox where it stopped.
    Resume {
        id: String,
        /// New lifetime in seconds from now (the daemon default when absent).
        #[arg(long, value_name = "SECS")]
        timeout: Option<u64>,
    },
    /// Put a sandbox back into a snapshot's state (or the state it was created in), in place.
    Reset {
        id: String,
        /// Snapshot id or name (default: what the sandbox started from).
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Manage snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Start sandboxes from a snapshot and print their ids.
    Fork(ForkArgs),
    /// Show a sandbox's address and egress policy, or replace the policy (with policy flags).
    Network {
        id: String,
        #[command(flatten)]
        net: NetArgs,
    },
    /// A sandbox's connection log: every TCP connection and DNS question, with the decision and the
    /// rule that made it.
    NetworkLog {
        id: String,
        /// Keep printing entries as they are logged, until the sandbox is gone.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only `allow`, `deny` or `audit` (would have been refused) entries.
        #[arg(long)]
        decision: Option<String>,
        /// At most this many entries (before --follow's live ones).
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Propose the tightest egress policy allowing what a sandbox (or a template's sandboxes) did;
    /// run it with `--audit` first to see what a policy would refuse.
    NetworkProposal {
        /// Sandbox id (or --template).
        #[arg(required_unless_present = "template", conflicts_with = "template")]
        id: Option<String>,
        #[arg(long)]
        template: Option<String>,
    },
    /// Host-level information.
    #[command(subcommand)]
    System(SystemCommand),
    /// List the processes of a sandbox.
    Ps { id: String },
    /// Live resource usage of a sandbox, or of every sandbox (a table) without an id.
    Stats { id: Option<String> },
    /// Send a signal to a process (selected by pid or tag).
    Kill {
        id: String,
        /// Pid or tag of the process.
        process: String,
        /// Signal name or number.
        #[arg(long, short = 's', default_value = "SIGKILL")]
        signal: String,
    },
    /// Run a command in a sandbox and stream its output; exits with the command's exit code.
    Exec(ExecArgs),
    /// Create a sandbox, run a command in it, delete it; exits with the command's exit code.
    Run(RunArgs),
    /// Open an interactive terminal in a sandbox.
    Shell {
        id: String,
        /// User to run as (name or uid).
        #[arg(long, short = 'u')]
        user: Option<String>,
        /// Command to run instead of `/bin/bash -l`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cmd: Vec<String>,
    },
    /// Copy files between the host and a sandbox (`ID:PATH` names the sandbox side).
    Cp { src: String, dst: String },
    /// Manage templates.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Run code in a sandbox's code interpreter (state persists between calls in a context).
    Code(crate::code::CodeArgs),
    /// Show the audit log (API actions and commands), oldest first; --json prints JSON lines.
    Audit(crate::audit::AuditArgs),
    /// Serve MCP (Model Context Protocol) over stdin/stdout: sandbox tools for AI agents and MCP
    /// clients such as Claude Desktop. The tools act on the daemon at --url with --api-key.
    Mcp,
}

#[derive(Debug, Clone, Args)]
pub struct CreateArgs {
    /// Template name (the daemon's default when absent).
    #[arg(long)]
    pub template: Option<String>,
    /// Lifetime of the sandbox in seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Environment variable of every command in the sandbox (repeatable).
    #[arg(long, short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Metadata label (repeatable).
    #[arg(long, short = 'm', value_name = "K=V", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
    /// CPU limit in cores (fractions allowed).
    #[arg(long)]
    pub cpu: Option<f64>,
    /// Memory limit in MiB.
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// Isolation tier.
    #[arg(long, value_parser = ["container", "gvisor", "microvm"])]
    pub isolation: Option<String>,
    /// Process/thread limit.
    #[arg(long)]
    pub pids: Option<u64>,
    /// Open files per process.
    #[arg(long)]
    pub nofile: Option<u64>,
    /// Size of the writable layer in MiB (0: no quota).
    #[arg(long)]
    pub disk_mb: Option<u64>,
    /// Inodes of the writable layer.
    #[arg(long)]
    pub disk_inodes: Option<u64>,
    /// Size of /tmp (a tmpfs counted as memory) in MiB (0: /tmp is on the writable layer).
    #[arg(long)]
    pub tmp_mb: Option<u64>,
    /// Output buffer per process in bytes.
    #[arg(long)]
    pub output_bytes: Option<u64>,
    /// Timeout of commands that give none, in seconds.
    #[arg(long, value_name = "SECS")]
    pub command_timeout: Option<u64>,
    /// Kill the sandbox after SECS seconds without an API request for it.
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<u64>,
    /// Start from this snapshot (id or name) instead of the template's clean state.
    #[arg(long)]
    pub snapshot: Option<String>,
    /// What to do when the timeout passes.
    #[arg(long, value_parser = ["kill", "pause"])]
    pub on_timeout: Option<String>,
    #[command(flatten)]
    pub net: NetArgs,
    /// Let anyone reach the sandbox's ports (preview URLs) without its access token.
    #[arg(long)]
    pub public_ports: bool,
    /// Resume the sandbox, when paused, on any request for it (a command, a file, a port's
    /// traffic) instead of answering 409.
    #[arg(long)]
    pub auto_resume: bool,
    /// A secret kept out of the sandbox (docs/secrets.md): `NAME@HOST[,HOST...]`, its value read
    /// from this command's own environment variable NAME (never from the command line); inside,
    /// `$NAME` is a placeholder that the egress proxy replaces in TLS requests to the hosts.
    /// Repeatable.
    #[arg(long = "secret", value_name = "NAME@HOSTS")]
    pub secrets: Vec<String>,
}

/// Egress policy flags (see docs/network.md).
#[derive(Debug, Clone, Default, Args)]
pub struct NetArgs {
    /// No public internet (only what --allow-out names).
    #[arg(long, conflicts_with = "allow_internet")]
    pub no_internet: bool,
    /// Public internet allowed (the default).
    #[arg(long)]
    pub allow_internet: bool,
    /// Allowed even without internet or when private (repeatable): an IPv4 address or CIDR, a
    /// domain, `*.domain` or a group (`@pypi`, `@npm`, `@debian`, `@github`, ...).
    #[arg(long, value_name = "DEST")]
    pub allow_out: Vec<String>,
    /// Refused (repeatable; the same kinds as --allow-out; allow beats deny).
    #[arg(long, value_name = "DEST")]
    pub deny_out: Vec<String>,
    /// Audit mode: let through what the policy would refuse, and log it as `audit`.
    #[arg(long)]
    pub audit: bool,
}

impl NetArgs {
    /// The policy these flags ask for; None when none was given.
    pub fn policy(&self) -> Option<moat_api::NetworkPolicy> {
        if !self.no_internet
            && !self.allow_internet
            && self.allow_out.is_empty()
            && self.deny_out.is_empty()
            && !self.audit
        {
            return None;
        }
        Some(moat_api::NetworkPolicy {
            allow_internet: !self.no_internet,
            allow_out: self.allow_out.clone(),
            deny_out: self.deny_out.clone(),
            mode: if self.audit {
                moat_api::NetworkMode::Audit
            } else {
                moat_api::NetworkMode::Enforce
            },
            ..Default::default()
        })
    }
}

impl CreateArgs {
    pub fn isolation(&self) -> anyhow::Result<Option<Isolation>> {
        self.isolation
            .as_deref()
            .map(|s| s.parse::<Isolation>().map_err(anyhow::Error::msg))
            .transpose()
    }
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only sandboxes in this state (starting, running, paused, stopping).
    #[arg(long)]
    pub state: Option<SandboxState>,
    /// Only sandboxes with this metadata label (repeatable; all must match).
    #[arg(long, short = 'm', value_name = "K=V", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
}

/// Process options shared by `exec` and `run`.
#[derive(Debug, Clone, Args)]
pub struct ProcessOpts {
    /// Working directory (the user's home when absent).
    #[arg(long, short = 'w')]
    pub cwd: Option<String>,
    /// User to run as (name or uid; root when absent).
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Pipe this terminal's stdin to the process.
    #[arg(long = "stdin", short = 'i')]
    pub stdin: bool,
    /// Run on a pseudo-terminal (interactive, like `shell`).
    #[arg(long, short = 't')]
    pub tty: bool,
    /// Tag to address the process by.
    #[arg(long)]
    pub tag: Option<String>,
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    pub id: String,
    #[command(flatten)]
    pub opts: ProcessOpts,
    /// Extra environment variable (repeatable).
    #[arg(long, short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Kill the command after SECS seconds (exit code 124).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<f64>,
    /// Start in the background and print the pid.
    #[arg(long, short = 'd', conflicts_with_all = ["stdin", "tty"])]
    pub detach: bool,
    /// The command and its arguments (argv, no shell: use `sh -c '...'` for shell syntax).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub cmd: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub create: CreateArgs,
    #[command(flatten)]
    pub opts: ProcessOpts,
    /// Kill the command after SECS seconds (exit code 124).
    #[arg(long, value_name = "SECS")]
    pub cmd_timeout: Option<f64>,
    /// The command and its arguments (argv, no shell: use `sh -c '...'` for shell syntax).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub cmd: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Snapshot a sandbox (its filesystem; with --full its processes and memory too); prints the snapshot id.
    Create {
        id: String,
        /// Unique name to address it by.
        #[arg(long)]
        name: Option<String>,
        /// Full-state snapshot: processes and memory too, so that sandboxes started from it continue them (gvisor and microvm tiers).
        #[arg(long)]
        full: bool,
        /// Metadata label (repeatable).
        #[arg(long, short = 'm', value_name = "K=V", value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
    },
    /// List snapshots.
    #[command(alias = "list")]
    Ls,
    /// Show a snapshot as JSON.
    Inspect { id: String },
    /// Delete snapshots (sandboxes started from them keep running).
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SystemCommand {
    /// Disk used by templates, snapshot layers and sandboxes' writable layers.
    Df,
    /// Empty the build cache (layers templates, snapshots or sandboxes use stay).
    Prune,
}

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// Snapshot id or name.
    pub snapshot: String,
    /// How many sandboxes.
    #[arg(long, short = 'n', default_value_t = 1)]
    pub count: u32,
    /// Lifetime of each in seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Environment variable added for every fork (repeatable).
    #[arg(long, short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Metadata label for every fork (repeatable).
    #[arg(long, short = 'm', value_name = "K=V", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
}

#[derive(Debug, Subcommand)]
pub enum TemplateCommand {
    /// List templates.
    #[command(alias = "list")]
    Ls,
    /// Build a template, showing progress: from a spec (`-f moat.toml`: a base, steps that become
    /// cached layers, a start command), or `base` / `code-interpreter` from Debian packages.
    Build {
        name: String,
        /// The template spec (TOML, docs/templates.md). Its directory is the build context (the
        /// files `copy` steps take) unless --context names another.
        #[arg(long, short = 'f', value_name = "FILE")]
        file: Option<std::path::PathBuf>,
        /// Directory `copy` sources are relative to.
        #[arg(long, value_name = "DIR", requires = "file")]
        context: Option<std::path::PathBuf>,
        /// Run every step again instead of taking it from the build cache.
        #[arg(long, requires = "file")]
        no_cache: bool,
        /// Print the build tool's log lines (spec builds print their steps' output unless --quiet).
        #[arg(long, short = 'v')]
        verbose: bool,
        /// Only the steps, not their output.
        #[arg(long, short = 'q', conflicts_with = "verbose")]
        quiet: bool,
    },
    /// List template builds from specs, newest first.
    Builds {
        /// Only the builds of this template.
        name: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// One build: its status and steps (cached or run, how long, the layer each made).
    Inspect { id: String },
    /// A build's output from its start; follows a build that is still running.
    Logs {
        /// Build id (`moat template builds` lists them).
        id: String,
        /// Only the steps, not their output.
        #[arg(long, short = 'q')]
        quiet: bool,
    },
    /// Stop a running build (the template stays as it was).
    Cancel { id: String },
    /// Register a root filesystem directory or tarball, an OCI image layout or a `docker save`
    /// archive on the daemon's host as a template.
    Add {
        name: String,
        path: std::path::PathBuf,
    },
    /// Make a template from an image in an OCI registry (e.g. `python:3.12-slim`,
    /// `ghcr.io/org/img:tag`, `127.0.0.1:5000/img`).
    Pull {
        name: String,
        image: String,
        /// Registry user.
        #[arg(long, requires = "password")]
        username: Option<String>,
        /// Registry password or token.
        #[arg(
            long,
            env = "MOAT_REGISTRY_PASSWORD",
            hide_env_values = true,
            requires = "username"
        )]
        password: Option<String>,
        /// Plain HTTP to the registry.
        #[arg(long)]
        insecure: bool,
    },
    /// Delete a template.
    #[command(alias = "delete")]
    Rm { name: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn exec_parses_trailing_command() {
        let cli = Cli::try_parse_from([
            "moat", "exec", "sbx_1", "-i", "--env", "A=1", "--", "ls", "-la", "/tmp",
        ])
        .unwrap();
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.id, "sbx_1");
        assert!(args.opts.stdin);
        assert_eq!(args.env, vec![("A".to_string(), "1".to_string())]);
        assert_eq!(args.cmd, vec!["ls", "-la", "/tmp"]);

        let cli = Cli::try_parse_from(["moat", "exec", "sbx_1", "echo", "-n", "hi"]).unwrap();
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.cmd, vec!["echo", "-n", "hi"]);
        assert!(Cli::try_parse_from(["moat", "exec", "sbx_1"]).is_err());
        assert!(Cli::try_parse_from(["moat", "exec", "sbx_1", "-d", "-t", "x"]).is_err());
    }

    #[test]
    fn run_and_globals() {
        let cli = Cli::try_parse_from([
            "moat",
            "run",
            "--template",
            "base",
            "--timeout",
            "60",
            "-m",
            "a=b",
            "--json",
            "--cmd-timeout",
            "1.5",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .unwrap();
        assert!(cli.global.json);
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(args.create.timeout, Some(60));
        assert_eq!(args.cmd_timeout, Some(1.5));
        assert_eq!(args.cmd, vec!["sh", "-c", "exit 3"]);
        assert!(Cli::try_parse_from(["moat", "create", "--env", "novalue"]).is_err());
        assert!(Cli::try_parse_from(["moat", "create", "--isolation", "vm"]).is_err());
        assert!(Cli::try_parse_from(["moat", "rm"]).is_err());
        assert!(Cli::try_parse_from(["moat", "rm", "--all"]).is_ok());
        assert!(Cli::try_parse_from(["moat", "ls", "--state", "bogus"]).is_err());
    }
}
