//! Duties of PID 1 besides reaping: bring up the loopback interface, and keep the sandbox's own root
//! from ptracing or reading the memory of the agent.

/// Marks the agent non-dumpable: root inside the sandbox can no longer ptrace it or open its
/// /proc/1/mem, so it cannot hijack the agent's connection to the daemon.
pub fn not_dumpable() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets IFF_UP on `lo`.
pub fn loopback_up() -> std::io::Result<()> {
    crate::vmnet::set_link("lo", true)
}
