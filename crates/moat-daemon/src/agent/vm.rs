//! The microvm tier's calls (`/vm/*`), which its agent serves on the VM's control port: freezing
//! the sandbox's processes, the guest's clock and network, and its writable layer.

use axum::body::Body;
use http::Response;
use hyper::body::Incoming;
use moat_api::guest::{ClockRequest, FreezeRequest, NetworkRequest};
use moat_api::protocol::{endpoint, LayerQuery, NoQuery};

use super::wire::AgentError;
use super::AgentClient;

impl AgentClient {
    /// Freezes (and syncs) or thaws the sandbox's processes.
    pub async fn vm_freeze(&self, frozen: bool) -> Result<(), AgentError> {
        self.call::<endpoint::VmFreeze>(None, &NoQuery {}, &FreezeRequest { frozen })
            .await
    }

    /// Sets the guest's wall clock.
    pub async fn vm_clock(&self, realtime_ns: u64) -> Result<(), AgentError> {
        self.call::<endpoint::VmClock>(None, &NoQuery {}, &ClockRequest { realtime_ns })
            .await
    }

    /// Gives the guest's `eth0` another address, route and nameserver, or none.
    pub async fn vm_network(&self, req: &NetworkRequest) -> Result<(), AgentError> {
        self.call::<endpoint::VmNetwork>(None, &NoQuery {}, req)
            .await
    }

    /// The guest's writable layer as a tar stream (with `freeze`, the sandbox's processes stay
    /// frozen while it is read).
    pub async fn vm_layer(&self, freeze: bool) -> Result<Response<Incoming>, AgentError> {
        self.request::<endpoint::VmLayer>(None, &LayerQuery { freeze }, None, Body::empty())
            .await
    }
}
