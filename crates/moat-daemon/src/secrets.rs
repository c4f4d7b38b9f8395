//! Where secrets are kept (docs/secrets.md): declared daemon-wide, on a template or on a sandbox;
//! each value sealed (XChaCha20-Poly1305) with a key of the data directory (`secrets.key`, 0600)
//! before it reaches the database, and opened only into the egress proxy's memory. A sandbox gets
//! a placeholder per secret (in its environment) and a certificate authority of its own (in its
//! trust stores); neither is secret. No answer, log line or audit entry ever holds a value.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use moat_api::{SecretInfo, SecretSpec, PLACEHOLDER_PREFIX};
use rand::RngCore;

use crate::clock::{now_ms, rfc3339};
use crate::db::{Db, SecretRow};
use crate::error::Error;
use crate::host::egress::secrets::{Ca, SandboxSecrets, Secret};

/// Where a secret was declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Daemon,
    Template(String),
    Sandbox(String),
}

impl Scope {
    fn key(&self) -> String {
        match self {
            Scope::Daemon => "daemon".into(),
            Scope::Template(t) => format!("template:{t}"),
            Scope::Sandbox(s) => format!("sandbox:{s}"),
        }
    }
    fn label(key: &str) -> &'static str {
        if key == "daemon" {
            "daemon"
        } else if key.starts_with("template:") {
            "template"
        } else {
            "sandbox"
        }
    }
}

/// A new placeholder: the prefix and 128 random bits.
pub fn new_placeholder() -> String {
    let mut b = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut b);
    format!("{PLACEHOLDER_PREFIX}{}", hex::encode(b))
}

/// The stored part of a spec (everything but the value).
fn stored(spec: &SecretSpec) -> SecretSpec {
    SecretSpec {
        value: String::new(),
        ..spec.clone()
    }
}

pub struct Vault {
    db: Arc<Db>,
    key_path: PathBuf,
    key: OnceLock<Result<[u8; 32], String>>,
    /// Each sandbox's secrets as the proxy uses them, opened once (dropped on any change).
    cache: Mutex<HashMap<String, Option<Arc<SandboxSecrets>>>>,
    /// Each sandbox's template, for the template's secrets.
    templates: Mutex<HashMap<String, String>>,
}

impl Vault {
    pub fn new(data_dir: &Path, db: Arc<Db>) -> Vault {
        Vault {
            db,
            key_path: data_dir.join("secrets.key"),
            key: OnceLock::new(),
            cache: Default::default(),
            templates: Default::default(),
        }
    }

    fn key(&self) -> Result<[u8; 32], Error> {
        self.key
            .get_or_init(|| load_or_create_key(&self.key_path).map_err(|e| format!("{e:#}")))
            .clone()
            .map_err(|e| Error::internal(format!("the secrets key: {e}")))
    }

