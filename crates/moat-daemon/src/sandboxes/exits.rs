//! Exit notifications: the process whose end is a sandbox's end (its agent, its Sentry, its QEMU:
//! `Tier::watched_process`) is watched through a pidfd, which becomes readable when the process
//! exits. The reaper is told at once instead of reading /proc for every sandbox every few seconds,
//! so the daemon's idle cost does not grow with the number of sandboxes. Where a pidfd cannot be
//! opened (a kernel older than 5.3), the reaper's slow full scan still finds the sandbox.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::host::proc::{self, Liveness};

/// The watches of one daemon.
pub struct Exits {
    tx: mpsc::UnboundedSender<String>,
    /// Sandbox id → the pid watched and its task.
    watches: Mutex<HashMap<String, (u32, tokio::task::AbortHandle)>>,
}

impl Exits {
    /// The watches, and where the ids of sandboxes whose process ended arrive.
    pub fn new() -> (Exits, mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Exits {
                tx,
                watches: Mutex::new(HashMap::new()),
            },
            rx,
        )
    }

    fn watches(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (u32, tokio::task::AbortHandle)>> {
        self.watches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Watches `process` (pid, start time) of sandbox `id`, replacing a watch of another process of
    /// it (a restore runs a new one); a process already gone is reported at once.
    pub fn watch(&self, id: &str, process: Option<(u32, u64)>) {
        let Some((pid, ticks)) = process else {
            return;
        };
        if matches!(self.watches().get(id), Some((p, _)) if *p == pid) {
            return;
        }
        let fd = match proc::pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::debug!(sandbox = %id, pid, "no pidfd ({e}); the full scan will look");
                self.forget(id);
                return;
            }
        };
        // Opened after the check below would leave a window for a recycled pid: opened first, the
        // pidfd is the process that had `ticks`, or the report goes out now.
        if proc::liveness(pid, ticks) == Liveness::Gone {
            let _ = self.tx.send(id.to_string());
            return;
        }
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same descriptor until
        // the AsyncFd is dropped.
        let afd =
            match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
                Ok(a) => a,
                Err(e) => {
                    tracing::debug!(sandbox = %id, pid, "pidfd not pollable ({e})");
                    return;
                }
            };
        let (tx, sid) = (self.tx.clone(), id.to_string());
        let task = tokio::spawn(async move {
            let _ = afd.readable().await;
            let _ = tx.send(sid);
        });
        if let Some((_, old)) = self
            .watches()
            .insert(id.to_string(), (pid, task.abort_handle()))
        {
            old.abort();
        }
    }

    /// Stops watching sandbox `id` (it is gone, or being replaced).
    pub fn forget(&self, id: &str) {
        if let Some((_, task)) = self.watches().remove(id) {
            task.abort();
        }
    }

    /// Whether sandbox `id`'s process is watched (the reaper is told when it exits).
    pub fn is_watched(&self, id: &str) -> bool {
        self.watches().contains_key(id)
    }

    /// How many sandboxes are watched.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.watches().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watched_process_that_exits_is_reported_at_once() {
        let (exits, mut rx) = Exits::new();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let ticks = proc::start_ticks(pid).unwrap();
        exits.watch("sbx_a", Some((pid, ticks)));
        assert_eq!(exits.len(), 1);
        // A process that is not the one with those ticks is reported at once.
        exits.watch("sbx_b", Some((pid, ticks + 1)));
        assert_eq!(rx.recv().await.as_deref(), Some("sbx_b"));
        assert!(rx.try_recv().is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .unwrap();
        assert_eq!(got.as_deref(), Some("sbx_a"));
        exits.forget("sbx_a");
        assert_eq!(exits.len(), 0);
    }
}
