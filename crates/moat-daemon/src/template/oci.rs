//! OCI and Docker images as template bases: an OCI image layout (directory or tar), a `docker save`
//! archive, or an image pulled from a registry (OCI distribution API over HTTPS, or HTTP when allowed,
//! with basic or bearer-token auth). The image's layers are applied in order onto one root filesystem
//! directory, which then is a template like any other.
//!
//! Layer application follows the OCI image spec: `.wh.NAME` deletes NAME from the layers below,
//! `.wh..wh..opq` empties its directory of what the layers below put there, a hard link may point at a
//! file of any earlier layer, an entry replaces whatever was at its path unless both are directories.
//! Every path is resolved inside the root filesystem: `..` is refused and a symlink from an earlier
//! layer can never take a write outside it.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};

const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const MT_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

#[derive(Debug, Deserialize)]
struct Descriptor {
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
    #[serde(default)]
    annotations: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

/// An image index / manifest list, or a manifest (the fields moat reads).
#[derive(Debug, Deserialize)]
struct ManifestOrIndex {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

impl ManifestOrIndex {
    fn is_index(&self) -> bool {
        self.media_type == MT_OCI_INDEX
            || self.media_type == MT_DOCKER_LIST
            || (self.layers.is_empty() && !self.manifests.is_empty())
    }
}

/// The `GOARCH` name of this host's architecture.
fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The manifest of an index for this host (linux, its architecture); the only one if there is one.
fn pick_manifest<'a>(
    manifests: &'a [Descriptor],
    want_ref: Option<&str>,
) -> Result<&'a Descriptor> {
    let by_ref: Vec<&Descriptor> = match want_ref {
        Some(r) => manifests
            .iter()
            .filter(|m| {
                m.annotations
                    .get("org.opencontainers.image.ref.name")
                    .is_some_and(|n| n == r)
            })
            .collect(),
        None => manifests.iter().collect(),
    };
    if by_ref.is_empty() {
        bail!(
            "the image has no manifest{}",
            want_ref
                .map(|r| format!(" tagged {r:?}"))
                .unwrap_or_default()
        );
    }
    if by_ref.len() == 1 && by_ref[0].platform.is_none() {
        return Ok(by_ref[0]);
    }
    by_ref
        .iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == host_arch())
        })
        .or_else(|| by_ref.iter().find(|m| m.platform.is_none()))
        .copied()
        .ok_or_else(|| anyhow!("the image has no linux/{} variant", host_arch()))
}

fn check_digest(digest: &str) -> Result<&str> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| anyhow!("unsupported digest {digest:?} (sha256 only)"))?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("malformed digest {digest:?}");
    }
    Ok(hex)
}

/// The sha256 digest of a file, `sha256:<hex>`.
fn file_digest(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

// ---------------------------------------------------------------------------------------------------
// Archives on the host

/// What kind of image a host path holds, if any.
pub fn detect(path: &Path) -> Result<Option<&'static str>> {
    if path.is_dir() {
        return Ok(path
            .join("index.json")
            .is_file()
            .then_some("OCI image layout"));
    }
    let f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut ar = tar::Archive::new(f);
    let Ok(entries) = ar.entries() else {
        return Ok(None);
    };
    for e in entries.take(10_000) {
        let Ok(e) = e else { return Ok(None) };
        let p = e.path().map(|p| p.into_owned()).unwrap_or_default();
        let p = p.strip_prefix("./").unwrap_or(&p).to_path_buf();
        if p == Path::new("index.json") || p == Path::new("oci-layout") {
            return Ok(Some("OCI image archive"));
        }
        if p == Path::new("manifest.json") {
            return Ok(Some("docker save archive"));
        }
    }
    Ok(None)
}

#[derive(Debug, Deserialize)]
struct DockerSaveEntry {
    #[serde(rename = "Layers")]
    layers: Vec<String>,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
}

