//! What the egress proxy needs to carry a sandbox's secrets (docs/secrets.md): each secret's value,
//! placeholder and hosts, the sandbox's own certificate authority (whose certificates the proxy
//! answers with when it terminates TLS towards a secret's host), and the byte rewriting done on the
//! way (placeholder → value out, value → placeholder in). Where secrets are kept and sealed is the
//! daemon's business (crate::secrets); this module only uses them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context, Result};
use moat_api::{parse_destination, Destination, SecretInject, PLACEHOLDER_LEN, PLACEHOLDER_PREFIX};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// One secret as the proxy uses it.
#[derive(Clone)]
pub struct Secret {
    pub name: String,
    pub value: String,
    pub placeholder: String,
    pub hosts: Vec<Destination>,
    pub inject: SecretInject,
    /// For `inject: header`: the header and its value with the secret in it.
    pub header: String,
    pub format: String,
    pub body: bool,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("name", &self.name)
            .field("placeholder", &self.placeholder)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// A secret from its declared parts (hosts as the API takes them; a bad entry matches nothing).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        value: &str,
        placeholder: &str,
        hosts: &[String],
        inject: SecretInject,
        header: Option<&str>,
        format: Option<&str>,
        body: bool,
    ) -> Secret {
        Secret {
            name: name.to_string(),
            value: value.to_string(),
            placeholder: placeholder.to_string(),
            hosts: hosts
                .iter()
                .filter_map(|h| parse_destination(h).ok())
                .filter(Destination::is_name)
                .collect(),
            inject,
            header: header.unwrap_or("authorization").to_ascii_lowercase(),
            format: format.unwrap_or("Bearer {value}").to_string(),
            body,
        }
    }

    pub fn belongs_to(&self, host: &str) -> bool {
        let host = moat_api::normalize_name(host);
        self.hosts.iter().any(|d| d.matches_name(&host))
    }

    /// The header value `inject: header` sets.
    pub fn header_value(&self) -> String {
        self.format.replace("{value}", &self.value)
    }
}

/// A sandbox's secrets and certificate authority, as the proxy reads them at each connection.
pub struct SandboxSecrets {
    pub secrets: Vec<Secret>,
    pub ca: Arc<Ca>,
}

impl std::fmt::Debug for SandboxSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxSecrets")
            .field("secrets", &self.secrets)
            .finish_non_exhaustive()
    }
}

impl SandboxSecrets {
    /// Whether a TLS connection to `host` is terminated (some secret belongs to it).
    pub fn intercepts(&self, host: &str) -> bool {
        self.secrets.iter().any(|s| s.belongs_to(host))
    }

    /// The first of this sandbox's placeholders found in `b`.
    pub fn placeholder_in(&self, b: &[u8]) -> Option<&Secret> {
        let mut from = 0;
        while let Some(i) = memchr::memmem::find(&b[from..], PLACEHOLDER_PREFIX.as_bytes()) {
            let at = from + i;
            if let Some(s) = b
                .get(at..at + PLACEHOLDER_LEN)
                .and_then(|p| self.secrets.iter().find(|s| s.placeholder.as_bytes() == p))
            {
                return Some(s);
            }
            from = at + 1;
        }
        None
    }

    /// A placeholder in `b` of a secret that does not belong to `host` (None: any host is wrong).
    pub fn foreign_in(&self, b: &[u8], host: Option<&str>) -> Option<&Secret> {
        let mut from = 0;
        while let Some(i) = memchr::memmem::find(&b[from..], PLACEHOLDER_PREFIX.as_bytes()) {
            let at = from + i;
            if let Some(s) = b.get(at..at + PLACEHOLDER_LEN).and_then(|p| {
                self.secrets.iter().find(|s| {
                    s.placeholder.as_bytes() == p && !host.is_some_and(|h| s.belongs_to(h))
                })
            }) {
                return Some(s);
            }
            from = at + 1;
        }
        None
    }

    /// Placeholder → value for the secrets of `host` (what goes out).
    pub fn outgoing(&self, host: &str) -> Replacer {
        Replacer::new(
            self.secrets
                .iter()
                .filter(|s| s.belongs_to(host))
                .map(|s| {
                    (
                        s.placeholder.clone().into_bytes(),
                        s.value.clone().into_bytes(),
                    )
                })
                .collect(),
        )
    }

    /// Value → placeholder for every secret (what comes back: a server that echoes a request must
    /// not hand the value to the sandbox).
    pub fn incoming(&self) -> Replacer {
        Replacer::new(
            self.secrets
                .iter()
                .map(|s| {
                    (
                        s.value.clone().into_bytes(),
                        s.placeholder.clone().into_bytes(),
                    )
                })
                .collect(),
        )
    }
}

/// Rewrites a stream of bytes: every `from` becomes its `to`, even across chunk boundaries (the
/// last bytes of a chunk that could start a match are held until the next one or the end).
pub struct Replacer {
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    carry: Vec<u8>,
    hold: usize,
}

