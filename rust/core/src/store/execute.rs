//! The server's shared state: the data plus its waiters, and the execution of one request
//! against them. Pure logic (replies are written to a buffer); the connection task owns I/O.

use bytes::{BufMut, BytesMut};

use super::counter::CounterError;
use super::data::KvState;
use super::protocol::{CHECK_NOT_READY, CHECK_READY, STOP_WAITING, WAIT_CANCELED};
use super::request::{put_bytes, Request};
use super::waiters::{AlreadyWaiting, WaiterId, Waiters, Waker};

/// A request that is well-formed on the wire but cannot be executed. The server closes the
/// connection that sent it (torch does the same), and nothing else is affected.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("{0}")]
    Counter(#[from] CounterError),
    #[error("{0}")]
    AlreadyWaiting(#[from] AlreadyWaiting),
    #[error("VALIDATE sent on an already validated connection")]
    RepeatedValidate,
}

#[derive(Debug, Default)]
pub struct Db {
    state: KvState,
    waiters: Waiters,
}

impl Db {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that also lists which waits completed, for a server that answers them by id
    /// (see [`Db::take_completed`]).
    pub fn listing_completed() -> Self {
        Db { state: KvState::default(), waiters: Waiters::listing_completed() }
    }

    /// Moves the ids of the waits completed since the last call into `into`.
    pub fn take_completed(&mut self, into: &mut Vec<WaiterId>) {
        self.waiters.take_completed(into);
    }

    pub fn state(&self) -> &KvState {
        &self.state
    }

    /// Number of parties blocked in WAIT or BARRIER.
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Whether the waiter `id` is blocked in a WAIT or BARRIER.
    pub fn is_waiting(&self, id: WaiterId) -> bool {
        self.waiters.is_waiting(id)
    }

    /// Executes `request` for the waiter `id` and appends its reply, if it has one, to `out`.
    /// A wait that cannot be answered yet registers `waker`, which later receives one `()`.
    pub fn execute(
        &mut self,
        id: WaiterId,
        waker: &Waker,
        request: &Request<'_>,
        out: &mut BytesMut,
    ) -> Result<(), ExecError> {
        use Request::*;
        match request {
            Validate { .. } => return Err(ExecError::RepeatedValidate),
            Ping { nonce } => out.put_u32_le(*nonce),
            Set { key, value } => self.set(key, value),
            CompareSet { key, expected, desired } => {
                let outcome = self.state.compare_set(key, expected, desired);
                put_bytes(out, &outcome.value);
                // torch's libuv server wakes waiters even when nothing was stored.
                self.waiters.key_written(key);
            }
            Get { key } => put_bytes(out, self.state.get(key).map_or(&[][..], |v| v)),
            Add { key, delta } => {
                let total = self.state.add(key, *delta)?;
                out.put_i64_le(total);
                self.waiters.key_written(key);
            }
            Check { keys } => {
                let ready = keys.iter().all(|key| self.state.is_ready(key));
                out.put_u8(if ready { CHECK_READY } else { CHECK_NOT_READY });
            }
            Wait { keys } => {
                if self.wait(id, keys, waker)? {
                    out.put_u8(STOP_WAITING);
                }
            }
            GetNumKeys => out.put_i64_le(self.state.num_keys() as i64),
            DeleteKey { key } => out.put_i64_le(i64::from(self.state.delete(key))),
            Append { key, value } => {
                self.state.append(key, value);
                self.waiters.key_written(key);
            }
            MultiGet { keys } => keys.iter().for_each(|key| put_bytes(out, self.state.get(key).map_or(&[][..], |v| v))),
            MultiSet { pairs } => pairs.iter().for_each(|(key, value)| self.set(key, value)),
            CancelWait => {
                self.waiters.cancel(id);
                out.put_u8(WAIT_CANCELED);
            }
            QueuePush { key, value } => {
                self.state.queue_push(key, value);
                self.waiters.item_pushed(key);
            }
            QueuePop { key } => self.queue_pop(key, out),
            QueueLen { key } => out.put_i64_le(self.state.queue_len(key) as i64),
            ListKeys => self.list_keys(out),
            Barrier { key, world_size } => self.barrier(id, waker, key, *world_size, out)?,
        }
        Ok(())
    }

    fn set(&mut self, key: &[u8], value: &[u8]) {
        self.state.set(key, value);
        self.waiters.key_written(key);
    }

    /// The queue's length before the pop, then the item popped, if there was one.
    fn queue_pop(&mut self, key: &[u8], out: &mut BytesMut) {
        let (before, item) = self.state.queue_pop(key);
        out.put_i64_le(before as i64);
        if let Some(item) = item {
            put_bytes(out, &item);
        }
    }

    fn list_keys(&self, out: &mut BytesMut) {
        out.put_i64_le(self.state.num_keys() as i64);
        for key in self.state.keys() {
            put_bytes(out, key);
        }
    }

    /// One more arrival at the barrier `key`: the last of `world_size` releases everyone, the
    /// others wait for it.
    fn barrier(
        &mut self,
        id: WaiterId,
        waker: &Waker,
        key: &[u8],
        world_size: i64,
        out: &mut BytesMut,
    ) -> Result<(), ExecError> {
        let arrived = self.state.add(key, 1)?;
        if arrived >= world_size {
            out.put_u8(STOP_WAITING);
            self.waiters.key_written(key);
        } else {
            self.waiters.register(id, &[key], waker.clone())?;
        }
        Ok(())
    }

    /// Returns true if every key is ready now; otherwise registers `id` on the missing ones.
    pub fn wait(&mut self, id: WaiterId, keys: &[&[u8]], waker: &Waker) -> Result<bool, AlreadyWaiting> {
        let missing: Vec<&[u8]> = keys.iter().copied().filter(|key| !self.state.is_ready(key)).collect();
        if missing.is_empty() {
            return Ok(true);
        }
        self.waiters.register(id, &missing, waker.clone())?;
        Ok(false)
    }

    /// Registers `id` to be woken at the next write of `key`, whether or not it exists now.
    /// At most one watch or wait per id: an id already registered is left as it is.
    pub fn watch_key(&mut self, id: WaiterId, key: &[u8], waker: &Waker) {
        if !self.waiters.is_waiting(id) {
            let _ = self.waiters.register(id, &[key], waker.clone());
        }
    }

    /// Forgets everything `id` was waiting for (its connection closed, or it gave up).
    pub fn forget(&mut self, id: WaiterId) {
        self.waiters.cancel(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::request::Keys;

    struct Conn {
        id: WaiterId,
        waker: Waker,
        woken: Waker,
    }

    fn conn(id: WaiterId) -> Conn {
        let waker = Waker::default();
        Conn { id, woken: waker.clone(), waker }
    }

    fn run(db: &mut Db, conn: &Conn, request: Request<'_>) -> Vec<u8> {
        let mut out = BytesMut::new();
        db.execute(conn.id, &conn.waker, &request, &mut out).unwrap();
        out.to_vec()
    }

    #[test]
    fn get_of_a_missing_key_answers_an_empty_value() {
        let mut db = Db::new();
        let c = conn(1);
        assert_eq!(run(&mut db, &c, Request::Get { key: b"/nokey" }), 0u64.to_le_bytes());
    }

    #[test]
    fn wait_answers_only_after_the_last_missing_key_is_set() {
        let mut db = Db::new();
        let (a, b) = (conn(1), conn(2));
        assert!(run(&mut db, &a, Request::Wait { keys: Keys::from_iter([&b"k1"[..], b"k2"]) }).is_empty());
        run(&mut db, &b, Request::Set { key: b"k1", value: b"" });
        assert_eq!(a.woken.take(), 0);
        run(&mut db, &b, Request::Add { key: b"k2", delta: 1 });
        assert!(a.woken.take() > 0);
        assert_eq!(db.waiting(), 0);
    }

    #[test]
    fn delete_does_not_wake_and_cancel_always_answers() {
        let mut db = Db::new();
        let (a, b) = (conn(1), conn(2));
        run(&mut db, &a, Request::Wait { keys: Keys::from_iter([&b"k"[..]]) });
        assert_eq!(run(&mut db, &b, Request::DeleteKey { key: b"k" }), 0i64.to_le_bytes());
        assert_eq!(a.woken.take(), 0);
        assert_eq!(run(&mut db, &a, Request::CancelWait), [WAIT_CANCELED]);
        assert_eq!(run(&mut db, &b, Request::CancelWait), [WAIT_CANCELED]);
        assert_eq!(db.waiting(), 0);
    }

    #[test]
    fn failed_compare_set_on_a_missing_key_still_wakes() {
        let mut db = Db::new();
        let (a, b) = (conn(1), conn(2));
        run(&mut db, &a, Request::Wait { keys: Keys::from_iter([&b"k"[..]]) });
        let reply = run(&mut db, &b, Request::CompareSet { key: b"k", expected: b"exp", desired: b"new" });
        assert_eq!(reply, [&3u64.to_le_bytes()[..], b"exp"].concat());
        assert!(a.woken.take() > 0);
        assert!(db.state().get(b"k").is_none());
    }

    #[test]
    fn barrier_releases_everyone_when_the_last_arrives() {
        let mut db = Db::new();
        let (a, b) = (conn(1), conn(2));
        assert!(run(&mut db, &a, Request::Barrier { key: b"bar", world_size: 2 }).is_empty());
        assert_eq!(run(&mut db, &b, Request::Barrier { key: b"bar", world_size: 2 }), [STOP_WAITING]);
        assert!(a.woken.take() > 0);
        assert_eq!(db.state().get(b"bar").unwrap(), "2");
        // world_size <= 0 is complete at once
        assert_eq!(run(&mut db, &a, Request::Barrier { key: b"z", world_size: 0 }), [STOP_WAITING]);
    }

    #[test]
    fn add_on_text_is_an_error_and_changes_nothing() {
        let mut db = Db::new();
        let c = conn(1);
        run(&mut db, &c, Request::Set { key: b"t", value: b"abc" });
        let mut out = BytesMut::new();
        let result = db.execute(c.id, &c.waker, &Request::Add { key: b"t", delta: 1 }, &mut out);
        assert!(matches!(result, Err(ExecError::Counter(_))));
        assert!(out.is_empty());
    }

    #[test]
    fn queue_pop_answers_length_then_item() {
        let mut db = Db::new();
        let c = conn(1);
        run(&mut db, &c, Request::QueuePush { key: b"q", value: b"x1" });
        run(&mut db, &c, Request::QueuePush { key: b"q", value: b"x2" });
        let reply = run(&mut db, &c, Request::QueuePop { key: b"q" });
        assert_eq!(reply, [&2i64.to_le_bytes()[..], &2u64.to_le_bytes(), b"x1"].concat());
        run(&mut db, &c, Request::QueuePop { key: b"q" });
        assert_eq!(run(&mut db, &c, Request::QueuePop { key: b"q" }), 0i64.to_le_bytes());
        assert_eq!(run(&mut db, &c, Request::GetNumKeys), 0i64.to_le_bytes());
    }
}
