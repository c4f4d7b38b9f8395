//! The lifecycle's logic on test doubles: a fake tier whose instances live in memory, each with an
//! in-process fake agent, over an in-memory store. No root, no namespaces, no guest kernel: what
//! is checked is the lifecycle's own work — what it asks the tier and the agent, what it records,
//! and that a failure at any step leaves nothing behind.

use std::sync::Arc;
use std::time::Duration;

use moat_api::protocol::Route;
use moat_api::{
    CreateSandboxRequest, Isolation, OnTimeout, Reason, ResumeRequest, SandboxState, StartSpec,
    TemplateConfig, TemplateSource, TemplateStatus,
};

use super::{ListFilter, Services, Settings};
use crate::clock::now_ms;
use crate::db::{Db, TemplateRecord};
use crate::error::Error;
use crate::layers::LayerStore;
use crate::template::store::TemplateStore;
use crate::tier::fake::{FakeTier, TierFaults};
use crate::tier::{IsolationTier, TierCapabilities};

struct World {
    dir: tempfile::TempDir,
    db: Arc<Db>,
    tier: FakeTier,
    s: Services,
}

/// A ready template `name` (its root filesystem an empty directory) with `config`.
fn template(db: &Db, dir: &std::path::Path, name: &str, config: TemplateConfig) {
    let store = TemplateStore::new(dir).unwrap();
    std::fs::create_dir_all(store.rootfs(name)).unwrap();
    let mut t = TemplateRecord::plain(name, TemplateSource::Directory, TemplateStatus::Ready);
    t.config = config;
    db.upsert_template(&t).unwrap();
}

fn settings(dir: &std::path::Path, pool_size: u32) -> Settings {
    let mut s = Settings::with_defaults(dir.to_path_buf());
    s.pool_size = pool_size;
    s.agent_timeout = Duration::from_millis(300);
    s
}

/// The lifecycle over `db` and `tier`, as a daemon (re)started on them would have it.
fn services(dir: &std::path::Path, db: &Arc<Db>, tier: &FakeTier, pool_size: u32) -> Services {
    Services::new(
        settings(dir, pool_size),
        db.clone(),
        Arc::new(TemplateStore::new(dir).unwrap()),
        Arc::new(LayerStore::new(dir.join("layers")).unwrap()),
        vec![Arc::new(tier.clone()) as Arc<dyn IsolationTier>],
        Arc::new(crate::secrets::Vault::new(dir, db.clone())),
    )
}

fn world_with(pool_size: u32, tier: FakeTier) -> World {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(Db::open_in_memory().unwrap());
    template(&db, dir.path(), "base", TemplateConfig::default());
    let s = services(dir.path(), &db, &tier, pool_size);
    World { dir, db, tier, s }
}

fn world() -> World {
    world_with(0, FakeTier::new(Isolation::Container))
}

fn rows(db: &Db) -> Vec<String> {
    db.list_sandboxes()
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// Waits (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn create_starts_an_instance_configures_its_agent_and_records_it_running() {
    let w = world();
    let req = CreateSandboxRequest {
        env: [("GREETING".to_string(), "hi".to_string())].into(),
        metadata: [("task".to_string(), "t1".to_string())].into(),
        memory_mb: Some(256),
        ..Default::default()
    };
    let sbx = w.s.sandboxes.create(req).await.unwrap();
    assert_eq!(sbx.state, SandboxState::Running);
    assert_eq!(sbx.metadata["task"], "t1");
    assert_eq!(sbx.limits.memory_mb, 256);
    assert_eq!(w.tier.live(), std::slice::from_ref(&sbx.id));
    let inst = w.tier.instance(&sbx.id).unwrap();
    // The environment goes in with the instance; the agent gets the per-process limits.
    assert_eq!(inst.spec.env["GREETING"], "hi");
    assert_eq!(inst.spec.limits.memory_mb, 256);
    let config = inst.agent.config().unwrap();
    assert_eq!(config.nofile, Some(4096));
    assert_eq!(
        config.oom_counter.as_deref(),
        Some("/run/moat/memory.events")
    );
    assert_eq!(inst.agent.routes()[..2], [Route::Health, Route::Configure]);
    let rec = w.db.get_sandbox(&sbx.id).unwrap().unwrap();
    assert_eq!(rec.state, SandboxState::Running);
    assert!(rec.tier_state.is_some());
    // Its agent answers through the lifecycle.
    let agent = w.s.sandboxes.agent(&sbx.id).await.unwrap();
    assert!(agent.processes().await.unwrap().processes.is_empty());
    assert_eq!(w.s.sandboxes.get(&sbx.id).unwrap().id, sbx.id);
    assert_eq!(w.s.sandboxes.list(&ListFilter::default()).unwrap().len(), 1);
}

