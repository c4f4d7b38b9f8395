//! What the microvm tier's daemon side tells the agent that boots as the guest's PID 1
//! (docs/microvm-tier.md): a [`GuestConfig`] as JSON on a small read-only disk of the VM's own
//! (serial [`CONFIG_DISK_SERIAL`]), NUL-padded to whole sectors; the initramfs with the agent and
//! the kernel modules is shared by every VM.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Serial number of the VM's configuration disk ([`encode_config_disk`]).
pub const CONFIG_DISK_SERIAL: &str = "moat-config";
/// Where the agent finds the kernel modules to load, one file name per line, in load order.
pub const MODULES_ORDER: &str = "/moat/modules.order";
/// The directory of those modules.
pub const MODULES_DIR: &str = "/moat/modules";
/// The virtio-serial port the daemon's agent connection runs over.
pub const AGENT_PORT: &str = "moat.agent";
/// A second port with the same protocol, for the microvm tier's own requests (freezing the
/// sandbox's processes, exporting its writable layer) while the daemon's connection is in use (a
/// virtio-serial port carries one host connection at a time).
pub const CONTROL_PORT: &str = "moat.control";
// The microvm tier's own routes (`/vm/*`) are in `crate::protocol`.

/// Body of `POST /vm/clock`: sets the guest's wall clock (a microVM has no clock of its own under
/// TCG, and a restored one's stopped while it was saved).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClockRequest {
    /// Nanoseconds since the Unix epoch.
    pub realtime_ns: u64,
}

/// The guest's network interface (`eth0`, the VM's virtio-net device) as the host's sandbox network
/// gave it: one address on a point-to-point subnet whose other end (the gateway) is the host's
/// side of the sandbox's veth pair, which also answers DNS.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GuestNetwork {
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: std::net::Ipv4Addr,
    pub nameserver: std::net::Ipv4Addr,
}

/// Body of `POST /vm/network`: gives the guest's `eth0` another address, route and nameserver, or
/// takes them away (a VM restored from a snapshot into another sandbox's network); `network: None`
/// leaves `eth0` down with no address.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    pub network: Option<GuestNetwork>,
}

/// Body of `POST /vm/freeze`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FreezeRequest {
    pub frozen: bool,
}
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
    /// CPU of [`SANDBOX_CGROUP`] in cores (its cpu.max), for fractions of the VM's vCPUs; 0: none.
    #[serde(default)]
    pub cpu: f64,
    /// `eth0`'s configuration; None: the VM has no network (its interface stays down).
    #[serde(default)]
    pub network: Option<GuestNetwork>,
}

/// The configuration disk's bytes: the JSON, then NULs to a multiple of 4 KiB.
pub fn encode_config_disk(config: &GuestConfig) -> Vec<u8> {
    let mut v = serde_json::to_vec(config).expect("GuestConfig serialises");
    v.resize(v.len().div_ceil(4096).max(1) * 4096, 0);
    v
}

/// A [`GuestConfig`] from the configuration disk's bytes.
pub fn decode_config_disk(bytes: &[u8]) -> Result<GuestConfig, serde_json::Error> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    serde_json::from_slice(&bytes[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_disk_round_trips_in_whole_sectors() {
        let c = GuestConfig {
            hostname: "h".into(),
            env: [("A".to_string(), "b c".to_string())].into(),
            memory_bytes: 256 << 20,
            pids: 64,
            tmp_mb: 0,
            cpu: 0.5,
            network: Some(GuestNetwork {
                address: "10.200.0.6".parse().unwrap(),
                prefix_len: 30,
                gateway: "10.200.0.5".parse().unwrap(),
                nameserver: "10.200.0.5".parse().unwrap(),
            }),
        };
        let disk = encode_config_disk(&c);
        assert_eq!(disk.len(), 4096);
        assert_eq!(decode_config_disk(&disk).unwrap(), c);
        assert!(decode_config_disk(&[0u8; 512]).is_err());
        // A configuration without a network (written by an older daemon) reads as none.
        let old = br#"{"hostname":"h","env":{},"memory_bytes":0,"pids":0,"tmp_mb":0}"#;
        assert_eq!(decode_config_disk(old).unwrap().network, None);
    }
}