/// Applies the image in `path` (an OCI layout directory, or a tar of one, or a `docker save`
/// archive) onto the new directory `rootfs`. `work` is scratch space (removed by the caller).
pub fn import_archive(path: &Path, rootfs: &Path, work: &Path) -> Result<()> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        let unpacked = work.join("archive");
        std::fs::create_dir_all(&unpacked)?;
        let mut ar = tar::Archive::new(File::open(path)?);
        ar.set_preserve_ownerships(false);
        ar.unpack(&unpacked)
            .with_context(|| format!("unpack {}", path.display()))?;
        unpacked
    };
    std::fs::create_dir_all(rootfs)?;
    if dir.join("index.json").is_file() {
        let index: ManifestOrIndex = read_json(&dir.join("index.json"))?;
        let mut desc_digest = pick_manifest(&index.manifests, None)?.digest.clone();
        loop {
            let m: ManifestOrIndex = read_json(&layout_blob(&dir, &desc_digest)?)?;
            if m.is_index() {
                desc_digest = pick_manifest(&m.manifests, None)?.digest.clone();
                continue;
            }
            for l in &m.layers {
                let blob = layout_blob(&dir, &l.digest)?;
                if file_digest(&blob)? != l.digest {
                    bail!("layer {} does not match its digest", l.digest);
                }
                apply_layer_file(rootfs, &blob)?;
            }
            return Ok(());
        }
    }
    if dir.join("manifest.json").is_file() {
        let entries: Vec<DockerSaveEntry> = read_json(&dir.join("manifest.json"))?;
        let e = match entries.as_slice() {
            [one] => one,
            [] => bail!("manifest.json lists no image"),
            many => bail!(
                "the archive holds {} images ({}); save one",
                many.len(),
                many.iter()
                    .flat_map(|e| e.repo_tags.clone().unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        for l in &e.layers {
            let blob = inside(&dir, Path::new(l))?;
            apply_layer_file(rootfs, &blob)?;
        }
        return Ok(());
    }
    bail!(
        "{} is neither an OCI image layout (index.json) nor a docker save archive (manifest.json)",
        path.display()
    )
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    serde_json::from_reader(BufReader::new(f)).with_context(|| format!("parse {}", path.display()))
}

fn layout_blob(dir: &Path, digest: &str) -> Result<PathBuf> {
    let hex = check_digest(digest)?;
    let p = dir.join("blobs/sha256").join(hex);
    if !p.is_file() {
        bail!("blob {digest} is missing from the image layout");
    }
    Ok(p)
}

// ---------------------------------------------------------------------------------------------------
// Layers

/// A decompressing reader for a layer blob (gzip, zstd or plain tar, by its first bytes).
fn open_layer(path: &Path) -> Result<Box<dyn Read>> {
    let mut head = [0u8; 4];
    let n = File::open(path)?.read(&mut head)?;
    let f = File::open(path)?;
    if n >= 2 && head[..2] == [0x1f, 0x8b] {
        return Ok(Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(
            f,
        ))));
    }
    if n == 4 && head == [0x28, 0xb5, 0x2f, 0xfd] {
        let child = std::process::Command::new("zstd")
            .args(["-dc", "--"])
            .arg(path)
            .stdout(std::process::Stdio::piped())
            .stdin(std::process::Stdio::null())
            .spawn()
            .context("run zstd (layer is zstd-compressed)")?;
        return Ok(Box::new(ChildReader(child)));
    }
    Ok(Box::new(BufReader::new(f)))
}

struct ChildReader(std::process::Child);

impl Read for ChildReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self
            .0
            .stdout
            .as_mut()
            .ok_or_else(|| std::io::Error::other("no stdout"))?
            .read(buf)?;
        if n == 0 {
            let status = self.0.wait()?;
            if !status.success() {
                return Err(std::io::Error::other(format!("zstd: {status}")));
            }
        }
        Ok(n)
    }
}

fn apply_layer_file(rootfs: &Path, blob: &Path) -> Result<()> {
    apply_layer(rootfs, open_layer(blob)?)
        .with_context(|| format!("apply layer {}", blob.display()))
}

/// The entry's path as plain components (no root, no `.`); None when it has `..`.
fn clean(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
            Component::ParentDir => return None,
        }
    }
    Some(out)
}

