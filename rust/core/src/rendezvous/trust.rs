//! Rank 0's workers' store, which requires the job secret of elastix clients; a round's
//! members may connect without it: their torch workers cannot prove it, and their agents
//! authenticate to the rendezvous only (c10d's store, or etcd). Rank 0 lets plain clients from
//! each member's published address in; each backend reads the members its own way
//! (c10d/trust.rs, etcd's handler).

use super::node::NodeDesc;
use crate::auth::{PlainClients, Secret};
use crate::store::server::Trusts;
use crate::store::ServerConfig;

/// How rank 0 serves the workers' store, reached at `addr`: with the job secret, plain clients
/// come in from loopback and from the members' addresses only.
pub(crate) fn workers_store_config(addr: &str, secret: Option<&Secret>) -> ServerConfig {
    ServerConfig::for_address(addr).requiring(secret, PlainClients::LoopbackAndAuthenticated)
}

/// Lets plain clients from `node`'s address (resolved, every address it has) in.
pub(crate) async fn let_in(trusts: &Trusts, node: &NodeDesc, round: u64) {
    let resolved = tokio::net::lookup_host((node.addr.as_str(), 0)).await;
    match resolved {
        Ok(addrs) => addrs.for_each(|addr| trusts.trust(addr.ip())),
        Err(err) => tracing::warn!(
            round,
            "cannot resolve member {node}'s address {}: its torch workers cannot reach the workers' store: {err}",
            node.addr
        ),
    };
}
