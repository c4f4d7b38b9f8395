//! The seccomp policy of container-tier sandboxes: data in `seccomp_policy.json` (seccompiler's JSON
//! format under a versioned envelope, compiled into the binary), plus one hand-written ABI filter that
//! seccompiler cannot express. `docs/hardening.md` says what is denied and why.
//!
//! Installed by the sandbox's PID 1 just before it execs the agent, so every process of the sandbox runs
//! under it. The kernel runs every installed filter and applies the most restrictive answer
//! (KILL > ERRNO > ALLOW), so the filters compose: the ABI filter, then the named ones.

use anyhow::{bail, Context, Result};
use seccompiler::{sock_filter, BpfProgram, TargetArch};
use serde::Deserialize;

/// The policy as shipped. Bump `version` in the file whenever its meaning changes.
pub const POLICY_JSON: &str = include_str!("seccomp_policy.json");
/// The policy version this code understands.
pub const POLICY_VERSION: u32 = 1;

/// `AUDIT_ARCH_X86_64` (EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE).
pub const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// `AUDIT_ARCH_I386`: what a 64-bit process's `int 0x80` reports.
pub const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
/// Syscall numbers of the x32 ABI carry this bit (the x86_64 entry point accepts them when the kernel
/// has x32 support); none of them is allowed.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    version: u32,
    #[allow(dead_code)]
    comment: Option<String>,
    /// seccompiler's format: filter name → { mismatch_action, filter_action, filter: [rules] }.
    filters: serde_json::Map<String, serde_json::Value>,
}

/// The BPF programs of the policy in the order they are installed (ABI filter first, then the policy's
/// filters by name).
pub fn compile() -> Result<Vec<(String, BpfProgram)>> {
    compile_policy(POLICY_JSON)
}

fn compile_policy(json: &str) -> Result<Vec<(String, BpfProgram)>> {
    if std::env::consts::ARCH != "x86_64" {
        bail!("the sandbox seccomp policy is written for x86_64 only");
    }
    let env: Envelope = serde_json::from_str(json).context("parse seccomp policy")?;
    if env.version != POLICY_VERSION {
        bail!(
            "seccomp policy version {} (this build understands {POLICY_VERSION})",
            env.version
        );
    }
    let inner = serde_json::to_vec(&env.filters)?;
    let map = seccompiler::compile_from_json(inner.as_slice(), TargetArch::x86_64)
        .map_err(|e| anyhow::anyhow!("compile seccomp policy: {e}"))?;
    let mut named: Vec<(String, BpfProgram)> = map.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = vec![("abi".to_string(), abi_filter())];
    out.extend(named);
    Ok(out)
}

