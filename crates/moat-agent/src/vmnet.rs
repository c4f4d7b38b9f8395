//! VM mode: the guest's network interface (`eth0`, the VM's virtio-net device), configured from the
//! [`GuestNetwork`] the host's sandbox network gave the VM (docs/microvm-tier.md, "Network"). Plain
//! `SIOC*` ioctls on an `AF_INET` socket: the guest root may be any template (a busybox one has no
//! `ip`), and these are all a point-to-point link with one address and a default route needs.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use moat_api::guest::GuestNetwork;

/// The guest's interface (the first and only NIC).
pub const IFACE: &str = "eth0";

/// `<linux/route.h>`: the route is usable / goes through a gateway.
const RTF_UP: libc::c_ushort = 0x0001;
const RTF_GATEWAY: libc::c_ushort = 0x0002;

/// `struct rtentry` of `<linux/route.h>` (x86-64 layout; the libc crate has it for musl only).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_tos: libc::c_uchar,
    rt_class: libc::c_uchar,
    rt_pad4: [libc::c_short; 3],
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn inet_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory preconditions; the new descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor we just opened and nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *dst = src as libc::c_char;
    }
    ifr
}

fn sockaddr_in(addr: std::net::Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain data; the kernel reads an
    // AF_INET sockaddr as a sockaddr_in.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl(sock: &OwnedFd, req: libc::c_ulong, arg: *mut libc::c_void, what: &str) -> io::Result<()> {
    // SAFETY: every caller passes the request's own argument type, valid for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), req, arg) } < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

/// Whether the guest has the interface `name`.
fn exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

/// The virtio-net driver's sysfs directory (its `bind` and `unbind` files).
const VIRTIO_NET_DRIVER: &str = "/sys/bus/virtio/drivers/virtio_net";

/// The virtio device that is the VM's NIC (`virtioN`: virtio device id 1, network).
fn nic_device() -> io::Result<String> {
    for entry in std::fs::read_dir("/sys/bus/virtio/devices")? {
        let entry = entry?;
        let id = std::fs::read_to_string(entry.path().join("device")).unwrap_or_default();
        if id.trim() == "0x0001" {
            return Ok(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "the VM has no virtio network device",
    ))
}

/// Binds the NIC to its driver (`eth0` appears) or unbinds it (`eth0` goes, and a sandbox without
/// a network has loopback only, as on the other tiers; its device has no peer on the host anyway).
fn set_bound(bound: bool) -> io::Result<()> {
    let dev = nic_device()?;
    let file = if bound { "bind" } else { "unbind" };
    std::fs::write(std::path::Path::new(VIRTIO_NET_DRIVER).join(file), &dev)
        .map_err(|e| io::Error::new(e.kind(), format!("{file} {dev} (virtio_net): {e}")))
}

/// Brings the interface `name` up or down. Nothing is set when it already is so: the container
/// tier brings `lo` up before the agent's capability drop, after which SIOCSIFFLAGS would fail.
pub fn set_link(name: &str, up: bool) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut ifr = ifreq(name);
    ioctl(
        &sock,
        libc::SIOCGIFFLAGS,
        (&mut ifr as *mut libc::ifreq).cast(),
        &format!("read {name}'s flags"),
    )?;
    let flag = libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCGIFFLAGS wrote ifru_flags, the union member read and updated here.
    unsafe {
        if (ifr.ifr_ifru.ifru_flags & flag != 0) == up {
            return Ok(());
        }
        if up {
            ifr.ifr_ifru.ifru_flags |= flag;
        } else {
            ifr.ifr_ifru.ifru_flags &= !flag;
        }
    }
    ioctl(
        &sock,
        libc::SIOCSIFFLAGS,
        (&mut ifr as *mut libc::ifreq).cast(),
        &format!("bring {name} {}", if up { "up" } else { "down" }),
    )
}

fn set_addr(
    sock: &OwnedFd,
    name: &str,
    req: libc::c_ulong,
    addr: std::net::Ipv4Addr,
    what: &str,
) -> io::Result<()> {
    let mut ifr = ifreq(name);
    ifr.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl(sock, req, (&mut ifr as *mut libc::ifreq).cast(), what)
}

fn add_default_route(sock: &OwnedFd, gateway: std::net::Ipv4Addr) -> io::Result<()> {
    let unspecified = std::net::Ipv4Addr::UNSPECIFIED;
    let mut dev = *b"eth0\0";
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in(unspecified),
        rt_gateway: sockaddr_in(gateway),
        rt_genmask: sockaddr_in(unspecified),
        rt_flags: RTF_UP | RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_tos: 0,
        rt_class: 0,
        rt_pad4: [0; 3],
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    match ioctl(
        sock,
        libc::SIOCADDRT,
        (&mut rt as *mut RtEntry).cast(),
        "add the default route",
    ) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other,
    }
}

/// The netmask of a prefix length.
fn netmask(prefix_len: u8) -> std::net::Ipv4Addr {
    let bits = u32::from(prefix_len.min(32));
    std::net::Ipv4Addr::from(u32::MAX.checked_shl(32 - bits).unwrap_or(0))
}

/// Gives `eth0` the address, route and nameserver of `net`, or (`None`) unbinds the NIC from its
/// driver so that the guest has loopback only. Taking the link down first drops what it had: the
/// old neighbour (ARP) entries and the routes through it, so a VM restored into another sandbox's
/// network keeps nothing of the old one.
pub fn configure(net: Option<&GuestNetwork>) -> io::Result<()> {
    let Some(n) = net else {
        return if exists(IFACE) {
            set_bound(false)
        } else {
            Ok(())
        };
    };
    if exists(IFACE) {
        set_link(IFACE, false)?;
    } else {
        set_bound(true)?;
        if !exists(IFACE) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the VM's NIC has no interface eth0 after binding it",
            ));
        }
    }
    let sock = inet_socket()?;
    set_addr(
        &sock,
        IFACE,
        libc::SIOCSIFADDR,
        n.address,
        "set eth0's address",
    )?;
    set_addr(
        &sock,
        IFACE,
        libc::SIOCSIFNETMASK,
        netmask(n.prefix_len),
        "set eth0's netmask",
    )?;
    set_link(IFACE, true)?;
    add_default_route(&sock, n.gateway)?;
    // A template's resolv.conf (or a symlink to one) is replaced, never followed: the sandbox's
    // resolver is the host's end of its link.
    let _ = std::fs::remove_file("/etc/resolv.conf");
    let _ = std::fs::create_dir_all("/etc");
    std::fs::write("/etc/resolv.conf", format!("nameserver {}\n", n.nameserver))
        .map_err(|e| io::Error::new(e.kind(), format!("write /etc/resolv.conf: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netmasks() {
        assert_eq!(netmask(30), std::net::Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(netmask(24), std::net::Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(32), std::net::Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(netmask(0), std::net::Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn rtentry_has_the_kernels_layout() {
        // struct rtentry on x86-64: 120 bytes, rt_dev at offset 88.
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
        let rt = std::mem::MaybeUninit::<RtEntry>::uninit();
        let base = rt.as_ptr() as usize;
        // SAFETY: addr_of! on a field of an uninitialised value computes its address only.
        let dev = unsafe { std::ptr::addr_of!((*rt.as_ptr()).rt_dev) } as usize;
        assert_eq!(dev - base, 88);
    }

    #[test]
    fn sockaddr_is_network_order() {
        let sa = sockaddr_in(std::net::Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
        let bytes: Vec<u8> = sa.sa_data[2..6].iter().map(|b| *b as u8).collect();
        assert_eq!(bytes, [10, 200, 0, 2]);
    }
}
