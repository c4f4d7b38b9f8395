//! What a create (or a pooled claim, or a build step's sandbox) is checked against: the request's
//! values, the limits the host can give, the egress policy. Every refusal names its field.

use std::collections::BTreeMap;

use moat_api::{AgentConfig, CreateSandboxRequest, Isolation, SandboxLimits};

use super::core::Core;
use crate::error::Error;
use crate::tier::TierCapabilities;

/// Per-process output buffer bounds, bytes.
const OUTPUT_BYTES_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(256 << 20);
/// Largest pids limit (the kernel's pid_max ceiling).
const MAX_PIDS: u64 = 4_194_304;
/// Smallest pids limit: the agent itself needs a handful of threads.
const MIN_PIDS: u64 = 16;

/// Checks every entry of an egress policy (the error names the entry).
pub fn validate_policy(p: &moat_api::NetworkPolicy) -> Result<(), Error> {
    if p.egress_mbps.is_some_and(|m| !(1..=100_000).contains(&m)) {
        return Err(Error::invalid(
            "network.egress_mbps",
            "egress_mbps must be 1..=100000",
        ));
    }
    if p.connections_per_second
        .is_some_and(|n| !(1..=100_000).contains(&n))
    {
        return Err(Error::invalid(
            "network.connections_per_second",
            "connections_per_second must be 1..=100000",
        ));
    }
    for (list, entries) in [("allow_out", &p.allow_out), ("deny_out", &p.deny_out)] {
        if entries.len() > 1000 {
            return Err(Error::invalid(
                &format!("network.{list}"),
                "at most 1000 entries",
            ));
        }
        for (i, e) in entries.iter().enumerate() {
            moat_api::parse_destination(e)
                .map_err(|m| Error::invalid(&format!("network.{list}[{i}]"), m))?;
        }
    }
    Ok(())
}

/// Checks metadata labels (of a sandbox or a snapshot).
pub(super) fn validate_metadata(md: &BTreeMap<String, String>) -> Result<(), Error> {
    if md.len() > 64 {
        return Err(Error::invalid("metadata", "at most 64 metadata labels"));
    }
    for (k, v) in md {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains('=') {
            return Err(Error::invalid(
                &format!("metadata.{k}"),
                "metadata keys must be 1-128 characters without '='; values at most 1024",
            ));
        }
    }
    Ok(())
}

/// `base` with what `req` sets replaced (a disk quota without an inode count gets one inode per
/// 16 KiB, like mkfs.ext4's default).
pub(super) fn limits_over(base: &SandboxLimits, req: &CreateSandboxRequest) -> SandboxLimits {
    let disk_mb = req.disk_mb.unwrap_or(base.disk_mb);
    let inodes = match req.disk_inodes {
        Some(n) => n,
        None if req.disk_mb.is_some() => 0,
        None => base.disk_inodes,
    };
    let disk_inodes = match (disk_mb, inodes) {
        (0, _) => 0,
        (mb, 0) => (mb * 64).clamp(1024, u32::MAX as u64),
        (_, n) => n,
    };
    SandboxLimits {
        cpu: req.cpu.unwrap_or(base.cpu),
        memory_mb: req.memory_mb.unwrap_or(base.memory_mb),
        pids: req.pids.unwrap_or(base.pids),
        nofile: req.nofile.unwrap_or(base.nofile),
        disk_mb,
        disk_inodes,
        tmp_mb: req.tmp_mb.unwrap_or(base.tmp_mb),
        output_bytes: req.output_bytes.unwrap_or(base.output_bytes),
        command_timeout: req.command_timeout.unwrap_or(base.command_timeout),
        idle_timeout: req.idle_timeout.unwrap_or(base.idle_timeout),
    }
}

pub(super) fn agent_config(
    l: &SandboxLimits,
    caps: &TierCapabilities,
    runtime: &moat_api::TemplateConfig,
) -> AgentConfig {
    AgentConfig {
        nofile: Some(l.nofile),
        output_bytes: Some(l.output_bytes),
        command_timeout: Some(l.command_timeout as f64),
        oom_counter: caps.oom_counter_inside.clone(),
        nproc: caps.process_limit_inside.then_some(l.pids),
        user: runtime.user.clone(),
        cwd: runtime.workdir.clone(),
        identity: None,
        egress_ca: None,
    }
}

impl Core {
    /// The limits of a sandbox created with `req` (the daemon's defaults where it gives none).
    pub fn limits_for(&self, req: &CreateSandboxRequest) -> SandboxLimits {
        let mut defaults = self.settings.default_limits.clone();
        defaults.nofile = defaults.nofile.min(self.host.nofile);
        limits_over(&defaults, req)
    }

