//! The dynamic rendezvous handler: elastic membership over any [`RendezvousStore`].
//!
//! Rounds follow one another; a round, once sealed, never changes. A member that calls
//! `next_rendezvous` again opens the next round (compare-and-set on the round number) and
//! tells everyone through the event log; late nodes register as waiting (which tells the
//! members to re-form with them) or as spares (the round is full), then wait for the next
//! round. While a round runs, members send heartbeats and watch their ring neighbour; a
//! background watcher turns relevant events into [`MembershipChange`]s for the agent.
//!
//! The store may blip, restart empty or be lost with its host: every background task
//! reconnects on its own, a copy of the state that is gone is set up again (at the same site
//! or the next one, see [`super::locate`]) with the job-wide restart count carried over, and
//! the members re-form there.
//!
//! Here: joining a round and the membership that follows; [`backend`]: the agent's interface
//! (closing, restarts, what `elastix status` reads); [`placement`]: where the state lives;
//! [`questions`]: what the agent asks when its workers fail; [`watcher`]: the events that end
//! a round.

mod backend;
mod placement;
mod questions;
mod watcher;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::watcher::{relevance, spawn_change_watcher};
use super::contact::Contact;
use super::events;
use super::keys::Keys;
use super::liveness::{answered, ask, member_key, report_lost, spawn_heartbeats, spawn_monitor, RoundContext};
use super::locate::{self, Choice, Known, Probe};
use super::round::{JoinOutcome, RoundJoin};
use super::trust;
use crate::rendezvous::backend::{Backend, StatusWriter};
use crate::rendezvous::change::{MembershipChange, RendezvousInfo};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::participant::{CloseNote, Participant};
use crate::rendezvous::presence::{self, Census, ASK_PATIENCE, PROBE_TIMEOUT};
use crate::rendezvous::records::{
    decode, encode, AgentFacts, Arrival, Event, FailureRecord, Master, Meta, NodeStatus, FORMAT_VERSION,
};
use crate::rendezvous::store::{RendezvousStore, StoreConn};
use crate::rendezvous::trust::workers_store_config;
use crate::store::AnyServer;

/// How long a node waits between looks for a store site that answers.
const SITE_RETRY: Duration = Duration::from_millis(500);

/// The round this node is a member of, with what runs for it.
struct Membership {
    round: u64,
    /// This node's group rank in the round.
    rank: u32,
    world_size: u32,
    tasks: Vec<JoinHandle<()>>,
    changes: watch::Receiver<Option<MembershipChange>>,
    /// Where the round's changes are sent (by its tasks, and by the handler itself).
    notify: Arc<watch::Sender<Option<MembershipChange>>>,
    /// The workers' store, when this node is rank 0.
    _master: Option<AnyServer>,
    /// The event log's count when this node joined: what comes after may concern the round.
    events_seen: i64,
}

impl Drop for Membership {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

pub struct DynamicRendezvous<S: RendezvousStore> {
    store: S,
    /// This node: its settings, description, presence port, and how the job ended.
    me: Participant,
    conn: Option<S::Conn>,
    current: Option<Membership>,
    /// The last round this node was a member of (it opens the next one when it comes back),
    /// and how many nodes to expect back.
    last_round: Option<LastRound>,
    /// The copy of the state this node works with (see [`super::locate`]).
    known: Option<Known>,
    /// The highest job-wide restart count seen, carried to a new copy of the state.
    restarts_seen: i64,
    /// The run's prefix in the store, for the [`RendezvousInfo`].
    store_prefix: String,
    /// How new connections are bounded now: by the deadline of the rendezvous under way (a
    /// store that stays away shows one countdown, see `next_rendezvous`), or by a question's,
    /// quietly (`census`). Without one, or once past, they give up after a loss window.
    connect_by: Option<ConnectBound>,
    /// The store's loss has been said, with the remedy, since it last answered.
    store_lost_said: bool,
    /// The rendezvous store sites this agent serves (none, or one per listed address of its
    /// own), kept up a little at the end for the nodes still reading how the job ended.
    hosted: Vec<AnyServer>,
}

impl<S: RendezvousStore> DynamicRendezvous<S> {
    /// `store_prefix` is the run's prefix in the store, for the [`RendezvousInfo`].
    pub fn new(store: S, settings: RendezvousSettings, store_prefix: String) -> Result<Self> {
        Ok(DynamicRendezvous {
            store,
            me: Participant::new(settings)?,
            conn: None,
            current: None,
            last_round: None,
            known: None,
            restarts_seen: 0,
            connect_by: None,
            store_lost_said: false,
            store_prefix,
            hosted: Vec::new(),
        })
    }