impl Replacer {
    pub fn new(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Replacer {
        let pairs: Vec<_> = pairs.into_iter().filter(|(f, _)| !f.is_empty()).collect();
        let hold = pairs.iter().map(|(f, _)| f.len() - 1).max().unwrap_or(0);
        Replacer {
            pairs,
            carry: Vec::new(),
            hold,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Rewrites all of `b` at once (a header, a whole body).
    pub fn all(&self, b: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(b.len());
        let rest = self.replace_into(b, &mut out);
        out.extend_from_slice(rest);
        out
    }

    /// Replaces the matches in `b` into `out`; returns the tail after the last match.
    fn replace_into<'a>(&self, mut b: &'a [u8], out: &mut Vec<u8>) -> &'a [u8] {
        loop {
            let first = self
                .pairs
                .iter()
                .filter_map(|(f, t)| memchr::memmem::find(b, f).map(|i| (i, f.len(), t)))
                .min_by_key(|(i, _, _)| *i);
            let Some((i, n, to)) = first else {
                return b;
            };
            out.extend_from_slice(&b[..i]);
            out.extend_from_slice(to);
            b = &b[i + n..];
        }
    }

    /// The rewritten bytes of the next chunk that are certain (some may be held).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.pairs.is_empty() {
            return chunk.to_vec();
        }
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(buf.len());
        let rest = self.replace_into(&buf, &mut out);
        let keep = rest.len().min(self.hold);
        out.extend_from_slice(&rest[..rest.len() - keep]);
        self.carry = rest[rest.len() - keep..].to_vec();
        out
    }

    /// What was held at the end.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.carry)
    }
}

/// Watches a stream for this sandbox's placeholders across chunk boundaries.
pub struct Scanner {
    tail: Vec<u8>,
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner::new()
    }
}

impl Scanner {
    pub fn new() -> Scanner {
        Scanner { tail: Vec::new() }
    }

    /// A placeholder of `secrets` not belonging to `host` in the stream so far, ending in `chunk`.
    pub fn foreign<'s>(
        &mut self,
        secrets: &'s SandboxSecrets,
        chunk: &[u8],
        host: Option<&str>,
    ) -> Option<&'s Secret> {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(chunk);
        let found = secrets.foreign_in(&buf, host);
        let keep = buf.len().min(PLACEHOLDER_LEN - 1);
        self.tail = buf[buf.len() - keep..].to_vec();
        found
    }
}

/// A sandbox's certificate authority: installed in the sandbox's trust stores by its agent, used by
/// the proxy to answer as the secret's host.
pub struct Ca {
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
    pem: String,
    leaves: Mutex<HashMap<String, Arc<rustls::sign::CertifiedKey>>>,
}

fn ca_params(sandbox_id: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, "moat");
    p.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("moat egress CA for {sandbox_id}"),
    );
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(3650);
    p
}

impl Ca {
    /// A new authority for `sandbox_id`: itself and its private key, both PEM.
    pub fn generate(sandbox_id: &str) -> Result<(Ca, String)> {
        let key = rcgen::KeyPair::generate().context("CA key")?;
        let params = ca_params(sandbox_id);
        let cert = params.self_signed(&key).context("CA certificate")?;
        let key_pem = key.serialize_pem();
        Ok((
            Ca {
                params,
                key,
                pem: cert.pem(),
                leaves: Default::default(),
            },
            key_pem,
        ))
    }

