//! The RRef reference-counting protocol of one worker, as pure state: it is told what
//! happened (a handle was dropped, a fork arrived, an ack came back) and answers which
//! control messages to send. The transport delivers them, with retries, and feeds the
//! answers back.
//!
//! * One OwnerRRef per RRef, on its owner, holds the value; UserRRefs (forks) hold none.
//! * **G1**: the owner hears of every fork that is deleted (`USER_DELETE`), and deletes the
//!   OwnerRRef with its value when no fork is left and its own code holds no handle.
//! * **G2**: a fork that is sent on (a *child*) keeps its parent alive until the owner knows
//!   the child: the parent waits for `CHILD_ACCEPT`, and a child the owner has not confirmed
//!   is not deleted either.
//!
//! The four ways a reference travels:
//! * owner → user: the owner registers the new fork before sending it;
//! * user → owner: the owner answers `CHILD_ACCEPT` to the sender, and its own code holds the
//!   OwnerRRef from then on;
//! * user → user: the receiver asks the owner (`FORK_REQUEST`), and once acked tells the
//!   parent (`CHILD_ACCEPT`);
//! * the creator is the owner (a local RRef, or `remote()` to itself): owner handles only.
//!
//! Every control message is idempotent, so the transport may repeat it: the owner remembers
//! the forks it has seen deleted, so a repeated or late `FORK_REQUEST` cannot bring one back.

use std::collections::{HashMap, HashSet};

use super::ids::{ForkId, Gid, IdGen, RRefId, WorkerId};

#[cfg(test)]
mod tests;

/// A reference-counting message to send.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Control {
    ForkRequest { rref: RRefId, fork: ForkId },
    ChildAccept { fork: ForkId },
    UserDelete { rref: RRefId, fork: ForkId },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Send {
    pub to: WorkerId,
    pub msg: Control,
}

/// What a worker's code holds: the OwnerRRef itself, or one fork.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Handle {
    Owner(RRefId),
    User(ForkId),
}

/// What travels in a message for an RRef: the receiver makes its handle from it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ForkData {
    pub owner: WorkerId,
    pub rref: RRefId,
    pub fork: ForkId,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefError {
    #[error("the RRef {0} was deleted (RPC shut down), it can no longer be used or sent")]
    Deleted(Gid),
}

/// The owner's state for one RRef. `V`: the value; `W`: who waits for it.
#[derive(Debug)]
pub enum Slot<V, W> {
    Pending(Vec<W>),
    Ready(V),
}

#[derive(Debug)]
struct Owner<V, W> {
    forks: HashSet<ForkId>,
    /// Forks seen deleted: a late or repeated FORK_REQUEST for one of them is ignored.
    gone: HashSet<ForkId>,
    /// Handles the owner's own code holds.
    handles: u32,
    /// Whether the message that creates it has arrived: until then it is known only from a
    /// FORK_REQUEST or TO_HERE that overtook the creator's REMOTE, and must not be deleted.
    created: bool,
    slot: Slot<V, W>,
}

impl<V, W> Owner<V, W> {
    fn new() -> Self {
        Owner {
            forks: HashSet::new(),
            gone: HashSet::new(),
            handles: 0,
            created: false,
            slot: Slot::Pending(Vec::new()),
        }
    }

    fn deletable(&self) -> bool {
        self.created && self.handles == 0 && self.forks.is_empty()
    }
}

#[derive(Debug)]
struct User {
    rref: RRefId,
    owner: WorkerId,
    /// The owner knows this fork (its REMOTE or FORK_REQUEST was acked, or the owner sent it).
    confirmed: bool,
    handles: u32,
    /// Forks sent on from this one that the owner has not confirmed yet (G2).
    children: u32,
    /// The worker that sent this fork, to be told once the owner has confirmed it.
    parent: Option<WorkerId>,
    /// The owner is gone: nobody is left to tell about a deletion.
    orphaned: bool,
}

impl User {
    fn deletable(&self) -> bool {
        self.handles == 0 && self.children == 0 && (self.confirmed || self.orphaned)
    }
}

