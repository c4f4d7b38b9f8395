//! The daemon's state, all of it, in one SQLite database (`<data_dir>/moat.db`), with migrations keyed
//! on `PRAGMA user_version`. Nothing the daemon needs after a restart lives only in memory.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use moat_api::{Isolation, SandboxState, TemplateSource, TemplateStatus};
use rusqlite::{params, Connection, OptionalExtension, Row};

/// What can go wrong with the store. Every one of these is the daemon's failure, never the
/// caller's, except [`StoreError::NoFreeSlot`], a limit of the host.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("open the database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("database migration {number}: {source}")]
    Migration {
        number: usize,
        source: rusqlite::Error,
    },
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("encode a stored value: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("the database lock is poisoned (a thread panicked holding it)")]
    Poisoned,
    /// Every uid slot (host uid range and network address) is taken by a sandbox.
    #[error("all {0} sandbox slots are in use")]
    NoFreeSlot(u32),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

const MIGRATIONS: &[&str] = &[
    // 1: sandboxes and templates.
    "CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        template TEXT NOT NULL,
        isolation TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        expires_at_ms INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        env TEXT NOT NULL,
        cpu REAL NOT NULL,
        memory_mb INTEGER NOT NULL,
        hostname TEXT NOT NULL,
        slot INTEGER NOT NULL UNIQUE,
        tier_state TEXT
    );
    CREATE TABLE templates (
        name TEXT PRIMARY KEY,
        source TEXT NOT NULL,
        status TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        created_at_ms INTEGER NOT NULL,
        error TEXT
    );",
    // 2: the warm pool, and round-robin uid slots (a freed slot is not handed out again at once).
    "ALTER TABLE sandboxes ADD COLUMN pooled INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);",
    // 3: resource limits beyond cpu/memory (JSON of moat_api::SandboxLimits) and the idle timeout's clock.
    "ALTER TABLE sandboxes ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE sandboxes ADD COLUMN last_active_ms INTEGER NOT NULL DEFAULT 0;",
    // 4: the audit log (see audit.rs); it outlives sandboxes, so no foreign key.
    "CREATE TABLE audit (
        id INTEGER PRIMARY KEY,
        at_ms INTEGER NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        sandbox_id TEXT,
        status INTEGER,
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX audit_at ON audit (at_ms);
    CREATE INDEX audit_sandbox ON audit (sandbox_id, at_ms);",
    // 5: snapshots and their layers (see layers.rs); a sandbox's layer stack above its template, the
    // snapshot it started from, and what it does at its timeout.
    "ALTER TABLE sandboxes ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE sandboxes ADD COLUMN snapshot TEXT;
    ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        name TEXT UNIQUE,
        kind TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        template TEXT NOT NULL,
        isolation TEXT NOT NULL,
        layers TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        created_at_ms INTEGER NOT NULL,
        frozen_ms INTEGER NOT NULL,
        limits TEXT NOT NULL,
        env TEXT NOT NULL,
        metadata TEXT NOT NULL
    );",
    // 6: a sandbox's egress policy (JSON of moat_api::NetworkPolicy; NULL without networking).
    "ALTER TABLE sandboxes ADD COLUMN network TEXT;",
    // 7: exposed ports: the per-sandbox access token and whether ports are public.
    "ALTER TABLE sandboxes ADD COLUMN access_token TEXT NOT NULL DEFAULT '';
    ALTER TABLE sandboxes ADD COLUMN public_traffic INTEGER NOT NULL DEFAULT 0;",
    // 8: the connection log (see netlog.rs); like the audit log it outlives sandboxes.
    "CREATE TABLE netlog (
        id INTEGER PRIMARY KEY,
        at_ms INTEGER NOT NULL,
        sandbox_id TEXT NOT NULL,
        template TEXT NOT NULL,
        protocol TEXT NOT NULL,
        dst_ip TEXT,
        dst_port INTEGER,
        name TEXT,
        name_source TEXT,
        decision TEXT NOT NULL,
        rule TEXT NOT NULL,
        dialed TEXT,
        bytes_out INTEGER NOT NULL,
        bytes_in INTEGER NOT NULL,
        duration_ms INTEGER NOT NULL,
        error TEXT
    );
    CREATE INDEX netlog_sandbox ON netlog (sandbox_id, id);
    CREATE INDEX netlog_template ON netlog (template, id);
    CREATE INDEX netlog_at ON netlog (at_ms);",
    // 9: templates built from a spec (see sandboxes/builds.rs): a template, sandbox or snapshot may
    // stand on another root than its template's own rootfs (`template:NAME` or a layer digest), with
    // layers and what its processes start with; builds, and the build cache of step layers.
    "ALTER TABLE templates ADD COLUMN root TEXT;
    ALTER TABLE templates ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE templates ADD COLUMN config TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE templates ADD COLUMN from_desc TEXT;
    ALTER TABLE templates ADD COLUMN build_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN root TEXT;
    ALTER TABLE sandboxes ADD COLUMN runtime TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE snapshots ADD COLUMN root TEXT;
    ALTER TABLE snapshots ADD COLUMN runtime TEXT NOT NULL DEFAULT '{}';
    CREATE TABLE builds (
        id TEXT PRIMARY KEY,
        template TEXT NOT NULL,
        status TEXT NOT NULL,
        started_at_ms INTEGER NOT NULL,
        finished_at_ms INTEGER,
        spec TEXT NOT NULL,
        steps TEXT NOT NULL,
        error TEXT,
        failed_step INTEGER
    );
    CREATE INDEX builds_template ON builds (template, started_at_ms);
    CREATE TABLE build_cache (
        key TEXT PRIMARY KEY,
        layer TEXT,
        size_bytes INTEGER NOT NULL,
        created_at_ms INTEGER NOT NULL,
        used_at_ms INTEGER NOT NULL
    );",
    // 10: failure causes as state: what degraded a live sandbox (the latest of each reason), the
    // sandboxes that ended without a request (their last state, kept 24 h), and the keys of
    // idempotent creates (kept 24 h).
    "CREATE TABLE conditions (
        sandbox_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        cause TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, reason)
    );
    CREATE TABLE ended (
        id TEXT PRIMARY KEY,
        at_ms INTEGER NOT NULL,
        sandbox TEXT NOT NULL
    );
    CREATE INDEX ended_at ON ended (at_ms);
    CREATE TABLE idempotency (
        key TEXT PRIMARY KEY,
        body TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        at_ms INTEGER NOT NULL
    );",
    // 11: secrets (docs/secrets.md): values sealed with the data dir's key; each sandbox's
    // placeholders and certificate authority.
    "CREATE TABLE secrets (
        scope TEXT NOT NULL,
        name TEXT NOT NULL,
        sealed BLOB NOT NULL,
        spec TEXT NOT NULL,
        updated_ms INTEGER NOT NULL,
        PRIMARY KEY (scope, name)
    );
    CREATE TABLE secret_placeholders (
        sandbox_id TEXT NOT NULL,
        name TEXT NOT NULL,
        placeholder TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, name)
    );
    CREATE TABLE sandbox_ca (
        sandbox_id TEXT PRIMARY KEY,
        cert_pem TEXT NOT NULL,
        sealed_key BLOB NOT NULL
    );",
    // 12: auto-resume: a paused sandbox resumes on a request for it (docs/api.md).
    "ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;",
];