/// Kills a process that enters the kernel through any ABI but x86_64 (the i386 `int 0x80` entry, whose
/// syscall numbers differ and would slip past number-based rules), and fails every x32 syscall
/// (x86_64 arch, number with bit 30 set) with EPERM.
pub fn abi_filter() -> BpfProgram {
    // BPF_LD | BPF_W | BPF_ABS
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x05 | 0x10;
    const JGE_K: u16 = 0x05 | 0x30;
    const RET_K: u16 = 0x06;
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        // A = seccomp_data.arch
        ins(LD_W_ABS, 0, 0, 4),
        ins(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        // A = seccomp_data.nr
        ins(LD_W_ABS, 0, 0, 0),
        ins(JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(
            RET_K,
            0,
            0,
            libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32 & libc::SECCOMP_RET_DATA),
        ),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Installs `programs` on the calling thread (sets no_new_privs, which seccomp requires). Call it last
/// before exec: from here on, the caller is bound by the policy too.
pub fn install(programs: &[(String, BpfProgram)]) -> Result<()> {
    for (name, prog) in programs {
        seccompiler::apply_filter(prog)
            .map_err(|e| anyhow::anyhow!("install seccomp filter {name}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A classic-BPF interpreter for the instructions seccompiler and `abi_filter` emit, so the tests
    /// check what the kernel would answer rather than the shape of the code.
    fn run(prog: &[sock_filter], nr: i64, arch: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&(nr as i32).to_le_bytes());
        data.extend_from_slice(&arch.to_le_bytes());
        data.extend_from_slice(&0u64.to_le_bytes());
        for a in args {
            data.extend_from_slice(&a.to_le_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            pc += 1;
            match i.code {
                0x20 => {
                    let o = i.k as usize;
                    acc = u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
                }
                0x54 => acc &= i.k,
                0x05 => pc += i.k as usize,
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let t = match i.code {
                        0x15 => acc == i.k,
                        0x25 => acc > i.k,
                        0x35 => acc >= i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += if t { i.jt } else { i.jf } as usize;
                }
                0x06 => return i.k,
                c => panic!("unsupported BPF opcode {c:#x}"),
            }
        }
    }

    /// What the kernel returns with every filter installed: the most restrictive action.
    fn verdict(nr: i64, arch: u32, args: [u64; 6]) -> u32 {
        let progs = compile().unwrap();
        progs
            .iter()
            .map(|(_, p)| run(p, nr, arch, args))
            .min_by_key(|r| {
                // Precedence by action (KILL_PROCESS is 0x80000000, the most restrictive).
                let action = r & libc::SECCOMP_RET_ACTION_FULL;
                if action == libc::SECCOMP_RET_KILL_PROCESS {
                    0
                } else {
                    action as u64 + 1
                }
            })
            .unwrap()
    }

    const RET_EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const RET_ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    const RET_ALLOW: u32 = libc::SECCOMP_RET_ALLOW;

    fn x86(nr: i64) -> u32 {
        verdict(nr, AUDIT_ARCH_X86_64, [0; 6])
    }

    #[test]
    fn policy_compiles() {
        let progs = compile().unwrap();
        let names: Vec<&str> = progs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["abi", "clone3", "deny"]);
        for (n, p) in &progs {
            assert!(p.len() < 4096, "filter {n} has {} instructions", p.len());
        }
    }

    #[test]
    fn required_syscalls_are_denied() {
        use libc::*;
        let required = [
            SYS_io_uring_setup,
            SYS_io_uring_enter,
            SYS_io_uring_register,
            SYS_bpf,
            SYS_perf_event_open,
            SYS_userfaultfd,
            SYS_keyctl,
            SYS_add_key,
            SYS_request_key,
            SYS_kexec_load,
            SYS_kexec_file_load,
            SYS_init_module,
            SYS_finit_module,
            SYS_delete_module,
            SYS_fsopen,
            SYS_fsconfig,
            SYS_fsmount,
            SYS_fspick,
            SYS_open_tree,
            SYS_move_mount,
            SYS_mount_setattr,
            SYS_mount,
            SYS_umount2,
            SYS_pivot_root,
            SYS_open_by_handle_at,
            SYS_name_to_handle_at,
            SYS_process_vm_readv,
            SYS_process_vm_writev,
            SYS_kcmp,
            SYS_settimeofday,
            SYS_clock_settime,
            SYS_clock_adjtime,
            SYS_adjtimex,
            SYS_reboot,
            SYS_acct,
            SYS_quotactl,
            SYS_swapon,
            SYS_swapoff,
            SYS_syslog,
            SYS_setns,
            SYS_unshare,
            SYS_lookup_dcookie,
            SYS_uselib,
            SYS_nfsservctl,
            SYS_iopl,
            SYS_ioperm,
            SYS__sysctl,
            SYS_ustat,
            SYS_sysfs,
            SYS_vhangup,
            SYS_fanotify_init,
            SYS_mbind,
            SYS_set_mempolicy,
            SYS_move_pages,
        ];
        for nr in required {
            assert_eq!(x86(nr), RET_EPERM, "syscall {nr} is not denied");
        }
        assert_eq!(x86(SYS_clone3), RET_ENOSYS);
    }

    #[test]
    fn ordinary_syscalls_are_allowed() {
        use libc::*;
        for nr in [
            SYS_read,
            SYS_write,
            SYS_openat,
            SYS_execve,
            SYS_wait4,
            SYS_waitid,
            SYS_setuid,
            SYS_setgid,
            SYS_setgroups,
            SYS_chown,
            SYS_fchown,
            SYS_inotify_init1,
            SYS_ioctl,
            SYS_ptrace,
            SYS_chroot,
            SYS_setsid,
            SYS_socket,
        ] {
            assert_eq!(x86(nr), RET_ALLOW, "syscall {nr} is denied");
        }
    }

    #[test]
    fn clone_with_namespace_flags_is_denied() {
        let plain = (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_THREAD | libc::SIGCHLD) as u64;
        let v = |flags: u64| verdict(libc::SYS_clone, AUDIT_ARCH_X86_64, [flags, 0, 0, 0, 0, 0]);
        assert_eq!(v(plain), RET_ALLOW);
        assert_eq!(v(libc::SIGCHLD as u64), RET_ALLOW);
        for f in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWCGROUP,
        ] {
            assert_eq!(v(plain | f as u64), RET_EPERM, "clone flag {f:#x}");
        }
    }

    #[test]
    fn personality_rules() {
        let v = |p: u64| verdict(libc::SYS_personality, AUDIT_ARCH_X86_64, [p, 0, 0, 0, 0, 0]);
        assert_eq!(v(0), RET_ALLOW);
        assert_eq!(v(0xffff_ffff), RET_ALLOW, "the query must work");
        assert_eq!(v(0x0008), RET_ALLOW, "PER_LINUX32");
        assert_eq!(v(0x0040000), RET_EPERM, "ADDR_NO_RANDOMIZE");
        assert_eq!(v(0x0100000), RET_EPERM, "MMAP_PAGE_ZERO");
        assert_eq!(v(0x0400000), RET_EPERM, "READ_IMPLIES_EXEC");
    }

    #[test]
    fn vsock_is_denied() {
        let v = |fam: u64| verdict(libc::SYS_socket, AUDIT_ARCH_X86_64, [fam, 1, 0, 0, 0, 0]);
        assert_eq!(v(libc::AF_VSOCK as u64), RET_EPERM);
        assert_eq!(v(libc::AF_INET as u64), RET_ALLOW);
        assert_eq!(v(libc::AF_UNIX as u64), RET_ALLOW);
    }

    #[test]
    fn x32_abi_is_denied() {
        let x32 = X32_SYSCALL_BIT as i64;
        // x32 getpid, read and unshare: every number with the x32 bit fails.
        for nr in [x32 + 39, x32, x32 + 272, x32 + 512] {
            assert_eq!(x86(nr), RET_EPERM, "x32 syscall {nr:#x}");
        }
    }

    #[test]
    fn i386_abi_is_killed() {
        // getpid (20) and mount (21) through int 0x80.
        for nr in [20, 21, 0] {
            assert_eq!(
                verdict(nr, AUDIT_ARCH_I386, [0; 6]),
                libc::SECCOMP_RET_KILL_PROCESS
            );
        }
    }

    #[test]
    fn rejects_other_versions_and_unknown_syscalls() {
        let bumped = POLICY_JSON.replacen("\"version\": 1", "\"version\": 99", 1);
        assert!(compile_policy(&bumped).is_err());
        let bad = POLICY_JSON.replacen("\"syscall\": \"bpf\"", "\"syscall\": \"no_such_call\"", 1);
        assert!(compile_policy(&bad).is_err());
    }
}