/// Counts for `_get_debug_info` and for shutdown.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct Stats {
    pub owners: usize,
    pub forks_of_owners: usize,
    pub users: usize,
    pub pending_users: usize,
    pub pending_children: usize,
}

#[derive(Debug)]
pub struct Table<V, W> {
    me: WorkerId,
    ids: IdGen,
    owners: HashMap<RRefId, Owner<V, W>>,
    users: HashMap<ForkId, User>,
    /// child fork -> the parent holding on for it
    children: HashMap<ForkId, Handle>,
}

/// What an event let go of: messages to send, and values (or waiters) to drop.
pub struct Released<V, W> {
    pub sends: Vec<Send>,
    pub dropped: Vec<Slot<V, W>>,
}

impl<V, W> Default for Released<V, W> {
    fn default() -> Self {
        Released { sends: Vec::new(), dropped: Vec::new() }
    }
}

impl<V, W> Table<V, W> {
    pub fn new(me: WorkerId) -> Self {
        Table { me, ids: IdGen::new(me), owners: HashMap::new(), users: HashMap::new(), children: HashMap::new() }
    }

    pub fn me(&self) -> WorkerId {
        self.me
    }

    /// A new RRef owned here, holding `value` (`RRef(value)`).
    pub fn new_owner(&mut self, value: V) -> Handle {
        let rref = self.ids.next();
        let owner = self.owners.entry(rref).or_insert_with(Owner::new);
        owner.created = true;
        owner.handles = 1;
        owner.slot = Slot::Ready(value);
        Handle::Owner(rref)
    }

    /// The caller's side of `remote(owner, ...)`: the new RRef's id, the caller's fork and its
    /// handle. With `owner == me` the handle is the OwnerRRef, which the REMOTE will fill.
    pub fn start_remote(&mut self, owner: WorkerId) -> (RRefId, ForkId, Handle) {
        let rref = self.ids.next();
        if owner == self.me {
            let entry = self.owners.entry(rref).or_insert_with(Owner::new);
            entry.created = true;
            entry.handles += 1;
            return (rref, rref, Handle::Owner(rref));
        }
        let fork = self.ids.next();
        let user = User { rref, owner, confirmed: false, handles: 1, children: 0, parent: None, orphaned: false };
        self.users.insert(fork, user);
        (rref, fork, Handle::User(fork))
    }

    /// The owner's side of a REMOTE from `caller`: the OwnerRRef exists from now on, and the
    /// caller's fork counts.
    pub fn remote_arrived(&mut self, rref: RRefId, fork: ForkId, caller: WorkerId) {
        if caller == self.me && !self.owners.contains_key(&rref) {
            return; // remote() to itself, and the caller let go before it ran: nothing to keep
        }
        let owner = self.owners.entry(rref).or_insert_with(Owner::new);
        owner.created = true;
        if caller != self.me && !owner.gone.contains(&fork) {
            owner.forks.insert(fork);
        }
    }

    /// The caller's REMOTE was answered: the owner knows its fork.
    pub fn remote_confirmed(&mut self, fork: ForkId) -> Released<V, W> {
        self.confirm(fork)
    }

    /// The owner will never answer (it died before knowing the fork): the fork is dropped
    /// quietly once let go of.
    pub fn owner_lost(&mut self, fork: ForkId) -> Released<V, W> {
        if let Some(user) = self.users.get_mut(&fork) {
            user.orphaned = true;
        }
        self.release_user_if_done(fork)
    }

    /// `handle` is being sent to another worker (or this one): make the fork that travels.
    pub fn fork_out(&mut self, handle: Handle) -> Result<ForkData, RefError> {
        let fork = self.ids.next();
        match handle {
            Handle::Owner(rref) => {
                // early registration: the owner knows the child before it leaves, so no
                // deletion can overtake it, and no message needs to come back
                let owner = self.owners.get_mut(&rref).ok_or(RefError::Deleted(rref))?;
                owner.forks.insert(fork);
                Ok(ForkData { owner: self.me, rref, fork })
            }
            Handle::User(parent) => {
                let user = self.users.get_mut(&parent).ok_or(RefError::Deleted(parent))?;
                user.children += 1;
                self.children.insert(fork, Handle::User(parent));
                Ok(ForkData { owner: user.owner, rref: user.rref, fork })
            }
        }
    }

