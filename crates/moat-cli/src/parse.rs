//! Pure helpers for argument parsing and result mapping (unit-tested).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use moat_api::ExitStatus;

/// Parses `KEY=VALUE` (the value may be empty and may hold `=`).
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        Some(_) => Err(format!("{s:?}: the key before '=' is empty")),
        None => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// One side of `moat cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Host(PathBuf),
    Sandbox { id: String, path: String },
}

/// `ID:PATH` is a sandbox path when ID is a non-empty run of `[A-Za-z0-9_-]`; anything else is a
/// host path (write `./a:b` for a host file whose name holds a colon).
pub fn parse_location(s: &str) -> Result<Location, String> {
    if let Some((id, path)) = s.split_once(':') {
        let is_id = !id.is_empty()
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if is_id {
            if path.is_empty() {
                return Err(format!("{s:?}: the path after ':' is empty"));
            }
            return Ok(Location::Sandbox {
                id: id.to_string(),
                path: path.to_string(),
            });
        }
    }
    if s.is_empty() {
        return Err("empty path".into());
    }
    Ok(Location::Host(PathBuf::from(s)))
}

/// The exit code `moat exec` reports for a process: its own code; 124 when killed by its timeout
/// (like `timeout(1)`); 128 + the signal number when killed by a signal; 127 when it could not start.
pub fn exit_code(status: &ExitStatus) -> i32 {
    if status.timed_out {
        return 124;
    }
    if let Some(code) = status.exit_code {
        return code;
    }
    if let Some(sig) = &status.signal {
        let num = moat_api::parse_signal(sig)
            .ok()
            .or_else(|| sig.trim_start_matches("SIG").parse::<i32>().ok())
            .unwrap_or(0);
        return 128 + num;
    }
    if status.error.is_some() {
        return 127;
    }
    1
}

/// What exists at a copy destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstKind {
    Missing,
    File,
    Dir,
}

/// Where a copied source lands, by `docker cp`'s rules:
/// - a file onto an existing directory (or a path ending in `/`) goes inside it under its own name;
///   a path ending in `/` that does not exist is an error; otherwise the file is written at `dst`;
/// - a directory onto an existing directory goes inside it under its own name (its contents go
///   straight in when the source ends in `/.`); onto a missing path it becomes that path; onto a
///   file it is an error.
pub fn copy_target(
    src: &Path,
    src_is_dir: bool,
    dst: &Path,
    dst_kind: DstKind,
) -> Result<PathBuf, String> {
    let dst_slash = dst.as_os_str().as_bytes().ends_with(b"/");
    let src_bytes = src.as_os_str().as_bytes();
    let contents_only = src_bytes.ends_with(b"/.") || src_bytes == b".";
    let base = src.file_name();
    if !src_is_dir {
        return match dst_kind {
            DstKind::Dir => match base {
                Some(b) => Ok(dst.join(b)),
                None => Err(format!("cannot tell the file name of {}", src.display())),
            },
            DstKind::Missing if dst_slash => Err(format!(
                "destination directory {} does not exist",
                dst.display()
            )),
            DstKind::File if dst_slash => {
                Err(format!("destination {} is not a directory", dst.display()))
            }
            DstKind::File | DstKind::Missing => Ok(dst.to_path_buf()),
        };
    }
    match dst_kind {
        DstKind::File => Err(format!(
            "cannot copy a directory onto the file {}",
            dst.display()
        )),
        DstKind::Missing => Ok(dst.to_path_buf()),
        DstKind::Dir => match base {
            Some(b) if !contents_only => Ok(dst.join(b)),
            _ => Ok(dst.to_path_buf()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv() {
        assert_eq!(parse_kv("A=1"), Ok(("A".into(), "1".into())));
        assert_eq!(parse_kv("A="), Ok(("A".into(), String::new())));
        assert_eq!(parse_kv("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_kv("=1").is_err());
        assert!(parse_kv("A").is_err());
        assert!(parse_kv("").is_err());
    }

    #[test]
    fn locations() {
        assert_eq!(
            parse_location("sbx_ABC:/root/a.txt"),
            Ok(Location::Sandbox {
                id: "sbx_ABC".into(),
                path: "/root/a.txt".into()
            })
        );
        assert_eq!(
            parse_location("sbx_1:rel/x"),
            Ok(Location::Sandbox {
                id: "sbx_1".into(),
                path: "rel/x".into()
            })
        );
        assert_eq!(
            parse_location("./a:b"),
            Ok(Location::Host(PathBuf::from("./a:b")))
        );
        assert_eq!(
            parse_location("/tmp/x"),
            Ok(Location::Host(PathBuf::from("/tmp/x")))
        );
        assert_eq!(
            parse_location(":x"),
            Ok(Location::Host(PathBuf::from(":x")))
        );
        assert!(parse_location("sbx_1:").is_err());
        assert!(parse_location("").is_err());
    }

    #[test]
    fn exit_codes() {
        let st = |code: Option<i32>, sig: Option<&str>, timed_out: bool| ExitStatus {
            exit_code: code,
            signal: sig.map(String::from),
            timed_out,
            ..Default::default()
        };
        assert_eq!(exit_code(&st(Some(0), None, false)), 0);
        assert_eq!(exit_code(&st(Some(3), None, false)), 3);
        assert_eq!(exit_code(&st(None, Some("SIGKILL"), false)), 137);
        assert_eq!(exit_code(&st(None, Some("SIGINT"), false)), 130);
        assert_eq!(exit_code(&st(None, Some("SIG40"), false)), 168);
        assert_eq!(exit_code(&st(None, Some("SIGKILL"), true)), 124);
        let failed = ExitStatus {
            error: Some("no such file".into()),
            ..Default::default()
        };
        assert_eq!(exit_code(&failed), 127);
        assert_eq!(exit_code(&ExitStatus::default()), 1);
    }

    #[test]
    fn docker_cp_destinations() {
        let p = Path::new;
        // file → existing dir: inside, under its own name
        assert_eq!(
            copy_target(p("/h/a.txt"), false, p("/root"), DstKind::Dir),
            Ok(PathBuf::from("/root/a.txt"))
        );
        // file → missing or existing file path: that path
        assert_eq!(
            copy_target(p("a.txt"), false, p("/root/b.txt"), DstKind::Missing),
            Ok(PathBuf::from("/root/b.txt"))
        );
        assert_eq!(
            copy_target(p("a.txt"), false, p("/root/b.txt"), DstKind::File),
            Ok(PathBuf::from("/root/b.txt"))
        );
        // file → missing path ending in '/': error
        assert!(copy_target(p("a.txt"), false, p("/nope/"), DstKind::Missing).is_err());
        assert!(copy_target(p("a.txt"), false, p("/f/"), DstKind::File).is_err());
        // dir → existing dir: inside under its name; `/.` copies contents
        assert_eq!(
            copy_target(p("/h/src"), true, p("/root"), DstKind::Dir),
            Ok(PathBuf::from("/root/src"))
        );
        assert_eq!(
            copy_target(p("/h/src/"), true, p("/root"), DstKind::Dir),
            Ok(PathBuf::from("/root/src"))
        );
        assert_eq!(
            copy_target(p("/h/src/."), true, p("/root"), DstKind::Dir),
            Ok(PathBuf::from("/root"))
        );
        // dir → missing: becomes that path; dir → file: error
        assert_eq!(
            copy_target(p("/h/src"), true, p("/root/new"), DstKind::Missing),
            Ok(PathBuf::from("/root/new"))
        );
        assert!(copy_target(p("/h/src"), true, p("/root/f"), DstKind::File).is_err());
    }
}