    /// Notes a job-wide restart count seen, to carry it to a new copy of the state.
    fn saw_restarts(&mut self, restarts: i64) -> i64 {
        self.restarts_seen = self.restarts_seen.max(restarts);
        restarts
    }

    /// The same handler, serving the rendezvous store `sites` too.
    pub(crate) fn hosting(self, sites: Vec<AnyServer>) -> Self {
        DynamicRendezvous { hosted: sites, ..self }
    }

    pub fn node(&self) -> &NodeDesc {
        &self.me.node
    }

    pub fn settings(&self) -> &RendezvousSettings {
        &self.me.settings
    }

    async fn conn(&mut self) -> Result<&mut S::Conn> {
        // a call that was cancelled midway (Ctrl-C) leaves its connection unusable
        if self.conn.as_ref().is_some_and(|conn| !conn.is_usable()) {
            self.conn = None;
        }
        if self.conn.is_none() {
            // within a rendezvous, up to its deadline; otherwise up to a loss window: a store
            // away for longer has lost this node anyway, and the caller goes on to re-join
            let (patience, quiet) = match self.connect_by.filter(|bound| bound.by > Instant::now()) {
                Some(bound) => (bound.by - Instant::now(), bound.quiet),
                None => (self.me.settings.node_lost_after(), false),
            };
            self.conn = Some(self.store.connect_within(patience, quiet).await?);
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Runs `operation` on the main connection; a failed operation drops the connection so
    /// that the next call starts from a fresh one.
    async fn with_conn<T>(&mut self, operation: impl AsyncFnOnce(&mut S::Conn) -> Result<T>) -> Result<T> {
        let result = operation(self.conn().await?).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// `next_rendezvous`'s loop. A store lost meanwhile is said once, with the
    /// deadline and the remedy, and its return once; the retries in between are quiet.
    async fn rendezvous_by(&mut self, deadline: Instant) -> Result<RendezvousInfo> {
        let mut lost_since: Option<Instant> = None;
        loop {
            match self.try_round(deadline).await {
                Ok(Some(info)) => {
                    self.store_lost_said = false;
                    if let Some(since) = lost_since {
                        tracing::info!(
                            "the rendezvous store at {} answers again (after {:.1?})",
                            self.store.describe(),
                            since.elapsed()
                        );
                    }
                    return Ok(info);
                }
                Ok(None) => {}
                Err(err) if err.is_store_unreachable() && Instant::now() < deadline => {
                    if lost_since.is_none() {
                        lost_since = Some(Instant::now());
                        let left = deadline.saturating_duration_since(Instant::now());
                        let store = self.store.describe();
                        if !self.store_lost_said {
                            match self.lost_store_advice(left) {
                                Some(advice) => {
                                    tracing::warn!("lost the rendezvous store at {store} ({err}): {advice}")
                                }
                                None => tracing::warn!(
                                    "lost the rendezvous store at {store} ({err}); looking for it for {}s more",
                                    left.as_secs()
                                ),
                            }
                        }
                    } else {
                        tracing::debug!("the rendezvous store at {} is still away: {err}", self.store.describe());
                    }
                    self.conn = None;
                    tokio::time::sleep(SITE_RETRY.min(deadline.saturating_duration_since(Instant::now()))).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// What a store lost for `left` more of the join timeout means, and what to do about it
    /// (said once per outage: see [`Self::rendezvous_by`]). `None` with several sites: the
    /// job moves to another, as [`super::locate`] says.
    fn lost_store_advice(&mut self, left: Duration) -> Option<String> {
        if self.store.sites() > 1 {
            return None;
        }
        self.store_lost_said = true;
        Some(format!(
            "the agent that hosts it has ended or is cut off from this node; this node looks for it for {}s more \
             (join_timeout), then ends. A job that must outlive any one node lists several sites (--rdzv-endpoint \
             a:29400,b:29400,c:29400) or uses --rdzv-backend etcd",
            left.as_secs()
        ))
    }

    /// One step: find the state, then join the current round (`Some`: this node is a member)
    /// or move past it (`None`: try again).
    async fn try_round(&mut self, deadline: Instant) -> Result<Option<RendezvousInfo>> {
        self.place(deadline).await?;
        if self.is_closed().await? {
            return Err(RendezvousError::Closed { run_id: self.me.settings.run_id.clone() });
        }
        let mut round = self.with_conn(async |conn| current_round(conn).await).await?;
        if let Some(last) = self.last_round {
            if round <= last.round {
                self.open_round(round, last.round + 1, Some(last)).await?;
                round = last.round + 1;
            }
        }
        let (outcome, seen) = self.join(round, deadline).await?;
        match outcome {
            JoinOutcome::Member { rank, world_size } => {
                if let Some(info) = self.start_membership(round, rank, world_size, seen, deadline).await? {
                    return Ok(Some(info));
                }
                // rank 0 died with the seal: the round never starts; the next one forms
                self.open_round(round, round + 1, None).await?;
            }
            JoinOutcome::Aborted => self.open_round(round, round + 1, None).await?,
            JoinOutcome::Late { world_size } => self.wait_as_late_node(round, world_size, deadline).await?,
        }
        Ok(None)
    }

    async fn join(&mut self, round: u64, deadline: Instant) -> Result<(JoinOutcome, i64)> {
        let (settings, node) = (self.me.settings.clone(), self.me.node.clone());
        let endpoint = self.store.address(self.store.active_site());
        self.with_conn(async |conn| {
            // Events counted before joining: the watcher replays anything that comes after.
            let seen = events::count(conn).await?;
            let join = RoundJoin { conn, settings: &settings, node: &node, round, deadline, endpoint: &endpoint };
            let outcome = join.run().await?;
            Ok((outcome, seen))
        })
        .await
    }

    /// Moves the round number from `from` to `to` (if nobody did yet) and announces it. When
    /// the previous round's size is known, the new round forms as soon as that many nodes
    /// (plus the late ones) are back, without waiting for the last call.
    async fn open_round(&mut self, from: u64, to: u64, previous: Option<LastRound>) -> Result<()> {
        let max = self.me.settings.max_nodes;
        let min = self.me.settings.min_nodes;
        self.with_conn(async |conn| {
            if let Some(last) = previous {
                let previous = to - 1;
                let late = conn.tally(&Keys::waiting(previous)).await? + conn.tally(&Keys::spares(previous)).await?;
                // members reported lost are not coming back; a lost store site's host may be
                // one of them, or unreported: the larger of the two counts
                let reported = conn.tally(&Keys::lost_count(previous)).await?.max(0) as u32;
                let back = last.world_size.saturating_sub(reported.max(last.site_host_lost)).max(1);
                let expected = (i64::from(back) + late).min(i64::from(max));
                if expected >= i64::from(min) {
                    // first writer wins, so joiners never see the expectation change
                    conn.compare_set(&Keys::expected(to), b"", expected.to_string().as_bytes()).await?;
                }
            }
            let now = conn.compare_set(Keys::ROUND, from.to_string().as_bytes(), to.to_string().as_bytes()).await?;
            if now.as_ref() == to.to_string().as_bytes() {
                events::publish(conn, &Event::Opened { v: FORMAT_VERSION, round: to }).await?;
            }
            Ok(())
        })
        .await
    }

    /// A node that arrived after `round` was fixed: registers as waiting (the round has room:
    /// its members will re-form) or as a spare (the round is full), then waits for the next
    /// round. Waiting nodes are bound by the join deadline; spares wait as long as it takes.
    async fn wait_as_late_node(&mut self, round: u64, world_size: u32, deadline: Instant) -> Result<()> {
        let spare = world_size >= self.me.settings.max_nodes;
        let node = self.me.node.clone();
        let run_id = self.me.settings.run_id.clone();
        let (interval, join_timeout) = (self.me.settings.progress_interval, self.me.settings.join_timeout);
        let (host, port) = self.store.address(self.store.active_site());
        tracing::info!(round, spare, "arrived after the round formed; waiting for the next round");
        self.with_conn(async |conn| {
            if spare {
                conn.count_up(&Keys::spares(round)).await?;
            } else if conn.count_up(&Keys::waiting(round)).await? == 1 {
                events::publish(conn, &Event::Waiting { v: FORMAT_VERSION, round, node }).await?;
            }
            loop {
                let seen = events::count(conn).await?;
                if conn.check(&[Keys::CLOSED.to_owned()]).await? {
                    return Err(if spare {
                        RendezvousError::GracefulExit { run_id }
                    } else {
                        RendezvousError::Closed { run_id }
                    });
                }
                if current_round(conn).await? > round {
                    return Ok(());
                }
                // spares wait as long as it takes, late nodes until the deadline; both say so
                let remaining = (!spare).then(|| deadline.saturating_duration_since(Instant::now()));
                let slice = remaining.map_or(interval, |remaining| remaining.min(interval));
                if events::wait_for(conn, seen + 1, Some(slice)).await?.is_some() {
                    continue;
                }
                match remaining {
                    Some(remaining) if remaining <= slice => {
                        return Err(RendezvousError::Timeout(format!(
                            "rendezvous {run_id:?}: waited {join_timeout:.0?} (join_timeout) as a late node for \
                             round {round} ({world_size} node(s)) to re-form, but its nodes did not come back"
                        )))
                    }
                    Some(remaining) => tracing::info!(
                        "waiting for round {round} ({world_size} node(s)) to re-form with this node at {host}:{port}, \
                         run ID {run_id}, deadline in {}s",
                        (remaining - slice).as_secs()
                    ),
                    None => tracing::info!(
                        "waiting as a spare: round {round} is full ({world_size} node(s)) at {host}:{port}, run ID \
                         {run_id}; this node joins when a slot opens"
                    ),
                }
            }
        })
        .await
    }

    /// Announces this member, sets up the workers' store (rank 0) and the round's background
    /// tasks, and returns the round's information (`None`: rank 0 died with the seal).
    async fn start_membership(
        &mut self,
        round: u64,
        rank: u32,
        world_size: u32,
        seen: i64,
        deadline: Instant,
    ) -> Result<Option<RendezvousInfo>> {
        let master_server = if rank == 0 { Some(self.start_workers_store()?) } else { None };
        let Some(master) = self.exchange_master(round, rank, master_server.as_ref(), deadline).await? else {
            return Ok(None);
        };
        let (sender, changes) = watch::channel(None);
        let context = RoundContext {
            store: self.store.clone(),
            settings: self.me.settings.clone(),
            round,
            contact: Arc::new(Contact::new(Instant::now())),
            changes: Arc::new(sender),
        };
        let tasks = self.spawn_round_tasks(&context, rank, world_size, seen, master_server.as_ref());
        let notify = context.changes.clone();
        self.current = Some(Membership {
            round,
            rank,
            world_size,
            tasks,
            changes,
            notify,
            _master: master_server,
            events_seen: seen,
        });
        let (store_host, store_port) = match self.store.serves_rounds() {
            true => self.store.address(self.store.active_site()),
            false => (master.addr.clone(), master.port),
        };
        tracing::info!("rendezvous complete: round {round}, {world_size} node(s); this node is rank {rank}");
        Ok(Some(RendezvousInfo {
            run_id: self.me.settings.run_id.clone(),
            round,
            rank,
            world_size,
            master_addr: master.addr,
            master_port: master.port,
            store_host,
            store_port,
            store_prefix: format!("{}{}", self.store_prefix.trim_start_matches('/'), Keys::round_store(round)),
        }))
    }

    /// Rank 0's workers' store, on the port it had last time if it can (MASTER_PORT stays
    /// across restarts).
    fn start_workers_store(&mut self) -> Result<AnyServer> {
        let config = workers_store_config(&self.me.node.addr, self.me.settings.secret.as_ref());
        let server = AnyServer::start_preferring(&config, self.me.workers_store_port)
            .map_err(|err| RendezvousError::Config(format!("cannot start the workers' store: {err}")))?;
        self.me.workers_store_port = Some(server.port());
        Ok(server)
    }

    /// Says this member arrived (and rank 0, where its workers' store is), then reads where
    /// the workers' store is. A live rank 0 publishes its address as the round seals: one that
    /// has not within two loss windows died with the seal (`None`), unless the join deadline
    /// comes first.
    async fn exchange_master(
        &mut self,
        round: u64,
        rank: u32,
        master_server: Option<&AnyServer>,
        deadline: Instant,
    ) -> Result<Option<Master>> {
        let member = Arrival { v: FORMAT_VERSION, node: Some(self.me.node.clone()) };
        let published = master_server.map(|server| Master {
            v: FORMAT_VERSION,
            addr: self.me.node.addr.clone(),
            port: server.port(),
        });
        let run_id = self.me.settings.run_id.clone();
        let patience = self.me.settings.node_lost_after() * 2;
        let master_wait = self.me.settings.master_wait(deadline);
        let master = self
            .with_conn(async |conn| {
                conn.set(&member_key(round, rank), &encode(&member)).await?;
                if let Some(master) = &published {
                    conn.set(&Keys::master(round), &encode(master)).await?;
                }
                let remaining = master_wait;
                match conn.wait_get(&Keys::master(round), Some(remaining.min(patience))).await? {
                    Some(bytes) => decode(&bytes, "master address").map(Some),
                    None if remaining > patience => Ok(None),
                    None => Err(RendezvousError::Timeout(format!(
                        "rendezvous {run_id:?} round {round}: rank 0 never published the workers' store address"
                    ))),
                }
            })
            .await?;
        if master.is_none() {
            tracing::warn!(round, "rank 0 did not publish the workers' store address within {patience:?}: it is lost");
        }
        Ok(master)
    }

    /// The round's background tasks: the change watcher; with others, heartbeats and the
    /// monitor of its neighbour; rank 0's trust in the members for its workers' store; with
    /// several sites, the watcher of the sites.
    fn spawn_round_tasks(
        &self,
        context: &RoundContext<S>,
        rank: u32,
        world_size: u32,
        seen: i64,
        master_server: Option<&AnyServer>,
    ) -> Vec<JoinHandle<()>> {
        let known = self.known.expect("placed before joining");
        let mut tasks = vec![spawn_change_watcher(context.clone(), seen, known, self.me.closed.clone())];
        if world_size > 1 {
            tasks.push(spawn_heartbeats(context.clone(), rank));
            tasks.push(spawn_monitor(context.clone(), rank, world_size));
        }
        if let (Some(server), true) = (master_server, world_size > 1) {
            let patience = self.me.settings.node_lost_after() * 2;
            tasks.push(trust::spawn_member_trust(
                self.store.clone(),
                context.round,
                world_size,
                patience,
                server.trusts(),
            ));
        }
        if self.store.sites() > 1 {
            let (interval, window) = (self.me.settings.keep_alive_interval, self.me.settings.node_lost_after());
            let changes = context.changes.clone();
            tasks.push(locate::spawn_site_watcher(self.store.clone(), known, interval, window, changes));
        }
        tasks
    }

    /// `shutdown`, and closes this node's connection to the store.
    fn disconnect(&mut self) {
        self.current = None;
        self.conn = None;
    }
}

/// A bound on the main connection's new connections (see `DynamicRendezvous::connect_by`).
#[derive(Clone, Copy, Debug)]
struct ConnectBound {
    by: Instant,
    /// Failures at DEBUG: the caller reports the outcome.
    quiet: bool,
}

impl ConnectBound {
    /// For a question asked as the workers fail (often with the store's loss): a keep-alive
    /// interval, quietly.
    fn question(settings: &RendezvousSettings) -> ConnectBound {
        ConnectBound { by: Instant::now() + settings.keep_alive_interval, quiet: true }
    }
}

/// The round this node was last a member of, for the next one to expect its nodes back.
#[derive(Clone, Copy, Debug)]
struct LastRound {
    round: u64,
    world_size: u32,
    /// 1 if the round ended because its store site was lost to the others with several sites:
    /// the agent that hosted it is gone too, whether or not anyone reported it lost.
    site_host_lost: u32,
}

impl LastRound {
    fn of(membership: &Membership, sites: usize) -> LastRound {
        let site_lost = matches!(
            &*membership.changes.borrow(),
            Some(MembershipChange::StoreMoved { .. } | MembershipChange::StoreUnreachable { .. })
        );
        LastRound {
            round: membership.round,
            world_size: membership.world_size,
            site_host_lost: u32::from(site_lost && sites > 1 && membership.world_size > 1),
        }
    }
}

/// Whether this node reaches a majority of the store's sites now (always, with one site: it
/// just reached the store).
async fn holds_a_majority<S: RendezvousStore>(store: &S) -> bool {
    store.sites() == 1 || locate::has_majority(&locate::probe_all(store).await)
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

async fn current_round<C: StoreConn>(conn: &mut C) -> Result<u64> {
    Ok(conn.add(Keys::ROUND, 0).await?.max(0) as u64)
}