#[tokio::test]
async fn a_template_start_command_runs_in_every_new_sandbox() {
    let w = world();
    let start = StartSpec {
        cmd: "python3 -m http.server".into(),
        ready: None,
        timeout: 5,
    };
    template(
        &w.db,
        w.dir.path(),
        "web",
        TemplateConfig {
            start: Some(start),
            user: Some("app".into()),
            ..Default::default()
        },
    );
    let sbx =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                template: Some("web".into()),
                ..Default::default()
            })
            .await
            .unwrap();
    let agent = w.tier.instance(&sbx.id).unwrap().agent;
    assert_eq!(agent.config().unwrap().user.as_deref(), Some("app"));
    let started = agent
        .calls()
        .into_iter()
        .find(|c| c.route == Route::StartProcess)
        .expect("the start command");
    let req: moat_api::StartProcessRequest = serde_json::from_slice(&started.body).unwrap();
    assert_eq!(req.tag.as_deref(), Some("start"));
    assert_eq!(req.command.as_deref(), Some("python3 -m http.server"));
}

/// A create that fails at `faults` (with `template`) removes what it made: no row, no instance.
async fn failed_create_leaves_nothing(faults: TierFaults, template_name: &str, expect: &str) {
    let w = world();
    template(
        &w.db,
        w.dir.path(),
        "web",
        TemplateConfig {
            start: Some(StartSpec {
                cmd: "serve".into(),
                ready: Some(moat_api::ReadyCheck::File("/ready".into())),
                timeout: 5,
            }),
            ..Default::default()
        },
    );
    w.tier.set_faults(faults);
    let err =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                template: Some(template_name.into()),
                ..Default::default()
            })
            .await
            .unwrap_err();
    assert!(matches!(err, Error::Internal(_)), "{err:?}");
    assert!(err.to_string().contains(expect), "{err}");
    assert!(rows(&w.db).is_empty(), "a row was left: {:?}", rows(&w.db));
    assert!(w.tier.live().is_empty(), "an instance was left");
    assert!(
        w.tier.log().iter().any(|l| l.starts_with("destroy ")),
        "{:?}",
        w.tier.log()
    );
}

#[tokio::test]
async fn a_create_that_fails_in_the_tier_leaves_nothing() {
    let faults = TierFaults {
        create: true,
        ..Default::default()
    };
    failed_create_leaves_nothing(faults, "base", "told to fail creates").await;
}

#[tokio::test]
async fn a_create_whose_agent_never_answers_leaves_nothing() {
    let faults = TierFaults {
        agent_not_ready: true,
        ..Default::default()
    };
    failed_create_leaves_nothing(faults, "base", "not ready").await;
}

#[tokio::test]
async fn a_create_whose_agent_refuses_its_configuration_leaves_nothing() {
    let faults = TierFaults {
        agent_refuses_config: true,
        ..Default::default()
    };
    failed_create_leaves_nothing(faults, "base", "configuration refused").await;
}

#[tokio::test]
async fn a_create_whose_start_command_fails_leaves_nothing() {
    let faults = TierFaults {
        failing_tag: Some("start".into()),
        ..Default::default()
    };
    failed_create_leaves_nothing(faults, "web", "before the sandbox was ready").await;
}

