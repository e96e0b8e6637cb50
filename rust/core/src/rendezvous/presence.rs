//! Whether a member's agent is still there, asked the moment it matters.
//!
//! A node's death reaches its peers' workers first (their collective breaks) and its heartbeats
//! only a loss window later, so an agent whose workers failed asks the other members before it
//! counts the failure as their own. First through the store (or etcd): a member whose agent
//! runs and reaches it answers at once, and is there. A member that does not answer is then
//! probed here: every agent listens on a port of its own that accepts and closes (published in
//! its member record). A refusal with no answer is a gone agent (a crash, a kill, a host whose
//! processes all died); a refusal alone is not, for a firewall that rejects answers the same
//! way; no answer at all is only a suspicion (a stopped agent, a dead machine, a cut link),
//! which the heartbeats or the lease then settle.
//!
//! A member can also be watched: a connection that sends [`WATCH`] is held open, and the
//! moment the agent dies (with every process of its host, say) its kernel closes it. The
//! watcher then asks the census at once, where the workers might compute for a while before
//! a collective breaks, and a heartbeat takes a loss window. Only a few watchers are held
//! ([`WATCHERS`]); a connection that does not say it watches within [`WATCH_HELLO`] (a probe)
//! is closed.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{lookup_host, TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use super::node::NodeDesc;
use crate::store::server::listener;

/// How long a probe waits for the connection: a live agent's kernel answers in well under a
/// millisecond on a LAN, and a longer wait only delays the unsure verdict.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a census waits for the members it asked through the store (or etcd) to answer: a
/// live agent that reaches it answers in a few round trips (it waits on the ask's key). Only a
/// member that did not answer is probed here at all, and a live agent's port accepts the probe,
/// so a slow answer only costs the probe: it is never counted gone for it. Each host lost waits
/// this long before the others re-form.
pub const ASK_PATIENCE: Duration = Duration::from_millis(250);

/// What a watcher sends once connected: hold this connection for as long as the agent lives.
pub const WATCH: u8 = b'W';
/// Watchers' connections held at once, at most: a round's agents watch one member each, and
/// strangers may fill the rest (a watcher then goes without, and the census is asked when the
/// collectives break or the heartbeats lapse, as before).
const WATCHERS: usize = 64;
/// How long an accepted connection has to say it watches.
const WATCH_HELLO: Duration = Duration::from_secs(1);

/// This agent's presence listener; stops when dropped.
pub struct Presence {
    port: u16,
    task: JoinHandle<()>,
    /// Dropped with the listener: the watchers' connections close too.
    _open: watch::Sender<()>,
}

