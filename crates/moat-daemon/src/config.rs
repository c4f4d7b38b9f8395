//! Daemon configuration: command-line flags with environment fallbacks and embedded defaults.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Flags of `moat serve`. Only this module reads them: the rest of the daemon takes the settings
/// made from them ([`ServeArgs::settings`] and each part's own).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// TCP address of the REST API (loopback by default).
    #[arg(long, env = "MOAT_LISTEN", default_value = "127.0.0.1:6628")]
    pub listen: SocketAddr,
    /// Also serve the API on this unix socket.
    #[arg(long, env = "MOAT_UNIX_SOCKET")]
    pub unix_socket: Option<PathBuf>,
    /// Where state (SQLite), templates and sandbox layers live.
    #[arg(long, env = "MOAT_DATA_DIR", default_value = "/var/lib/moat")]
    pub data_dir: PathBuf,
    /// Sandbox lifetime when create gives none, in seconds.
    #[arg(long, env = "MOAT_DEFAULT_TIMEOUT", default_value_t = 300)]
    pub default_timeout: u64,
    /// Longest lifetime a sandbox may be given, in seconds.
    #[arg(long, env = "MOAT_MAX_TIMEOUT", default_value_t = 86_400)]
    pub max_timeout: u64,
    /// Template used when create names none.
    #[arg(long, env = "MOAT_DEFAULT_TEMPLATE", default_value = "base")]
    pub default_template: String,
    /// Isolation tier of sandboxes created without one (container, gvisor, microvm); the warm pool
    /// holds sandboxes of this tier.
    #[arg(long, env = "MOAT_DEFAULT_ISOLATION", default_value = "container")]
    pub default_isolation: moat_api::Isolation,
    /// Static agent binary bind-mounted into sandboxes; found next to the `moat` binary or in
    /// /usr/local/lib/moat when absent.
    #[arg(long, env = "MOAT_AGENT")]
    pub agent: Option<PathBuf>,
    /// Default CPU limit of a sandbox, in cores.
    #[arg(long, env = "MOAT_DEFAULT_CPU", default_value_t = 1.0)]
    pub default_cpu: f64,
    /// Default memory limit of a sandbox, in MiB.
    #[arg(long, env = "MOAT_DEFAULT_MEMORY_MB", default_value_t = 512)]
    pub default_memory_mb: u64,
    /// Default process/thread limit of a sandbox (cgroup pids.max).
    #[arg(long, env = "MOAT_DEFAULT_PIDS", default_value_t = 4096)]
    pub default_pids: u64,
    /// Default open-file limit (RLIMIT_NOFILE) of sandbox processes; capped at the daemon's own hard limit.
    #[arg(long, env = "MOAT_DEFAULT_NOFILE", default_value_t = 4096)]
    pub default_nofile: u64,
    /// Default size of a sandbox's writable layer in MiB (a sparse ext4 image); 0: no disk quota, the
    /// layer lives on the data directory's filesystem.
    #[arg(long, env = "MOAT_DEFAULT_DISK_MB", default_value_t = 10_240)]
    pub default_disk_mb: u64,
    /// Default inode count of the writable layer; 0: one per 16 KiB of `disk_mb`.
    #[arg(long, env = "MOAT_DEFAULT_DISK_INODES", default_value_t = 0)]
    pub default_disk_inodes: u64,
    /// Default size of /tmp in MiB (a tmpfs charged to the sandbox's memory); 0: /tmp is part of the
    /// writable layer.
    #[arg(long, env = "MOAT_DEFAULT_TMP_MB", default_value_t = 0)]
    pub default_tmp_mb: u64,
    /// Default per-process output buffer in bytes.
    #[arg(long, env = "MOAT_DEFAULT_OUTPUT_BYTES", default_value_t = 4 << 20)]
    pub default_output_bytes: u64,
    /// Default timeout in seconds of commands that give none; 0: none.
    #[arg(long, env = "MOAT_DEFAULT_COMMAND_TIMEOUT", default_value_t = 0)]
    pub default_command_timeout: u64,
    /// Default idle timeout in seconds (killed after this long without an API request for it); 0: never.
    #[arg(long, env = "MOAT_DEFAULT_IDLE_TIMEOUT", default_value_t = 0)]
    pub default_idle_timeout: u64,
    /// Directory of the microvm tier's guest kernel (vmlinuz, modules/, modules.order), as
    /// scripts/guest-kernel.sh installs it.
    #[arg(
        long,
        env = "MOAT_GUEST_KERNEL",
        default_value = "/usr/local/lib/moat/guest"
    )]
    pub guest_kernel: PathBuf,
    /// Accelerator of the microvm tier: auto (KVM when a probe guest boots under it, else TCG), kvm
    /// or tcg.
    #[arg(long, env = "MOAT_MICROVM_ACCEL", default_value = "auto")]
    pub microvm_accel: crate::tier::microvm::AccelChoice,
    /// First host uid/gid of the ranges sandbox users map to (each sandbox gets 65536 ids).
    #[arg(long, env = "MOAT_UID_BASE", default_value_t = 1_000_000_000)]
    pub uid_base: u32,
    /// Sandboxes of the default template kept started ahead of demand (the warm pool); a create that
    /// fits takes one instead of starting from nothing. 0 turns the pool off.
    #[arg(long, env = "MOAT_POOL_SIZE", default_value_t = 2)]
    pub pool_size: u32,
    /// Start sandboxes WITHOUT the capability drop, seccomp filter and /proc and /sys masks (the user
    /// namespace, cgroups and the rest stay). Only for measuring what hardening costs (bench/); never
    /// for untrusted code.
    #[arg(long, env = "MOAT_NO_HARDENING")]
    pub no_hardening: bool,
    /// Container-tier sandboxes see their own CPU and memory counts in /proc and /sys (`free`,
    /// `nproc`, `os.cpu_count()`) through LXCFS: `auto` (when the `lxcfs` binary and /dev/fuse are
    /// there), `on` (refuse to start without it) or `off` (the host's counts).
    #[arg(long, env = "MOAT_LXCFS", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub lxcfs: String,
    /// Largest request body accepted by JSON endpoints, in bytes (file uploads stream and are unlimited).
    #[arg(long, env = "MOAT_MAX_JSON_BODY", default_value_t = 1 << 20)]
    pub max_json_body: usize,
    /// Audit log entries older than this many days are deleted (at start and hourly); 0: kept for ever.
    #[arg(long, env = "MOAT_AUDIT_RETENTION_DAYS", default_value_t = 30)]
    pub audit_retention_days: u64,
    /// Sandbox networking: `nat` (each sandbox gets an address, NAT out of the host under its egress
    /// policy) or `none` (loopback only).
    #[arg(long, env = "MOAT_NETWORK", default_value = "nat", value_parser = ["nat", "none"])]
    pub network: String,
    /// IPv4 subnet sandbox addresses come from (a /30 per sandbox; at least a /18).
    #[arg(long, env = "MOAT_SUBNET", default_value = "10.200.0.0/16")]
    pub subnet: String,
    /// Interface sandbox traffic leaves the host by (NAT); default: the default route's.
    #[arg(long, env = "MOAT_UPLINK")]
    pub uplink: Option<String>,
    /// Resolver sandbox DNS queries go to; default: the host's first non-loopback nameserver.
    #[arg(long, env = "MOAT_DNS")]
    pub dns: Option<std::net::Ipv4Addr>,
    /// Daemon-wide deny list: a file of IPv4 addresses, CIDRs and domains (one per line, `#`
    /// comments) that no sandbox reaches, whatever its own policy allows. Repeatable (comma-separated in the
    /// environment); re-read when a file changes or the daemon gets SIGHUP.
    #[arg(long = "deny-list", env = "MOAT_DENY_LIST", value_delimiter = ',')]
    pub deny_list: Vec<PathBuf>,
    /// PEM certificates the egress proxy trusts, besides the host's own store, when it opens TLS to
    /// a secret's host (docs/secrets.md): a private CA of your own services.
    #[arg(long, env = "MOAT_EGRESS_CA_FILE", value_name = "PEM")]
    pub egress_ca_file: Option<PathBuf>,
    /// Egress policy of sandboxes created without one, as JSON (`{"allow_internet": false,
    /// "allow_out": ["@pypi"]}`) or `@FILE` holding it; default: public internet allowed, private
    /// ranges and metadata blocked.
    #[arg(long, env = "MOAT_DEFAULT_NETWORK", value_name = "JSON|@FILE")]
    pub default_network: Option<String>,
    /// TCP connections one sandbox may hold open through the daemon's egress proxy at once (each
    /// holds two of the daemon's file descriptors); more are reset and logged.
    #[arg(long, env = "MOAT_MAX_CONNECTIONS_PER_SANDBOX", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_connections_per_sandbox: u64,
    /// The audit log keeps at most this many entries (the oldest go first); 0: no cap.
    #[arg(long, env = "MOAT_AUDIT_MAX_ENTRIES", default_value_t = 1_000_000)]
    pub audit_max_entries: u64,
    /// An apt source line (`deb [trusted=yes] http://mirror.internal/debian bookworm main`) that the
    /// `apt` steps of template builds use instead of the image's own sources: a local or company
    /// mirror. Repeatable; steps then reach only these hosts.
    #[arg(
        long = "build-apt-source",
        env = "MOAT_BUILD_APT_SOURCE",
        value_delimiter = '\n'
    )]
    pub build_apt_source: Vec<String>,
    /// Python package index the `pip` steps of template builds install from (PIP_INDEX_URL);
    /// default: PyPI.
    #[arg(long, env = "MOAT_BUILD_PIP_INDEX", value_name = "URL")]
    pub build_pip_index: Option<String>,
    /// npm registry the `npm` steps of template builds install from; default: registry.npmjs.org.
    #[arg(long, env = "MOAT_BUILD_NPM_REGISTRY", value_name = "URL")]
    pub build_npm_registry: Option<String>,
    /// Address of the E2B-compatible API (E2B's SDKs with `E2B_API_URL` and `E2B_SANDBOX_URL` set to
    /// `http://` this address; docs/e2b.md), or `off`.
    #[arg(
        long,
        env = "MOAT_E2B_LISTEN",
        default_value = "127.0.0.1:6629",
        value_name = "ADDR|off"
    )]
    pub e2b_listen: String,
    /// The domain E2B's SDKs build sandbox hosts from (`sbx.get_host(port)` gives
    /// `{port}-{id}.{domain}`), answered as `domain` by the E2B API, whose listener serves those
    /// hosts. Default `localhost:PORT` (the E2B listener's port): browsers and curl take any
    /// `*.localhost` name to this machine. A wildcard DNS name (`*.sbx.example.com`) for remote
    /// clients (docs/e2b.md).
    #[arg(long, env = "MOAT_E2B_DOMAIN", value_name = "DOMAIN")]
    pub e2b_domain: Option<String>,
    /// Connections the API listeners (REST, its unix socket and E2B, together) hold open at once;
    /// kept below half the daemon's open-file limit. More are answered 503 and closed.
    #[arg(long, env = "MOAT_MAX_CONNECTIONS", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// Connections one client address may hold open at once on the API listeners.
    #[arg(long, env = "MOAT_MAX_CONNECTIONS_PER_CLIENT", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections_per_client: u64,
    /// Seconds a request's head may take to arrive (a half-sent request, or an HTTP/1.1 connection
    /// idle between requests, is closed after them).
    #[arg(long, env = "MOAT_HEADER_TIMEOUT", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub header_timeout: u64,
    /// Seconds a request body may send nothing while the daemon reads it (process stdin streams
    /// excepted) before the request fails.
    #[arg(long, env = "MOAT_BODY_IDLE_TIMEOUT", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub body_idle_timeout: u64,
    /// MiB of the data directory's filesystem kept free for the daemon (its database, logs and
    /// snapshots): sandboxes' disks are capped so that none can take them, and creates are refused
    /// (507) below twice this much free. 0: 5% of the filesystem, at least 256 MiB, at most 4 GiB.
    #[arg(long, env = "MOAT_DISK_RESERVE_MB", default_value_t = 0)]
    pub disk_reserve_mb: u64,
    /// Largest build context (the files a template spec's `copy` steps take) accepted, in MiB.
    #[arg(long, env = "MOAT_MAX_BUILD_CONTEXT_MB", default_value_t = 2048)]
    pub max_build_context_mb: u64,
}