    /// Checks the limits that come from `req` or the defaults (a bad default is reported on the field
    /// too, so a misconfigured daemon is visible at the first create).
    pub(super) fn validate_limits(&self, l: &SandboxLimits) -> Result<(), Error> {
        let range = |field: &str, v: u64, r: std::ops::RangeInclusive<u64>, zero_ok: bool| {
            if (zero_ok && v == 0) || r.contains(&v) {
                Ok(())
            } else {
                Err(Error::invalid(
                    field,
                    format!(
                        "{field} must be {}{}..={}, got {v}",
                        if zero_ok { "0 or " } else { "" },
                        r.start(),
                        r.end()
                    ),
                ))
            }
        };
        range("pids", l.pids, MIN_PIDS..=MAX_PIDS, false)?;
        range("nofile", l.nofile, 16..=self.host.nofile, false)?;
        range("disk_mb", l.disk_mb, 16..=self.host.disk_mb.max(16), true)?;
        if l.disk_mb > 0 {
            // At most one inode per 4 KiB block (ext4's limit).
            range(
                "disk_inodes",
                l.disk_inodes,
                1024..=(l.disk_mb * 256).min(u32::MAX as u64),
                false,
            )?;
        }
        range("tmp_mb", l.tmp_mb, 1..=l.memory_mb, true)?;
        range("output_bytes", l.output_bytes, OUTPUT_BYTES_RANGE, false)?;
        range(
            "command_timeout",
            l.command_timeout,
            1..=self.settings.max_timeout,
            true,
        )?;
        range(
            "idle_timeout",
            l.idle_timeout,
            1..=self.settings.max_timeout,
            true,
        )?;
        Ok(())
    }

    /// A sandbox lifetime in seconds: 1..=`--max-timeout`.
    pub(super) fn check_timeout(&self, t: u64) -> Result<(), Error> {
        if t == 0 || t > self.settings.max_timeout {
            return Err(Error::invalid(
                "timeout",
                format!(
                    "timeout must be 1..={} seconds, got {t}",
                    self.settings.max_timeout
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn validate(&self, req: &CreateSandboxRequest) -> Result<(), Error> {
        if let Some(t) = req.timeout {
            self.check_timeout(t)?;
        }
        if let Some(c) = req.cpu {
            if !c.is_finite() || c < 0.01 || c > self.host.cpus {
                return Err(Error::invalid(
                    "cpu",
                    format!("cpu must be 0.01..={} cores, got {c}", self.host.cpus),
                ));
            }
        }
        if let Some(m) = req.memory_mb {
            if !(16..=self.host.memory_mb).contains(&m) {
                return Err(Error::invalid(
                    "memory_mb",
                    format!("memory_mb must be 16..={}, got {m}", self.host.memory_mb),
                ));
            }
        }
        let isolation = req.isolation.unwrap_or(self.settings.default_isolation);
        if let Some(m) = req.memory_mb {
            let least = self.capabilities(isolation).min_memory_mb;
            if m < least {
                return Err(Error::invalid(
                    "memory_mb",
                    format!(
                        "memory_mb must be at least {least} on the {} tier (what it needs to \
                         start lives in that memory), got {m}",
                        isolation.as_str()
                    ),
                ));
            }
        }
        if req.disk_inodes.is_some_and(|n| n > 0) && req.disk_mb == Some(0) {
            return Err(Error::invalid(
                "disk_inodes",
                "disk_inodes needs a disk quota (disk_mb > 0)",
            ));
        }
        if req.env.len() > 1000 {
            return Err(Error::invalid("env", "at most 1000 environment variables"));
        }
        if req.secrets.len() > 100 {
            return Err(Error::invalid("secrets", "at most 100 secrets"));
        }
        for (i, sec) in req.secrets.iter().enumerate() {
            moat_api::check_secret(sec)
                .map_err(|(f, m)| Error::invalid(&format!("secrets[{i}].{f}"), m))?;
            if req.secrets[..i].iter().any(|o| o.name == sec.name) {
                return Err(Error::invalid(
                    &format!("secrets[{i}].name"),
                    format!("secret {} is declared twice", sec.name),
                ));
            }
            if req.env.contains_key(&sec.name) {
                return Err(Error::invalid(
                    &format!("secrets[{i}].name"),
                    format!(
                        "{} is both an environment variable and a secret (its placeholder)",
                        sec.name
                    ),
                ));
            }
        }
        for (k, v) in &req.env {
            if k.is_empty()
                || k.contains('=')
                || k.contains('\0')
                || v.contains('\0')
                || k.len() > 4096
                || v.len() > 128 * 1024
            {
                return Err(Error::invalid(&format!("env.{k}"), "environment names must be non-empty without '=' or NUL; values without NUL and at most 128 KiB"));
            }
        }
        validate_metadata(&req.metadata)
    }

    /// The egress policy a create asks for, checked; None without networking.
    pub(super) fn network_policy(
        &self,
        isolation: Isolation,
        asked: Option<&moat_api::NetworkPolicy>,
    ) -> Result<Option<moat_api::NetworkPolicy>, Error> {
        if !self.networking(isolation) {
            return match asked {
                Some(_) => Err(Error::invalid(
                    "network",
                    "sandbox networking is off on this daemon (moat serve --network none)",
                )),
                None => Ok(None),
            };
        }
        let policy = asked
            .cloned()
            .unwrap_or_else(|| self.settings.default_network.clone());
        validate_policy(&policy)?;
        Ok(Some(policy))
    }
}