#[tokio::test]
async fn bad_requests_are_refused_before_anything_is_made() {
    let w = world();
    let cases = [
        (
            CreateSandboxRequest {
                timeout: Some(0),
                ..Default::default()
            },
            "timeout",
        ),
        (
            CreateSandboxRequest {
                pids: Some(1),
                ..Default::default()
            },
            "pids",
        ),
        (
            CreateSandboxRequest {
                template: Some("no-such".into()),
                ..Default::default()
            },
            "template",
        ),
        (
            CreateSandboxRequest {
                network: Some(Default::default()),
                ..Default::default()
            },
            "network",
        ),
    ];
    for (req, field) in cases {
        let err = w.s.sandboxes.create(req).await.unwrap_err();
        assert_eq!(err.field(), Some(field), "{err:?}");
        assert!(
            matches!(err, Error::Invalid { .. } | Error::NotFound { .. }),
            "{err:?}"
        );
    }
    assert!(w.tier.log().is_empty(), "{:?}", w.tier.log());
    let missing =
        w.s.sandboxes
            .get("sbx_aaaaaaaaaaaaaaaaaaaaaaaaaa")
            .unwrap_err();
    assert!(matches!(missing, Error::NotFound { ref field, .. } if field == "id"));
}

#[tokio::test]
async fn the_warm_pool_fills_serves_creates_that_fit_and_refills() {
    let w = world_with(2, FakeTier::new(Isolation::Container));
    tokio::spawn(w.s.pool.clone().run());
    eventually("two pooled sandboxes", || {
        w.s.pool.info().is_some_and(|p| p.ready == 2)
    })
    .await;
    let pooled = w.tier.live();
    assert_eq!(pooled.len(), 2);
    // Pooled sandboxes are nobody's: not listed.
    assert!(w
        .s
        .sandboxes
        .list(&ListFilter::default())
        .unwrap()
        .is_empty());

    let sbx =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                env: [("K".to_string(), "v".to_string())].into(),
                ..Default::default()
            })
            .await
            .unwrap();
    assert!(pooled.contains(&sbx.id), "not a pooled sandbox: {}", sbx.id);
    let agent = w.tier.instance(&sbx.id).unwrap().agent;
    // The creator's environment reaches the agent; its limits are the defaults, so the agent's
    // configuration is the one it booted with.
    assert_eq!(agent.env()["K"], "v");
    assert_eq!(
        agent
            .routes()
            .iter()
            .filter(|r| **r == Route::Configure)
            .count(),
        1
    );
    eventually("the pool refilled", || w.tier.live().len() == 3).await;

    // Other limits the tier can change: still pooled, with the new limits set.
    let bigger =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                memory_mb: Some(1024),
                ..Default::default()
            })
            .await
            .unwrap();
    let inst = w.tier.instance(&bigger.id).unwrap();
    assert_eq!(inst.limits.memory_mb, 1024);
    assert!(w.tier.log().contains(&format!("set_limits {}", bigger.id)));
    // A /tmp of its own cannot be given to a started sandbox: a new one is started for it.
    let creates_before = w
        .tier
        .log()
        .iter()
        .filter(|l| l.starts_with("create"))
        .count();
    let own =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                tmp_mb: Some(64),
                ..Default::default()
            })
            .await
            .unwrap();
    assert_eq!(w.tier.instance(&own.id).unwrap().spec.limits.tmp_mb, 64);
    assert!(
        w.tier
            .log()
            .iter()
            .filter(|l| l.starts_with("create"))
            .count()
            > creates_before,
        "no new instance for a create the pool cannot serve"
    );

    // Draining removes the pooled ones and stops the refill until resumed.
    w.s.pool.drain("base").await.unwrap();
    assert_eq!(w.s.pool.info().unwrap().ready, 0);
    assert_eq!(w.tier.live().len(), 3);
}

#[tokio::test]
async fn a_tier_with_limits_fixed_at_start_gets_its_own_instance_for_other_limits() {
    let tier = FakeTier::new(Isolation::Container).with_capabilities(TierCapabilities {
        limits_fixed_at_start: true,
        ..Default::default()
    });
    let w = world_with(1, tier);
    tokio::spawn(w.s.pool.clone().run());
    eventually("one pooled sandbox", || {
        w.s.pool.info().is_some_and(|p| p.ready == 1)
    })
    .await;
    let pooled = w.tier.live();
    let sbx =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                memory_mb: Some(1024),
                ..Default::default()
            })
            .await
            .unwrap();
    assert!(!pooled.contains(&sbx.id));
    assert!(!w.tier.log().iter().any(|l| l.starts_with("set_limits")));
}

