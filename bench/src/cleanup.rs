//! What the bench made and must remove, whatever happens: moat sandboxes (deleted through the API,
//! then swept by label), bwrap processes, and the runsc, runc and podman containers (each tool keeps
//! its state in a directory of the bench's own, which is swept whole at the end).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Mutex;
use std::time::Duration;

use moat_client::{Client, SandboxFilter};

use crate::peers;

/// Label put on every sandbox the bench makes, so a crashed run's leftovers are found and deleted.
pub const LABEL: &str = "moat-bench";

/// The sandbox filter that finds the bench's sandboxes.
pub fn label_filter() -> SandboxFilter {
    let mut filter = SandboxFilter::default();
    filter.metadata.insert(LABEL.into(), "1".into());
    filter
}

/// Where the peers keep their containers' state; each directory belongs to the bench alone, so
/// everything listed there is the bench's and is removed at the end.
#[derive(Debug, Clone, Default)]
pub struct PeerState {
    /// `runsc --root`
    pub runsc: Option<PathBuf>,
    /// `runc --root`
    pub runc: Option<PathBuf>,
    /// `podman --root .. --runroot ..` and the rest of the global flags.
    pub podman: Option<Vec<OsString>>,
}

#[derive(Default)]
struct Inner {
    sandboxes: Vec<String>,
    children: Vec<Child>,
}

/// Things to remove. Shared by reference (a mutex inside) so concurrent creators can record theirs.
#[derive(Default)]
pub struct Cleanup {
    inner: Mutex<Inner>,
    pub peers: PeerState,
}

impl Cleanup {
    pub fn new(peers: PeerState) -> Cleanup {
        Cleanup {
            inner: Mutex::default(),
            peers,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn add_sandbox(&self, id: &str) {
        self.lock().sandboxes.push(id.to_string());
    }

    pub fn remove_sandbox(&self, id: &str) {
        self.lock().sandboxes.retain(|s| s != id);
    }

    /// A process (bwrap with `--die-with-parent`) killed at the end.
    pub fn add_child(&self, child: Child) {
        self.lock().children.push(child);
    }

    /// Kills and reaps the recorded processes now (they are also killed at the end).
    pub fn kill_children(&self) {
        let children: Vec<Child> = self.lock().children.drain(..).collect();
        for mut child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Removes every container of the peers' state directories; returns what could not be removed.
    pub fn sweep_peers(&self) -> Vec<String> {
        let mut problems = Vec::new();
        // A state directory that does not exist holds nothing.
        if let Some(state) = self.peers.runsc.as_ref().filter(|d| d.is_dir()) {
            problems.extend(peers::sweep_oci(&peers::runsc_base(state), "runsc"));
        }
        if let Some(root) = self.peers.runc.as_ref().filter(|d| d.is_dir()) {
            problems.extend(peers::sweep_oci(&peers::runc_base(root), "runc"));
        }
        if let Some(base) = &self.peers.podman {
            problems.extend(peers::sweep_podman(base));
        }
        problems
    }

    /// Removes everything; returns what could not be removed.
    pub async fn finish(&self, client: &Client) -> Vec<String> {
        self.kill_children();
        let mut problems = self.sweep_peers();
        // Sandboxes outlive the daemon by design: delete each one explicitly, then sweep by label
        // (twice: a create cut short by a signal may still be answered after the first sweep).
        let mut ids: Vec<String> = self.lock().sandboxes.drain(..).collect();
        for round in 0..2 {
            if round == 1 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if let Ok(list) = client.list_sandboxes(&label_filter()).await {
                for s in list {
                    if !ids.contains(&s.id) {
                        ids.push(s.id);
                    }
                }
            }
            for id in ids.drain(..) {
                if let Err(e) = client.delete_sandbox(&id).await {
                    if !e.is_not_found() {
                        problems.push(format!("sandbox {id}: {e}"));
                    }
                }
            }
        }
        problems
    }
}
