//! One worker's RPC endpoint: a listener, one connection to each peer it calls (made on
//! first use; the peer answers on it), the calls waiting for an answer, the control messages
//! waiting for an ack, and this worker's RRef table.
//!
//! Python's threads meet the endpoint through two queues: requests to run (`next_request`)
//! and answers to `rpc_async` calls (`next_completion`). Nothing here waits on Python: the
//! tasks that read sockets only push to those queues and answer control messages themselves.

mod calls;
mod conn;
mod control;
mod dispatch;
mod outbox;
mod rrefs;

use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::task::AbortHandle;

use super::frame::Frame;
use super::ids::{Gid, WorkerId};
use super::queue::{BlockingQueue, Empty};
use super::refs::{Slot, Table};
use crate::address_log::{AddressLog, Throttled};
use crate::auth::{Door, Key};

pub use calls::{CallError, Request};
pub use rrefs::ValueError;

/// An OwnerRRef's value, opaque here (a Python object in the bindings).
pub type Value = Box<dyn Any + Send>;

/// Who waits for an OwnerRRef's value.
pub enum Waiter {
    /// A TO_HERE from another worker, answered by whoever sets the value.
    Remote(Responder),
    /// A thread of this worker (`local_value`, `to_here` on the owner).
    Local(std::sync::mpsc::SyncSender<()>),
}

pub type RefTable = Table<Value, Waiter>;

#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    /// host:port it listens on
    pub addr: String,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub me: WorkerId,
    /// Ranks of the group: a connection from any other rank is refused, even before the
    /// peers' addresses are known.
    pub world: u32,
    /// The host to listen on (the port is the kernel's choice).
    pub host: String,
    /// The group's key: every connection proves it ([`crate::auth::pair`], bound to the pair
    /// of ranks).
    pub key: Key,
    /// Test hook: each control message and ack waits a random time in this range before it
    /// leaves, so that they arrive in any order.
    pub control_delay: Option<(Duration, Duration)>,
}

/// A request or a response as Python sees it.
#[derive(Clone, Debug, Default)]
pub struct Message {
    pub status: u8,
    pub payload: Bytes,
    pub buffers: Vec<Bytes>,
}

/// A request for Python's threads to run.
pub struct Incoming {
    pub from: WorkerId,
    pub op: u8,
    pub rref: Gid,
    pub fork: Gid,
    pub message: Message,
    pub responder: Responder,
}

/// Where the answer to one request goes.
#[derive(Clone)]
pub struct Responder {
    id: u64,
    tx: conn::ConnTx,
}

impl Responder {
    /// Sends the answer; if the caller's connection is gone, so is the caller's wait.
    pub fn respond(&self, message: Message) {
        let frame = Frame {
            kind: super::frame::Kind::Response,
            op: 0,
            status: message.status,
            id: self.id,
            rref: Gid::default(),
            fork: Gid::default(),
            payload: message.payload,
            buffers: message.buffers,
        };
        let _ = self.tx.send(frame);
    }
}

/// The answer to an `rpc_async` call, for the thread that completes Python's futures.
pub struct Completion {
    pub token: u64,
    pub result: Result<Message, CallError>,
}