#[tokio::test]
async fn expiry_deletes_or_pauses_as_the_sandbox_asked() {
    let w = world();
    let killed = w.s.sandboxes.create(Default::default()).await.unwrap();
    let paused =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                on_timeout: Some(OnTimeout::Pause),
                ..Default::default()
            })
            .await
            .unwrap();
    let idle =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                idle_timeout: Some(1),
                ..Default::default()
            })
            .await
            .unwrap();
    let kept = w.s.sandboxes.create(Default::default()).await.unwrap();
    let mut ends = w.s.sandboxes.ends();
    // Nothing is due yet.
    w.s.reaper.expire().await;
    assert_eq!(w.tier.live().len(), 4);

    let past = now_ms() - 1;
    w.db.set_expiry(&killed.id, past).unwrap();
    w.db.set_expiry(&paused.id, past).unwrap();
    w.db.touch(&idle.id, now_ms() - 2000).unwrap();
    w.s.reaper.expire().await;
    assert!(w.db.get_sandbox(&killed.id).unwrap().is_none());
    assert!(w.db.get_sandbox(&idle.id).unwrap().is_none());
    assert_eq!(
        w.s.sandboxes.get(&paused.id).unwrap().state,
        SandboxState::Paused
    );
    assert!(w.tier.instance(&paused.id).unwrap().paused);
    assert_eq!(w.tier.live(), {
        let mut v = vec![paused.id.clone(), kept.id.clone()];
        v.sort();
        v
    });
    // Each end is told with its reason; a pause is no end.
    let mut told = [ends.try_recv().unwrap(), ends.try_recv().unwrap()];
    told.sort_by_key(|e| e.reason.as_str());
    assert_eq!(
        told.iter()
            .map(|e| (e.id.as_str(), e.reason))
            .collect::<Vec<_>>(),
        [
            (idle.id.as_str(), Reason::Idle),
            (killed.id.as_str(), Reason::Timeout)
        ]
    );
    assert!(ends.try_recv().is_err());
    // What each was is kept with why it ended: `state: ended` in a look-up, listed as ended, and
    // every other call's 404 says why.
    for (id, reason) in [(&killed.id, Reason::Timeout), (&idle.id, Reason::Idle)] {
        let s = w.s.sandboxes.inspect(id).await.unwrap();
        assert_eq!(s.state, SandboxState::Ended);
        let end = s.ended.unwrap();
        assert_eq!(end.reason, reason);
        assert!(!end.at.is_empty());
        match w.s.sandboxes.get(id) {
            Err(Error::NotFound { message, .. }) => {
                assert!(
                    message.contains(&format!("({})", reason.as_str())),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
    let ended =
        w.s.sandboxes
            .list(&ListFilter {
                state: Some(SandboxState::Ended),
                ..Default::default()
            })
            .unwrap();
    assert_eq!(ended.len(), 2);
    assert!(w
        .s
        .sandboxes
        .list(&ListFilter::default())
        .unwrap()
        .iter()
        .all(|s| s.state != SandboxState::Ended));
}

#[tokio::test]
async fn a_sandbox_smaller_than_its_tier_can_start_is_refused_naming_memory_mb() {
    // As the microvm tier says of itself (its guest needs the memory to boot).
    let tier = FakeTier::new(Isolation::Container).with_capabilities(TierCapabilities {
        min_memory_mb: 128,
        ..Default::default()
    });
    let w = world_with(0, tier);
    let r =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                memory_mb: Some(64),
                ..Default::default()
            })
            .await;
    assert!(
        matches!(&r, Err(Error::Invalid { field, message }) if field == "memory_mb" && message.contains("at least 128")),
        "{r:?}"
    );
}

#[tokio::test]
async fn idle_means_no_request_no_open_connection_and_no_command_running() {
    let w = world();
    let sbx =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                idle_timeout: Some(1),
                on_timeout: Some(OnTimeout::Pause),
                ..Default::default()
            })
            .await
            .unwrap();
    let idle_since = || w.db.touch(&sbx.id, now_ms() - 2000).unwrap();
    let state = || w.s.sandboxes.get(&sbx.id).unwrap().state;
    // A connection to one of its ports is open: not idle (and its idle clock restarts).
    let hold = w.s.sandboxes.hold(&sbx.id);
    idle_since();
    w.s.reaper.expire().await;
    assert_eq!(state(), SandboxState::Running);
    assert!(w.db.get_sandbox(&sbx.id).unwrap().unwrap().last_active_ms > now_ms() - 1000);
    drop(hold);
    // A command of its own runs: not idle.
    let agent = w.s.sandboxes.agent(&sbx.id).await.unwrap();
    agent
        .start_background(&moat_api::StartProcessRequest {
            command: Some("sleep 100".into()),
            background: true,
            ..Default::default()
        })
        .await
        .unwrap();
    idle_since();
    w.s.reaper.expire().await;
    assert_eq!(state(), SandboxState::Running);
}