    /// A message that carried `data` was never delivered: undo its `fork_out`.
    pub fn fork_not_delivered(&mut self, data: ForkData) -> Released<V, W> {
        if data.owner == self.me {
            return self.fork_deleted(data.rref, data.fork);
        }
        self.child_accepted(data.fork)
    }

    /// `data` arrived from `parent`: the handle this worker's code gets for it.
    pub fn fork_in(&mut self, data: ForkData, parent: WorkerId) -> (Handle, Released<V, W>) {
        let mut released = Released::default();
        if data.owner == self.me {
            let owner = self.owners.entry(data.rref).or_insert_with(Owner::new);
            owner.handles += 1;
            if parent == self.me {
                // sent to itself: the early-registered fork has no UserRRef behind it
                owner.forks.remove(&data.fork);
            } else {
                // from a user: the fork was only there to hold the parent (G2)
                released.sends.push(Send { to: parent, msg: Control::ChildAccept { fork: data.fork } });
            }
            return (Handle::Owner(data.rref), released);
        }
        let from_owner = parent == data.owner;
        let user = User {
            rref: data.rref,
            owner: data.owner,
            confirmed: from_owner,
            handles: 1,
            children: 0,
            parent: (!from_owner).then_some(parent),
            orphaned: false,
        };
        self.users.insert(data.fork, user);
        if !from_owner {
            let msg = Control::ForkRequest { rref: data.rref, fork: data.fork };
            released.sends.push(Send { to: data.owner, msg });
        }
        (Handle::User(data.fork), released)
    }

    /// The owner acked this worker's FORK_REQUEST for `fork`.
    pub fn fork_confirmed(&mut self, fork: ForkId) -> Released<V, W> {
        self.confirm(fork)
    }

    fn confirm(&mut self, fork: ForkId) -> Released<V, W> {
        let mut released = Released::default();
        if let Some(user) = self.users.get_mut(&fork) {
            if !user.confirmed {
                user.confirmed = true;
                if let Some(parent) = user.parent.take() {
                    released.sends.push(Send { to: parent, msg: Control::ChildAccept { fork } });
                }
            }
        }
        released.append(self.release_user_if_done(fork));
        released
    }

    /// Owner side of FORK_REQUEST.
    pub fn fork_requested(&mut self, rref: RRefId, fork: ForkId) {
        let owner = self.owners.entry(rref).or_insert_with(Owner::new);
        if !owner.gone.contains(&fork) {
            owner.forks.insert(fork);
        }
    }

    /// Owner side of USER_DELETE.
    pub fn fork_deleted(&mut self, rref: RRefId, fork: ForkId) -> Released<V, W> {
        if let Some(owner) = self.owners.get_mut(&rref) {
            owner.forks.remove(&fork);
            owner.gone.insert(fork);
        }
        self.release_owner_if_done(rref)
    }

    /// Parent side of CHILD_ACCEPT.
    pub fn child_accepted(&mut self, fork: ForkId) -> Released<V, W> {
        match self.children.remove(&fork) {
            Some(Handle::User(parent)) => {
                if let Some(user) = self.users.get_mut(&parent) {
                    user.children = user.children.saturating_sub(1);
                }
                self.release_user_if_done(parent)
            }
            Some(Handle::Owner(rref)) => self.release_owner_if_done(rref),
            None => Released::default(),
        }
    }

    /// The worker's code let go of `handle`.
    pub fn release(&mut self, handle: Handle) -> Released<V, W> {
        match handle {
            Handle::Owner(rref) => {
                if let Some(owner) = self.owners.get_mut(&rref) {
                    owner.handles = owner.handles.saturating_sub(1);
                }
                self.release_owner_if_done(rref)
            }
            Handle::User(fork) => {
                if let Some(user) = self.users.get_mut(&fork) {
                    user.handles = user.handles.saturating_sub(1);
                }
                self.release_user_if_done(fork)
            }
        }
    }

