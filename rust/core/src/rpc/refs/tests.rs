//! The protocol across simulated workers, with every message delivered in a random order.

use super::*;

/// A message between simulated workers.
#[derive(Clone, Copy, Debug)]
enum Msg {
    Control(Send),
    /// The ack of a FORK_REQUEST, back to its sender.
    ForkAck {
        to: WorkerId,
        fork: ForkId,
    },
    /// An RPC that carries a fork.
    Carry {
        to: WorkerId,
        data: ForkData,
    },
    /// remote(): the REMOTE to the owner, then its answer to the caller.
    Remote {
        to: WorkerId,
        rref: RRefId,
        fork: ForkId,
        caller: WorkerId,
    },
    RemoteAck {
        to: WorkerId,
        fork: ForkId,
    },
}

struct World {
    tables: Vec<Table<u64, ()>>,
    /// (sender, message) in flight
    wire: Vec<(WorkerId, Msg)>,
    /// the handles each worker's code holds
    held: Vec<Vec<Handle>>,
    rng: fastrand::Rng,
}

impl World {
    fn new(workers: u32, seed: u64) -> World {
        World {
            tables: (0..workers).map(Table::new).collect(),
            wire: Vec::new(),
            held: vec![Vec::new(); workers as usize],
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    fn post(&mut self, from: WorkerId, released: Released<u64, ()>) {
        self.wire.extend(released.sends.into_iter().map(|send| (from, Msg::Control(send))));
    }

    fn create(&mut self, at: WorkerId, value: u64) {
        let handle = self.tables[at as usize].new_owner(value);
        self.held[at as usize].push(handle);
    }

    fn remote(&mut self, caller: WorkerId, owner: WorkerId) {
        let (rref, fork, handle) = self.tables[caller as usize].start_remote(owner);
        self.held[caller as usize].push(handle);
        self.wire.push((caller, Msg::Remote { to: owner, rref, fork, caller }));
    }

    fn share(&mut self, from: WorkerId, which: usize, to: WorkerId) {
        let handle = self.held[from as usize][which];
        let data = self.tables[from as usize].fork_out(handle).unwrap();
        self.wire.push((from, Msg::Carry { to, data }));
    }

    fn drop_handle(&mut self, at: WorkerId, which: usize) {
        let handle = self.held[at as usize].swap_remove(which);
        let released = self.tables[at as usize].release(handle);
        self.post(at, released);
    }

    /// Delivers one message in flight, chosen at random.
    fn deliver_one(&mut self) {
        let pick = self.rng.usize(..self.wire.len());
        let (from, msg) = self.wire.swap_remove(pick);
        self.deliver(from, msg);
    }

    /// Delivers the first message in flight that `pick` chooses; false if there is none.
    fn deliver_first(&mut self, pick: impl Fn(&Msg) -> bool) -> bool {
        let Some(at) = self.wire.iter().position(|(_, msg)| pick(msg)) else { return false };
        let (from, msg) = self.wire.remove(at);
        self.deliver(from, msg);
        true
    }

    fn deliver(&mut self, from: WorkerId, msg: Msg) {
        match msg {
            Msg::Control(Send { to, msg }) => {
                let table = &mut self.tables[to as usize];
                let released = match msg {
                    Control::ForkRequest { rref, fork } => {
                        table.fork_requested(rref, fork);
                        self.wire.push((to, Msg::ForkAck { to: from, fork }));
                        Released::default()
                    }
                    Control::ChildAccept { fork } => table.child_accepted(fork),
                    Control::UserDelete { rref, fork } => table.fork_deleted(rref, fork),
                };
                self.post(to, released);
            }
            Msg::ForkAck { to, fork } => {
                let released = self.tables[to as usize].fork_confirmed(fork);
                self.post(to, released);
            }
            Msg::Carry { to, data } => {
                let (handle, released) = self.tables[to as usize].fork_in(data, from);
                self.held[to as usize].push(handle);
                self.post(to, released);
            }
            Msg::Remote { to, rref, fork, caller } => {
                let table = &mut self.tables[to as usize];
                table.remote_arrived(rref, fork, caller);
                let _ = table.set_value(rref, rref.local);
                self.wire.push((to, Msg::RemoteAck { to: caller, fork }));
            }
            Msg::RemoteAck { to, fork } => {
                let released = self.tables[to as usize].remote_confirmed(fork);
                self.post(to, released);
            }
        }
    }

    /// Never early: every handle held, and every fork in flight, still finds its OwnerRRef
    /// (or the REMOTE that creates it is still on the way).
    fn check_nothing_deleted_early(&self) {
        let remote_in_flight =
            |rref: RRefId| self.wire.iter().any(|(_, msg)| matches!(msg, Msg::Remote { rref: r, .. } if *r == rref));
        let owner_has = |owner: WorkerId, rref: RRefId| self.tables[owner as usize].owners.contains_key(&rref);
        for (at, handles) in self.held.iter().enumerate() {
            for handle in handles {
                let (owner, rref) = match handle {
                    Handle::Owner(rref) => (at as WorkerId, *rref),
                    Handle::User(fork) => {
                        let user = &self.tables[at].users[fork];
                        (user.owner, user.rref)
                    }
                };
                assert!(owner_has(owner, rref) || remote_in_flight(rref), "{rref} deleted while held on {at}");
            }
        }
        for (_, msg) in &self.wire {
            if let Msg::Carry { data, .. } = msg {
                assert!(
                    owner_has(data.owner, data.rref) || remote_in_flight(data.rref),
                    "{} deleted in flight",
                    data.rref
                );
            }
        }
    }

    fn settle(&mut self) {
        for _ in 0..100_000 {
            if self.wire.is_empty() {
                return;
            }
            self.deliver_one();
            self.check_nothing_deleted_early();
        }
        panic!("messages never settled");
    }

    fn assert_no_leaks(&self) {
        for (at, table) in self.tables.iter().enumerate() {
            assert_eq!(table.stats(), Stats::default(), "worker {at} leaks");
        }
    }
}

#[test]
fn owner_shares_with_user() {
    let mut world = World::new(2, 1);
    world.create(0, 42);
    world.share(0, 0, 1);
    world.drop_handle(0, 0);
    // the owner registered the fork before sending it: the value outlives the owner's handle
    assert_eq!(world.tables[0].value(world.tables[0].owners.keys().next().copied().unwrap()), Some(&42));
    world.settle();
    assert_eq!(world.tables[1].stats().users, 1);
    assert!(world.tables[1].is_confirmed(world.held[1][0]));
    world.drop_handle(1, 0);
    world.settle();
    world.assert_no_leaks();
}

#[test]
fn user_shares_with_owner() {
    let mut world = World::new(2, 2);
    world.remote(1, 0);
    world.settle();
    world.share(1, 0, 0);
    world.drop_handle(1, 0);
    // the user holds its fork for the child until the owner accepts it (G2)
    assert_eq!(world.tables[1].stats().users, 1);
    world.settle();
    assert_eq!(world.tables[1].stats(), Stats::default());
    assert_eq!(world.tables[0].stats().owners, 1, "the owner's code holds it now");
    world.drop_handle(0, 0);
    world.assert_no_leaks();
}

#[test]
fn user_shares_with_user() {
    let mut world = World::new(3, 3);
    world.create(0, 7);
    world.share(0, 0, 1);
    world.drop_handle(0, 0);
    world.settle();
    world.share(1, 0, 2);
    world.drop_handle(1, 0);
    world.settle();
    assert_eq!(world.tables[1].stats(), Stats::default());
    assert_eq!(world.tables[0].stats().forks_of_owners, 1);
    world.drop_handle(2, 0);
    world.settle();
    world.assert_no_leaks();
}

#[test]
fn creator_is_owner() {
    let mut world = World::new(1, 4);
    world.remote(0, 0);
    world.share(0, 0, 0);
    world.settle();
    assert_eq!(world.tables[0].stats().forks_of_owners, 0, "a fork sent to itself is no fork");
    world.drop_handle(0, 0);
    assert_eq!(world.tables[0].stats().owners, 1);
    world.drop_handle(0, 0);
    world.assert_no_leaks();
}

#[test]
fn a_fork_request_that_overtakes_the_remote_does_not_delete_early() {
    let mut world = World::new(3, 5);
    world.remote(1, 0);
    world.share(1, 0, 2);
    // the share, its FORK_REQUEST, the ack and the CHILD_ACCEPT all overtake the REMOTE
    while world.deliver_first(|msg| !matches!(msg, Msg::Remote { .. })) {
        world.check_nothing_deleted_early();
    }
    assert_eq!(world.tables[2].stats().users, 1);
    world.drop_handle(2, 0);
    world.settle();
    world.check_nothing_deleted_early();
    assert!(world.tables[0].value(world.tables[0].owners.keys().next().copied().unwrap()).is_some());
    world.drop_handle(1, 0);
    world.settle();
    world.assert_no_leaks();
}

#[test]
fn repeated_control_messages_change_nothing() {
    let mut table: Table<u64, ()> = Table::new(0);
    let handle = table.new_owner(1);
    let Handle::Owner(rref) = handle else { unreachable!() };
    let fork = Gid::new(1, 99);
    table.fork_requested(rref, fork);
    table.fork_requested(rref, fork);
    assert_eq!(table.stats().forks_of_owners, 1);
    assert!(table.fork_deleted(rref, fork).dropped.is_empty());
    assert!(table.fork_deleted(rref, fork).dropped.is_empty());
    // a late FORK_REQUEST for a deleted fork cannot bring it back
    table.fork_requested(rref, fork);
    assert_eq!(table.stats().forks_of_owners, 0);
    assert!(table.child_accepted(Gid::new(5, 5)).sends.is_empty());
    assert_eq!(table.release(handle).dropped.len(), 1);
    assert_eq!(table.release(handle).dropped.len(), 0);
}

#[test]
fn chain_owner_a_y_z_in_every_order_never_deletes_early_and_never_leaks() {
    for seed in 0..300 {
        let mut world = World::new(4, seed);
        world.create(0, 1);
        world.share(0, 0, 1);
        world.drop_handle(0, 0);
        // each hop as soon as the fork arrives, and the sender lets go at once
        for (from, to) in [(1, 2), (2, 3)] {
            while world.held[from as usize].is_empty() {
                world.deliver_one();
                world.check_nothing_deleted_early();
            }
            world.share(from, 0, to);
            world.drop_handle(from, 0);
        }
        world.settle();
        assert_eq!(world.tables[0].stats().owners, 1, "seed {seed}: Z still holds it");
        world.drop_handle(3, 0);
        world.settle();
        world.assert_no_leaks();
    }
}

#[test]
fn random_sharing_among_four_workers_never_leaks() {
    for seed in 0..8 {
        let mut world = World::new(4, seed);
        for step in 0..1_500 {
            let (at, to) = (world.rng.u32(..4), world.rng.u32(..4));
            match world.rng.u8(..10) {
                0 => world.create(at, step),
                1 => world.remote(at, to),
                2..=4 if !world.held[at as usize].is_empty() => {
                    let which = world.rng.usize(..world.held[at as usize].len());
                    world.share(at, which, to);
                }
                5..=6 if !world.held[at as usize].is_empty() => {
                    let which = world.rng.usize(..world.held[at as usize].len());
                    world.drop_handle(at, which);
                }
                _ if !world.wire.is_empty() => world.deliver_one(),
                _ => {}
            }
            world.check_nothing_deleted_early();
        }
        // forks still in flight arrive as new handles: let go until none is left
        while world.held.iter().any(|held| !held.is_empty()) || !world.wire.is_empty() {
            for at in 0..4 {
                while !world.held[at].is_empty() {
                    world.drop_handle(at as WorkerId, 0);
                }
            }
            world.settle();
        }
        world.assert_no_leaks();
    }
}

#[test]
fn shutdown_releases_every_fork_then_every_owner() {
    let mut world = World::new(2, 9);
    world.create(0, 1);
    world.share(0, 0, 1);
    world.remote(0, 1);
    world.settle();
    world.held.iter_mut().for_each(Vec::clear); // what the code holds no longer counts
    let released = world.tables[1].release_all_users();
    world.post(1, released);
    let released = world.tables[0].release_all_users();
    world.post(0, released);
    world.settle();
    assert_eq!(world.tables[0].stats().users + world.tables[1].stats().users, 0);
    assert_eq!(world.tables[0].stats().forks_of_owners + world.tables[1].stats().forks_of_owners, 0);
    // worker 1's OwnerRRef went with worker 0's fork; worker 0's own code held its one
    assert_eq!(world.tables[1].stats().owners, 0);
    assert_eq!(world.tables[0].clear_owners().len(), 1);
}
