//! Identifiers the daemon hands out: sandbox ids and access tokens, random from the OS. At the
//! bottom of the daemon: it imports nothing of the crate.

use rand::RngCore;

/// `<prefix>_` + 26 base32 characters of 128 random bits from the OS (`sbx_`, `snap_`, `bld_`).
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut b);
    format!("{prefix}_{}", base32(&b))
}

/// Whether `s` looks like an id [`new_id`] made with `prefix` (so garbage never reaches the
/// database or a path).
pub fn valid_id(prefix: &str, s: &str) -> bool {
    s.len() == prefix.len() + 27
        && s.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('_'))
            .is_some_and(|r| {
                r.bytes()
                    .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
            })
}

/// A new sandbox id: `sbx_` + 26 base32 characters.
pub fn new_sandbox_id() -> String {
    new_id("sbx")
}

/// Whether `s` looks like a sandbox id.
pub fn valid_sandbox_id(s: &str) -> bool {
    valid_id("sbx", s)
}

/// A sandbox's port access token: 160 random bits, base32.
pub fn new_access_token() -> String {
    let mut b = [0u8; 20];
    rand::rngs::OsRng.fill_bytes(&mut b);
    base32(&b)
}

/// Lower-case RFC 4648 base32 without padding.
pub fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for &b in bytes {
        acc = (acc << 8) | b as u32;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_well_formed_and_distinct() {
        let a = new_sandbox_id();
        let b = new_sandbox_id();
        assert_ne!(a, b);
        assert!(valid_sandbox_id(&a), "{a}");
        assert!(!valid_sandbox_id("sbx_../../etc"));
        assert!(!valid_sandbox_id("sbx_ABCDEFGHIJKLMNOPQRSTUVWXYZ"));
        assert_eq!(new_access_token().len(), 32);
        let snap = new_id("snap");
        assert_eq!(snap.len(), 31);
        assert!(valid_id("snap", &snap) && !valid_id("bld", &snap) && !valid_sandbox_id(&snap));
    }

    #[test]
    fn base32_known_values() {
        assert_eq!(base32(b"f"), "my");
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
    }
}
