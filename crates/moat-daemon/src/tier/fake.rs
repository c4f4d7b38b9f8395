//! A fake tier for unit tests: instances are entries in memory, each with an in-process
//! [`FakeAgent`]; it can be told to fail at each step of a start, and it records what it was asked
//! to do. It stands in for any isolation (the one it is made with), so the lifecycle's logic runs
//! without root, namespaces or a guest kernel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Result};
use moat_api::{Isolation, SandboxLimits, TierInfo};
use serde::{Deserialize, Serialize};

use super::{AgentStream, Liveness, SandboxSpec, Tier, TierCapabilities, TierError, TierUsage};
use crate::agent::fake::FakeAgent;

/// What the fake tier keeps of a sandbox: which instance it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FakeState {
    pub instance: u64,
}

/// One started instance.
#[derive(Clone)]
pub struct Instance {
    pub id: String,
    pub number: u64,
    pub agent: FakeAgent,
    pub spec: SandboxSpec,
    pub paused: bool,
    pub limits: SandboxLimits,
}

/// Where a start fails.
#[derive(Debug, Clone, Default)]
pub struct TierFaults {
    /// `create` fails (after making a half instance, which it removes as a real tier does).
    pub create: bool,
    /// `create` takes this long (a slow boot).
    pub create_delay: Duration,
    /// The instance's agent never answers `/health`.
    pub agent_not_ready: bool,
    /// The instance's agent refuses its configuration.
    pub agent_refuses_config: bool,
    /// Background processes with this tag fail at once (a template's start command).
    pub failing_tag: Option<String>,
    /// `destroy` fails.
    pub destroy: bool,
    /// `is_alive` cannot tell (as a daemon out of file descriptors cannot).
    pub liveness_unknown: bool,
}

#[derive(Default)]
struct State {
    next: u64,
    live: HashMap<String, Instance>,
    /// Leftovers on the "host" no sandbox row may own (what `sweep` finds).
    leftovers: HashSet<String>,
    faults: TierFaults,
    log: Vec<String>,
    network: BTreeMap<u32, moat_api::NetworkPolicy>,
}

/// A tier whose sandboxes live in memory.
#[derive(Clone)]
pub struct FakeTier {
    isolation: Isolation,
    capabilities: TierCapabilities,
    state: Arc<Mutex<State>>,
}

impl FakeTier {
    pub fn new(isolation: Isolation) -> FakeTier {
        FakeTier {
            isolation,
            capabilities: TierCapabilities {
                oom_counter_inside: Some("/run/moat/memory.events".into()),
                process_limit_inside: false,
                limits_fixed_at_start: false,
                checkpoint_ends_connections: true,
                min_memory_mb: 0,
            },
            state: Arc::default(),
        }
    }

    /// The same tier with other capabilities.
    pub fn with_capabilities(mut self, c: TierCapabilities) -> FakeTier {
        self.capabilities = c;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where starts fail from now on.
    pub fn set_faults(&self, faults: TierFaults) {
        self.state().faults = faults;
    }

    /// Sandbox ids with a live instance.
    pub fn live(&self) -> Vec<String> {
        let mut v: Vec<String> = self.state().live.keys().cloned().collect();
        v.sort();
        v
    }

    /// A live instance.
    pub fn instance(&self, id: &str) -> Option<Instance> {
        self.state().live.get(id).cloned()
    }

    /// Kills an instance behind the daemon's back (its PID 1 died; or a host reboot).
    pub fn kill(&self, id: &str) {
        self.state().live.remove(id);
    }

    /// Something on the host a crash left behind, which no sandbox row owns.
    pub fn leave_leftover(&self, name: &str) {
        self.state().leftovers.insert(name.to_string());
    }

    /// What the tier was asked to do, in order (`create ID`, `destroy ID`, `pause ID`, ...).
    pub fn log(&self) -> Vec<String> {
        self.state().log.clone()
    }

    /// The egress policies installed, by slot.
    pub fn policies(&self) -> BTreeMap<u32, moat_api::NetworkPolicy> {
        self.state().network.clone()
    }

    fn record(&self, what: &str, id: &str) {
        self.state().log.push(format!("{what} {id}"));
    }

    fn agent_of(&self, id: &str, state: &FakeState) -> Result<FakeAgent> {
        match self.state().live.get(id) {
            Some(i) if i.number == state.instance => Ok(i.agent.clone()),
            _ => bail!("no instance {} of sandbox {id}", state.instance),
        }
    }
}

#[async_trait::async_trait]
impl Tier for FakeTier {
    type State = FakeState;