impl ServeArgs {
    /// What the lifecycle is configured with; an error names the flag that is wrong.
    pub fn settings(&self) -> anyhow::Result<crate::sandboxes::Settings> {
        Ok(crate::sandboxes::Settings {
            data_dir: self.data_dir.clone(),
            default_timeout: self.default_timeout,
            max_timeout: self.max_timeout,
            default_template: self.default_template.clone(),
            default_isolation: self.default_isolation,
            default_limits: moat_api::SandboxLimits {
                cpu: self.default_cpu,
                memory_mb: self.default_memory_mb,
                pids: self.default_pids,
                nofile: self.default_nofile,
                disk_mb: self.default_disk_mb,
                disk_inodes: self.default_disk_inodes,
                tmp_mb: self.default_tmp_mb,
                output_bytes: self.default_output_bytes,
                command_timeout: self.default_command_timeout,
                idle_timeout: self.default_idle_timeout,
            },
            pool_size: self.pool_size,
            default_network: self.default_network_policy()?,
            max_build_context_mb: self.max_build_context_mb,
            registries: crate::template::spec::Registries::new(
                &self.build_apt_source,
                self.build_pip_index.clone(),
                self.build_npm_registry.clone(),
            )?,
            agent_timeout: std::time::Duration::from_secs(20),
            disk_reserve: self.disk_reserve_mb << 20,
        })
    }

