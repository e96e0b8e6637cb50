//! The member this node watches: the next one in the round (group rank + 1, around), so that
//! every member is watched by one other. A connection held to its presence port
//! ([`crate::rendezvous::presence::Watched`]) closes the moment its agent dies, with every
//! process of its host too; the watcher then asks the census at once. Without it, the loss is
//! found when a collective breaks (after the compute in progress, which may be long, and never
//! where a collective hangs rather than fails) or when the heartbeats lapse.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::presence::{Watched, PROBE_TIMEOUT};
use crate::rendezvous::{Rendezvous, RendezvousInfo};

/// How long reading the neighbor's description may take before the round goes unwatched.
const DESCRIBE_WAIT: Duration = Duration::from_secs(2);
/// After a watch that closed while its agent lived (it would not hold it: too many watchers),
/// or that could not connect, the pause before the next, doubled each time up to
/// [`MOST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const MOST_PAUSE: Duration = Duration::from_secs(60);

/// A watch on one member: [`NeighborWatch::closed`] returns when its connection closed.
pub(super) struct NeighborWatch {
    /// The member's group rank and description; `None`: nobody to watch (a round of one, a
    /// member with no presence port, a backend that keeps no descriptions).
    watched: Option<(u32, NodeDesc)>,
    task: Option<JoinHandle<()>>,
    pause: Duration,
}

impl NeighborWatch {
    /// Starts watching the member after this one in the round `info`.
    pub(super) async fn start(rdzv: &mut Rendezvous, info: &RendezvousInfo) -> NeighborWatch {
        let mut watch = NeighborWatch { watched: None, task: None, pause: FIRST_PAUSE };
        if info.world_size < 2 {
            return watch;
        }
        let rank = (info.rank + 1) % info.world_size;
        let node = match tokio::time::timeout(DESCRIBE_WAIT, rdzv.member_node(rank)).await {
            Ok(Ok(node)) => node,
            Ok(Err(err)) => return unwatched(watch, rank, &err.to_string()),
            Err(_) => return unwatched(watch, rank, &format!("no answer within {DESCRIBE_WAIT:?}")),
        };
        let Some(node) = node.filter(|node| node.presence.is_some()) else {
            return unwatched(watch, rank, "it published no presence port");
        };
        watch.watched = Some((rank, node));
        watch.task = watch.spawn(Duration::ZERO);
        watch
    }

    /// Who is watched, as the log names it.
    pub(super) fn describe(&self) -> String {
        match &self.watched {
            Some((rank, node)) => format!("node {node} (group rank {rank})"),
            None => "nobody".to_owned(),
        }
    }

    /// Returns when the watched member's connection closed, or its machine refused one (never
    /// when nobody is watched).
    pub(super) async fn closed(&mut self) {
        match self.task.as_mut() {
            Some(task) => {
                let _ = task.await;
                self.task = None;
            }
            None => std::future::pending().await,
        }
    }

    /// Watches again after a close that the census found to be no loss: after a pause that
    /// doubles each time, so that an agent that will not hold the watch is not asked about in
    /// a loop.
    pub(super) fn again(&mut self) {
        let pause = self.pause;
        self.pause = (self.pause * 2).min(MOST_PAUSE);
        self.task = self.spawn(pause);
    }

    fn spawn(&self, after: Duration) -> Option<JoinHandle<()>> {
        let (rank, node) = self.watched.clone()?;
        let port = node.presence?;
        Some(tokio::spawn(async move {
            let mut pause = after;
            loop {
                tokio::time::sleep(pause).await;
                match Watched::connect(&node.addr, port, PROBE_TIMEOUT).await {
                    Ok(mut watched) => {
                        tracing::debug!("watching node {node} (group rank {rank}) at {}:{port}", node.addr);
                        return watched.closed().await;
                    }
                    // nothing listens there: what the census is for, asked now
                    Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => return,
                    // no answer (a dead machine, a cut link, a firewall that drops): only the
                    // heartbeats can tell, so no census is asked for it; tried again later
                    Err(err) => {
                        tracing::debug!("cannot watch node {node} (group rank {rank}) yet: {err}");
                        pause = (pause * 2).clamp(FIRST_PAUSE, MOST_PAUSE);
                    }
                }
            }
        }))
    }
}

impl Drop for NeighborWatch {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

fn unwatched(watch: NeighborWatch, rank: u32, why: &str) -> NeighborWatch {
    tracing::debug!("not watching group rank {rank}: {why}; its loss is found by the census and the heartbeats");
    watch
}
