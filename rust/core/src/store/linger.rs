//! A process that serves a store and exits takes the store with it. Where one rank of a plain
//! launch hosts the store (rank 0, as torch's TCPStore does) and finishes first, the other
//! ranks' last requests (a shutdown barrier's final read, a result they publish) would find
//! the server gone and fail a job that succeeded.
//!
//! So the process keeps, for its exit, a list of the servers it runs and of the local
//! addresses of its own client connections: [`wait_for_foreign_clients`] waits, bounded, until
//! every connection a server still serves comes from this process itself, that is until the
//! other processes have disconnected (they do when they exit or drop their store).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

/// The addresses of the connections being served (a process exiting waits for the ones that
/// are not its own: see [`crate::store::linger`]).
#[derive(Default)]
pub struct Peers(Mutex<HashMap<SocketAddr, usize>>);

impl Peers {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, usize>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts `peer` in until the guard is dropped.
    pub(crate) fn add(self: &Arc<Self>, peer: SocketAddr) -> PeerServed {
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        *self.map().entry(peer).or_default() += 1;
        PeerServed { peers: self.clone(), peer }
    }

    pub(crate) fn snapshot(&self) -> Vec<SocketAddr> {
        self.map().keys().copied().collect()
    }
}

/// A peer counted in [`Peers`]; counted out when dropped.
pub struct PeerServed {
    peers: Arc<Peers>,
    peer: SocketAddr,
}

impl Drop for PeerServed {
    fn drop(&mut self) {
        let mut map = self.peers.map();
        if let Some(count) = map.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                map.remove(&self.peer);
            }
        }
    }
}

/// This process's client connections (their local addresses) and servers.
#[derive(Default)]
struct Registry {
    clients: HashSet<SocketAddr>,
    servers: Vec<(SocketAddr, Weak<Peers>)>,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    // nothing panics while holding it; a poisoned list is still a list
    REGISTRY.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner)
}

/// The same address however a dual-stack socket spells it (::ffff:a.b.c.d is a.b.c.d).
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Held by a client connection of this process for its lifetime.
#[derive(Debug)]
pub struct OwnClient(Option<SocketAddr>);

impl OwnClient {
    /// Registers a connection by its local address (`None`: unknown, nothing to register).
    pub fn register(local: Option<SocketAddr>) -> OwnClient {
        let local = local.map(canonical);
        if let Some(addr) = local {
            registry().clients.insert(addr);
        }
        OwnClient(local)
    }
}

impl Drop for OwnClient {
    fn drop(&mut self) {
        if let Some(addr) = self.0 {
            registry().clients.remove(&addr);
        }
    }
}

/// Registers a server of this process (by the peers it serves), for as long as it lives.
pub(crate) fn register_server(local: SocketAddr, peers: &Arc<Peers>) {
    let mut registry = registry();
    registry.servers.retain(|(_, server)| server.strong_count() > 0);
    registry.servers.push((local, Arc::downgrade(peers)));
}

/// Connections to this process's servers from other processes, by server address.
pub fn foreign_clients() -> Vec<(SocketAddr, usize)> {
    let registry = registry();
    registry
        .servers
        .iter()
        .filter_map(|(local, peers)| Some((*local, peers.upgrade()?)))
        .map(|(local, peers)| {
            let foreign = peers.snapshot().into_iter().filter(|peer| !registry.clients.contains(peer)).count();
            (local, foreign)
        })
        .filter(|(_, foreign)| *foreign > 0)
        .collect()
}

/// Waits (blocking, up to `limit`) until no other process is connected to a server of this
/// one; returns (and warns of) the servers that still serve others then, with how many.
pub fn wait_for_foreign_clients(limit: Duration) -> Vec<(SocketAddr, usize)> {
    let deadline = Instant::now() + limit;
    let mut left = foreign_clients();
    if !left.is_empty() {
        tracing::debug!(?left, "exiting: waiting up to {limit:?} for other processes to leave this process's stores");
    }
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        left = foreign_clients();
    }
    for (server, clients) in &left {
        tracing::warn!(
            "exiting while {clients} connection(s) from other processes still use the store this process serves at \
             {server}: their next request will fail"
        );
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_connections_are_told_from_foreign_ones() {
        let peers = Arc::new(Peers::default());
        let server: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        register_server(server, &peers);
        let own: SocketAddr = "127.0.0.1:50001".parse().unwrap();
        let foreign: SocketAddr = "[::ffff:127.0.0.1]:50002".parse().unwrap();
        let _own_client = OwnClient::register(Some(own));
        let _own_served = peers.add(own);
        assert!(foreign_clients().iter().all(|(addr, _)| *addr != server));
        let served = peers.add(foreign);
        assert!(foreign_clients().contains(&(server, 1)));
        assert_eq!(
            wait_for_foreign_clients(Duration::from_millis(20)).iter().find(|(a, _)| *a == server),
            Some(&(server, 1))
        );
        drop(served);
        assert!(wait_for_foreign_clients(Duration::from_secs(1)).iter().all(|(addr, _)| *addr != server));
    }
}