    /// The authority of `sandbox_id` made earlier (its certificate as installed and its key).
    pub fn load(sandbox_id: &str, cert_pem: &str, key_pem: &str) -> Result<Ca> {
        let key = rcgen::KeyPair::from_pem(key_pem).context("CA key")?;
        Ok(Ca {
            params: ca_params(sandbox_id),
            key,
            pem: cert_pem.to_string(),
            leaves: Default::default(),
        })
    }

    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for `host` signed by this authority (made once per host).
    pub fn leaf(&self, host: &str) -> Result<Arc<rustls::sign::CertifiedKey>> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = leaves.get(host) {
            return Ok(k.clone());
        }
        let key = rcgen::KeyPair::generate()?;
        let mut p = rcgen::CertificateParams::new(vec![host.to_string()])?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CommonName, host);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(1);
        p.not_after = now + time::Duration::days(365);
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = p.signed_by(&key, &issuer)?;
        let provider = rustls::crypto::ring::default_provider();
        let signing = provider
            .key_provider
            .load_private_key(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
                key.serialize_der(),
            )))
            .map_err(|e| anyhow!("leaf key: {e}"))?;
        let ck = Arc::new(rustls::sign::CertifiedKey::new(
            vec![CertificateDer::from(cert.der().to_vec())],
            signing,
        ));
        if leaves.len() > 256 {
            leaves.clear();
        }
        leaves.insert(host.to_string(), ck.clone());
        Ok(ck)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;

    pub fn sandbox_secrets() -> SandboxSecrets {
        let (ca, _) = Ca::generate("sbx_test").unwrap();
        SandboxSecrets {
            secrets: vec![
                Secret::new(
                    "GH",
                    "ghp_real",
                    &format!("{PLACEHOLDER_PREFIX}{}", "a".repeat(32)),
                    &["api.github.com".into()],
                    SecretInject::Placeholder,
                    None,
                    None,
                    false,
                ),
                Secret::new(
                    "OPENAI",
                    "sk-real-longer-value",
                    &format!("{PLACEHOLDER_PREFIX}{}", "b".repeat(32)),
                    &["*.openai.com".into()],
                    SecretInject::Header,
                    None,
                    None,
                    false,
                ),
            ],
            ca: Arc::new(ca),
        }
    }

    #[test]
    fn placeholders_are_found_and_judged_by_host() {
        let s = sandbox_secrets();
        let gh = s.secrets[0].placeholder.clone();
        let msg = format!("Authorization: token {gh}\r\n");
        assert_eq!(s.placeholder_in(msg.as_bytes()).unwrap().name, "GH");
        assert!(s
            .foreign_in(msg.as_bytes(), Some("API.GitHub.com."))
            .is_none());
        assert_eq!(
            s.foreign_in(msg.as_bytes(), Some("evil.example"))
                .unwrap()
                .name,
            "GH"
        );
        assert_eq!(s.foreign_in(msg.as_bytes(), None).unwrap().name, "GH");
        // Another sandbox's placeholder, or a cut one, is only text.
        let other = format!("{PLACEHOLDER_PREFIX}{}", "c".repeat(32));
        assert!(s.placeholder_in(other.as_bytes()).is_none());
        assert!(s
            .placeholder_in(&gh.as_bytes()[..PLACEHOLDER_LEN - 1])
            .is_none());
        assert!(s.intercepts("x.openai.com") && !s.intercepts("openai.com"));
        assert_eq!(s.secrets[1].header_value(), "Bearer sk-real-longer-value");
    }

    #[test]
    fn replacing_holds_across_every_chunk_boundary() {
        let s = sandbox_secrets();
        let gh = s.secrets[0].placeholder.clone();
        let text = format!("a{gh}b{gh}{gh}c sk-real-longer-value ghp_real end");
        let want_out = text.replace(&gh, "ghp_real");
        let want_in = text
            .replace("ghp_real", &gh)
            .replace("sk-real-longer-value", &s.secrets[1].placeholder);
        assert_eq!(
            s.outgoing("api.github.com").all(text.as_bytes()),
            want_out.as_bytes()
        );
        assert_eq!(
            s.outgoing("evil.example").all(text.as_bytes()),
            text.as_bytes()
        );
        for step in 1..=text.len() {
            for (mut r, want) in [
                (s.outgoing("api.github.com"), &want_out),
                (s.incoming(), &want_in),
            ] {
                let mut got = Vec::new();
                for c in text.as_bytes().chunks(step) {
                    got.extend(r.push(c));
                }
                got.extend(r.finish());
                assert_eq!(String::from_utf8(got).unwrap(), *want, "chunks of {step}");
            }
            let mut sc = Scanner::new();
            let hit = text
                .as_bytes()
                .chunks(step)
                .any(|c| sc.foreign(&s, c, Some("evil.example")).is_some());
            assert!(hit, "chunks of {step}");
            let mut sc = Scanner::new();
            assert!(!text
                .as_bytes()
                .chunks(step)
                .any(|c| sc.foreign(&s, c, Some("api.github.com")).is_some()));
        }
    }

    #[test]
    fn leaves_chain_to_the_authority_and_a_reloaded_one_signs_alike() {
        let (ca, key_pem) = Ca::generate("sbx_x").unwrap();
        let again = Ca::load("sbx_x", ca.pem(), &key_pem).unwrap();
        for ca_used in [&ca, &again] {
            let leaf = ca_used.leaf("api.github.com").unwrap();
            let mut roots = rustls::RootCertStore::empty();
            let der = rustls_pemfile_der(ca.pem());
            roots.add(der).unwrap();
            let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                Arc::new(rustls::crypto::ring::default_provider()),
            )
            .build()
            .unwrap();
            let name = rustls::pki_types::ServerName::try_from("api.github.com").unwrap();
            verifier
                .verify_server_cert(
                    &leaf.cert[0],
                    &[],
                    &name,
                    &[],
                    rustls::pki_types::UnixTime::now(),
                )
                .unwrap();
            let wrong = rustls::pki_types::ServerName::try_from("evil.example").unwrap();
            assert!(verifier
                .verify_server_cert(
                    &leaf.cert[0],
                    &[],
                    &wrong,
                    &[],
                    rustls::pki_types::UnixTime::now()
                )
                .is_err());
        }
    }

    fn rustls_pemfile_der(pem: &str) -> CertificateDer<'static> {
        use base64::Engine;
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        CertificateDer::from(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap(),
        )
    }
}
