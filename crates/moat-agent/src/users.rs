//! Users and groups from the sandbox's own /etc/passwd and /etc/group (the agent is static: no NSS).

use std::path::Path;

/// A resolved account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
    /// Supplementary groups (including the primary one).
    pub groups: Vec<u32>,
}

impl User {
    fn root() -> User {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
            shell: "/bin/sh".into(),
            groups: vec![0],
        }
    }
}

/// Resolves `spec` (a name or numeric uid; root when `None`) against the files under `etc`.
pub fn lookup(spec: Option<&str>, etc: &Path) -> Result<User, String> {
    let passwd = std::fs::read_to_string(etc.join("passwd")).unwrap_or_default();
    let group = std::fs::read_to_string(etc.join("group")).unwrap_or_default();
    lookup_in(spec, &passwd, &group)
}

/// Resolves `spec` against passwd and group file contents.
pub fn lookup_in(spec: Option<&str>, passwd: &str, group: &str) -> Result<User, String> {
    let spec = spec
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or("root");
    let numeric = spec.parse::<u32>().ok();
    let found = passwd
        .lines()
        .filter_map(parse_passwd_line)
        .find(|u| match numeric {
            Some(uid) => u.uid == uid,
            None => u.name == spec,
        });
    let mut user = match (found, numeric) {
        (Some(u), _) => u,
        (None, Some(uid)) => User {
            name: uid.to_string(),
            uid,
            gid: uid,
            home: "/".into(),
            shell: "/bin/sh".into(),
            groups: Vec::new(),
        },
        (None, None) if spec == "root" => User::root(),
        (None, None) => return Err(format!("user {spec:?} not found in /etc/passwd")),
    };
    let mut groups = vec![user.gid];
    for line in group.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 || line.starts_with('#') {
            continue;
        }
        let Ok(gid) = f[2].parse::<u32>() else {
            continue;
        };
        if f[3].split(',').any(|m| m.trim() == user.name) && !groups.contains(&gid) {
            groups.push(gid);
        }
    }
    user.groups = groups;
    Ok(user)
}

fn parse_passwd_line(line: &str) -> Option<User> {
    if line.starts_with('#') {
        return None;
    }
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 {
        return None;
    }
    Some(User {
        name: f[0].to_string(),
        uid: f[2].parse().ok()?,
        gid: f[3].parse().ok()?,
        home: if f[5].is_empty() {
            "/".into()
        } else {
            f[5].to_string()
        },
        shell: if f[6].is_empty() {
            "/bin/sh".into()
        } else {
            f[6].to_string()
        },
        groups: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# comment\nbroken line\nalice:x:1000:1000:Alice:/home/alice:/bin/zsh\nbob:x:1001:100::/home/bob:\n";
    const GROUP: &str = "root:x:0:\nusers:x:100:alice\nwheel:x:10:alice,bob\nbad:x:zz:alice\n";

    #[test]
    fn by_name_and_uid() {
        let a = lookup_in(Some("alice"), PASSWD, GROUP).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (a.uid, a.gid, a.home.as_str(), a.shell.as_str()),
            (1000, 1000, "/home/alice", "/bin/zsh")
        );
        assert_eq!(a.groups, vec![1000, 100, 10]);
        let b = lookup_in(Some("1001"), PASSWD, GROUP).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.name, "bob");
        assert_eq!(b.shell, "/bin/sh");
        assert_eq!(b.groups, vec![100, 10]);
    }

    #[test]
    fn defaults_and_unknowns() {
        let r = lookup_in(None, "", "").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.uid, r.home.as_str()), (0, "/root"));
        assert!(lookup_in(Some("mallory"), PASSWD, GROUP).is_err());
        let n = lookup_in(Some("4242"), PASSWD, GROUP).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((n.uid, n.gid), (4242, 4242));
    }
}