#[tokio::test]
async fn auto_resume_resumes_a_paused_sandbox_for_a_request_and_only_then() {
    let w = world();
    let sbx =
        w.s.sandboxes
            .create(CreateSandboxRequest {
                auto_resume: Some(true),
                on_timeout: Some(moat_api::OnTimeout::Pause),
                ..Default::default()
            })
            .await
            .unwrap();
    assert!(sbx.auto_resume);
    // Paused at its timeout, as asked.
    w.db.set_expiry(&sbx.id, now_ms() - 1).unwrap();
    w.s.reaper.expire().await;
    assert_eq!(
        w.s.sandboxes.get(&sbx.id).unwrap().state,
        SandboxState::Paused
    );
    // Listing and reading it does not wake it; a request into it does, with a new timeout.
    let _ = w.s.sandboxes.list(&Default::default()).unwrap();
    assert!(w.tier.instance(&sbx.id).unwrap().paused);
    w.s.sandboxes.agent(&sbx.id).await.unwrap();
    assert!(!w.tier.instance(&sbx.id).unwrap().paused);
    let rec = w.db.get_sandbox(&sbx.id).unwrap().unwrap();
    assert_eq!(rec.state, SandboxState::Running);
    assert!(rec.expires_at_ms > now_ms());
    // Two requests at once on a paused sandbox: one resumes it, both get the agent.
    w.s.sandboxes.pause(&sbx.id).await.unwrap();
    let (a, b) = tokio::join!(w.s.sandboxes.agent(&sbx.id), w.s.sandboxes.agent(&sbx.id));
    a.unwrap();
    b.unwrap();
    assert!(!w.tier.instance(&sbx.id).unwrap().paused);
}

#[tokio::test]
async fn pause_freezes_refuses_the_agent_and_resume_restarts_the_clock() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    let r = w.s.sandboxes.pause(&sbx.id).await.unwrap();
    assert!(r.processes_kept);
    assert_eq!(r.sandbox.state, SandboxState::Paused);
    assert!(w.tier.instance(&sbx.id).unwrap().paused);
    assert!(matches!(
        w.s.sandboxes.agent(&sbx.id).await,
        Err(Error::Conflict(m)) if m.contains("paused")
    ));
    assert!(matches!(
        w.s.sandboxes.pause(&sbx.id).await,
        Err(Error::Conflict(_))
    ));
    w.db.set_expiry(&sbx.id, now_ms() - 1).unwrap();
    let r =
        w.s.sandboxes
            .resume(&sbx.id, ResumeRequest { timeout: Some(600) })
            .await
            .unwrap();
    assert_eq!(r.sandbox.state, SandboxState::Running);
    assert!(!w.tier.instance(&sbx.id).unwrap().paused);
    let rec = w.db.get_sandbox(&sbx.id).unwrap().unwrap();
    assert!(
        rec.expires_at_ms > now_ms() + 500_000,
        "the timeout restarts"
    );
    assert!(matches!(
        w.s.sandboxes
            .resume(&sbx.id, ResumeRequest::default())
            .await,
        Err(Error::Conflict(_))
    ));
}