impl Presence {
    /// Listens on a port the kernel picks: on loopback alone for a node whose address is a
    /// loopback one (a job of this machine alone), else on every address. `None` outside a
    /// tokio runtime (then nobody can probe this node, and its peers rely on its heartbeats).
    pub fn start(addr: &str) -> Option<Presence> {
        tokio::runtime::Handle::try_current().ok()?;
        let host = listener::is_loopback_name(addr).then_some(addr);
        let listening = listener::bind(host, 0).and_then(|std| {
            std.set_nonblocking(true)?;
            TcpListener::from_std(std)
        });
        let listener = match listening {
            Ok(listener) => listener,
            Err(err) => {
                tracing::warn!("cannot listen for presence probes ({err}): peers will notice this node's loss by its heartbeats only");
                return None;
            }
        };
        let port = listener.local_addr().ok()?.port();
        let held = Arc::new(Semaphore::new(WATCHERS));
        let (open, watching) = watch::channel(());
        let task = tokio::spawn(async move {
            loop {
                // a probe's connection is the answer; a watcher's is held while it watches
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let Ok(place) = held.clone().try_acquire_owned() else { continue };
                        let mut open = watching.clone();
                        tokio::spawn(async move {
                            tokio::select! {
                                () = hold(stream) => {}
                                _ = open.changed() => {} // the listener stopped
                            }
                            drop(place);
                        });
                    }
                    Err(err) => {
                        tracing::debug!("presence listener: {err}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        Some(Presence { port, task, _open: open })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Holds a watcher's connection until it goes (or sends anything more); closes any other.
async fn hold(mut stream: TcpStream) {
    let mut byte = [0u8; 1];
    if let Ok(Ok(1)) = tokio::time::timeout(WATCH_HELLO, stream.read(&mut byte)).await {
        if byte[0] == WATCH {
            let _ = stream.read(&mut byte).await;
        }
    }
}

/// A connection held to a member's presence port.
pub struct Watched(TcpStream);

impl Watched {
    /// Connects to the agent at `host:port` (within `timeout`) and asks it to hold the
    /// connection.
    pub async fn connect(host: &str, port: u16, timeout: Duration) -> io::Result<Watched> {
        let connect = async {
            let mut stream = TcpStream::connect((host, port)).await?;
            stream.write_all(&[WATCH]).await?;
            Ok(Watched(stream))
        };
        tokio::time::timeout(timeout, connect)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {timeout:?}"))))
    }

    /// Returns when the other end closed the connection: its agent exited or died, or it
    /// would not hold it (too many watchers).
    pub async fn closed(&mut self) {
        let mut byte = [0u8; 1];
        while let Ok(1..) = self.0.read(&mut byte).await {}
    }
}

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The agent accepted the connection.
    Present,
    /// The machine refused it: nothing listens there any more.
    Gone,
    /// No answer within the timeout, or the network said no route (the reason).
    Unsure(String),
}

/// Probes the agent at `host:port`, within `timeout`.
pub async fn probe(host: &str, port: u16, timeout: Duration) -> Probe {
    let attempt = async {
        let addrs: Vec<SocketAddr> = lookup_host((host, port)).await?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} resolves to no address"));
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(_) => return Ok(()),
                Err(err) => last = err,
            }
        }
        Err(last)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(())) => Probe::Present,
        Ok(Err(err)) if err.kind() == io::ErrorKind::ConnectionRefused => Probe::Gone,
        Ok(Err(err)) => Probe::Unsure(err.to_string()),
        Err(_) => Probe::Unsure(format!("no answer within {timeout:?}")),
    }
}

/// Probes at once in flight, at most (a large job's agents must not open a descriptor per
/// member at the same moment).
const PROBES_IN_FLIGHT: usize = 64;

/// What a look at the round's other members found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Members whose agents are gone (group rank, node).
    pub gone: Vec<(u32, NodeDesc)>,
    /// Members that did not answer (group rank, why): only their heartbeats or leases can tell.
    pub unsure: Vec<(u32, String)>,
}