    fn isolation(&self) -> Isolation {
        self.isolation
    }

    fn info(&self) -> TierInfo {
        TierInfo {
            isolation: self.isolation,
            available: true,
            note: Some("fake".into()),
        }
    }

    fn capabilities(&self) -> TierCapabilities {
        self.capabilities.clone()
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<FakeState> {
        self.record("create", &spec.id);
        let delay = self.state().faults.create_delay;
        tokio::time::sleep(delay).await;
        let mut st = self.state();
        if st.faults.create {
            bail!("the fake tier was told to fail creates");
        }
        st.next += 1;
        let agent = FakeAgent::new();
        agent.set_faults(crate::agent::fake::Faults {
            not_ready: st.faults.agent_not_ready,
            refuse_config: st.faults.agent_refuses_config,
            failing_tag: st.faults.failing_tag.clone(),
        });
        let number = st.next;
        st.live.insert(
            spec.id.clone(),
            Instance {
                id: spec.id.clone(),
                number,
                agent,
                spec: spec.clone(),
                paused: false,
                limits: spec.limits.clone(),
            },
        );
        if let Some(p) = &spec.network {
            st.network.insert(spec.slot, p.clone());
        }
        Ok(FakeState { instance: number })
    }

    async fn connect(&self, id: &str, state: &FakeState) -> Result<AgentStream> {
        Ok(self.agent_of(id, state)?.connect())
    }

    async fn is_alive(&self, id: &str, state: &FakeState) -> Liveness {
        let st = self.state();
        if st.faults.liveness_unknown {
            return Liveness::Unknown;
        }
        match st.live.get(id) {
            Some(i) if i.number == state.instance => Liveness::Alive,
            _ => Liveness::Gone,
        }
    }

    async fn set_limits(&self, id: &str, _state: &FakeState, limits: &SandboxLimits) -> Result<()> {
        self.record("set_limits", id);
        match self.state().live.get_mut(id) {
            Some(i) => {
                i.limits = limits.clone();
                Ok(())
            }
            None => bail!("no instance of {id}"),
        }
    }

    async fn usage(&self, id: &str, _state: &FakeState) -> Result<TierUsage> {
        match self.state().live.get(id) {
            Some(_) => Ok(TierUsage {
                memory_bytes: 1 << 20,
                pids: 1,
                ..Default::default()
            }),
            None => bail!("no instance of {id}"),
        }
    }

    async fn pause(&self, id: &str, _state: &FakeState) -> Result<()> {
        self.record("pause", id);
        match self.state().live.get_mut(id) {
            Some(i) => {
                i.paused = true;
                Ok(())
            }
            None => bail!("no instance of {id}"),
        }
    }

    async fn resume(&self, id: &str, _state: &FakeState) -> Result<()> {
        self.record("resume", id);
        match self.state().live.get_mut(id) {
            Some(i) => {
                i.paused = false;
                Ok(())
            }
            None => bail!("no instance of {id}"),
        }
    }

    async fn export_changes(
        &self,
        id: &str,
        _state: &FakeState,
        _dest: &std::path::Path,
    ) -> Result<Duration> {
        self.record("export", id);
        Ok(Duration::ZERO)
    }

    fn host_network(&self) -> Option<&crate::host::net::Network> {
        None
    }

    async fn restore_network(&self, live: &BTreeMap<u32, moat_api::NetworkPolicy>) -> Result<()> {
        self.state().network = live.clone();
        Ok(())
    }

    fn full_snapshot_unsupported(&self) -> Option<String> {
        Some("the fake tier takes no full-state snapshots".into())
    }

    async fn checkpoint(
        &self,
        _id: &str,
        _state: &FakeState,
        _changes: &std::path::Path,
        _image: &std::path::Path,
    ) -> Result<(Duration, FakeState), TierError> {
        Err(TierError::Unsupported(
            "the fake tier takes no full-state snapshots".into(),
        ))
    }

    async fn release(&self, id: &str, _state: Option<&FakeState>) -> Result<()> {
        self.record("release", id);
        self.state().live.remove(id);
        Ok(())
    }

    async fn destroy(&self, id: &str, _state: Option<&FakeState>) -> Result<()> {
        self.record("destroy", id);
        let mut st = self.state();
        if st.faults.destroy {
            bail!("the fake tier was told to fail destroys");
        }
        st.live.remove(id);
        st.leftovers.remove(id);
        Ok(())
    }

    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>> {
        let names: Vec<String> = {
            let st = self.state();
            st.live.keys().chain(st.leftovers.iter()).cloned().collect()
        };
        super::destroy_unowned(self, names, live).await
    }
}
