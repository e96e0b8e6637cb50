//! Connections that have not proven anything yet. A stranger without the secret can still
//! connect and say nothing; the door bounds what that costs: at most [`DoorLimits::per_source`]
//! such connections per source address and [`DoorLimits::total`] in all, each for at most a
//! short deadline. When a bound is reached the oldest waiting connection (of that source, else
//! of all) is shed to make room: a genuine peer finishes its handshake in a few round trips, so
//! it is the newest, and a shed client retries. Proven peers are never counted here, so a flood
//! of strangers can delay a member's handshake but never take a member's place.
//!
//! [`Lobby`] is the bookkeeping without I/O (Python's collectives listener uses it through the
//! bindings); [`Door`] runs a handshake future under it on tokio.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// How long a connection may take to prove itself.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DoorLimits {
    /// Connections waiting at once from one address.
    pub per_source: usize,
    /// Connections waiting at once in all.
    pub total: usize,
}

impl Default for DoorLimits {
    fn default() -> Self {
        DoorLimits { per_source: 32, total: 512 }
    }
}

impl DoorLimits {
    /// The limits for a process that may hold `open_files` descriptors: a quarter of them for
    /// strangers at most (the default's 512 at most, 16 at least), 32 per source at most.
    pub fn for_open_files(open_files: u64) -> DoorLimits {
        let total = usize::try_from(open_files / 4).unwrap_or(usize::MAX).clamp(16, DoorLimits::default().total);
        DoorLimits { per_source: DoorLimits::default().per_source.min(total), total }
    }
}

/// The process's soft open-file limit (a generous guess where it cannot be read).
fn open_file_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(65536, |(soft, _)| soft)
}

/// Who is waiting: each entry holds the caller's token (what it needs to shed it).
pub struct Lobby<T> {
    limits: DoorLimits,
    next: u64,
    /// By arrival: the first is the oldest.
    waiting: BTreeMap<u64, (IpAddr, T)>,
    per_source: HashMap<IpAddr, usize>,
    shed: u64,
}

impl<T> Lobby<T> {
    pub fn new(limits: DoorLimits) -> Lobby<T> {
        let limits = DoorLimits { per_source: limits.per_source.max(1), total: limits.total.max(1) };
        Lobby { limits, next: 0, waiting: BTreeMap::new(), per_source: HashMap::new(), shed: 0 }
    }

    /// Lets a connection from `ip` wait: its ticket, and the tokens of the connections shed
    /// to make room (the caller closes them).
    pub fn arrive(&mut self, ip: IpAddr, token: T) -> (u64, Vec<T>) {
        let ip = ip.to_canonical();
        let mut shed = Vec::new();
        if self.per_source.get(&ip).copied().unwrap_or(0) >= self.limits.per_source {
            let oldest = self.waiting.iter().find(|(_, (from, _))| *from == ip).map(|(ticket, _)| *ticket);
            shed.extend(oldest.and_then(|ticket| self.take(ticket)));
        }
        if self.waiting.len() >= self.limits.total {
            shed.extend(self.shed_oldest());
        }
        self.shed += shed.len() as u64;
        let ticket = self.next;
        self.next += 1;
        self.waiting.insert(ticket, (ip, token));
        *self.per_source.entry(ip).or_default() += 1;
        (ticket, shed)
    }

    /// The connection with `ticket` is done waiting (proven, refused or closed).
    pub fn leave(&mut self, ticket: u64) -> Option<T> {
        self.take(ticket)
    }

    /// Sheds the oldest waiting connection (to free a descriptor for a new one): its token.
    pub fn shed_oldest(&mut self) -> Option<T> {
        let oldest = *self.waiting.keys().next()?;
        self.take(oldest)
    }

    fn take(&mut self, ticket: u64) -> Option<T> {
        let (ip, token) = self.waiting.remove(&ticket)?;
        if let Some(count) = self.per_source.get_mut(&ip) {
            *count -= 1;
            if *count == 0 {
                self.per_source.remove(&ip);
            }
        }
        Some(token)
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Connections shed so far.
    pub fn shed(&self) -> u64 {
        self.shed
    }
}

/// Why a connection was turned away at the door.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TurnedAway {
    #[error("shed to make room for newer connections (too many were waiting to authenticate)")]
    Shed,
    #[error("no authentication within {0:?}")]
    Late(Duration),
}

/// A [`Lobby`] for tokio tasks: each waiting connection's handshake runs under [`Door::hold`].
pub struct Door {
    lobby: Mutex<Lobby<Arc<Notify>>>,
    deadline: Duration,
}

impl Door {
    pub fn new(limits: DoorLimits, deadline: Duration) -> Door {
        Door { lobby: Mutex::new(Lobby::new(limits)), deadline }
    }

