//! What the microvm tier's daemon side tells the agent that boots as the guest's PID 1
//! (docs/microvm-tier.md): written as JSON to [`CONFIG_PATH`] in a small initramfs archive of the
//! VM's own, appended to the shared one with the agent and the kernel modules.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where the agent finds its [`GuestConfig`] in the initramfs.
pub const CONFIG_PATH: &str = "/moat/config.json";
/// Where the agent finds the kernel modules to load, one file name per line, in load order.
pub const MODULES_ORDER: &str = "/moat/modules.order";
/// The directory of those modules.
pub const MODULES_DIR: &str = "/moat/modules";
/// The virtio-serial port the daemon's agent connection runs over.
pub const AGENT_PORT: &str = "moat.agent";
/// Serial number of the read-only base disk (the template and snapshot layers as one ext4 image).
pub const BASE_DISK_SERIAL: &str = "moat-base";
/// Serial number of the VM's writable disk (ext4: the overlay's upper and work directories).
pub const RW_DISK_SERIAL: &str = "moat-rw";
/// Inside the guest: the cgroup every process the agent starts runs in (the agent stays outside it).
pub const SANDBOX_CGROUP: &str = "/sys/fs/cgroup/sandbox";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GuestConfig {
    pub hostname: String,
    /// The agent's (and so every process's) starting environment.
    pub env: BTreeMap<String, String>,
    /// memory.max of [`SANDBOX_CGROUP`]; 0: none.
    pub memory_bytes: u64,
    /// pids.max of [`SANDBOX_CGROUP`]; 0: none.
    pub pids: u64,
    /// Size of the tmpfs on /tmp in MiB; 0: /tmp is on the root filesystem.
    pub tmp_mb: u64,
}