    /// The policy `--default-network` gives (JSON, or `@FILE` holding JSON), checked like a
    /// create's.
    pub fn default_network_policy(&self) -> anyhow::Result<moat_api::NetworkPolicy> {
        let Some(v) = &self.default_network else {
            return Ok(moat_api::NetworkPolicy::default());
        };
        let text = match v.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--default-network {v}: {e}"))?,
            None => v.clone(),
        };
        let p: moat_api::NetworkPolicy =
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--default-network: {e}"))?;
        crate::sandboxes::validate_policy(&p).map_err(|e| {
            anyhow::anyhow!("--default-network: {}: {e}", e.field().unwrap_or_default())
        })?;
        Ok(p)
    }

    /// The E2B API's address, None when it is `off`.
    pub fn e2b_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        match self.e2b_listen.trim() {
            "off" | "none" | "" => Ok(None),
            a => a.parse().map(Some).map_err(|e| {
                anyhow::anyhow!("--e2b-listen {a}: {e} (an address like 127.0.0.1:6629, or off)")
            }),
        }
    }

    /// The domain of E2B sandbox hosts (see `e2b_domain`) for a listener on `addr`.
    pub fn e2b_domain_for(&self, addr: SocketAddr) -> String {
        match self.e2b_domain.as_deref().map(str::trim) {
            Some(d) if !d.is_empty() => d.trim_start_matches('.').to_ascii_lowercase(),
            _ => format!("localhost:{}", addr.port()),
        }
    }

    /// What each API listener allows (before [`crate::api::serve::Limits::within_file_limit`]).
    pub fn listen_limits(&self) -> crate::api::serve::Limits {
        crate::api::serve::Limits {
            max_connections: usize::try_from(self.max_connections).unwrap_or(usize::MAX),
            max_per_client: usize::try_from(self.max_connections_per_client).unwrap_or(usize::MAX),
            header_timeout: std::time::Duration::from_secs(self.header_timeout),
            body_idle_timeout: std::time::Duration::from_secs(self.body_idle_timeout),
        }
    }

    /// Path of the API key file the daemon creates on first start and the CLI reads.
    pub fn api_key_path(&self) -> PathBuf {
        api_key_path(&self.data_dir)
    }
}