    fn release_user_if_done(&mut self, fork: ForkId) -> Released<V, W> {
        let mut released = Released::default();
        if self.users.get(&fork).is_some_and(User::deletable) {
            let user = self.users.remove(&fork).expect("checked above");
            if !user.orphaned {
                let msg = Control::UserDelete { rref: user.rref, fork };
                released.sends.push(Send { to: user.owner, msg });
            }
        }
        released
    }

    fn release_owner_if_done(&mut self, rref: RRefId) -> Released<V, W> {
        let mut released = Released::default();
        if self.owners.get(&rref).is_some_and(Owner::deletable) {
            released.dropped.push(self.owners.remove(&rref).expect("checked above").slot);
        }
        released
    }

    /// The owner got the value of `rref`: returns whoever waited for it. A value for an
    /// RRef deleted meanwhile is handed back to be dropped.
    pub fn set_value(&mut self, rref: RRefId, value: V) -> Result<Vec<W>, V> {
        let Some(owner) = self.owners.get_mut(&rref) else { return Err(value) };
        match std::mem::replace(&mut owner.slot, Slot::Ready(value)) {
            Slot::Pending(waiters) => Ok(waiters),
            Slot::Ready(_) => Ok(Vec::new()),
        }
    }

    /// The value of `rref`, or None after `waiter` was queued for it. An RRef this owner
    /// has not heard of yet is noted (its REMOTE is still on the way).
    pub fn value_or_wait(&mut self, rref: RRefId, waiter: W) -> Option<&V> {
        let owner = self.owners.entry(rref).or_insert_with(Owner::new);
        match &mut owner.slot {
            Slot::Ready(value) => Some(value),
            Slot::Pending(waiters) => {
                waiters.push(waiter);
                None
            }
        }
    }

    pub fn value(&self, rref: RRefId) -> Option<&V> {
        match &self.owners.get(&rref)?.slot {
            Slot::Ready(value) => Some(value),
            Slot::Pending(_) => None,
        }
    }

    pub fn is_confirmed(&self, handle: Handle) -> bool {
        match handle {
            Handle::Owner(_) => true,
            Handle::User(fork) => self.users.get(&fork).is_some_and(|user| user.confirmed),
        }
    }

    /// Shutdown: every fork is let go of, whatever the worker's code still holds.
    pub fn release_all_users(&mut self) -> Released<V, W> {
        let forks: Vec<ForkId> = self.users.keys().copied().collect();
        let mut released = Released::default();
        for fork in forks {
            if let Some(user) = self.users.get_mut(&fork) {
                user.handles = 0;
            }
            released.append(self.release_user_if_done(fork));
        }
        released
    }

    /// Shutdown, once no worker has a fork left: the OwnerRRefs the owners' own code holds go.
    pub fn clear_owners(&mut self) -> Vec<Slot<V, W>> {
        self.owners.drain().map(|(_, owner)| owner.slot).collect()
    }

    /// One line per fork and OwnerRRef still held (diagnostics).
    pub fn describe(&self) -> Vec<String> {
        let users = self.users.iter().map(|(fork, user)| format!("user {fork}: {user:?}"));
        let owners = self.owners.iter().map(|(rref, owner)| {
            format!(
                "owner {rref}: forks {:?} gone {} handles {} created {}",
                owner.forks,
                owner.gone.len(),
                owner.handles,
                owner.created
            )
        });
        let children = self.children.iter().map(|(child, parent)| format!("child {child} of {parent:?}"));
        users.chain(owners).chain(children).collect()
    }

    pub fn stats(&self) -> Stats {
        Stats {
            owners: self.owners.len(),
            forks_of_owners: self.owners.values().map(|owner| owner.forks.len()).sum(),
            users: self.users.len(),
            pending_users: self.users.values().filter(|user| !user.confirmed).count(),
            pending_children: self.children.len(),
        }
    }
}

impl<V, W> Released<V, W> {
    pub fn append(&mut self, other: Released<V, W>) {
        self.sends.extend(other.sends);
        self.dropped.extend(other.dropped);
    }
}
