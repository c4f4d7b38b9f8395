//! The guest's initramfs, written as a cpio "newc" archive (the format the kernel unpacks): the agent
//! as `/init` and the kernel modules, built once per agent and kernel and shared by every VM (each
//! VM's own configuration is on a disk of its own, `moat_api::guest::encode_config_disk`).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// A cpio newc archive being written.
pub struct Newc<W: Write> {
    out: W,
    ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl<W: Write> Newc<W> {
    pub fn new(out: W) -> Self {
        Newc { out, ino: 1 }
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> Result<()> {
        let namesize = name.len() + 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            if mode & S_IFDIR != 0 { 2 } else { 1 },
            0,
            u32::try_from(data.len()).context("cpio entry over 4 GiB")?,
            0,
            0,
            rdev.0,
            rdev.1,
            u32::try_from(namesize)?,
            0,
        ];
        self.ino += 1;
        let mut header = String::from("070701");
        for f in fields {
            header.push_str(&format!("{f:08X}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + namesize)?;
        self.out.write_all(data)?;
        self.pad(data.len())?;
        Ok(())
    }

    fn pad(&mut self, len: usize) -> Result<()> {
        let n = (4 - len % 4) % 4;
        self.out.write_all(&[0u8; 3][..n])?;
        Ok(())
    }

    pub fn dir(&mut self, name: &str) -> Result<()> {
        self.entry(name, S_IFDIR | 0o755, (0, 0), &[])
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<()> {
        self.entry(name, S_IFREG | mode, (0, 0), data)
    }

    pub fn char_device(&mut self, name: &str, mode: u32, major: u32, minor: u32) -> Result<()> {
        self.entry(name, S_IFCHR | mode, (major, minor), &[])
    }

    /// Writes the trailer and returns the writer.
    pub fn finish(mut self) -> Result<W> {
        self.entry("TRAILER!!!", 0, (0, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The shared archive: `/init` (the agent), the guest kernel's modules and their load order, and the
/// directories the agent mounts on.
pub fn shared(agent: &Path, guest_kernel: &Path, out: &Path) -> Result<()> {
    let tmp = out.with_extension("tmp");
    let file = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
    let mut a = Newc::new(std::io::BufWriter::new(file));
    for d in [
        "dev",
        "proc",
        "sys",
        "base",
        "rw",
        "newroot",
        "moat",
        "moat/modules",
    ] {
        a.dir(d)?;
    }
    // The kernel opens /dev/console for init's standard streams before init runs.
    a.char_device("dev/console", 0o600, 5, 1)?;
    let agent_bytes = std::fs::read(agent).with_context(|| format!("read {}", agent.display()))?;
    a.file("init", 0o755, &agent_bytes)?;
    let order_path = guest_kernel.join("modules.order");
    let order = std::fs::read_to_string(&order_path)
        .with_context(|| format!("read {}", order_path.display()))?;
    for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let ko = guest_kernel.join("modules").join(name);
        let bytes = std::fs::read(&ko).with_context(|| format!("read {}", ko.display()))?;
        a.file(&format!("moat/modules/{name}"), 0o644, &bytes)?;
    }
    a.file("moat/modules.order", 0o644, order.as_bytes())?;
    a.finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    std::fs::rename(&tmp, out).with_context(|| format!("rename to {}", out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_cpio_reads_them() {
        let json = br#"{"hostname":"h"}"#;
        let mut a = Newc::new(Vec::new());
        a.dir("moat").unwrap();
        a.file("moat/config.json", 0o600, json).unwrap();
        let bytes = a.finish().unwrap();
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        // The trailer closes the archive.
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
        let name = "moat/config.json";
        let pos = bytes
            .windows(name.len())
            .position(|w| w == name.as_bytes())
            .unwrap();
        // A header is 110 bytes before its name; the data starts 4-aligned after the name's NUL.
        assert_eq!((pos - 110) % 4, 0);
        let data_at = (pos + name.len() + 1).div_ceil(4) * 4;
        assert_eq!(&bytes[data_at..data_at + json.len()], &json[..]);
    }
}