/// A secret as stored: its value sealed, the rest (the spec without its value) as JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct SecretRow {
    pub scope: String,
    pub name: String,
    pub sealed: Vec<u8>,
    pub spec: String,
    pub updated_ms: i64,
}

/// A sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub isolation: Isolation,
    pub state: SandboxState,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub cpu: f64,
    pub memory_mb: u64,
    pub hostname: String,
    pub slot: u32,
    pub tier_state: Option<serde_json::Value>,
    /// Started ahead of demand and not yet handed to anyone: invisible in the API.
    pub pooled: bool,
    /// All limits (`cpu` and `memory_mb` mirror the columns above).
    pub limits: moat_api::SandboxLimits,
    /// Last API request for the sandbox (the idle timeout counts from it).
    pub last_active_ms: i64,
    /// Layer digests above the template, bottom first (from the snapshot it started from).
    pub layers: Vec<String>,
    /// The snapshot it started from or was last reset to.
    pub snapshot: Option<String>,
    pub on_timeout: moat_api::OnTimeout,
    /// Egress policy; None when the daemon runs without sandbox networking.
    pub network: Option<moat_api::NetworkPolicy>,
    /// Opens the sandbox's exposed ports to holders without the API key.
    pub access_token: String,
    pub public_traffic: bool,
    /// A paused sandbox resumes when a request for it comes.
    pub auto_resume: bool,
    /// What stands under `layers` when it is not the template's own rootfs (a spec-built template's
    /// base): `template:NAME` or a layer digest.
    pub root: Option<String>,
    /// Default user and working directory of commands, and the start command (from the template).
    pub runtime: moat_api::TemplateConfig,
}

/// A snapshot row.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRecord {
    pub id: String,
    pub name: Option<String>,
    pub kind: moat_api::SnapshotKind,
    pub sandbox_id: String,
    pub template: String,
    pub isolation: Isolation,
    pub layers: Vec<String>,
    pub size_bytes: u64,
    pub created_at_ms: i64,
    pub frozen_ms: u64,
    pub limits: moat_api::SandboxLimits,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    /// As in [`SandboxRecord`].
    pub root: Option<String>,
    pub runtime: moat_api::TemplateConfig,
}

/// What a creator asks of a sandbox taken from the warm pool.
#[derive(Debug, Clone)]
pub struct Claim {
    pub template: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub cpu: f64,
    pub memory_mb: u64,
    pub limits: moat_api::SandboxLimits,
    pub on_timeout: moat_api::OnTimeout,
    pub network: Option<moat_api::NetworkPolicy>,
    pub public_traffic: bool,
    pub auto_resume: bool,
}

/// A template row.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateRecord {
    pub name: String,
    pub source: TemplateSource,
    pub status: TemplateStatus,
    pub size_bytes: u64,
    pub created_at_ms: i64,
    pub error: Option<String>,
    /// For a spec-built template: what stands under its layers (`template:NAME` or a layer digest).
    pub root: Option<String>,
    pub layers: Vec<String>,
    /// Environment, user, working directory and start command of its sandboxes.
    pub config: moat_api::TemplateConfig,
    /// What it was built from, for the API (`template base`).
    pub from_desc: Option<String>,
    pub build_id: Option<String>,
}

impl TemplateRecord {
    /// A plain template (its own rootfs, nothing over it).
    pub fn plain(name: &str, source: TemplateSource, status: TemplateStatus) -> TemplateRecord {
        TemplateRecord {
            name: name.to_string(),
            source,
            status,
            size_bytes: 0,
            created_at_ms: crate::clock::now_ms(),
            error: None,
            root: None,
            layers: Vec::new(),
            config: Default::default(),
            from_desc: None,
            build_id: None,
        }
    }
}

/// A build row.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildRecord {
    pub id: String,
    pub template: String,
    pub status: moat_api::BuildStatus,
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub spec: moat_api::TemplateSpec,
    pub steps: Vec<moat_api::BuildStepInfo>,
    pub error: Option<String>,
    pub failed_step: Option<u32>,
}

pub struct Db {
    conn: Mutex<Connection>,
    /// A file of space kept for the database on its filesystem (`<db>.reserve`), given up when
    /// a write finds the disk full so that the write (a delete, a timeout change, an audit entry)
    /// still happens; made again by [`Db::keep_reserve`] once there is room.
    reserve: Option<std::path::PathBuf>,
}

impl StoreError {
    /// Whether the disk under the database is full (SQLITE_FULL).
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self,
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DiskFull
        )
    }
}

