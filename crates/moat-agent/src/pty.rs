//! Pseudo-terminals: open a master/slave pair of a given size, resize it.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use moat_api::PtySize;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};

fn winsize(size: PtySize) -> libc::winsize {
    libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Opens a pty pair of `size`; both ends are close-on-exec (the child gets the slave as 0/1/2).
pub fn open(size: PtySize) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let ws = winsize(size);
    let pty = nix::pty::openpty(Some(&ws), None).map_err(std::io::Error::from)?;
    for fd in [&pty.master, &pty.slave] {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
            .map_err(std::io::Error::from)?;
    }
    Ok((pty.master, pty.slave))
}

/// Sets the window size of the terminal behind `master` (the foreground group gets SIGWINCH).
pub fn resize(master: RawFd, size: PtySize) -> std::io::Result<()> {
    let ws = winsize(size);
    // SAFETY: `master` is an open fd owned by the caller and `ws` is a valid winsize for TIOCSWINSZ.
    if unsafe { libc::ioctl(master, libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_and_resize() {
        let (m, s) = open(PtySize { cols: 80, rows: 24 }).unwrap_or_else(|e| panic!("{e}"));
        resize(
            m.as_raw_fd(),
            PtySize {
                cols: 100,
                rows: 40,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut ws = winsize(PtySize { cols: 0, rows: 0 });
        // SAFETY: `s` is an open tty fd and `ws` is writable.
        let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(r, 0);
        assert_eq!((ws.ws_col, ws.ws_row), (100, 40));
    }
}