/// `root/rel`, with every directory on the way checked to resolve inside `root` (a symlink there
/// must not lead out). The last component itself is not followed.
fn inside(root: &Path, rel: &Path) -> Result<PathBuf> {
    let rel = clean(rel).ok_or_else(|| anyhow!("path {} has '..'", rel.display()))?;
    let full = root.join(&rel);
    // The nearest ancestor that exists (as anything, a dangling symlink included) must resolve
    // inside `root`: directories made on the way below it then stay inside too.
    let mut ancestor = full.parent();
    while let Some(p) = ancestor {
        if p == root || p.symlink_metadata().is_ok() {
            break;
        }
        ancestor = p.parent();
    }
    if let Some(p) = ancestor.filter(|p| *p != root) {
        let canon_root = root.canonicalize()?;
        let canon = p
            .canonicalize()
            .map_err(|_| anyhow!("{} leads outside the root filesystem", rel.display()))?;
        if !canon.starts_with(&canon_root) {
            bail!("{} leads outside the root filesystem", rel.display());
        }
    }
    Ok(full)
}

fn remove_any(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Applies one layer (a tar stream) onto `rootfs`.
pub fn apply_layer(rootfs: &Path, reader: impl Read) -> Result<()> {
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_unpack_xattrs(true);
    ar.set_preserve_mtime(true);
    ar.set_overwrite(true);
    // What this layer made: an opaque marker only hides what the layers below put in its directory.
    let mut made: HashSet<PathBuf> = HashSet::new();
    for entry in ar.entries()? {
        let mut entry = entry?;
        let raw = entry.path()?.into_owned();
        let Some(rel) = clean(&raw) else {
            bail!("layer entry {} has '..'", raw.display());
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let name = rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent_rel = rel.parent().unwrap_or(Path::new("")).to_path_buf();
        if name == ".wh..wh..opq" {
            let dir = inside(rootfs, &parent_rel.join("x"))?
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| rootfs.to_path_buf());
            if let Ok(rd) = std::fs::read_dir(&dir) {
                for e in rd.flatten() {
                    if !made.contains(&parent_rel.join(e.file_name())) {
                        remove_any(&e.path())?;
                    }
                }
            }
            continue;
        }
        if let Some(target) = name.strip_prefix(".wh.") {
            remove_any(&inside(rootfs, &parent_rel.join(target))?)?;
            continue;
        }
        let dst = inside(rootfs, &rel)?;
        let kind = entry.header().entry_type();
        // Whatever is in the way goes, unless both are directories.
        if let Ok(m) = std::fs::symlink_metadata(&dst) {
            if !(m.is_dir() && kind.is_dir()) {
                remove_any(&dst)?;
            }
        }
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            make_special(&dst, entry.header(), kind)?;
        } else if kind.is_hard_link() {
            let target = entry
                .link_name()?
                .ok_or_else(|| anyhow!("hard link {} has no target", rel.display()))?
                .into_owned();
            let target = inside(rootfs, &target)?;
            std::fs::hard_link(&target, &dst)
                .with_context(|| format!("hard link {}", rel.display()))?;
        } else if !entry.unpack_in(rootfs)? {
            bail!("layer entry {} was refused", rel.display());
        }
        made.insert(rel);
    }
    Ok(())
}

/// A device node or fifo with the header's mode, owner and device numbers.
fn make_special(dst: &Path, h: &tar::Header, kind: tar::EntryType) -> Result<()> {
    use nix::sys::stat::{mknod, Mode, SFlag};
    let sflag = if kind.is_character_special() {
        SFlag::S_IFCHR
    } else if kind.is_block_special() {
        SFlag::S_IFBLK
    } else {
        SFlag::S_IFIFO
    };
    let mode = Mode::from_bits_truncate(h.mode()? & 0o7777);
    let dev = nix::sys::stat::makedev(
        h.device_major()?.unwrap_or(0) as u64,
        h.device_minor()?.unwrap_or(0) as u64,
    );
    if let Some(p) = dst.parent() {
        std::fs::create_dir_all(p)?;
    }
    mknod(dst, sflag, mode, dev).with_context(|| format!("mknod {}", dst.display()))?;
    nix::unistd::fchownat(
        None,
        dst,
        Some((h.uid()? as u32).into()),
        Some((h.gid()? as u32).into()),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .with_context(|| format!("chown {}", dst.display()))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// Registries

/// `[registry/]repository[:tag][@digest]`, Docker's defaults for the short forms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    pub registry: String,
    pub repository: String,
    /// A tag or a `sha256:` digest.
    pub reference: String,
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<ImageRef> {
        if s.is_empty() || s.len() > 512 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("image reference {s:?} is malformed");
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                check_digest(d)?;
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (first, remainder) = match rest.split_once('/') {
            Some((f, r)) if f.contains('.') || f.contains(':') || f == "localhost" => {
                (Some(f.to_string()), r.to_string())
            }
            _ => (None, rest.to_string()),
        };
        let (repo, tag) = match remainder.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r.to_string(), Some(t.to_string())),
            _ => (remainder.clone(), None),
        };
        let valid_repo = !repo.is_empty()
            && repo.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
            });
        if !valid_repo {
            bail!("image reference {s:?}: repository {repo:?} is malformed");
        }
        let registry = first.unwrap_or_else(|| "docker.io".into());
        let repository = if registry == "docker.io" && !repo.contains('/') {
            format!("library/{repo}")
        } else {
            repo
        };
        Ok(ImageRef {
            registry,
            repository,
            reference: digest.or(tag).unwrap_or_else(|| "latest".into()),
        })
    }

    fn api_host(&self) -> &str {
        if self.registry == "docker.io" {
            "registry-1.docker.io"
        } else {
            &self.registry
        }
    }
}