    fn seal(&self, aad: &str, plain: &[u8]) -> Result<Vec<u8>, Error> {
        let cipher = XChaCha20Poly1305::new(&self.key()?.into());
        let mut nonce = [0u8; 24];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let ct = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: plain,
                    aad: aad.as_bytes(),
                },
            )
            .map_err(|_| Error::internal("sealing a secret failed"))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&ct);
        Ok(out)
    }

    fn open(&self, aad: &str, sealed: &[u8]) -> Result<Vec<u8>, Error> {
        if sealed.len() < 24 {
            return Err(Error::internal("a sealed secret is cut short"));
        }
        let cipher = XChaCha20Poly1305::new(&self.key()?.into());
        cipher
            .decrypt(
                XNonce::from_slice(&sealed[..24]),
                Payload {
                    msg: &sealed[24..],
                    aad: aad.as_bytes(),
                },
            )
            .map_err(|_| {
                Error::internal(
                    "a sealed secret does not open with this data directory's secrets.key",
                )
            })
    }

    /// Declares (or replaces: a rotation) secret `spec` in `scope`. New connections use the new
    /// value at once.
    pub fn put(&self, scope: &Scope, spec: &SecretSpec) -> Result<SecretInfo, Error> {
        moat_api::check_secret(spec).map_err(|(f, m)| Error::invalid(f, m))?;
        let key = scope.key();
        let row = SecretRow {
            scope: key.clone(),
            name: spec.name.clone(),
            sealed: self.seal(&format!("{key}\0{}", spec.name), spec.value.as_bytes())?,
            spec: serde_json::to_string(&stored(spec))
                .map_err(|e| Error::internal(format!("encode: {e}")))?,
            updated_ms: now_ms(),
        };
        self.db.put_secret(&row)?;
        self.changed();
        Ok(info(&row, None))
    }

    pub fn delete(&self, scope: &Scope, name: &str) -> Result<(), Error> {
        if !self.db.delete_secret(&scope.key(), name)? {
            return Err(Error::not_found("name", format!("no secret {name:?} here")));
        }
        self.changed();
        Ok(())
    }

    /// The secrets declared in `scope` (no values).
    pub fn list(&self, scope: &Scope) -> Result<Vec<SecretInfo>, Error> {
        Ok(self
            .db
            .secrets(&[&scope.key()])?
            .iter()
            .map(|r| info(r, None))
            .collect())
    }

    /// Whether any secret applies to every sandbox of `template` (the daemon's or the template's).
    pub fn applies_to_template(&self, template: &str) -> Result<bool, Error> {
        Ok(!self
            .db
            .secrets(&[
                &Scope::Daemon.key(),
                &Scope::Template(template.into()).key(),
            ])?
            .is_empty())
    }

    fn changed(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// The secret rows that apply to a sandbox of `template`: the daemon's, the template's, the
    /// sandbox's own, a later scope replacing an earlier one's secret of the same name.
    fn effective(&self, id: &str, template: &str) -> Result<BTreeMap<String, SecretRow>, Error> {
        let scopes = [
            Scope::Daemon.key(),
            Scope::Template(template.into()).key(),
            Scope::Sandbox(id.into()).key(),
        ];
        let rows = self.db.secrets(&[&scopes[0], &scopes[1], &scopes[2]])?;
        Ok(rows.into_iter().map(|r| (r.name.clone(), r)).collect())
    }

    /// Makes a new sandbox's secrets: its own `specs` stored, a placeholder for every secret that
    /// applies, and its certificate authority. Returns the environment to add (`NAME` =
    /// placeholder) and the authority's certificate, or nothing when no secret applies.
    pub fn prepare(
        &self,
        id: &str,
        template: &str,
        specs: &[SecretSpec],
    ) -> Result<(BTreeMap<String, String>, Option<String>), Error> {
        for s in specs {
            self.put(&Scope::Sandbox(id.into()), s)?;
        }
        self.templates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), template.to_string());
        let rows = self.effective(id, template)?;
        if rows.is_empty() {
            return Ok((BTreeMap::new(), None));
        }
        let mut env = BTreeMap::new();
        let have = self.db.placeholders(id)?;
        for name in rows.keys() {
            let p = match have.get(name) {
                Some(p) => p.clone(),
                None => {
                    let p = new_placeholder();
                    self.db.put_placeholder(id, name, &p)?;
                    p
                }
            };
            env.insert(name.clone(), p);
        }
        let ca = self.ensure_ca(id)?;
        self.changed();
        Ok((env, Some(ca)))
    }

    /// Sandbox `id`'s authority certificate (made when it has none).
    pub fn ensure_ca(&self, id: &str) -> Result<String, Error> {
        if let Some((pem, _)) = self.db.sandbox_ca(id)? {
            return Ok(pem);
        }
        let (ca, key_pem) =
            Ca::generate(id).map_err(|e| Error::internal(format!("a sandbox CA: {e:#}")))?;
        let sealed = self.seal(&format!("ca\0{id}"), key_pem.as_bytes())?;
        self.db.put_sandbox_ca(id, ca.pem(), &sealed)?;
        // A connection between a secret's declaration and this cached "no authority, no secrets".
        self.changed();
        Ok(ca.pem().to_string())
    }

    /// The authority certificate of a sandbox that has one.
    pub fn ca_pem(&self, id: &str) -> Option<String> {
        self.db.sandbox_ca(id).ok().flatten().map(|(p, _)| p)
    }

    /// A new placeholder for secret `name` of sandbox `id` when it has none yet.
    pub fn placeholder(&self, id: &str, name: &str) -> Result<String, Error> {
        if let Some(p) = self.db.placeholders(id)?.get(name) {
            return Ok(p.clone());
        }
        let p = new_placeholder();
        self.db.put_placeholder(id, name, &p)?;
        self.changed();
        Ok(p)
    }

    /// The secrets that apply to sandbox `id` (with its placeholders), no values.
    pub fn list_for(&self, id: &str, template: &str) -> Result<Vec<SecretInfo>, Error> {
        let ph = self.db.placeholders(id)?;
        Ok(self
            .effective(id, template)?
            .values()
            .map(|r| info(r, ph.get(&r.name).cloned()))
            .collect())
    }

    /// Forgets what was cached of a sandbox that is gone (its rows go with its database row).
    pub fn forget(&self, id: &str) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        self.templates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// What the proxy needs of sandbox `id` (of `template`): None when no secret applies to it or
    /// it has no authority (made before its secrets existed: `inject` needs the CA installed).
    pub fn for_proxy(&self, id: &str, template: &str) -> Option<Arc<SandboxSecrets>> {
        if let Some(hit) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            return hit.clone();
        }
        let built = match self.build(id, template) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(sandbox = id, "secrets: {e}");
                None
            }
        };
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), built.clone());
        built
    }

    fn build(&self, id: &str, template: &str) -> Result<Option<Arc<SandboxSecrets>>, Error> {
        let rows = self.effective(id, template)?;
        if rows.is_empty() {
            return Ok(None);
        }
        let Some((cert_pem, sealed_key)) = self.db.sandbox_ca(id)? else {
            return Ok(None);
        };
        let key_pem = self.open(&format!("ca\0{id}"), &sealed_key)?;
        let ca = Ca::load(id, &cert_pem, &String::from_utf8_lossy(&key_pem))
            .map_err(|e| Error::internal(format!("a sandbox CA: {e:#}")))?;
        let mut placeholders = self.db.placeholders(id)?;
        let mut secrets = Vec::new();
        for r in rows.values() {
            let spec: SecretSpec = serde_json::from_str(&r.spec)
                .map_err(|e| Error::internal(format!("a stored secret: {e}")))?;
            let value = self.open(&format!("{}\0{}", r.scope, r.name), &r.sealed)?;
            let placeholder = match placeholders.get(&r.name) {
                Some(p) => p.clone(),
                None => {
                    let p = new_placeholder();
                    self.db.put_placeholder(id, &r.name, &p)?;
                    placeholders.insert(r.name.clone(), p.clone());
                    p
                }
            };
            secrets.push(Secret::new(
                &r.name,
                &String::from_utf8_lossy(&value),
                &placeholder,
                &spec.hosts,
                spec.inject,
                spec.header.as_deref(),
                spec.format.as_deref(),
                spec.body,
            ));
        }
        Ok(Some(Arc::new(SandboxSecrets {
            secrets,
            ca: Arc::new(ca),
        })))
    }

    /// Every value that applies to sandbox `id`, with its name: what command output is redacted
    /// of should a value ever reach the sandbox.
    pub fn values_for(&self, id: &str, template: &str) -> Vec<(String, String)> {
        self.for_proxy(id, template)
            .map(|s| {
                s.secrets
                    .iter()
                    .map(|x| (x.name.clone(), x.value.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn info(r: &SecretRow, placeholder: Option<String>) -> SecretInfo {
    let spec: SecretSpec = serde_json::from_str(&r.spec).unwrap_or(SecretSpec {
        name: r.name.clone(),
        value: String::new(),
        hosts: Vec::new(),
        inject: Default::default(),
        header: None,
        format: None,
        body: false,
    });
    SecretInfo {
        name: r.name.clone(),
        hosts: spec.hosts,
        inject: spec.inject,
        header: spec.header,
        body: spec.body,
        scope: Scope::label(&r.scope).into(),
        placeholder,
        updated_at: rfc3339(r.updated_ms),
    }
}

/// The data directory's sealing key: 32 random bytes in a 0600 file, made on first use.
fn load_or_create_key(path: &Path) -> anyhow::Result<[u8; 32]> {
    use anyhow::Context;
    match std::fs::read(path) {
        Ok(b) if b.len() == 32 => {
            let mut k = [0u8; 32];
            k.copy_from_slice(&b);
            return Ok(k);
        }
        Ok(_) => anyhow::bail!("{} is not a 32-byte key", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let mut k = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut k);
    let tmp = path.with_extension("key.new");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("create {}", tmp.display()))?;
    f.write_all(&k)?;
    f.sync_all()?;
    drop(f);
    // Never over a key made meanwhile: the first one wins.
    match std::fs::hard_link(&tmp, path) {
        Ok(()) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(k)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&tmp);
            load_or_create_key(path)
        }
        Err(e) => Err(e).with_context(|| format!("create {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, value: &str, host: &str) -> SecretSpec {
        SecretSpec {
            name: name.into(),
            value: value.into(),
            hosts: vec![host.into()],
            inject: Default::default(),
            header: None,
            format: None,
            body: false,
        }
    }

    #[test]
    fn values_are_sealed_scoped_and_rotated() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Db::open(&dir.path().join("moat.db")).unwrap());
        let v = Vault::new(dir.path(), db.clone());
        v.put(&Scope::Daemon, &spec("SHARED", "daemon-value", "a.example"))
            .unwrap();
        v.put(
            &Scope::Template("t".into()),
            &spec("SHARED", "template-value", "b.example"),
        )
        .unwrap();
        let (env, ca) = v
            .prepare("sbx_1", "t", &[spec("OWN", "own-value-123", "c.example")])
            .unwrap();
        assert_eq!(env.keys().collect::<Vec<_>>(), ["OWN", "SHARED"]);
        assert!(env.values().all(|p| p.starts_with(PLACEHOLDER_PREFIX)));
        assert!(ca.unwrap().contains("BEGIN CERTIFICATE"));
        // The key file is the owner's alone; no value is stored in clear.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("secrets.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let raw = std::fs::read(dir.path().join("moat.db")).unwrap();
        for secret in ["daemon-value", "template-value", "own-value-123"] {
            assert!(
                memchr::memmem::find(&raw, secret.as_bytes()).is_none(),
                "{secret} in clear"
            );
        }
        // The template's replaces the daemon's of the same name; the proxy sees the values.
        let s = v.for_proxy("sbx_1", "t").unwrap();
        let by: BTreeMap<_, _> = s
            .secrets
            .iter()
            .map(|x| (x.name.as_str(), (x.value.as_str(), x.placeholder.as_str())))
            .collect();
        assert_eq!(by["SHARED"], ("template-value", env["SHARED"].as_str()));
        assert_eq!(by["OWN"].0, "own-value-123");
        // Lists never carry a value.
        let listed = serde_json::to_string(&v.list_for("sbx_1", "t").unwrap()).unwrap();
        assert!(!listed.contains("value-"), "{listed}");
        assert!(listed.contains(&env["OWN"]));
        // A rotation is seen at once; the placeholder stays.
        v.put(
            &Scope::Sandbox("sbx_1".into()),
            &spec("OWN", "rotated-456", "c.example"),
        )
        .unwrap();
        let s = v.for_proxy("sbx_1", "t").unwrap();
        let own = s.secrets.iter().find(|x| x.name == "OWN").unwrap();
        assert_eq!(
            (own.value.as_str(), own.placeholder.as_str()),
            ("rotated-456", env["OWN"].as_str())
        );
        // Another data dir's key does not open them.
        let other = tempfile::tempdir().unwrap();
        let w = Vault::new(other.path(), db.clone());
        assert!(w.for_proxy("sbx_1", "t").is_none());
        // They go with the sandbox.
        db.delete_sandbox("sbx_1").unwrap();
        v.forget("sbx_1");
        assert!(v.list(&Scope::Sandbox("sbx_1".into())).unwrap().is_empty());
        assert!(v.ca_pem("sbx_1").is_none());
        // Bad input names its field.
        let e = v
            .put(&Scope::Daemon, &spec("X", "v", "10.0.0.1"))
            .unwrap_err();
        assert_eq!(e.field(), Some("hosts"));
    }
}