/// `<data_dir>/api-key`.
pub fn api_key_path(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("api-key")
}

/// Default data directory, for clients that look for the API key on the same machine.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/moat";
/// Default API address, for clients.
pub const DEFAULT_URL: &str = "http://127.0.0.1:6628";

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> ServeArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let mut argv = vec!["moat"];
        argv.extend(extra);
        <Cli as clap::Parser>::try_parse_from(argv).unwrap().serve
    }

    #[test]
    fn default_network_from_json_or_a_file() {
        assert_eq!(
            args(&[]).default_network_policy().unwrap(),
            moat_api::NetworkPolicy::default()
        );
        let p = args(&[
            "--default-network",
            r#"{"allow_internet":false,"allow_out":["@pypi"]}"#,
        ])
        .default_network_policy()
        .unwrap();
        assert!(!p.allow_internet);
        assert_eq!(p.allow_out, ["@pypi"]);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("net.json");
        std::fs::write(&f, r#"{"deny_out":["203.0.113.0/24"]}"#).unwrap();
        let from_file = format!("@{}", f.display());
        assert_eq!(
            args(&["--default-network", &from_file])
                .default_network_policy()
                .unwrap()
                .deny_out,
            ["203.0.113.0/24"]
        );
        let bad = args(&["--default-network", r#"{"allow_out":["exa mple.com"]}"#])
            .default_network_policy()
            .unwrap_err();
        assert!(bad.to_string().contains("network.allow_out[0]"), "{bad}");
        assert!(args(&["--default-network", "{not json"])
            .default_network_policy()
            .is_err());
        assert!(args(&["--default-network", "@/nonexistent"])
            .default_network_policy()
            .is_err());
    }

    #[test]
    fn settings_carry_the_defaults_and_refuse_a_bad_registry() {
        let s = args(&["--default-memory-mb", "256", "--pool-size", "0"])
            .settings()
            .unwrap();
        assert_eq!(s.default_limits.memory_mb, 256);
        assert_eq!(s.default_limits.disk_mb, 10_240);
        assert_eq!(s.pool_size, 0);
        let bad = args(&["--build-pip-index", "not a url"])
            .settings()
            .unwrap_err();
        assert!(format!("{bad:#}").contains("--build-pip-index"), "{bad:#}");
    }
}