/// Credentials and transport of a pull.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    pub username: Option<String>,
    pub password: Option<String>,
    /// Plain HTTP (for a registry on a private network or localhost).
    pub insecure: bool,
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

pub fn parse_challenge(h: &str) -> Option<Challenge> {
    let (scheme, params) = h.trim().split_once(' ').unwrap_or((h.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut realm = None;
    let mut service = None;
    let mut scope = None;
    // key="value" pairs; values may hold commas (scopes do).
    let mut rest = params.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (q[..end].to_string(), &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_string(), &after[end..])
        };
        match key.as_str() {
            "realm" => realm = Some(value),
            "service" => service = Some(value),
            "scope" => scope = Some(value),
            _ => {}
        }
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge::Bearer {
        realm: realm?,
        service,
        scope,
    })
}

struct Registry {
    http: reqwest::Client,
    base: String,
    image: ImageRef,
    opts: PullOptions,
    auth: Option<String>,
}

impl Registry {
    async fn get(&mut self, path: &str, accept: &str) -> Result<reqwest::Response> {
        let url = format!("{}/v2/{}/{}", self.base, self.image.repository, path);
        for attempt in 0..2 {
            let mut req = self.http.get(&url).header("Accept", accept);
            if let Some(a) = &self.auth {
                req = req.header("Authorization", a);
            }
            let resp = req.send().await.with_context(|| format!("GET {url}"))?;
            if resp.status() == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 {
                let challenge = resp
                    .headers()
                    .get("www-authenticate")
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_challenge)
                    .ok_or_else(|| {
                        anyhow!("{url}: 401 without a usable WWW-Authenticate challenge")
                    })?;
                self.authenticate(challenge).await?;
                continue;
            }
            if resp.status() == reqwest::StatusCode::UNAUTHORIZED {
                bail!("GET {url}: 401: the registry refused the credentials (check username and password)");
            }
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                bail!(
                    "GET {url}: {status}: {}",
                    body.chars().take(300).collect::<String>()
                );
            }
            return Ok(resp);
        }
        bail!("GET {url}: 401 unauthorized")
    }

    async fn authenticate(&mut self, c: Challenge) -> Result<()> {
        use base64::Engine;
        let basic = match (&self.opts.username, &self.opts.password) {
            (Some(u), Some(p)) => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )),
            _ => None,
        };
        match c {
            Challenge::Basic => {
                self.auth = Some(
                    basic.ok_or_else(|| anyhow!("the registry needs a username and password"))?,
                );
            }
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let mut req = self.http.get(&realm);
                let scope =
                    scope.unwrap_or_else(|| format!("repository:{}:pull", self.image.repository));
                let mut q = vec![("scope", scope)];
                if let Some(s) = service {
                    q.push(("service", s));
                }
                req = req.query(&q);
                if let Some(b) = basic {
                    req = req.header("Authorization", b);
                }
                let resp = req
                    .send()
                    .await
                    .with_context(|| format!("token from {realm}"))?;
                if !resp.status().is_success() {
                    bail!("token from {realm}: {}", resp.status());
                }
                #[derive(Deserialize)]
                struct Token {
                    #[serde(default)]
                    token: Option<String>,
                    #[serde(default)]
                    access_token: Option<String>,
                }
                let t: Token = resp.json().await.context("token answer")?;
                let t = t
                    .token
                    .or(t.access_token)
                    .ok_or_else(|| anyhow!("token answer from {realm} has no token"))?;
                self.auth = Some(format!("Bearer {t}"));
            }
        }
        Ok(())
    }

    async fn manifest(&mut self, reference: &str) -> Result<(ManifestOrIndex, String)> {
        let accept = [
            MT_OCI_INDEX,
            MT_OCI_MANIFEST,
            MT_DOCKER_LIST,
            MT_DOCKER_MANIFEST,
        ]
        .join(", ");
        let resp = self.get(&format!("manifests/{reference}"), &accept).await?;
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let bytes = resp.bytes().await?;
        if bytes.len() > 4 << 20 {
            bail!("manifest {reference} is larger than 4 MiB");
        }
        if reference.starts_with("sha256:") {
            let got = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
            if got != reference {
                bail!("manifest {reference} does not match its digest");
            }
        }
        let mut m: ManifestOrIndex = serde_json::from_slice(&bytes).context("parse manifest")?;
        if m.media_type.is_empty() {
            m.media_type = ct;
        }
        Ok((m, reference.to_string()))
    }

    /// Downloads a blob to `dest`, checking its digest.
    async fn blob(&mut self, digest: &str, dest: &Path) -> Result<()> {
        check_digest(digest)?;
        let resp = self.get(&format!("blobs/{digest}"), "*/*").await?;
        let mut f = tokio::fs::File::create(dest).await?;
        let mut h = Sha256::new();
        let mut stream = resp.bytes_stream();
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.with_context(|| format!("download {digest}"))?;
            h.update(&chunk);
            f.write_all(&chunk).await?;
        }
        f.flush().await?;
        let got = format!("sha256:{}", hex::encode(h.finalize()));
        if got != digest {
            bail!("blob {digest} arrived as {got}");
        }
        Ok(())
    }
}