#[tokio::test]
async fn a_restarted_daemon_readopts_live_sandboxes_and_removes_the_rest() {
    let w = world();
    let alive = w.s.sandboxes.create(Default::default()).await.unwrap();
    let dead = w.s.sandboxes.create(Default::default()).await.unwrap();
    let paused = w.s.sandboxes.create(Default::default()).await.unwrap();
    w.s.sandboxes.pause(&paused.id).await.unwrap();
    // What a crash leaves: a half-created sandbox (its row still `starting`)...
    let half = w.s.sandboxes.create(Default::default()).await.unwrap();
    w.db.set_state(&half.id, SandboxState::Starting).unwrap();
    // ...an instance on the host no row owns, and sandboxes whose processes died with the host.
    w.tier.leave_leftover("sbx_leftoverleftoverleftover22");
    w.tier.kill(&dead.id);
    w.tier.kill(&paused.id);

    // The daemon starts again over the same store and host: nothing in memory survives.
    let again = services(w.dir.path(), &w.db, &w.tier, 0);
    again.recover().await.unwrap();
    // Its reaper's first scan finds nothing more to remove.
    again.reaper.remove_dead().await;

    // Re-adopted: usable through a new agent connection.
    let agent = again.sandboxes.agent(&alive.id).await.unwrap();
    agent.processes().await.unwrap();
    assert_eq!(
        again.sandboxes.get(&alive.id).unwrap().state,
        SandboxState::Running
    );
    // Gone: the dead one, the half-created one, the leftover.
    assert!(w.db.get_sandbox(&dead.id).unwrap().is_none());
    assert!(w.db.get_sandbox(&half.id).unwrap().is_none());
    assert!(w.tier.instance(&half.id).is_none());
    assert!(w
        .tier
        .log()
        .contains(&"destroy sbx_leftoverleftoverleftover22".to_string()));
    // Kept with its files: the paused one whose processes ended; a resume starts it over them.
    let rec = w.db.get_sandbox(&paused.id).unwrap().unwrap();
    assert_eq!(rec.state, SandboxState::Paused);
    assert!(rec.tier_state.as_ref().is_none_or(|v| v.is_null()));
    assert!(w.tier.log().contains(&format!("release {}", paused.id)));
    let r = again
        .sandboxes
        .resume(&paused.id, ResumeRequest::default())
        .await
        .unwrap();
    assert!(!r.processes_kept);
    assert!(w.tier.instance(&paused.id).unwrap().spec.keep_files);
    assert_eq!(w.tier.live(), {
        let mut v = vec![alive.id.clone(), paused.id.clone()];
        v.sort();
        v
    });
}

#[tokio::test]
async fn a_sandbox_whose_pid_1_died_is_removed() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    // Its PID 1 dies behind the daemon's back: the reaper removes it, row and all, and says why.
    let mut ends = w.s.sandboxes.ends();
    w.tier.kill(&sbx.id);
    w.s.reaper.remove_dead().await;
    assert!(w.db.get_sandbox(&sbx.id).unwrap().is_none());
    let end = ends.try_recv().unwrap();
    assert_eq!(
        (end.id.as_str(), end.reason),
        (sbx.id.as_str(), Reason::AgentLost)
    );
    assert!(matches!(
        w.s.sandboxes.delete(&sbx.id).await,
        Err(Error::NotFound { .. })
    ));
    assert_eq!(
        w.s.sandboxes
            .inspect(&sbx.id)
            .await
            .unwrap()
            .ended
            .unwrap()
            .reason,
        Reason::AgentLost
    );
}

#[tokio::test]
async fn a_deleted_sandbox_is_not_found_and_leaves_no_record_of_an_end() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    w.s.sandboxes.delete(&sbx.id).await.unwrap();
    assert!(matches!(
        w.s.sandboxes.inspect(&sbx.id).await,
        Err(Error::NotFound { .. })
    ));
}

