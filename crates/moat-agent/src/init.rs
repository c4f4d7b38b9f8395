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
    // SAFETY: socket() has no memory preconditions; the fd is closed below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `ifr` is a valid ifreq naming "lo"; SIOCGIFFLAGS fills ifru_flags.
    let mut r = unsafe { libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut ifr) };
    // SAFETY: after a successful SIOCGIFFLAGS the kernel wrote ifru_flags.
    let already_up =
        r == 0 && unsafe { ifr.ifr_ifru.ifru_flags } & libc::IFF_UP as libc::c_short != 0;
    // The container tier brings `lo` up before the capability drop; only set it when still down.
    if r == 0 && !already_up {
        // SAFETY: the kernel just wrote ifru_flags, the union member we read and update.
        unsafe { ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
        // SAFETY: as above; SIOCSIFFLAGS reads ifr_name and ifru_flags.
        r = unsafe { libc::ioctl(sock, libc::SIOCSIFFLAGS, &ifr) };
    }
    let err = std::io::Error::last_os_error();
    // SAFETY: `sock` is our open fd, closed once.
    unsafe { libc::close(sock) };
    if r < 0 {
        return Err(err);
    }
    Ok(())
}