/// Probes every member that published a presence port (group rank, node), all at once up to
/// [`PROBES_IN_FLIGHT`].
pub async fn census(members: Vec<(u32, NodeDesc)>, timeout: Duration) -> Census {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(PROBES_IN_FLIGHT));
    let mut probes = tokio::task::JoinSet::new();
    for (rank, node) in members {
        let Some(port) = node.presence else { continue };
        let slots = slots.clone();
        probes.spawn(async move {
            let _slot = slots.acquire_owned().await;
            let found = probe(&node.addr, port, timeout).await;
            (rank, node, found)
        });
    }
    let mut census = Census::default();
    while let Some(done) = probes.join_next().await {
        let Ok((rank, node, found)) = done else { continue };
        match found {
            Probe::Present => {}
            Probe::Gone => census.gone.push((rank, node)),
            Probe::Unsure(why) => census.unsure.push((rank, why)),
        }
    }
    census.gone.sort_by_key(|(rank, _)| *rank);
    census.unsure.sort_by_key(|(rank, _)| *rank);
    census
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_live_agent_is_present_and_a_closed_port_is_gone() {
        let presence = Presence::start("127.0.0.1").expect("inside a runtime");
        assert_eq!(probe("127.0.0.1", presence.port(), PROBE_TIMEOUT).await, Probe::Present);
        let port = presence.port();
        drop(presence);
        tokio::task::yield_now().await; // the listener goes with its task
        let found = probe("127.0.0.1", port, PROBE_TIMEOUT).await;
        assert_eq!(found, Probe::Gone, "nothing listens on port {port} any more");
    }

    /// A listener that never accepts, with its accept queue filled: a SYN to it goes
    /// unanswered, as to a dead machine (or one flooded by strangers).
    fn silent_listener() -> (socket2::Socket, u16, Vec<std::net::TcpStream>) {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
        socket.listen(0).unwrap();
        let port = socket.local_addr().unwrap().as_socket().unwrap().port();
        let mut fillers = Vec::new();
        let target = SocketAddr::from(([127, 0, 0, 1], port));
        while let Ok(stream) = std::net::TcpStream::connect_timeout(&target, Duration::from_millis(100)) {
            fillers.push(stream);
            assert!(fillers.len() < 16, "the accept queue never filled");
        }
        (socket, port, fillers)
    }

    #[tokio::test]
    async fn a_census_sorts_members_into_gone_and_unsure() {
        let alive = Presence::start("127.0.0.1").unwrap();
        let dead = Presence::start("127.0.0.1").unwrap();
        let dead_port = dead.port();
        drop(dead);
        tokio::task::yield_now().await;
        let (_silent, silent_port, _fillers) = silent_listener();
        let node = |presence| NodeDesc { order: None, addr: "127.0.0.1".into(), pid: 1, local_id: 0, presence };
        let members = vec![
            (1, node(Some(alive.port()))),
            (2, node(Some(dead_port))),
            (3, node(Some(silent_port))),
            (4, node(None)), // cannot be asked: not counted either way
        ];
        let census = census(members, Duration::from_millis(200)).await;
        assert_eq!(census.gone.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), [2]);
        assert_eq!(census.unsure.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), [3]);
    }

    #[tokio::test]
    async fn a_watch_is_held_while_the_agent_lives_and_closes_when_it_goes() {
        let presence = Presence::start("127.0.0.1").unwrap();
        let mut watched = Watched::connect("127.0.0.1", presence.port(), PROBE_TIMEOUT).await.unwrap();
        let held = tokio::time::timeout(Duration::from_millis(1500), watched.closed()).await;
        assert!(held.is_err(), "the watch closed while the agent lives (past the hello's deadline too)");
        // probes are answered as before while a watch is held
        assert_eq!(probe("127.0.0.1", presence.port(), PROBE_TIMEOUT).await, Probe::Present);
        drop(presence);
        tokio::time::timeout(Duration::from_secs(10), watched.closed()).await.expect("the watch closed with the agent");
    }

    #[tokio::test]
    async fn strangers_who_fill_the_watchers_places_are_held_apart_from_probes() {
        let presence = Presence::start("127.0.0.1").unwrap();
        let mut strangers = Vec::new();
        for _ in 0..WATCHERS {
            strangers.push(Watched::connect("127.0.0.1", presence.port(), PROBE_TIMEOUT).await.unwrap());
        }
        // one more is closed at once (its watcher falls back on the census when the
        // collectives break); a probe is still answered
        let mut late = Watched::connect("127.0.0.1", presence.port(), PROBE_TIMEOUT).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), late.closed()).await.expect("closed at once");
        assert_eq!(probe("127.0.0.1", presence.port(), PROBE_TIMEOUT).await, Probe::Present);
        // a connection that never says it watches is closed after the hello's deadline
        let mut silent = TcpStream::connect(("127.0.0.1", presence.port())).await.unwrap();
        drop(strangers.pop());
        tokio::time::sleep(Duration::from_millis(50)).await; // its place is given back
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(WATCH_HELLO * 5, silent.read(&mut byte)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a silent connection was held: {read:?}");
    }

    #[tokio::test]
    async fn a_machine_that_never_answers_is_unsure_not_gone() {
        let (_silent, port, _fillers) = silent_listener();
        match probe("127.0.0.1", port, Duration::from_millis(200)).await {
            Probe::Unsure(_) => {}
            other => panic!("expected Unsure, got {other:?}"),
        }
    }
}
