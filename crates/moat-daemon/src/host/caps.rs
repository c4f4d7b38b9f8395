//! Capability sets of a sandbox's processes. The sandbox's PID 1 calls [`restrict`] before it execs the
//! agent: the bounding set becomes Docker's default set minus NET_RAW and MKNOD, the inheritable and
//! ambient sets are emptied, ambient raising is locked off and no_new_privs is set, so no exec inside the
//! sandbox (setuid binaries, file capabilities) can ever gain more. Root inside keeps the kept set,
//! which is all it needs to act as root over its own files and users.

use anyhow::{Context, Result};

/// Capabilities that stay in the bounding set, by number (linux/capability.h), with their names.
/// Docker's default set, less CAP_NET_RAW (raw and packet sockets: ARP/DNS spoofing of neighbours;
/// ping works through ICMP datagram sockets, which the sandbox's init enables) and CAP_MKNOD (a user
/// namespace may not create device nodes anyway: keeping it only adds surface).
pub const KEPT: &[(u32, &str)] = &[
    (0, "CAP_CHOWN"),
    (1, "CAP_DAC_OVERRIDE"),
    (3, "CAP_FOWNER"),
    (4, "CAP_FSETID"),
    (5, "CAP_KILL"),
    (6, "CAP_SETGID"),
    (7, "CAP_SETUID"),
    (8, "CAP_SETPCAP"),
    (10, "CAP_NET_BIND_SERVICE"),
    (18, "CAP_SYS_CHROOT"),
    (29, "CAP_AUDIT_WRITE"),
    (31, "CAP_SETFCAP"),
];

/// The kept set as a 64-bit mask (the CapBnd/CapEff value of /proc/PID/status).
pub fn kept_mask() -> u64 {
    KEPT.iter().fold(0u64, |m, (c, _)| m | (1u64 << c))
}

const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn prctl(op: libc::c_int, arg: libc::c_ulong, what: &str) -> Result<()> {
    // SAFETY: the prctl operations used here take integer arguments only.
    let r = unsafe { libc::prctl(op, arg, 0 as libc::c_ulong, 0 as libc::c_ulong, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context(what.to_string());
    }
    Ok(())
}

/// Restricts the calling (single-threaded) process as described in the module documentation. Needs
/// CAP_SETPCAP, which root of the sandbox's user namespace holds until here.
pub fn restrict() -> Result<()> {
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .context("read cap_last_cap")?
        .trim()
        .parse()
        .context("parse cap_last_cap")?;
    let kept = kept_mask();
    for cap in 0..=last.min(63) {
        if kept & (1 << cap) == 0 {
            prctl(
                libc::PR_CAPBSET_DROP,
                cap as libc::c_ulong,
                "drop from bounding set",
            )?;
        }
    }
    // SAFETY: integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("clear ambient capabilities");
    }
    prctl(
        libc::PR_SET_SECUREBITS,
        SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED,
        "set securebits",
    )?;
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [
        CapData {
            effective: kept as u32,
            permitted: kept as u32,
            inheritable: 0,
        },
        CapData {
            effective: (kept >> 32) as u32,
            permitted: (kept >> 32) as u32,
            inheritable: 0,
        },
    ];
    // SAFETY: capset reads a version-3 header and two CapData structs, both alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("capset");
    }
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_mask_is_dockers_default_without_net_raw_and_mknod() {
        // Docker's default bounding set is 0x00000000a80425fb; NET_RAW is bit 13, MKNOD bit 27.
        assert_eq!(kept_mask(), 0xa80425fb & !(1 << 13) & !(1 << 27));
        for dropped in [
            12, /* NET_ADMIN */
            13, /* NET_RAW */
            16, /* SYS_MODULE */
            19, /* SYS_PTRACE */
            21, /* SYS_ADMIN */
            27, /* MKNOD */
        ] {
            assert_eq!(kept_mask() & (1 << dropped), 0, "capability {dropped}");
        }
    }
}
