//! Duties of PID 1 besides reaping: bring up the loopback interface.

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
    if r == 0 {
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
