//! `/mcp`: MCP's streamable HTTP transport, behind the same API-key check as the REST API.
//!
//! The tools (crate `moat-mcp`) act through a REST client pointed at this daemon's own listen
//! address, so the stdio server (`moat mcp`) and this endpoint share one implementation.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;

use super::{auth, AppState};

/// The URL this daemon reaches itself at: its listen address, with a wildcard IP replaced by loopback.
pub fn self_url(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, listen.port()))
}

/// The `/mcp` route; merge it into [`super::router`]'s router.
pub fn routes(state: Arc<AppState>, listen: SocketAddr) -> anyhow::Result<Router> {
    let client = moat_client::Client::new(&self_url(listen), state.api_key.clone())
        .map_err(|e| anyhow::anyhow!("MCP endpoint: {e}"))?;
    Ok(Router::new()
        .route_service("/mcp", moat_mcp::http_service(client))
        .route_layer(axum::middleware::from_fn_with_state(state, auth)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_urls() {
        assert_eq!(
            self_url("0.0.0.0:6628".parse().unwrap()),
            "http://127.0.0.1:6628"
        );
        assert_eq!(self_url("[::]:1".parse().unwrap()), "http://[::1]:1");
        assert_eq!(
            self_url("10.0.0.2:80".parse().unwrap()),
            "http://10.0.0.2:80"
        );
    }
}
