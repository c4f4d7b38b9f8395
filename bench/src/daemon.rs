//! The benchmark's own moat daemon: started on a free loopback port with its own data directory,
//! stopped with SIGTERM at the end.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moat_api::{RegisterTemplateRequest, TemplateStatus};
use moat_client::Client;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub struct Daemon {
    child: Child,
    pub url: String,
    pub data_dir: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts `moat serve` and waits until `/healthz` answers (at most `wait`).
    pub async fn start(
        moat_bin: &Path,
        agent: &Path,
        data_dir: &Path,
        wait: Duration,
        extra: &[&str],
    ) -> Result<(Daemon, Client)> {
        Self::start_in(moat_bin, agent, data_dir, wait, extra, None).await
    }

    /// The same, in network namespace `netns` (`/run/netns/NAME`, entered with `nsenter --net`): the
    /// daemon listens on a unix socket in its data dir, which the bench reaches through a loopback
    /// relay of its own.
    pub async fn start_in(
        moat_bin: &Path,
        agent: &Path,
        data_dir: &Path,
        wait: Duration,
        extra: &[&str],
        netns: Option<&str>,
    ) -> Result<(Daemon, Client)> {
        for (what, path) in [("moat binary", moat_bin), ("agent", agent)] {
            if !path.is_file() {
                bail!(
                    "the {what} {} does not exist; build it first (cargo build --release -p moat-cli; scripts/build-agent.sh --release)",
                    path.display()
                );
            }
        }
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("mkdir {}", data_dir.display()))?;
        let port = free_port()?;
        let listen = format!("127.0.0.1:{port}");
        let log = data_dir.join("daemon.log");
        let log_file = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let log_err = log_file.try_clone().context("dup the daemon log")?;
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(moat_bin);
                c
            }
            None => Command::new(moat_bin),
        };
        let url = match netns {
            Some(_) => {
                let sock = data_dir.join("api.sock");
                cmd.arg("serve").arg("--unix-socket").arg(&sock);
                format!("http://127.0.0.1:{}", unix_relay(sock)?)
            }
            None => {
                cmd.arg("serve");
                format!("http://{listen}")
            }
        };
        let child = cmd
            .arg("--listen")
            .arg(&listen)
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--agent")
            .arg(agent)
            .args(["--e2b-listen", "off"])
            .args(extra)
            // No sandbox networking: the bench's sandboxes, like the peers, get an empty network
            // namespace and never a NAT path out of this machine. (A daemon older than the
            // networking flag ignores the variable; its sandboxes have no network anyway.)
            .env("MOAT_NETWORK", "none")
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            // Its own process group: a Ctrl-C meant for the bench must not stop the daemon before
            // the bench has deleted its sandboxes.
            .process_group(0)
            .spawn()
            .with_context(|| format!("start {}", moat_bin.display()))?;
        let mut daemon = Daemon {
            child,
            url,
            data_dir: data_dir.to_path_buf(),
            log,
        };
        match daemon.wait_ready(wait).await {
            Ok(client) => Ok((daemon, client)),
            Err(e) => {
                let tail = daemon.log_tail();
                daemon.stop();
                Err(e.context(format!("daemon log:\n{tail}")))
            }
        }
    }

    async fn wait_ready(&mut self, wait: Duration) -> Result<Client> {
        let deadline = Instant::now() + wait;
        let key_path = moat_client::api_key_path(&self.data_dir);
        loop {
            if let Some(status) = self.child.try_wait().context("wait for the daemon")? {
                bail!("the daemon exited early ({status})");
            }
            if let Ok(key) = std::fs::read_to_string(&key_path) {
                let client = Client::new(&self.url, key.trim())?;
                if client.health().await.is_ok() {
                    return Ok(client);
                }
            }
            if Instant::now() > deadline {
                bail!("the daemon did not answer /healthz within {wait:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How the daemon ended, when it has.
    pub fn exit_status(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            _ => None,
        }
    }

    /// The last lines of the daemon's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("warning: the daemon ignored SIGTERM for 10 s; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback listener whose connections are relayed to the unix socket `path` (which may not exist
/// yet); returns its port. Lives as long as the bench.
fn unix_relay(path: PathBuf) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("bind a relay port")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(tcp) = conn else { continue };
            // Streamed answers are many small writes: without it, Nagle and delayed ACKs add ~40 ms.
            let _ = tcp.set_nodelay(true);
            let Ok(unix) = std::os::unix::net::UnixStream::connect(&path) else {
                continue;
            };
            let (Ok(mut t2), Ok(mut u2)) = (tcp.try_clone(), unix.try_clone()) else {
                continue;
            };
            let (mut t1, mut u1) = (tcp, unix);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut t1, &mut u1);
                let _ = u1.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut u2, &mut t2);
                let _ = t2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    Ok(port)
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("find a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// Makes template `name` ready on the daemon: reuses it when it is, else registers `source` (a rootfs
/// directory) when given and present, else builds it (debootstrap; only `base` can be built).
pub async fn ensure_template(client: &Client, name: &str, source: Option<&Path>) -> Result<()> {
    match client.get_template(name).await {
        Ok(t) if t.status == TemplateStatus::Ready => {
            eprintln!("template {name}: ready (reused)");
            return Ok(());
        }
        Ok(t) if t.status == TemplateStatus::Building => {
            eprintln!("template {name}: a build is under way; waiting");
            return wait_template(client, name, Duration::from_secs(600)).await;
        }
        Ok(_) => {
            // Failed earlier: drop it and start over.
            client
                .delete_template(name)
                .await
                .with_context(|| format!("delete the failed template {name}"))?;
        }
        Err(_) => {}
    }
    match source.filter(|p| p.is_dir()) {
        Some(path) => {
            eprintln!("template {name}: registering {}", path.display());
            let req = RegisterTemplateRequest {
                name: name.to_string(),
                path: path.display().to_string(),
            };
            client
                .register_template(&req)
                .await
                .with_context(|| format!("register {} as template {name}", path.display()))?;
            wait_template(client, name, Duration::from_secs(600)).await
        }
        None => {
            use futures::StreamExt;
            eprintln!("template {name}: building it (debootstrap, about 90 s)");
            let mut events = client.build_template(name).await?;
            while let Some(ev) = events.next().await {
                match ev? {
                    moat_api::BuildEvent::Done { .. } => return Ok(()),
                    moat_api::BuildEvent::Failed { message, .. } => {
                        bail!("building template {name} failed: {message}")
                    }
                    _ => {}
                }
            }
            wait_template(client, name, Duration::from_secs(600)).await
        }
    }
}

async fn wait_template(client: &Client, name: &str, wait: Duration) -> Result<()> {
    let deadline = Instant::now() + wait;
    loop {
        let t = client.get_template(name).await?;
        match t.status {
            TemplateStatus::Ready => return Ok(()),
            TemplateStatus::Failed => bail!(
                "template {name} failed: {}",
                t.error.unwrap_or_else(|| "no reason given".into())
            ),
            TemplateStatus::Building if Instant::now() > deadline => {
                bail!("template {name} was not ready within {wait:?}")
            }
            TemplateStatus::Building => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}
