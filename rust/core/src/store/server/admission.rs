//! Who gets served: at most `max_connections` clients at once. A client past the cap is
//! refused at once (accepted and closed, so it sees EOF instead of hanging in the backlog),
//! with one warning per [`WARN_EVERY`] that says how many were refused; the clients being
//! served go on. A client that proved the job secret is a member of the job and is never
//! refused for capacity (strangers cannot take its place: they never get past the gate). Each served connection's task owns an [`Admitted`] guard, so the count (and
//! the list of [`Peers`]) is right however the task ends.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::store::linger::{PeerServed, Peers};

/// Refusals are logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

pub(super) struct Admission {
    slots: Arc<Semaphore>,
    max: usize,
    served: Arc<AtomicUsize>,
    pub(super) peers: Arc<Peers>,
    refused: AtomicU64,
    /// When the last warning was logged, and the refusal count it reported.
    warned: Mutex<Option<(Instant, u64)>>,
}

/// A served connection's place; gives it back when dropped.
pub(super) struct Admitted {
    /// `None` for a member, which takes no place under the cap.
    _slot: Option<OwnedSemaphorePermit>,
    _peer: PeerServed,
    served: Arc<AtomicUsize>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.served.fetch_sub(1, Ordering::Relaxed);
        crate::metrics::store::server().connection_closed();
    }
}

impl Admission {
    pub fn new(max: usize) -> Admission {
        let max = max.max(1);
        Admission {
            slots: Arc::new(Semaphore::new(max)),
            max,
            served: Arc::new(AtomicUsize::new(0)),
            peers: Arc::default(),
            refused: AtomicU64::new(0),
            warned: Mutex::new(None),
        }
    }

    /// A place for a new connection, or `None` (refused, counted and reported) at the cap.
    pub fn admit(&self, peer: SocketAddr) -> Option<Admitted> {
        match self.slots.clone().try_acquire_owned() {
            Ok(slot) => Some(self.serve(peer, Some(slot))),
            Err(_) => {
                self.refuse(peer);
                None
            }
        }
    }

    /// A place for a client that proved the job secret: always.
    pub fn admit_member(&self, peer: SocketAddr) -> Admitted {
        self.serve(peer, None)
    }

    fn serve(&self, peer: SocketAddr, slot: Option<OwnedSemaphorePermit>) -> Admitted {
        self.served.fetch_add(1, Ordering::Relaxed);
        crate::metrics::store::server().connection_opened();
        Admitted { _slot: slot, _peer: self.peers.add(peer), served: self.served.clone() }
    }

    fn refuse(&self, peer: SocketAddr) {
        // a dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d; name them as they are
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        match *warned {
            Some((at, _)) if now.duration_since(at) < WARN_EVERY => {
                tracing::debug!(%peer, "refused a connection: {} connections served already", self.max);
            }
            last => {
                let since = refused - last.map_or(0, |(_, count)| count);
                tracing::warn!(
                    "refusing connections: {} served already (--max-connections); {since} refused since the last \
                     warning, the latest from {peer}",
                    self.max
                );
                *warned = Some((now, refused));
            }
        }
    }

    /// Connections being served.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_refuses_and_a_closed_connection_frees_its_place() {
        let admission = Admission::new(2);
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let first = admission.admit(peer).unwrap();
        let _second = admission.admit(peer).unwrap();
        assert!(admission.admit(peer).is_none());
        assert!(admission.admit(peer).is_none());
        assert_eq!((admission.served(), admission.refused()), (2, 2));
        drop(first);
        assert_eq!(admission.served(), 1);
        let _third = admission.admit(peer).unwrap();
        assert!(admission.admit(peer).is_none());
        let _member = admission.admit_member(peer);
        assert_eq!(admission.served(), 3, "a member is served past the cap");
    }
}