    /// The process's one door for every listener that authenticates (its stores, RPC): a
    /// flood spread over several listeners shares one bound, a quarter of the open-file limit
    /// at most, so the rest stays for what keeps the job alive (its stores' members, its
    /// workers' pipes, a new round's store). Sized when first used: agents raise their soft
    /// limit before they serve anything.
    pub fn shared() -> Arc<Door> {
        static SHARED: std::sync::OnceLock<Arc<Door>> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| Arc::new(Door::new(DoorLimits::for_open_files(open_file_limit()), HANDSHAKE_DEADLINE)))
            .clone()
    }

    fn lobby(&self) -> std::sync::MutexGuard<'_, Lobby<Arc<Notify>>> {
        self.lobby.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `handshake` for a connection from `ip` until it ends, the deadline passes or the
    /// connection is shed.
    pub async fn hold<F: Future>(&self, ip: IpAddr, handshake: F) -> Result<F::Output, TurnedAway> {
        let shed = Arc::new(Notify::new());
        let (ticket, others) = self.lobby().arrive(ip, shed.clone());
        for other in others {
            other.notify_one();
        }
        let _leave = Leave { door: self, ticket };
        tokio::select! {
            done = tokio::time::timeout(self.deadline, handshake) => done.map_err(|_| TurnedAway::Late(self.deadline)),
            () = shed.notified() => Err(TurnedAway::Shed),
        }
    }

    /// Sheds the oldest waiting connection; whether there was one.
    pub fn shed_oldest(&self) -> bool {
        let oldest = self.lobby().shed_oldest();
        oldest.map(|shed| shed.notify_one()).is_some()
    }

    pub fn waiting(&self) -> usize {
        self.lobby().waiting()
    }
}

struct Leave<'a> {
    door: &'a Door,
    ticket: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.door.lobby().leave(self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_source_over_its_share_sheds_its_own_oldest_and_nobody_elses() {
        let mut lobby = Lobby::new(DoorLimits { per_source: 2, total: 100 });
        let (genuine, _) = lobby.arrive(ip(1), "genuine");
        assert!(lobby.arrive(ip(9), "flood 1").1.is_empty());
        assert!(lobby.arrive(ip(9), "flood 2").1.is_empty());
        assert_eq!(lobby.arrive(ip(9), "flood 3").1, vec!["flood 1"]);
        assert_eq!(lobby.arrive(ip(9), "flood 4").1, vec!["flood 2"]);
        assert_eq!(lobby.waiting(), 3);
        assert_eq!(lobby.leave(genuine), Some("genuine"));
        assert_eq!(lobby.leave(genuine), None);
        assert_eq!(lobby.shed(), 2);
    }

    #[test]
    fn a_full_lobby_sheds_the_oldest_and_v4_mapped_addresses_are_one_source() {
        let mut lobby = Lobby::new(DoorLimits { per_source: 10, total: 2 });
        lobby.arrive(ip(1), 1);
        lobby.arrive(ip(2), 2);
        assert_eq!(lobby.arrive(ip(3), 3).1, vec![1]);
        assert_eq!(lobby.shed_oldest(), Some(2));
        let mut lobby = Lobby::new(DoorLimits { per_source: 1, total: 10 });
        lobby.arrive(ip(1), "v4");
        let mapped = IpAddr::V6(std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert_eq!(lobby.arrive(mapped, "mapped").1, vec!["v4"]);
    }

    #[test]
    fn the_door_keeps_most_descriptors_for_the_job() {
        assert_eq!(DoorLimits::for_open_files(1024), DoorLimits { per_source: 32, total: 256 });
        assert_eq!(DoorLimits::for_open_files(1 << 20), DoorLimits::default());
        assert_eq!(DoorLimits::for_open_files(20), DoorLimits { per_source: 16, total: 16 });
        assert!(Arc::ptr_eq(&Door::shared(), &Door::shared()), "one door per process");
    }

    #[tokio::test(start_paused = true)]
    async fn the_door_sheds_and_times_out_waiting_handshakes() {
        let door = Arc::new(Door::new(DoorLimits { per_source: 1, total: 10 }, Duration::from_secs(3)));
        let first = tokio::spawn({
            let door = door.clone();
            async move { door.hold(ip(9), std::future::pending::<()>()).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(door.waiting(), 1);
        let second = tokio::spawn({
            let door = door.clone();
            async move { door.hold(ip(9), std::future::pending::<()>()).await }
        });
        assert_eq!(first.await.unwrap(), Err(TurnedAway::Shed));
        assert_eq!(second.await.unwrap(), Err(TurnedAway::Late(Duration::from_secs(3))));
        assert_eq!(door.waiting(), 0);
        assert_eq!(door.hold(ip(1), async { 7 }).await, Ok(7));
    }
}