fn enum_str<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn parse_enum<T: serde::de::DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(s: &str) -> rusqlite::Result<T> {
    serde_json::from_str(s).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn sandbox_from_row(r: &Row<'_>) -> rusqlite::Result<SandboxRecord> {
    let tier_state: Option<String> = r.get("tier_state")?;
    let cpu: f64 = r.get("cpu")?;
    let memory_mb = r.get::<_, i64>("memory_mb")? as u64;
    let mut limits: moat_api::SandboxLimits = parse_json(&r.get::<_, String>("limits")?)?;
    limits.cpu = cpu;
    limits.memory_mb = memory_mb;
    Ok(SandboxRecord {
        id: r.get("id")?,
        template: r.get("template")?,
        isolation: parse_enum(&r.get::<_, String>("isolation")?)?,
        state: parse_enum(&r.get::<_, String>("state")?)?,
        created_at_ms: r.get("created_at_ms")?,
        expires_at_ms: r.get("expires_at_ms")?,
        metadata: parse_json(&r.get::<_, String>("metadata")?)?,
        env: parse_json(&r.get::<_, String>("env")?)?,
        cpu: r.get("cpu")?,
        memory_mb: r.get::<_, i64>("memory_mb")? as u64,
        hostname: r.get("hostname")?,
        slot: r.get::<_, i64>("slot")? as u32,
        tier_state: tier_state.map(|s| parse_json(&s)).transpose()?,
        pooled: r.get::<_, i64>("pooled")? != 0,
        limits,
        last_active_ms: r.get("last_active_ms")?,
        layers: parse_json(&r.get::<_, String>("layers")?)?,
        snapshot: r.get("snapshot")?,
        on_timeout: parse_enum(&r.get::<_, String>("on_timeout")?)?,
        network: r
            .get::<_, Option<String>>("network")?
            .map(|s| parse_json(&s))
            .transpose()?,
        access_token: r.get("access_token")?,
        public_traffic: r.get::<_, i64>("public_traffic")? != 0,
        auto_resume: r.get::<_, i64>("auto_resume")? != 0,
        root: r.get("root")?,
        runtime: parse_json(&r.get::<_, String>("runtime")?)?,
    })
}

fn snapshot_from_row(r: &Row<'_>) -> rusqlite::Result<SnapshotRecord> {
    Ok(SnapshotRecord {
        id: r.get("id")?,
        name: r.get("name")?,
        kind: parse_enum(&r.get::<_, String>("kind")?)?,
        sandbox_id: r.get("sandbox_id")?,
        template: r.get("template")?,
        isolation: parse_enum(&r.get::<_, String>("isolation")?)?,
        layers: parse_json(&r.get::<_, String>("layers")?)?,
        size_bytes: r.get::<_, i64>("size_bytes")? as u64,
        created_at_ms: r.get("created_at_ms")?,
        frozen_ms: r.get::<_, i64>("frozen_ms")? as u64,
        limits: parse_json(&r.get::<_, String>("limits")?)?,
        env: parse_json(&r.get::<_, String>("env")?)?,
        metadata: parse_json(&r.get::<_, String>("metadata")?)?,
        root: r.get("root")?,
        runtime: parse_json(&r.get::<_, String>("runtime")?)?,
    })
}

fn build_from_row(r: &Row<'_>) -> rusqlite::Result<BuildRecord> {
    Ok(BuildRecord {
        id: r.get("id")?,
        template: r.get("template")?,
        status: parse_enum(&r.get::<_, String>("status")?)?,
        started_at_ms: r.get("started_at_ms")?,
        finished_at_ms: r.get("finished_at_ms")?,
        spec: parse_json(&r.get::<_, String>("spec")?)?,
        steps: parse_json(&r.get::<_, String>("steps")?)?,
        error: r.get("error")?,
        failed_step: r.get::<_, Option<i64>>("failed_step")?.map(|n| n as u32),
    })
}

fn template_from_row(r: &Row<'_>) -> rusqlite::Result<TemplateRecord> {
    Ok(TemplateRecord {
        name: r.get("name")?,
        source: parse_enum(&r.get::<_, String>("source")?)?,
        status: parse_enum(&r.get::<_, String>("status")?)?,
        size_bytes: r.get::<_, i64>("size_bytes")? as u64,
        created_at_ms: r.get("created_at_ms")?,
        error: r.get("error")?,
        root: r.get("root")?,
        layers: parse_json(&r.get::<_, String>("layers")?)?,
        config: parse_json(&r.get::<_, String>("config")?)?,
        from_desc: r.get("from_desc")?,
        build_id: r.get("build_id")?,
    })
}

impl Db {
    pub fn open(path: &Path) -> Result<Db> {
        let conn = Connection::open(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?;
        let mut reserve = path.as_os_str().to_owned();
        reserve.push(".reserve");
        Self::init(conn, Some(reserve.into()))
    }

    pub fn open_in_memory() -> Result<Db> {
        Self::init(Connection::open_in_memory()?, None)
    }

    /// Makes the file of space kept for the database `bytes` long if it is not (allocated, not
    /// sparse). Returns whether it was (re)made.
    pub fn keep_reserve(&self, bytes: u64) -> std::io::Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let Some(path) = &self.reserve else {
            return Ok(false);
        };
        if std::fs::metadata(path).is_ok_and(|m| m.blocks() * 512 >= bytes) {
            return Ok(false);
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if let Err(e) = nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            nix::fcntl::FallocateFlags::empty(),
            0,
            bytes as i64,
        ) {
            drop(f);
            let _ = std::fs::remove_file(path);
            return Err(e.into());
        }
        Ok(true)
    }

    /// Gives up the space kept for the database; whether there was any.
    fn release_reserve(&self) -> bool {
        let Some(path) = &self.reserve else {
            return false;
        };
        match std::fs::remove_file(path) {
            Ok(()) => {
                tracing::warn!(
                    "the disk under the database is full: gave up the space kept for it ({})",
                    path.display()
                );
                true
            }
            Err(_) => false,
        }
    }

    /// Runs `f` on the connection; when it fails because the disk is full, gives up the space
    /// kept for the database and runs it once more (a failed write changed nothing).
    fn run<T>(&self, mut f: impl FnMut(&mut Connection) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        match f(&mut conn) {
            Err(e) if e.is_disk_full() && self.release_reserve() => f(&mut conn),
            r => r,
        }
    }

    fn init(mut conn: Connection, reserve: Option<std::path::PathBuf>) -> Result<Db> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        let tx = conn.transaction()?;
        for (i, m) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            tx.execute_batch(m)
                .map_err(|source| StoreError::Migration {
                    number: i + 1,
                    source,
                })?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        }
        tx.commit()?;
        Ok(Db {
            conn: Mutex::new(conn),
            reserve,
        })
    }

    fn with<T>(&self, mut f: impl FnMut(&Connection) -> rusqlite::Result<T>) -> Result<T> {
        self.run(|c| f(c).map_err(Into::into))
    }

    /// Runs `f` on the connection (for modules that keep their own tables, such as `audit`); run
    /// again once if the disk was full (see [`Db::keep_reserve`]).
    pub fn with_conn<T>(
        &self,
        mut f: impl FnMut(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T> {
        self.run(|c| f(c).map_err(Into::into))
    }

    /// Inserts a new sandbox, choosing the lowest free uid slot below `max_slots`.
    pub fn insert_sandbox(&self, rec: &mut SandboxRecord, max_slots: u32) -> Result<()> {
        self.run(|conn| Self::insert_sandbox_in(conn, rec, max_slots))
    }

    fn insert_sandbox_in(
        conn: &mut Connection,
        rec: &mut SandboxRecord,
        max_slots: u32,
    ) -> Result<()> {
        let tx = conn.transaction()?;
        let next: i64 = tx
            .query_row("SELECT value FROM meta WHERE key = 'next_slot'", [], |r| {
                r.get(0)
            })
            .optional()?
            .unwrap_or(0);
        // The first free slot at or after the one after the last handed out, wrapping around.
        let slot: Option<i64> = tx
            .query_row(
                "WITH RECURSIVE n(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM n WHERE x + 1 < ?1)
                 SELECT x FROM n WHERE x NOT IN (SELECT slot FROM sandboxes)
                 ORDER BY (x < ?2), x LIMIT 1",
                params![max_slots, next],
                |r| r.get(0),
            )
            .optional()?;
        let slot = slot.ok_or(StoreError::NoFreeSlot(max_slots))?;
        tx.execute(
            "INSERT INTO meta (key, value) VALUES ('next_slot', ?1)
             ON CONFLICT(key) DO UPDATE SET value = ?1",
            [(slot + 1) % max_slots as i64],
        )?;
        rec.slot = slot as u32;
        tx.execute(
            "INSERT INTO sandboxes (id, template, isolation, state, created_at_ms, expires_at_ms, metadata, env,
                                    cpu, memory_mb, hostname, slot, tier_state, pooled, limits, last_active_ms,
                                    layers, snapshot, on_timeout, network, access_token, public_traffic,
                                    root, runtime, auto_resume)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20,
                     ?21, ?22, ?23, ?24, ?25)",
            params![
                rec.id,
                rec.template,
                enum_str(&rec.isolation),
                enum_str(&rec.state),
                rec.created_at_ms,
                rec.expires_at_ms,
                serde_json::to_string(&rec.metadata)?,
                serde_json::to_string(&rec.env)?,
                rec.cpu,
                rec.memory_mb as i64,
                rec.hostname,
                rec.slot as i64,
                rec.tier_state.as_ref().map(|v| v.to_string()),
                rec.pooled as i64,
                serde_json::to_string(&rec.limits)?,
                rec.last_active_ms,
                serde_json::to_string(&rec.layers)?,
                rec.snapshot,
                enum_str(&rec.on_timeout),
                rec.network
                    .as_ref()
                    .map(serde_json::to_string)
                    .transpose()?,
                rec.access_token,
                rec.public_traffic as i64,
                rec.root,
                serde_json::to_string(&rec.runtime)?,
                rec.auto_resume as i64,
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            c.query_row(
                "SELECT * FROM sandboxes WHERE id = ?1",
                [id],
                sandbox_from_row,
            )
            .optional()
        })
    }

    pub fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let mut st = c.prepare("SELECT * FROM sandboxes ORDER BY created_at_ms, id")?;
            let rows = st.query_map([], sandbox_from_row)?;
            rows.collect()
        })
    }

    pub fn set_state(&self, id: &str, state: SandboxState) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET state = ?2 WHERE id = ?1",
                params![id, enum_str(&state)],
            )
        })?;
        Ok(())
    }

    pub fn set_tier_state(
        &self,
        id: &str,
        state: SandboxState,
        tier_state: &serde_json::Value,
    ) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET state = ?2, tier_state = ?3 WHERE id = ?1",
                params![id, enum_str(&state), tier_state.to_string()],
            )
        })?;
        Ok(())
    }

    pub fn set_expiry(&self, id: &str, expires_at_ms: i64) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET expires_at_ms = ?2 WHERE id = ?1",
                params![id, expires_at_ms],
            )
        })?;
        Ok(())
    }

    /// Records an API request for the sandbox (the idle timeout counts from the last one).
    pub fn touch(&self, id: &str, now_ms: i64) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET last_active_ms = ?2 WHERE id = ?1",
                params![id, now_ms],
            )
        })?;
        Ok(())
    }

    /// Ids of sandboxes whose expiry is at or before `now_ms`.
    pub fn expired(&self, now_ms: i64) -> Result<Vec<String>> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT id FROM sandboxes WHERE expires_at_ms <= ?1 AND state IN ('running', 'starting') AND pooled = 0",
            )?;
            let rows = st.query_map([now_ms], |r| r.get(0))?;
            rows.collect()
        })
    }

    /// Every sandbox's id and state, without reading the rest of its row.
    pub fn states(&self) -> Result<Vec<(String, SandboxState)>> {
        self.with(|c| {
            let mut st = c.prepare_cached("SELECT id, state FROM sandboxes")?;
            let rows = st.query_map([], |r| {
                Ok((r.get::<_, String>(0)?, parse_enum(&r.get::<_, String>(1)?)?))
            })?;
            rows.collect()
        })
    }

    /// Ids of running sandboxes whose idle timeout passed (none read whole: the reaper asks twice
    /// a second, whatever the number of sandboxes).
    pub fn idle(&self, now_ms: i64) -> Result<Vec<String>> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT id FROM sandboxes WHERE state = 'running' AND pooled = 0 \
                 AND json_extract(limits, '$.idle_timeout') > 0 \
                 AND last_active_ms + 1000 * json_extract(limits, '$.idle_timeout') <= ?1",
            )?;
            let rows = st.query_map([now_ms], |r| r.get(0))?;
            rows.collect()
        })
    }

    /// Hands a running pooled sandbox of `claim.template` to a creator; None when the pool is empty.
    pub fn claim_pooled(&self, claim: &Claim) -> Result<Option<SandboxRecord>> {
        let id: Option<String> = self.with(|c| {
            c.query_row(
                "UPDATE sandboxes SET pooled = 0, created_at_ms = ?2, expires_at_ms = ?3, metadata = ?4, env = ?5,
                        cpu = ?6, memory_mb = ?7, limits = ?8, last_active_ms = ?2, on_timeout = ?9,
                        network = ?10, public_traffic = ?11, auto_resume = ?12
                 WHERE id = (SELECT id FROM sandboxes WHERE pooled = 1 AND state = 'running' AND template = ?1
                             ORDER BY created_at_ms LIMIT 1)
                 RETURNING id",
                params![
                    claim.template,
                    claim.created_at_ms,
                    claim.expires_at_ms,
                    serde_json::to_string(&claim.metadata).unwrap_or_default(),
                    serde_json::to_string(&claim.env).unwrap_or_default(),
                    claim.cpu,
                    claim.memory_mb as i64,
                    serde_json::to_string(&claim.limits).unwrap_or_else(|_| "{}".into()),
                    enum_str(&claim.on_timeout),
                    claim
                        .network
                        .as_ref()
                        .and_then(|n| serde_json::to_string(n).ok()),
                    claim.public_traffic as i64,
                    claim.auto_resume as i64
                ],
                |r| r.get(0),
            )
            .optional()
        })?;
        match id {
            Some(id) => self.get_sandbox(&id),
            None => Ok(None),
        }
    }

    /// Number of pooled sandboxes of a template (any state).
    pub fn pooled_count(&self, template: &str) -> Result<u64> {
        self.with(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM sandboxes WHERE pooled = 1 AND template = ?1",
                [template],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| n as u64)
    }

    /// The largest disk quota (MiB) of a sandbox in the store; 0 when none has one.
    pub fn largest_disk_quota_mb(&self) -> Result<u64> {
        self.with(|c| {
            c.query_row(
                "SELECT COALESCE(MAX(json_extract(limits, '$.disk_mb')), 0) FROM sandboxes",
                [],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| n.max(0) as u64)
    }

    pub fn delete_sandbox(&self, id: &str) -> Result<()> {
        self.run(|c| {
            let tx = c.transaction()?;
            tx.execute("DELETE FROM sandboxes WHERE id = ?1", [id])?;
            tx.execute("DELETE FROM conditions WHERE sandbox_id = ?1", [id])?;
            tx.execute(
                "DELETE FROM secrets WHERE scope = ?1",
                [format!("sandbox:{id}")],
            )?;
            tx.execute(
                "DELETE FROM secret_placeholders WHERE sandbox_id = ?1",
                [id],
            )?;
            tx.execute("DELETE FROM sandbox_ca WHERE sandbox_id = ?1", [id])?;
            tx.commit()?;
            Ok(())
        })
    }

    /// Records `cause` as sandbox `id`'s condition of its reason (replacing the previous one).
    pub fn put_condition(&self, id: &str, cause: &moat_api::Cause) -> Result<()> {
        let json = serde_json::to_string(cause)?;
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO conditions (sandbox_id, reason, cause) VALUES (?1, ?2, ?3)",
                params![id, cause.reason.as_str(), json],
            )
        })?;
        Ok(())
    }

    /// The conditions of sandbox `id`, in the order of their reasons' names.
    pub fn conditions(&self, id: &str) -> Result<Vec<moat_api::Cause>> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT cause FROM conditions WHERE sandbox_id = ?1 ORDER BY reason",
            )?;
            let rows = st.query_map([id], |r| parse_json(&r.get::<_, String>(0)?))?;
            rows.collect()
        })
    }

    /// Keeps what an ended sandbox last was (its `ended` filled in).
    pub fn put_ended(&self, sandbox: &moat_api::Sandbox, at_ms: i64) -> Result<()> {
        let json = serde_json::to_string(sandbox)?;
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO ended (id, at_ms, sandbox) VALUES (?1, ?2, ?3)",
                params![sandbox.id, at_ms, json],
            )
        })?;
        Ok(())
    }

    pub fn get_ended(&self, id: &str) -> Result<Option<moat_api::Sandbox>> {
        self.with(|c| {
            c.query_row("SELECT sandbox FROM ended WHERE id = ?1", [id], |r| {
                parse_json(&r.get::<_, String>(0)?)
            })
            .optional()
        })
    }

    /// Ended sandboxes, newest first.
    pub fn list_ended(&self) -> Result<Vec<moat_api::Sandbox>> {
        self.with(|c| {
            let mut st = c.prepare_cached("SELECT sandbox FROM ended ORDER BY at_ms DESC")?;
            let rows = st.query_map([], |r| parse_json(&r.get::<_, String>(0)?))?;
            rows.collect()
        })
    }

    pub fn put_secret(&self, r: &SecretRow) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO secrets (scope, name, sealed, spec, updated_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![r.scope, r.name, r.sealed, r.spec, r.updated_ms],
            )
        })?;
        Ok(())
    }

    /// Deletes a secret; whether there was one.
    pub fn delete_secret(&self, scope: &str, name: &str) -> Result<bool> {
        self.with(|c| {
            c.execute(
                "DELETE FROM secrets WHERE scope = ?1 AND name = ?2",
                [scope, name],
            )
        })
        .map(|n| n > 0)
    }

    /// The secrets of the scopes given, in the order of the scopes, then by name.
    pub fn secrets(&self, scopes: &[&str]) -> Result<Vec<SecretRow>> {
        let mut out = Vec::new();
        for scope in scopes {
            let rows = self.with(|c| {
                let mut st = c.prepare_cached(
                    "SELECT scope, name, sealed, spec, updated_ms FROM secrets WHERE scope = ?1 ORDER BY name",
                )?;
                let rows = st.query_map([scope], |r| {
                    Ok(SecretRow {
                        scope: r.get(0)?,
                        name: r.get(1)?,
                        sealed: r.get(2)?,
                        spec: r.get(3)?,
                        updated_ms: r.get(4)?,
                    })
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })?;
            out.extend(rows);
        }
        Ok(out)
    }

    /// Sandbox `id`'s placeholders, by secret name.
    pub fn placeholders(&self, id: &str) -> Result<BTreeMap<String, String>> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT name, placeholder FROM secret_placeholders WHERE sandbox_id = ?1",
            )?;
            let rows = st.query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<BTreeMap<String, String>>>()
        })
    }

    pub fn put_placeholder(&self, id: &str, name: &str, placeholder: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO secret_placeholders (sandbox_id, name, placeholder) VALUES (?1, ?2, ?3)",
                [id, name, placeholder],
            )
        })?;
        Ok(())
    }

    /// Sandbox `id`'s certificate authority: its certificate and sealed key.
    pub fn sandbox_ca(&self, id: &str) -> Result<Option<(String, Vec<u8>)>> {
        self.with(|c| {
            c.query_row(
                "SELECT cert_pem, sealed_key FROM sandbox_ca WHERE sandbox_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
        })
    }

    pub fn put_sandbox_ca(&self, id: &str, cert_pem: &str, sealed_key: &[u8]) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO sandbox_ca (sandbox_id, cert_pem, sealed_key) VALUES (?1, ?2, ?3)",
                params![id, cert_pem, sealed_key],
            )
        })?;
        Ok(())
    }

    /// Forgets ended sandboxes and idempotency keys older than `before_ms`.
    pub fn prune_ended(&self, before_ms: i64) -> Result<()> {
        self.with(|c| {
            c.execute("DELETE FROM ended WHERE at_ms < ?1", [before_ms])?;
            c.execute("DELETE FROM idempotency WHERE at_ms < ?1", [before_ms])
        })?;
        Ok(())
    }

    /// The request digest and sandbox of an idempotency key.
    pub fn idempotency(&self, key: &str) -> Result<Option<(String, String)>> {
        self.with(|c| {
            c.query_row(
                "SELECT body, sandbox_id FROM idempotency WHERE key = ?1",
                [key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
        })
    }

    pub fn put_idempotency(
        &self,
        key: &str,
        body: &str,
        sandbox_id: &str,
        at_ms: i64,
    ) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO idempotency (key, body, sandbox_id, at_ms) VALUES (?1, ?2, ?3, ?4)",
                params![key, body, sandbox_id, at_ms],
            )
        })?;
        Ok(())
    }

    pub fn upsert_template(&self, t: &TemplateRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO templates (name, source, status, size_bytes, created_at_ms, error, root, layers, config,
                                        from_desc, build_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                 ON CONFLICT(name) DO UPDATE SET source = ?2, status = ?3, size_bytes = ?4, created_at_ms = ?5,
                     error = ?6, root = ?7, layers = ?8, config = ?9, from_desc = ?10, build_id = ?11",
                params![
                    t.name,
                    enum_str(&t.source),
                    enum_str(&t.status),
                    t.size_bytes as i64,
                    t.created_at_ms,
                    t.error,
                    t.root,
                    serde_json::to_string(&t.layers).unwrap_or_else(|_| "[]".into()),
                    serde_json::to_string(&t.config).unwrap_or_else(|_| "{}".into()),
                    t.from_desc,
                    t.build_id
                ],
            )
        })?;
        Ok(())
    }

    pub fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            c.query_row(
                "SELECT * FROM templates WHERE name = ?1",
                [name],
                template_from_row,
            )
            .optional()
        })
    }

    pub fn list_templates(&self) -> Result<Vec<TemplateRecord>> {
        self.with(|c| {
            let mut st = c.prepare("SELECT * FROM templates ORDER BY name")?;
            let rows = st.query_map([], template_from_row)?;
            rows.collect()
        })
    }

    pub fn delete_template(&self, name: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM templates WHERE name = ?1", [name]))?;
        Ok(())
    }

    /// The sandbox holding a network slot: (id, template, egress policy).
    pub fn network_by_slot(
        &self,
        slot: u32,
    ) -> Result<Option<(String, String, Option<moat_api::NetworkPolicy>)>> {
        self.with(|c| {
            c.query_row(
                "SELECT id, template, network FROM sandboxes WHERE slot = ?1",
                [slot],
                |r| {
                    let net: Option<String> = r.get(2)?;
                    Ok((
                        r.get(0)?,
                        r.get(1)?,
                        net.and_then(|n| serde_json::from_str(&n).ok()),
                    ))
                },
            )
            .optional()
        })
    }

    /// Records a sandbox's new egress policy.
    pub fn set_network(&self, id: &str, policy: &moat_api::NetworkPolicy) -> Result<()> {
        let json = serde_json::to_string(policy)?;
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET network = ?2 WHERE id = ?1",
                params![id, json],
            )
        })?;
        Ok(())
    }

    /// Points a sandbox at a new layer stack (after a reset) and records its new tier state.
    pub fn set_layers(
        &self,
        id: &str,
        layers: &[String],
        snapshot: Option<&str>,
        tier_state: Option<&serde_json::Value>,
    ) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET layers = ?2, snapshot = ?3, tier_state = ?4 WHERE id = ?1",
                params![
                    id,
                    serde_json::to_string(layers).unwrap_or_else(|_| "[]".into()),
                    snapshot,
                    tier_state.map(|v| v.to_string())
                ],
            )
        })?;
        Ok(())
    }

    pub fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO snapshots (id, name, kind, sandbox_id, template, isolation, layers, size_bytes,
                                        created_at_ms, frozen_ms, limits, env, metadata, root, runtime)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
                params![
                    s.id,
                    s.name,
                    enum_str(&s.kind),
                    s.sandbox_id,
                    s.template,
                    enum_str(&s.isolation),
                    serde_json::to_string(&s.layers).unwrap_or_else(|_| "[]".into()),
                    s.size_bytes as i64,
                    s.created_at_ms,
                    s.frozen_ms as i64,
                    serde_json::to_string(&s.limits).unwrap_or_else(|_| "{}".into()),
                    serde_json::to_string(&s.env).unwrap_or_else(|_| "{}".into()),
                    serde_json::to_string(&s.metadata).unwrap_or_else(|_| "{}".into()),
                    s.root,
                    serde_json::to_string(&s.runtime).unwrap_or_else(|_| "{}".into()),
                ],
            )
        })?;
        Ok(())
    }

    /// A snapshot by id or by name.
    pub fn get_snapshot(&self, id_or_name: &str) -> Result<Option<SnapshotRecord>> {
        self.with(|c| {
            c.query_row(
                "SELECT * FROM snapshots WHERE id = ?1 OR name = ?1",
                [id_or_name],
                snapshot_from_row,
            )
            .optional()
        })
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        self.with(|c| {
            let mut st = c.prepare("SELECT * FROM snapshots ORDER BY created_at_ms, id")?;
            let rows = st.query_map([], snapshot_from_row)?;
            rows.collect()
        })
    }

    pub fn delete_snapshot(&self, id: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM snapshots WHERE id = ?1", [id]))?;
        Ok(())
    }

    /// Every layer digest a sandbox, snapshot, template or build-cache entry still uses (roots that
    /// are layers included).
    pub fn layers_in_use(&self) -> Result<std::collections::HashSet<String>> {
        self.with(|c| {
            let mut out = std::collections::HashSet::new();
            for table in ["sandboxes", "snapshots", "templates"] {
                let mut st = c.prepare(&format!("SELECT layers, root FROM {table}"))?;
                let rows = st.query_map([], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
                })?;
                for row in rows {
                    let (layers, root) = row?;
                    let v: Vec<String> = parse_json(&layers)?;
                    out.extend(v);
                    out.extend(root.filter(|r| r.starts_with("sha256:")));
                }
            }
            let mut st = c.prepare("SELECT layer FROM build_cache WHERE layer IS NOT NULL")?;
            for l in st.query_map([], |r| r.get::<_, String>(0))? {
                out.insert(l?);
            }
            Ok(out)
        })
    }

    /// Number of sandboxes, snapshots and templates standing on a template.
    pub fn template_users(&self, name: &str) -> Result<u64> {
        let root = format!("template:{name}");
        self.with(|c| {
            c.query_row(
                "SELECT (SELECT COUNT(*) FROM sandboxes WHERE template = ?1 OR root = ?2)
                      + (SELECT COUNT(*) FROM snapshots WHERE template = ?1 OR root = ?2)
                      + (SELECT COUNT(*) FROM templates WHERE root = ?2)",
                params![name, root],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| n as u64)
    }

    pub fn upsert_build(&self, b: &BuildRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO builds (id, template, status, started_at_ms, finished_at_ms, spec, steps, error, failed_step)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                 ON CONFLICT(id) DO UPDATE SET status = ?3, finished_at_ms = ?5, steps = ?7, error = ?8,
                     failed_step = ?9",
                params![
                    b.id,
                    b.template,
                    enum_str(&b.status),
                    b.started_at_ms,
                    b.finished_at_ms,
                    serde_json::to_string(&b.spec).unwrap_or_else(|_| "{}".into()),
                    serde_json::to_string(&b.steps).unwrap_or_else(|_| "[]".into()),
                    b.error,
                    b.failed_step.map(i64::from),
                ],
            )
        })?;
        Ok(())
    }

    pub fn get_build(&self, id: &str) -> Result<Option<BuildRecord>> {
        self.with(|c| {
            c.query_row("SELECT * FROM builds WHERE id = ?1", [id], build_from_row)
                .optional()
        })
    }

    /// Builds, newest first (of one template when given).
    pub fn list_builds(&self, template: Option<&str>, limit: u32) -> Result<Vec<BuildRecord>> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT * FROM builds WHERE ?1 IS NULL OR template = ?1
                 ORDER BY started_at_ms DESC, id LIMIT ?2",
            )?;
            let rows = st.query_map(params![template, limit], build_from_row)?;
            rows.collect()
        })
    }

    /// Removes finished builds beyond the newest `keep`; returns their ids (their logs go too).
    pub fn prune_builds(&self, keep: u32) -> Result<Vec<String>> {
        self.with(|c| {
            let mut st = c.prepare(
                "DELETE FROM builds WHERE status != 'running' AND id NOT IN
                    (SELECT id FROM builds ORDER BY started_at_ms DESC LIMIT ?1)
                 RETURNING id",
            )?;
            let rows = st.query_map([keep], |r| r.get(0))?;
            rows.collect()
        })
    }

    /// A build-cache entry: Some(layer) for a step that made one, Some(None) for one that changed no
    /// file. Marks it used.
    pub fn cache_get(&self, key: &str, now_ms: i64) -> Result<Option<Option<(String, u64)>>> {
        self.with(|c| {
            let hit = c
                .query_row(
                    "UPDATE build_cache SET used_at_ms = ?2 WHERE key = ?1 RETURNING layer, size_bytes",
                    params![key, now_ms],
                    |r| {
                        Ok(r.get::<_, Option<String>>(0)?
                            .map(|l| (l, r.get::<_, i64>(1).unwrap_or(0) as u64)))
                    },
                )
                .optional()?;
            Ok(hit)
        })
    }

    pub fn cache_put(&self, key: &str, layer: Option<&str>, size: u64, now_ms: i64) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO build_cache (key, layer, size_bytes, created_at_ms, used_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?4)
                 ON CONFLICT(key) DO UPDATE SET layer = ?2, size_bytes = ?3, used_at_ms = ?4",
                params![key, layer, size as i64, now_ms],
            )
        })?;
        Ok(())
    }

    pub fn cache_delete(&self, key: &str) -> Result<()> {
        self.with(|c| c.execute("DELETE FROM build_cache WHERE key = ?1", [key]))?;
        Ok(())
    }

    /// Empties the build cache; returns how many entries it had.
    pub fn cache_clear(&self) -> Result<u64> {
        self.with(|c| c.execute("DELETE FROM build_cache", []))
            .map(|n| n as u64)
    }

    /// Entries of the build cache and the bytes of their layers (each layer once).
    pub fn cache_usage(&self) -> Result<(u64, u64)> {
        self.with(|c| {
            c.query_row(
                "SELECT COUNT(*), (SELECT COALESCE(SUM(size_bytes), 0) FROM
                     (SELECT DISTINCT layer, size_bytes FROM build_cache WHERE layer IS NOT NULL))
                 FROM build_cache",
                [],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template: "base".into(),
            isolation: Isolation::Container,
            state: SandboxState::Starting,
            created_at_ms: 1,
            expires_at_ms: 100,
            metadata: [("k".to_string(), "v".to_string())].into(),
            env: BTreeMap::new(),
            cpu: 1.0,
            memory_mb: 512,
            hostname: "h".into(),
            slot: 0,
            tier_state: None,
            pooled: false,
            limits: moat_api::SandboxLimits {
                pids: 64,
                ..Default::default()
            },
            last_active_ms: 0,
            layers: Vec::new(),
            snapshot: None,
            on_timeout: moat_api::OnTimeout::Kill,
            network: None,
            access_token: "t".into(),
            public_traffic: false,
            auto_resume: false,
            root: None,
            runtime: Default::default(),
        }
    }

    #[test]
    fn slots_are_reused_and_bounded() {
        let db = Db::open_in_memory().unwrap();
        let mut a = rec("a");
        let mut b = rec("b");
        db.insert_sandbox(&mut a, 2).unwrap();
        db.insert_sandbox(&mut b, 2).unwrap();
        assert_eq!((a.slot, b.slot), (0, 1));
        assert!(db.insert_sandbox(&mut rec("c"), 2).is_err());
        db.delete_sandbox("a").unwrap();
        let mut c = rec("c");
        db.insert_sandbox(&mut c, 2).unwrap();
        assert_eq!(c.slot, 0);
    }

    #[test]
    fn freed_slots_are_not_reused_at_once() {
        let db = Db::open_in_memory().unwrap();
        let mut a = rec("a");
        db.insert_sandbox(&mut a, 8).unwrap();
        db.delete_sandbox("a").unwrap();
        let mut b = rec("b");
        db.insert_sandbox(&mut b, 8).unwrap();
        assert_eq!((a.slot, b.slot), (0, 1));
    }

    #[test]
    fn claim_takes_a_pooled_sandbox_once() {
        let db = Db::open_in_memory().unwrap();
        let mut p = rec("p");
        p.pooled = true;
        p.state = SandboxState::Running;
        db.insert_sandbox(&mut p, 8).unwrap();
        assert_eq!(db.pooled_count("base").unwrap(), 1);
        let claim = Claim {
            template: "base".into(),
            created_at_ms: 5,
            expires_at_ms: 50,
            metadata: [("a".to_string(), "b".to_string())].into(),
            env: BTreeMap::new(),
            cpu: 0.5,
            memory_mb: 128,
            limits: moat_api::SandboxLimits::default(),
            on_timeout: moat_api::OnTimeout::Pause,
            network: None,
            public_traffic: true,
            auto_resume: true,
        };
        assert!(db
            .claim_pooled(&Claim {
                template: "other".into(),
                ..claim.clone()
            })
            .unwrap()
            .is_none());
        let got = db.claim_pooled(&claim).unwrap().unwrap();
        assert_eq!(
            (got.id.as_str(), got.pooled, got.cpu, got.expires_at_ms),
            ("p", false, 0.5, 50)
        );
        assert!(db.claim_pooled(&claim).unwrap().is_none());
        assert_eq!(db.pooled_count("base").unwrap(), 0);
    }

    #[test]
    fn round_trip_and_expiry() {
        let db = Db::open_in_memory().unwrap();
        let mut a = rec("a");
        db.insert_sandbox(&mut a, 8).unwrap();
        db.set_tier_state("a", SandboxState::Running, &serde_json::json!({"pid": 5}))
            .unwrap();
        let got = db.get_sandbox("a").unwrap().unwrap();
        assert_eq!(got.state, SandboxState::Running);
        assert_eq!(got.tier_state, Some(serde_json::json!({"pid": 5})));
        assert_eq!(got.metadata.get("k").map(String::as_str), Some("v"));
        assert_eq!((got.limits.pids, got.limits.memory_mb), (64, 512));
        assert_eq!(db.expired(99).unwrap(), Vec::<String>::new());
        assert_eq!(db.expired(100).unwrap(), vec!["a".to_string()]);
        db.set_expiry("a", 500).unwrap();
        assert!(db.expired(100).unwrap().is_empty());
    }

    #[test]
    fn reopen_keeps_state() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.db");
        {
            let db = Db::open(&p).unwrap();
            db.insert_sandbox(&mut rec("a"), 8).unwrap();
        }
        let db = Db::open(&p).unwrap();
        assert_eq!(db.list_sandboxes().unwrap().len(), 1);
    }

    #[test]
    fn a_full_disk_gives_up_the_reserve_and_the_write_happens() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root (a tmpfs of its own)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=4m"),
        )
        .unwrap();
        let unmount = scopeguard(dir.path().to_path_buf());
        let p = dir.path().join("m.db");
        let db = Db::open(&p).unwrap();
        assert!(db.keep_reserve(1 << 20).unwrap());
        assert!(!db.keep_reserve(1 << 20).unwrap(), "made twice");
        // Something else takes every byte left.
        let mut filler = std::fs::File::create(dir.path().join("filler")).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while std::io::Write::write_all(&mut filler, &chunk).is_ok() {}
        drop(filler);
        let mut r = rec("full");
        r.metadata = (0..64)
            .map(|i| (format!("k{i}"), "v".repeat(4000)))
            .collect();
        db.insert_sandbox(&mut r, 8).unwrap();
        assert!(!p.with_extension("db.reserve").exists(), "reserve kept");
        assert_eq!(db.get_sandbox("full").unwrap().unwrap().metadata.len(), 64);
        // With neither room nor reserve, the error says the disk is full.
        let mut big = rec("big");
        big.metadata = (0..512)
            .map(|i| (format!("k{i}"), "v".repeat(4000)))
            .collect();
        let e = db.insert_sandbox(&mut big, 8).unwrap_err();
        assert!(e.is_disk_full(), "{e}");
        // Room again: the reserve is made again.
        std::fs::remove_file(dir.path().join("filler")).unwrap();
        assert!(db.keep_reserve(1 << 20).unwrap());
        drop(db);
        drop(unmount);
    }

    /// Unmounts the test's tmpfs when dropped.
    fn scopeguard(dir: std::path::PathBuf) -> impl Drop {
        struct Unmount(std::path::PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        Unmount(dir)
    }
}
