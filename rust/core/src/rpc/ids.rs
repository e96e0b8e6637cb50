//! Globally unique ids: an RRef's id and each fork's id are (the worker that made it, a
//! counter of that worker), so no two workers ever hand out the same one and none needs to
//! ask anyone.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A worker's rank in the RPC group.
pub type WorkerId = u32;

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Debug)]
pub struct Gid {
    pub worker: WorkerId,
    pub local: u64,
}

/// The id of an RRef, given by the worker that created it (which need not be its owner).
pub type RRefId = Gid;
/// The id of one UserRRef (a fork): every copy of an RRef sent to a worker is a new fork.
pub type ForkId = Gid;

impl Gid {
    pub const fn new(worker: WorkerId, local: u64) -> Gid {
        Gid { worker, local }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.worker, self.local)
    }
}

/// Hands out this worker's ids. Counting starts at 1: a zero id on the wire means "none".
#[derive(Debug)]
pub struct IdGen {
    worker: WorkerId,
    next: AtomicU64,
}

impl IdGen {
    pub fn new(worker: WorkerId) -> IdGen {
        IdGen { worker, next: AtomicU64::new(1) }
    }

    pub fn next(&self) -> Gid {
        Gid::new(self.worker, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_per_worker_and_never_zero() {
        let a = IdGen::new(3);
        let b = IdGen::new(4);
        let (x, y, z) = (a.next(), a.next(), b.next());
        assert_ne!(x, y);
        assert_ne!(x, z);
        assert_eq!(x.worker, 3);
        assert!(x.local > 0 && z.local > 0);
        assert_eq!(y.to_string(), "3:2");
    }
}