#[tokio::test]
async fn the_kernels_notes_become_conditions_of_the_sandbox_they_name() {
    use crate::host::kmsg::{KernelEvent, KernelNote};
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    let other = w.s.sandboxes.create(Default::default()).await.unwrap();
    let core = w.s.sandboxes.core();
    for _ in 0..2 {
        core.kernel_note(&KernelNote {
            cgroup: format!("/moat/{}", sbx.id),
            event: KernelEvent::OomKill {
                task: "python3".into(),
                pid: 4242,
            },
        });
    }
    core.kernel_note(&KernelNote {
        cgroup: format!("/moat-1a2b3c4d/{}", sbx.id),
        event: KernelEvent::ForkRejected,
    });
    // A cgroup of no sandbox of this daemon: nothing.
    core.kernel_note(&KernelNote {
        cgroup: format!("/moat/{}", crate::ids::new_sandbox_id()),
        event: KernelEvent::ForkRejected,
    });
    let got = w.s.sandboxes.inspect(&sbx.id).await.unwrap().conditions;
    assert_eq!(
        got.iter()
            .map(|c| (c.reason, c.count, c.process.clone()))
            .collect::<Vec<_>>(),
        [
            (Reason::Oom, 2, Some("4242 (python3)".to_string())),
            (Reason::PidsExhausted, 1, None)
        ]
    );
    assert!(
        got[0].message.contains("4242 (python3)"),
        "{}",
        got[0].message
    );
    assert!(w
        .s
        .sandboxes
        .inspect(&other.id)
        .await
        .unwrap()
        .conditions
        .is_empty());
    // They go with the sandbox.
    w.s.sandboxes.delete(&sbx.id).await.unwrap();
    assert!(w.db.conditions(&sbx.id).unwrap().is_empty());
}

#[tokio::test]
async fn an_idempotent_create_retried_returns_the_first_sandbox() {
    let w = world();
    let req = CreateSandboxRequest {
        metadata: [("task".to_string(), "a".to_string())].into(),
        ..Default::default()
    };
    let (first, replayed) =
        w.s.sandboxes
            .create_once("key-1", req.clone())
            .await
            .unwrap();
    assert!(!replayed);
    let (again, replayed) =
        w.s.sandboxes
            .create_once("key-1", req.clone())
            .await
            .unwrap();
    assert!(replayed);
    assert_eq!(again.id, first.id);
    assert_eq!(rows(&w.db), vec![first.id.clone()]);
    // Another request under the key: refused, nothing made.
    let other = CreateSandboxRequest {
        metadata: [("task".to_string(), "b".to_string())].into(),
        ..Default::default()
    };
    assert!(matches!(
        w.s.sandboxes.create_once("key-1", other.clone()).await,
        Err(Error::Unprocessable(_))
    ));
    assert_eq!(rows(&w.db).len(), 1);
    // Retries at the same time make one sandbox between them.
    let (a, b) = tokio::join!(
        w.s.sandboxes.create_once("key-2", other.clone()),
        w.s.sandboxes.create_once("key-2", other.clone())
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.0.id, b.0.id);
    assert!(a.1 != b.1, "one made it, the other was replayed");
    assert_eq!(rows(&w.db).len(), 2);
    // Once its sandbox is deleted, the key says so rather than making another.
    w.s.sandboxes.delete(&first.id).await.unwrap();
    assert!(matches!(
        w.s.sandboxes.create_once("key-1", req).await,
        Err(Error::Conflict(m)) if m.contains(&first.id)
    ));
    // Once its sandbox has ended without a request, a replay says so, and why, rather than
    // answering 201 with a sandbox that cannot be used.
    w.db.set_expiry(&a.0.id, now_ms() - 1).unwrap();
    w.s.reaper.expire().await;
    assert!(matches!(
        w.s.sandboxes.create_once("key-2", other).await,
        Err(Error::Conflict(m)) if m.contains(&a.0.id) && m.contains("(timeout)")
    ));
    assert_eq!(rows(&w.db).len(), 0);
    assert!(matches!(
        w.s.sandboxes.create_once("bad key", Default::default()).await,
        Err(Error::Invalid { field, .. }) if field == "Idempotency-Key"
    ));
}

#[tokio::test]
async fn delete_removes_the_instance_and_the_row() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    w.s.sandboxes.delete(&sbx.id).await.unwrap();
    assert!(w.tier.live().is_empty());
    assert!(rows(&w.db).is_empty());
    assert_eq!(w.tier.log().last().unwrap(), &format!("destroy {}", sbx.id));
}