/// Pulls `image` and applies its layers onto the new directory `rootfs`; `work` is scratch space.
pub async fn pull(image: &str, opts: &PullOptions, rootfs: &Path, work: &Path) -> Result<()> {
    let image = ImageRef::parse(image)?;
    let scheme = if opts.insecure { "http" } else { "https" };
    let mut reg = Registry {
        http: reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(15))
            .build()?,
        base: format!("{scheme}://{}", image.api_host()),
        image: image.clone(),
        opts: opts.clone(),
        auth: None,
    };
    let (mut m, _) = reg.manifest(&image.reference).await?;
    for _ in 0..3 {
        if !m.is_index() {
            break;
        }
        let d = pick_manifest(&m.manifests, None)?.digest.clone();
        m = reg.manifest(&d).await?.0;
    }
    if m.is_index() {
        bail!("image index nested too deep");
    }
    std::fs::create_dir_all(rootfs)?;
    for (i, l) in m.layers.iter().enumerate() {
        let blob = work.join(format!("layer-{i}"));
        tracing::info!(image = %image.repository, layer = %l.digest, "pulling layer {}/{}", i + 1, m.layers.len());
        reg.blob(&l.digest, &blob).await?;
        let root = rootfs.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let r = apply_layer_file(&root, &blob);
            let _ = std::fs::remove_file(&blob);
            r
        })
        .await??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = ImageRef::parse("debian").unwrap();
        assert_eq!(
            (
                r.registry.as_str(),
                r.repository.as_str(),
                r.reference.as_str()
            ),
            ("docker.io", "library/debian", "latest")
        );
        let r = ImageRef::parse("127.0.0.1:5000/team/img:v1").unwrap();
        assert_eq!(
            (
                r.registry.as_str(),
                r.repository.as_str(),
                r.reference.as_str()
            ),
            ("127.0.0.1:5000", "team/img", "v1")
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let r = ImageRef::parse(&format!("ghcr.io/o/r@{d}")).unwrap();
        assert_eq!(r.reference, d);
        assert!(ImageRef::parse("Bad/Name").is_err());
        assert!(ImageRef::parse("x@sha256:zz").is_err());
        assert!(ImageRef::parse("").is_err());
    }

    #[test]
    fn challenges() {
        assert_eq!(parse_challenge("Basic realm=\"r\""), Some(Challenge::Basic));
        assert_eq!(
            parse_challenge(
                "Bearer realm=\"https://auth.docker.io/token\",service=\"registry.docker.io\",scope=\"repository:library/debian:pull,push\""
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/debian:pull,push".into()),
            })
        );
        assert_eq!(parse_challenge("Negotiate x"), None);
    }

    fn layer(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(if kind.is_dir() { 0o755 } else { 0o644 });
            h.set_uid(0);
            h.set_gid(0);
            h.set_size(data.len() as u64);
            if let Some(l) = link {
                h.set_link_name(l).unwrap();
            }
            b.append_data(&mut h, path, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn an_entry_below_a_symlink_out_is_refused_however_deep() {
        let d = tempfile::tempdir().unwrap();
        let (root, outside) = (d.path().join("root"), d.path().join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink("/nonexistent-moat", root.join("dangling")).unwrap();
        for rel in ["link/x", "link/new/deeper/x", "dangling/x"] {
            assert!(inside(&root, Path::new(rel)).is_err(), "{rel}");
        }
        assert!(inside(&root, Path::new("fresh/dir/x")).is_ok());
        assert!(
            inside(&root, Path::new("link")).is_ok(),
            "the link itself is not followed"
        );
    }

    #[test]
    fn whiteouts_opaque_dirs_and_links() {
        use tar::EntryType as T;
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply_layer(
            r,
            &layer(&[
                ("etc/", T::Directory, b"", None),
                ("etc/keep", T::Regular, b"k", None),
                ("etc/gone", T::Regular, b"g", None),
                ("opt/", T::Directory, b"", None),
                ("opt/old", T::Regular, b"o", None),
                ("bin", T::Regular, b"file becomes dir", None),
            ])[..],
        )
        .unwrap();
        apply_layer(
            r,
            &layer(&[
                ("etc/.wh.gone", T::Regular, b"", None),
                ("opt/new", T::Regular, b"n", None),
                ("opt/.wh..wh..opq", T::Regular, b"", None),
                ("etc/hard", T::Link, b"", Some("etc/keep")),
                ("bin/", T::Directory, b"", None),
                ("bin/sh", T::Regular, b"#!", None),
                ("etc/link", T::Symlink, b"", Some("/etc/keep")),
            ])[..],
        )
        .unwrap();
        assert!(r.join("etc/keep").is_file());
        assert!(!r.join("etc/gone").exists());
        assert!(!r.join("opt/old").exists(), "opaque dir kept a lower entry");
        assert_eq!(std::fs::read(r.join("opt/new")).unwrap(), b"n");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::metadata(r.join("etc/hard")).unwrap().ino(),
            std::fs::metadata(r.join("etc/keep")).unwrap().ino()
        );
        assert_eq!(std::fs::read(r.join("bin/sh")).unwrap(), b"#!");
        assert_eq!(
            std::fs::read_link(r.join("etc/link")).unwrap(),
            Path::new("/etc/keep")
        );
    }

    #[test]
    fn a_symlink_cannot_lead_a_later_layer_outside() {
        use tar::EntryType as T;
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let target = outside.path().to_str().unwrap().to_string();
        apply_layer(
            root.path(),
            &layer(&[("escape", T::Symlink, b"", Some(&target))])[..],
        )
        .unwrap();
        let err = apply_layer(
            root.path(),
            &layer(&[("escape/pwned", T::Regular, b"x", None)])[..],
        );
        assert!(err.is_err());
        assert!(!outside.path().join("pwned").exists());
        let err = apply_layer(
            root.path(),
            &layer(&[("escape/.wh.x", T::Regular, b"", None)])[..],
        );
        assert!(err.is_err());
        // `..` in a path is refused outright.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        h.set_entry_type(T::Regular);
        // Builder refuses '..' in set_path; write the raw name.
        h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../pwned2");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        assert!(apply_layer(root.path(), &b.into_inner().unwrap()[..]).is_err());
        assert!(!root.path().parent().unwrap().join("pwned2").exists());
    }
}
