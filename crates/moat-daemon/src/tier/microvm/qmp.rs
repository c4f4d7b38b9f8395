//! A blocking client of QEMU's machine protocol (QMP) on a VM's unix socket: one connection per
//! operation (QEMU serves one client at a time; a second waits until the first closes).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

/// Connects to the unix socket at `path` only when it is a socket owned by `uid` (the VM's QEMU
/// made it): a compromised QEMU, which can write the socket's directory, cannot point the daemon at
/// another VM's socket. The name is opened without following a symlink.
pub fn connect_owned(path: &Path, uid: u32) -> Result<UnixStream> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    let meta = file.metadata()?;
    if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) || meta.uid() != uid {
        bail!("{} is not the VM's socket", path.display());
    }
    UnixStream::connect(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .with_context(|| format!("connect {}", path.display()))
}

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    pub fn connect(path: &Path, uid: u32, timeout: Duration) -> Result<Qmp> {
        let s = connect_owned(path, uid)?;
        s.set_read_timeout(Some(timeout))?;
        let mut q = Qmp {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        };
        let greeting = q.read()?;
        if greeting.get("QMP").is_none() {
            bail!("QEMU did not greet with QMP: {greeting}");
        }
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line).context("read from QMP")? == 0 {
            bail!("QEMU closed its QMP socket");
        }
        serde_json::from_str(&line).context("parse a QMP message")
    }

    /// Runs a command and returns its `return` value (events in between are skipped).
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        let msg = json!({"execute": command, "arguments": arguments});
        self.send(&msg, None)
    }

    /// As [`Self::execute`], passing `fd` along (SCM_RIGHTS), as `getfd` takes it.
    pub fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value> {
        let msg = json!({"execute": command, "arguments": arguments});
        self.send(&msg, Some(fd))
    }

    fn send(&mut self, msg: &Value, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Result<Value> {
        let mut bytes = serde_json::to_vec(msg)?;
        bytes.push(b'\n');
        match fd {
            None => self.writer.write_all(&bytes)?,
            Some(fd) => {
                let raw = [fd.as_raw_fd()];
                let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
                let iov = [std::io::IoSlice::new(&bytes)];
                let n = nix::sys::socket::sendmsg::<()>(
                    self.writer.as_raw_fd(),
                    &iov,
                    &cmsg,
                    nix::sys::socket::MsgFlags::empty(),
                    None,
                )
                .context("send to QMP")?;
                if n != bytes.len() {
                    self.writer.write_all(&bytes[n..])?;
                }
            }
        }
        loop {
            let v = self.read()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(anyhow!(
                    "QEMU {}: {}",
                    msg["execute"].as_str().unwrap_or("command"),
                    e.get("desc").and_then(Value::as_str).unwrap_or("error")
                ));
            }
        }
    }
}