pub struct Endpoint {
    me: WorkerId,
    world: u32,
    key: Key,
    /// Connections that have not proven the key yet.
    door: std::sync::Arc<Door>,
    control_delay: Option<(Duration, Duration)>,
    runtime: Handle,
    local_addr: SocketAddr,
    peers: OnceLock<Vec<conn::PeerSlot>>,
    next_id: AtomicU64,
    calls: Mutex<HashMap<u64, calls::PendingCall>>,
    control: Mutex<HashMap<u64, control::PendingControl>>,
    refs: Mutex<RefTable>,
    requests: BlockingQueue<Incoming>,
    completions: BlockingQueue<Completion>,
    closed: AtomicBool,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Connections that failed the handshake: counted, said once a minute per address.
    refused: AddressLog,
    /// Accepts that failed (out of descriptors), said once a minute at most.
    accept_failures: Throttled,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Endpoint {
    /// Binds the listener and starts accepting; peers are known later ([`Endpoint::set_peers`]),
    /// once every worker has published its address.
    pub async fn start(config: Config) -> std::io::Result<Arc<Endpoint>> {
        let listener = TcpListener::bind((config.host.as_str(), 0)).await?;
        let endpoint = Arc::new(Endpoint {
            me: config.me,
            world: config.world,
            key: config.key,
            door: Door::shared(),
            control_delay: config.control_delay,
            runtime: Handle::current(),
            local_addr: listener.local_addr()?,
            peers: OnceLock::new(),
            next_id: AtomicU64::new(1),
            calls: Mutex::new(HashMap::new()),
            control: Mutex::new(HashMap::new()),
            refs: Mutex::new(Table::new(config.me)),
            requests: BlockingQueue::default(),
            completions: BlockingQueue::default(),
            closed: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            refused: AddressLog::new(),
            accept_failures: Throttled::new(),
        });
        let accepting = tokio::spawn(endpoint.clone().accept_loop(listener));
        endpoint.track(accepting.abort_handle());
        Ok(endpoint)
    }

    pub fn me(&self) -> WorkerId {
        self.me
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Every worker of the group, indexed by rank. Set once.
    pub fn set_peers(&self, peers: Vec<Peer>) -> Result<(), CallError> {
        if peers.len() != self.world as usize {
            let message = format!("{} peers for an RPC group of {}", peers.len(), self.world);
            return Err(CallError::Refused(message));
        }
        let slots = peers.into_iter().map(conn::PeerSlot::new).collect();
        self.peers.set(slots).map_err(|_| CallError::Refused("the RPC group's peers are already set".into()))
    }

    fn peers(&self) -> &[conn::PeerSlot] {
        self.peers.get().map(Vec::as_slice).unwrap_or_default()
    }

    fn world(&self) -> u32 {
        self.world
    }

    /// "worker 'name' (rank r)", for messages.
    pub fn describe(&self, peer: WorkerId) -> String {
        match self.peers().get(peer as usize) {
            Some(slot) => format!("worker '{}' (rank {peer}, {})", slot.info.name, slot.info.addr),
            None => format!("rank {peer}"),
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn track(&self, task: AbortHandle) {
        let mut tasks = lock(&self.tasks);
        tasks.retain(|task| !task.is_finished());
        tasks.push(task);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The next request for Python to run; `Empty::Closed` once the endpoint is closed.
    pub fn next_request(&self, wait: Duration) -> Result<Incoming, Empty> {
        self.requests.pop(wait)
    }

    /// The next answer to an `rpc_async` call.
    pub fn next_completion(&self, wait: Duration) -> Result<Completion, Empty> {
        self.completions.pop(wait)
    }

    /// Calls waiting for an answer and control messages waiting for an ack: what a graceful
    /// shutdown waits for.
    pub fn outstanding(&self) -> (usize, usize) {
        (lock(&self.calls).len() + self.completions.len(), lock(&self.control).len())
    }

    /// Stops at once: every pending call fails, connections and the listener close, the
    /// queues wake their waiters. What the RRef table holds is dropped.
    pub fn close(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.fail_all_calls(|| CallError::Shutdown("RPC was shut down on this worker".into()));
        lock(&self.control).clear();
        for slot in self.peers() {
            slot.disconnect();
        }
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        self.requests.close();
        self.completions.close();
        let dropped = lock(&self.refs).clear_owners();
        drop_slots(dropped);
    }
}

/// Drops what the table let go of, outside its lock: local waiters wake up (their value is
/// gone), values go (in the bindings, to the thread that drops Python objects).
fn drop_slots(slots: Vec<Slot<Value, Waiter>>) {
    drop(slots);
}