#[tokio::test]
async fn a_tier_that_fails_to_destroy_leaves_the_row_for_the_next_try() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    w.tier.set_faults(TierFaults {
        destroy: true,
        ..Default::default()
    });
    let err = w.s.sandboxes.delete(&sbx.id).await.unwrap_err();
    assert!(matches!(err, Error::Internal(_)), "{err:?}");
    assert!(err.to_string().contains("told to fail destroys"), "{err}");
    // Not forgotten: the row stays (stopping), so a later start-up removes it.
    assert_eq!(
        w.db.get_sandbox(&sbx.id).unwrap().unwrap().state,
        SandboxState::Stopping
    );
}

#[tokio::test]
async fn a_create_whose_caller_goes_away_still_ends_running() {
    let w = world();
    w.tier.set_faults(TierFaults {
        create_delay: Duration::from_millis(200),
        ..Default::default()
    });
    let sandboxes = w.s.sandboxes.clone();
    let caller = tokio::spawn(async move { sandboxes.create(Default::default()).await });
    eventually("the create is under way", || !rows(&w.db).is_empty()).await;
    // The client disconnects: its request future is dropped.
    caller.abort();
    eventually("the sandbox runs", || {
        w.db.list_sandboxes()
            .unwrap()
            .iter()
            .any(|r| r.state == SandboxState::Running)
    })
    .await;
    assert_eq!(w.tier.live().len(), 1);
    assert_eq!(w.s.sandboxes.list(&ListFilter::default()).unwrap().len(), 1);
}

#[tokio::test]
async fn a_sandbox_being_started_can_be_deleted() {
    let w = world();
    w.tier.set_faults(TierFaults {
        create_delay: Duration::from_millis(300),
        ..Default::default()
    });
    let sandboxes = w.s.sandboxes.clone();
    let create = tokio::spawn(async move { sandboxes.create(Default::default()).await });
    eventually("a row starting", || !rows(&w.db).is_empty()).await;
    let id = rows(&w.db).remove(0);
    assert_eq!(
        w.db.get_sandbox(&id).unwrap().unwrap().state,
        SandboxState::Starting
    );
    // The delete waits for the start to end, then removes it.
    w.s.sandboxes.delete(&id).await.unwrap();
    assert!(rows(&w.db).is_empty());
    assert!(w.tier.live().is_empty());
    // The creator got its sandbox, which is gone now.
    assert_eq!(create.await.unwrap().unwrap().id, id);
}

#[tokio::test]
async fn a_starting_row_without_a_start_in_flight_is_removed() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    // What a start that vanished (a panic in its task) leaves.
    w.db.set_state(&sbx.id, SandboxState::Starting).unwrap();
    w.s.reaper.remove_dead().await;
    assert!(w.db.get_sandbox(&sbx.id).unwrap().is_none());
    assert!(w.tier.live().is_empty());
}

#[tokio::test]
async fn a_sandbox_whose_liveness_the_host_cannot_tell_is_never_removed() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    // The daemon out of file descriptors cannot read /proc: that says nothing of the sandbox.
    w.tier.set_faults(TierFaults {
        liveness_unknown: true,
        ..Default::default()
    });
    w.s.reaper.remove_dead().await;
    assert!(w.db.get_sandbox(&sbx.id).unwrap().is_some());
    // Nor at a restart: it is re-adopted, without waiting for its agent.
    let again = services(w.dir.path(), &w.db, &w.tier, 0);
    again.recover().await.unwrap();
    assert_eq!(
        again.sandboxes.get(&sbx.id).unwrap().state,
        SandboxState::Running
    );
    assert_eq!(w.tier.live(), std::slice::from_ref(&sbx.id));
}

#[tokio::test]
async fn a_restart_does_not_wait_for_slow_agents() {
    let w = world();
    let sbx = w.s.sandboxes.create(Default::default()).await.unwrap();
    // Its agent stops answering (a host under load): the sandbox runs on.
    w.tier
        .instance(&sbx.id)
        .unwrap()
        .agent
        .set_faults(crate::agent::fake::Faults {
            not_ready: true,
            ..Default::default()
        });
    let again = services(w.dir.path(), &w.db, &w.tier, 0);
    let started = std::time::Instant::now();
    again.recover().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert!(again.sandboxes.get(&sbx.id).is_ok(), "re-adopted");
}
