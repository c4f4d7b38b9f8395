//! The sandbox's egress certificate authority in its trust stores (docs/secrets.md): the daemon's
//! proxy answers TLS to a secret's host with certificates this authority signs. It is added, as a
//! marked block that a later start replaces (a fork gets its own), to every system bundle present
//! (Debian/Ubuntu/Alpine, Fedora/RHEL, the OpenSSL default), or to a new Debian-style bundle when
//! there is none; it is also written alone to /etc/moat/egress-ca.pem. Processes started from now on
//! get the variables Python's requests, Node, curl, git and OpenSSL read.

use std::path::Path;

const BEGIN: &str = "# moat egress CA (begin: replaced at every sandbox start)";
const END: &str = "# moat egress CA (end)";
const BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
];
pub const ALONE: &str = "/etc/moat/egress-ca.pem";

/// `text` without a previous moat block, with `pem`'s.
fn with_block(text: &str, pem: &str) -> String {
    let mut out = String::with_capacity(text.len() + pem.len() + 128);
    let mut skipping = false;
    for line in text.lines() {
        if line == BEGIN {
            skipping = true;
        } else if line == END {
            skipping = false;
        } else if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str(BEGIN);
    out.push('\n');
    out.push_str(pem.trim_end());
    out.push('\n');
    out.push_str(END);
    out.push('\n');
    out
}

/// Replaces `path` with `body` (its directory made when missing).
fn write(path: &Path, body: &str) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    crate::identity::replace_file(path, body.as_bytes(), 0o644)
}

/// Installs `pem`; returns what could not be done.
pub fn install(
    pem: &str,
    env: &std::sync::RwLock<std::collections::BTreeMap<String, String>>,
) -> Vec<String> {
    let mut missed = Vec::new();
    if let Err(e) = write(Path::new(ALONE), pem) {
        missed.push(format!("{ALONE}: {e}"));
    }
    let mut bundle = None;
    for b in BUNDLES {
        let p = Path::new(b);
        // A bundle that is a link to another (Alpine's cert.pem) is written through its target once.
        let Ok(real) = std::fs::canonicalize(p) else {
            continue;
        };
        let text = match std::fs::read_to_string(&real) {
            Ok(t) => t,
            Err(e) => {
                missed.push(format!("{b}: {e}"));
                continue;
            }
        };
        if let Err(e) = write(&real, &with_block(&text, pem)) {
            missed.push(format!("{b}: {e}"));
            continue;
        }
        bundle.get_or_insert(b);
    }
    let bundle = match bundle {
        Some(b) => b,
        None => {
            let b = BUNDLES[0];
            if let Err(e) = write(Path::new(b), &with_block("", pem)) {
                missed.push(format!("{b}: {e}"));
            }
            b
        }
    };
    if let Ok(mut e) = env.write() {
        for k in [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
        ] {
            e.insert(k.into(), bundle.into());
        }
        e.insert("NODE_EXTRA_CA_CERTS".into(), ALONE.into());
    }
    missed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_is_replaced_not_stacked() {
        let sys = "-----BEGIN CERTIFICATE-----\nSYS\n-----END CERTIFICATE-----\n";
        let one = with_block(sys, "PEM-A\n");
        let two = with_block(&one, "PEM-B");
        assert!(two.starts_with(sys));
        assert!(two.contains("PEM-B") && !two.contains("PEM-A"));
        assert_eq!(two.matches(BEGIN).count(), 1);
    }
}
