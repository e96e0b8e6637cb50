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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::contact::Contact;
use super::events;
use super::keys::Keys;
use super::liveness::{answered, ask, member_key, report_lost, spawn_heartbeats, spawn_monitor, RoundContext};
use super::locate::{self, Choice, Known, Probe};
use super::round::{JoinOutcome, RoundJoin};
use super::trust;
use crate::rendezvous::backend::StatusWriter;
use crate::rendezvous::change::{MembershipChange, RendezvousInfo};
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::presence::{self, Census, Presence, ASK_PATIENCE, PROBE_TIMEOUT};
use crate::rendezvous::records::{
    decode, encode, AgentFacts, Arrival, Event, FailureRecord, Master, Meta, NodeStatus, FORMAT_VERSION,
};
use crate::rendezvous::settings::RendezvousSettings;
use crate::rendezvous::store::{RendezvousStore, StoreConn};
use crate::rendezvous::trust::workers_store_config;
use crate::store::StoreServer;

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
    _master: Option<StoreServer>,
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
    settings: RendezvousSettings,
    node: NodeDesc,
    conn: Option<S::Conn>,
    current: Option<Membership>,
    /// The last round this node was a member of (it opens the next one when it comes back),
    /// and how many nodes to expect back.
    last_round: Option<LastRound>,
    /// The copy of the state this node works with (see [`super::locate`]).
    known: Option<Known>,
    /// The highest job-wide restart count seen, carried to a new copy of the state.
    restarts_seen: i64,
    /// How the job ended, as the close event said (the store may be gone when it is asked).
    closed_reason: Arc<Mutex<Option<String>>>,
    /// The run's prefix in the store, for the [`RendezvousInfo`].
    store_prefix: String,
    /// The port of the workers' store this node last served, tried first next time.
    workers_store_port: Option<u16>,
    /// What the other members probe to ask whether this node's agent is still there.
    _presence: Option<Presence>,
    /// How new connections are bounded now: by the deadline of the rendezvous under way (a
    /// store that stays away shows one countdown, see [`Self::next_rendezvous`]), or by a
    /// question's, quietly ([`Self::census`]). Without one, or once past, they give up after a
    /// loss window.
    connect_by: Option<ConnectBound>,
    /// The store's loss has been said, with the remedy, since it last answered.
    store_lost_said: bool,
}

impl<S: RendezvousStore> DynamicRendezvous<S> {
    /// `store_prefix` is the run's prefix in the store, for the [`RendezvousInfo`].
    pub fn new(store: S, settings: RendezvousSettings, store_prefix: String) -> Result<Self> {
        settings.validate()?;
        let mut node = NodeDesc::this_process(settings.local_addr.as_deref());
        node.order = settings.node_order;
        let presence = Presence::start(&node.addr);
        node.presence = presence.as_ref().map(Presence::port);
        Ok(DynamicRendezvous {
            store,
            settings,
            node,
            conn: None,
            current: None,
            last_round: None,
            known: None,
            restarts_seen: 0,
            closed_reason: Arc::default(),
            connect_by: None,
            store_lost_said: false,
            store_prefix,
            workers_store_port: None,
            _presence: presence,
        })
    }

    pub fn run_id(&self) -> &str {
        &self.settings.run_id
    }

    pub fn node(&self) -> &NodeDesc {
        &self.node
    }

    pub fn settings(&self) -> &RendezvousSettings {
        &self.settings
    }

    /// The store site in use, for messages.
    pub fn describe_store(&self) -> String {
        self.store.describe()
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
                None => (self.settings.node_lost_after(), false),
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

    /// Joins the next round and returns this node's place in it. Blocks until the round
    /// forms, up to `join_timeout` (spares wait without a deadline, as in torch). A store that
    /// stops answering meanwhile is looked for again (and the state moved if it is lost) until
    /// the deadline.
    pub async fn next_rendezvous(&mut self) -> Result<RendezvousInfo> {
        let deadline = Instant::now() + self.settings.join_timeout;
        if let Some(membership) = self.current.take() {
            self.last_round = Some(LastRound::of(&membership, self.store.sites()));
        }
        self.connect_by = Some(ConnectBound { by: deadline, quiet: false });
        let outcome = self.rendezvous_by(deadline).await;
        self.connect_by = None;
        outcome
    }

    /// [`Self::next_rendezvous`]'s loop. A store lost meanwhile is said once, with the
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
                            match self.store_lost_advice(left) {
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
    pub fn store_lost_advice(&mut self, left: Duration) -> Option<String> {
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
            return Err(RendezvousError::Closed { run_id: self.settings.run_id.clone() });
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
        let (settings, node) = (self.settings.clone(), self.node.clone());
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

    /// Finds the copy of the state to work with ([`super::locate`]), setting one up where the
    /// rules say so, and fails fast if other agents use different bounds or another format.
    /// With several sites every one is asked each time: only a node that reaches a majority
    /// of them may run the job, and the best copy may be anywhere.
    async fn place(&mut self, deadline: Instant) -> Result<()> {
        let mut reported = Instant::now();
        let mut said_minority = false;
        loop {
            let probes = self.probe_sites().await?;
            let choice = locate::choose(&probes, self.known);
            match choice {
                Choice::Join(site) => {
                    let Probe::Answer(Some(meta)) = probes[site].clone() else {
                        unreachable!("joined sites hold the state")
                    };
                    return self.settle(site, meta).await;
                }
                Choice::Create { site, generation } => {
                    self.move_to(site);
                    let ours = Meta {
                        v: FORMAT_VERSION,
                        min_nodes: self.settings.min_nodes,
                        max_nodes: self.settings.max_nodes,
                        incarnation: fastrand::u64(1..),
                        generation,
                    };
                    let mine = encode(&ours);
                    let stored = self.with_conn(async |conn| conn.compare_set(Keys::META, b"", &mine).await).await?;
                    if stored[..] == mine[..] {
                        // this node made the run's state: the store's list of runs names it
                        let run_id = self.settings.run_id.clone();
                        if let Err(err) = self.with_conn(async |conn| conn.register_run(&run_id).await).await {
                            tracing::debug!("cannot add run {run_id:?} to the store's list of runs: {err}");
                        }
                    }
                    return self.settle(site, decode(&stored, "metadata")?).await;
                }
                Choice::Wait | Choice::Minority => {
                    let now = Instant::now();
                    let (reached, silent) = locate::split_sites(&self.store, &probes);
                    let what = match choice {
                        Choice::Minority => format!(
                            "a majority of the {} rendezvous sites (this node reaches {}; not {}): it is on the \
                             minority side of a partition, and the job may run on the other side",
                            probes.len(),
                            list_or_none(&reached),
                            silent.join(", ")
                        ),
                        _ => format!(
                            "a rendezvous store site to answer: {}",
                            reached
                                .iter()
                                .map(|site| format!("{site} (no state)"))
                                .chain(silent)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    };
                    if now >= deadline {
                        return Err(RendezvousError::Timeout(format!(
                            "rendezvous {:?}: waited {:?} (join_timeout) for {what}",
                            self.settings.run_id, self.settings.join_timeout,
                        )));
                    }
                    if choice == Choice::Minority && !said_minority {
                        // said at once: this node's workers are not running, and this is why
                        said_minority = true;
                        reported = now;
                        tracing::warn!("waiting for {what}; deadline in {}s", deadline.duration_since(now).as_secs());
                    } else if now.duration_since(reported) >= self.settings.progress_interval {
                        reported = now;
                        tracing::info!("waiting for {what}; deadline in {}s", deadline.duration_since(now).as_secs());
                    }
                    tokio::time::sleep(SITE_RETRY.min(deadline.duration_since(now))).await;
                }
            }
        }
    }

    /// What each site holds. A single store is asked through the main connection, which
    /// waits for it (up to the store's patience) as an unreachable store always did.
    async fn probe_sites(&mut self) -> Result<Vec<Probe>> {
        if self.store.sites() == 1 {
            let meta = self.with_conn(async |conn| locate::read_meta(conn).await).await?;
            return Ok(vec![Probe::Answer(meta)]);
        }
        Ok(locate::probe_all(&self.store).await)
    }

    fn move_to(&mut self, site: usize) {
        if site != self.store.active_site() {
            self.store.set_active_site(site);
            self.conn = None;
        }
    }

    /// Works with the copy `meta` at `site` from now on.
    async fn settle(&mut self, site: usize, meta: Meta) -> Result<()> {
        let (min, max) = (self.settings.min_nodes, self.settings.max_nodes);
        if (meta.min_nodes, meta.max_nodes) != (min, max) {
            return Err(RendezvousError::Config(format!(
                "this node was started with --nnodes {min}:{max} but rendezvous {:?} runs with --nnodes {}:{}",
                self.settings.run_id, meta.min_nodes, meta.max_nodes
            )));
        }
        self.move_to(site);
        let known = Known { site, generation: meta.generation, incarnation: meta.incarnation };
        let previous = self.known.replace(known);
        if previous.is_some_and(|previous| previous != known) {
            tracing::info!(
                "the rendezvous state is now at {} (generation {}); carrying the restart count ({}) over",
                self.store.describe(),
                known.generation,
                self.restarts_seen
            );
            self.carry_restarts().await?;
        }
        Ok(())
    }

    /// Raises the job-wide restart count of a new copy of the state to what this node had
    /// seen (every node does, so the copy ends with the highest count anyone saw).
    async fn carry_restarts(&mut self) -> Result<()> {
        let seen = self.restarts_seen;
        if seen == 0 {
            return Ok(());
        }
        self.with_conn(async |conn| {
            let mut expected = Vec::new();
            for _ in 0..8 {
                let stored = conn.compare_set(Keys::RESTARTS, &expected, seen.to_string().as_bytes()).await?;
                let now: i64 = String::from_utf8_lossy(&stored).trim().parse().unwrap_or(0);
                if now >= seen {
                    return Ok(());
                }
                expected = stored.to_vec();
            }
            tracing::warn!("could not carry the restart count over to the new copy of the rendezvous state");
            Ok(())
        })
        .await
    }

    /// Moves the round number from `from` to `to` (if nobody did yet) and announces it. When
    /// the previous round's size is known, the new round forms as soon as that many nodes
    /// (plus the late ones) are back, without waiting for the last call.
    async fn open_round(&mut self, from: u64, to: u64, previous: Option<LastRound>) -> Result<()> {
        let max = self.settings.max_nodes;
        let min = self.settings.min_nodes;
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
        let spare = world_size >= self.settings.max_nodes;
        let node = self.node.clone();
        let run_id = self.settings.run_id.clone();
        let (interval, join_timeout) = (self.settings.progress_interval, self.settings.join_timeout);
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
        let member = Arrival { v: FORMAT_VERSION, node: Some(self.node.clone()) };
        let master_server = if rank == 0 {
            let config = workers_store_config(&self.node.addr, self.settings.secret.as_ref());
            Some(
                StoreServer::start_preferring(&config, self.workers_store_port)
                    .map_err(|err| RendezvousError::Config(format!("cannot start the workers' store: {err}")))?,
            )
        } else {
            None
        };
        if let Some(server) = &master_server {
            self.workers_store_port = Some(server.port()); // MASTER_PORT stays across restarts
        }
        let published = master_server.as_ref().map(|server| Master {
            v: FORMAT_VERSION,
            addr: self.node.addr.clone(),
            port: server.port(),
        });
        let run_id = self.settings.run_id.clone();
        // a live rank 0 publishes its address as the round seals: one that has not within two
        // loss windows died with the seal (None), unless the join deadline comes first
        let patience = self.settings.node_lost_after() * 2;
        let master_wait = self.settings.master_wait(deadline);
        let master: Option<Master> = self
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
        let Some(master) = master else {
            tracing::warn!(round, "rank 0 did not publish the workers' store address within {patience:?}: it is lost");
            return Ok(None);
        };

        let (sender, changes) = watch::channel(None);
        let context = RoundContext {
            store: self.store.clone(),
            settings: self.settings.clone(),
            round,
            contact: Arc::new(Contact::new(Instant::now())),
            changes: Arc::new(sender),
        };
        let known = self.known.expect("placed before joining");
        let mut tasks = vec![spawn_change_watcher(context.clone(), seen, known, self.closed_reason.clone())];
        if world_size > 1 {
            tasks.push(spawn_heartbeats(context.clone(), rank));
            tasks.push(spawn_monitor(context.clone(), rank, world_size));
        }
        if let (Some(server), true) = (&master_server, world_size > 1) {
            let patience = self.settings.node_lost_after() * 2;
            tasks.push(trust::spawn_member_trust(self.store.clone(), round, world_size, patience, server.trusts()));
        }
        if self.store.sites() > 1 {
            let (interval, window) = (self.settings.keep_alive_interval, self.settings.node_lost_after());
            let changes = context.changes.clone();
            tasks.push(locate::spawn_site_watcher(self.store.clone(), known, interval, window, changes));
        }
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
            run_id: self.settings.run_id.clone(),
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

    /// Changes to the current round (`None` until one happens). Stale once the node moves
    /// to another round.
    pub fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        self.current.as_ref().map(|membership| membership.changes.clone())
    }

    /// Late nodes waiting for the current round to re-form with them (torch's wait list).
    pub async fn num_nodes_waiting(&mut self) -> Result<u32> {
        let Some(round) = self.current.as_ref().map(|m| m.round) else { return Ok(0) };
        let waiting = self.with_conn(async |conn| conn.tally(&Keys::waiting(round)).await).await?;
        Ok(waiting.max(0) as u32)
    }

    /// Asks the other members of the current round whether their agents are still there
    /// ([`crate::rendezvous::presence`]), and reports the gone ones lost at once (the heartbeat monitor
    /// would, a loss window later), so that every member re-forms without them now.
    /// `only`: the group ranks to ask (default: every other member).
    pub async fn census(&mut self, only: Option<&[u32]>) -> Result<Census> {
        let outer = self.connect_by.replace(ConnectBound::question(&self.settings));
        let census = self.ask_members(only).await;
        self.connect_by = outer;
        census
    }

    /// [`Self::census`], its new connections bounded as a question's: the workers' failure
    /// that prompts it often came with the store's loss.
    async fn ask_members(&mut self, only: Option<&[u32]>) -> Result<Census> {
        let Some((round, rank, world_size)) = self.current.as_ref().map(|m| (m.round, m.rank, m.world_size)) else {
            return Ok(Census::default());
        };
        let asked: Vec<u32> =
            (0..world_size).filter(|other| *other != rank && only.map_or(true, |only| only.contains(other))).collect();
        // every member asked at once, then their answers awaited up to one deadline
        let silent = self
            .with_conn(async |conn| {
                let mut before = Vec::with_capacity(asked.len());
                for &other in &asked {
                    before.push((other, ask(conn, round, other).await?));
                }
                let deadline = Instant::now() + ASK_PATIENCE;
                let mut silent = Vec::new();
                for (other, before) in before {
                    let within = deadline.saturating_duration_since(Instant::now());
                    if !answered(conn, round, other, before, within).await? {
                        if let Some(bytes) = conn.try_get(&member_key(round, other)).await? {
                            if let Ok(Arrival { node: Some(node), .. }) = decode::<Arrival>(&bytes, "member") {
                                silent.push((other, node));
                            }
                        }
                    }
                }
                Ok(silent)
            })
            .await;
        let silent = match silent {
            Ok(silent) => silent,
            Err(err) => {
                // the store went with the failure: that ends the round (and with several
                // sites, its host is one of the members not coming back)
                if err.is_store_unreachable() {
                    let change = MembershipChange::StoreUnreachable {
                        store: self.store.describe(),
                        silent_for: Duration::ZERO,
                        error: err.to_string(),
                    };
                    if let Some(membership) = &self.current {
                        membership
                            .notify
                            .send_if_modified(|current| current.is_none() && current.replace(change).is_none());
                    }
                }
                return Err(err);
            }
        };
        if silent.is_empty() {
            return Ok(Census::default());
        }
        // members that did not answer: is their agent gone (its machine refuses), or only
        // silent (stopped, cut off from the store, a dead machine)?
        let mut census = presence::census(silent, PROBE_TIMEOUT).await;
        if !census.gone.is_empty() && !holds_a_majority(&self.store.clone()).await {
            // a refusal seen from the minority side of a partition is no verdict
            let unsure = census.gone.drain(..).map(|(rank, node)| {
                (rank, format!("{} refused, but this node reaches no majority of the sites", node.addr))
            });
            census.unsure.extend(unsure);
        }
        for (lost, node) in &census.gone {
            let why = format!(
                "its agent at {} is gone (it did not answer through the store, and its presence port refused the probe)",
                node.addr
            );
            let node = Some(node.clone());
            self.with_conn(async |conn| report_lost(conn, round, *lost, node, &why).await).await?;
        }
        Ok(census)
    }

    /// What ended this node's round without its watcher having said so yet: a newer round
    /// (the others re-formed without it: this agent was stopped, or cut off, while they did),
    /// the store losing the state the round lived in (it restarted empty), or an event about
    /// the round already in the log (a member reported lost, late nodes: another member's
    /// agent stopped its workers for it, which is how this node's workers came to fail).
    pub async fn round_ended(&mut self) -> Result<Option<MembershipChange>> {
        let outer = self.connect_by.replace(ConnectBound::question(&self.settings));
        let ended = self.look_for_round_end().await;
        self.connect_by = outer;
        ended
    }

    /// [`Self::round_ended`], its new connections bounded as a question's.
    async fn look_for_round_end(&mut self) -> Result<Option<MembershipChange>> {
        let Some((round, seen)) = self.current.as_ref().map(|m| (m.round, m.events_seen)) else { return Ok(None) };
        let known = self.known;
        let look = async |conn: &mut S::Conn| {
            let meta = locate::read_meta(conn).await?;
            if known.is_some_and(|known| meta.as_ref().map_or(true, |meta| meta.incarnation != known.incarnation)) {
                return Ok(Some(MembershipChange::StoreReset));
            }
            // events are few per round; a producer writes an event's key just after counting
            // it, so one that is not there yet is skipped. A member's loss tells most (it is
            // what broke this node's workers, though the others have moved on since); else
            // the first change, else a newer round.
            let mut first = None;
            for n in seen + 1..=events::count(conn).await? {
                let Some(bytes) = conn.try_get(&Keys::event(n)).await? else { continue };
                match decode::<Event>(&bytes, "event").ok().and_then(|event| relevance(&event, round)) {
                    Some(lost @ MembershipChange::NodeLost { .. }) => return Ok(Some(lost)),
                    Some(change) => first = first.or(Some(change)),
                    None => {}
                }
            }
            if first.is_some() {
                return Ok(first);
            }
            let current = current_round(conn).await?;
            Ok((current > round).then_some(MembershipChange::RoundSuperseded { round: current }))
        };
        match self.with_conn(look).await {
            // the main connection may have gone stale while idle (the store restarted): these
            // reads are safe to make again, on a fresh one
            Err(err) if err.is_store_unreachable() => self.with_conn(look).await,
            found => found,
        }
    }

    /// The address of the store site that holds the job's state now: with several sites, the
    /// one a lost site's nodes moved to (found, or set up, as a re-join would).
    pub async fn locate_store(&mut self) -> Result<(String, u16)> {
        if self.store.sites() > 1 {
            self.place(Instant::now() + self.settings.heartbeat_timeout * 2).await?;
        }
        Ok(self.store.address(self.store.active_site()))
    }

    pub async fn is_closed(&mut self) -> Result<bool> {
        self.with_conn(async |conn| conn.check(&[Keys::CLOSED.to_owned()]).await).await
    }

    /// Ends the job's rendezvous: no node may join any more, and every node is told.
    pub async fn set_closed(&mut self) -> Result<()> {
        self.set_closed_with("closed").await
    }

    /// Closes with a reason every node can read back ([`Self::closed_reason`]): how the job
    /// ended. The first reason stays.
    pub async fn set_closed_with(&mut self, reason: &str) -> Result<()> {
        let close_timeout = self.settings.close_timeout;
        let reason = if reason.is_empty() { "closed" } else { reason };
        let closing = self.with_conn(async |conn| {
            let stored = conn.compare_set(Keys::CLOSED, b"", reason.as_bytes()).await?;
            if stored.as_ref() == reason.as_bytes() {
                events::publish(conn, &Event::Closed { v: FORMAT_VERSION, reason: Some(reason.to_owned()) }).await?;
            }
            Ok(())
        });
        match tokio::time::timeout(close_timeout, closing).await {
            Ok(result) => result,
            Err(_) => {
                self.conn = None;
                Err(RendezvousError::Timeout(format!(
                    "closing rendezvous {:?} took longer than {close_timeout:?} (close_timeout)",
                    self.settings.run_id
                )))
            }
        }
    }

    /// Why the rendezvous was closed, if it is: as the close event said (so a node learns it
    /// even when the store went away with the node that closed it), else from the store.
    pub async fn closed_reason(&mut self) -> Result<Option<String>> {
        let announced = self.closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        if announced.is_some() {
            return Ok(announced);
        }
        self.with_conn(async |conn| {
            let key = Keys::CLOSED.to_owned();
            Ok(conn.try_get(&key).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned()))
        })
        .await
    }

    /// Reports that this node's round ended in a failure. One crash often fails workers on
    /// every node, so only the first report of a round counts as a job-wide restart. Returns
    /// the number of restarts so far.
    pub async fn report_failure(&mut self) -> Result<i64> {
        let round = self.current.as_ref().map(|m| m.round).or(self.last_round.map(|last| last.round));
        let Some(round) = round else { return self.restart_count().await };
        let restarts = self
            .with_conn(async |conn| {
                let reports = conn.count_up(&Keys::failures(round)).await?;
                conn.add(Keys::RESTARTS, i64::from(reports == 1)).await
            })
            .await?;
        Ok(self.saw_restarts(restarts))
    }

    /// Counts one restart after a failure, job-wide; returns the new total.
    pub async fn record_restart(&mut self) -> Result<i64> {
        let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 1).await).await?;
        Ok(self.saw_restarts(restarts))
    }

    /// Restarts after failures so far, job-wide.
    pub async fn restart_count(&mut self) -> Result<i64> {
        let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 0).await).await?;
        Ok(self.saw_restarts(restarts))
    }

    fn saw_restarts(&mut self, restarts: i64) -> i64 {
        self.restarts_seen = self.restarts_seen.max(restarts);
        restarts
    }

    /// Publishes what this member's agent knows about itself, for `elastix status`.
    pub async fn publish_node_status(&mut self, facts: AgentFacts) -> Result<()> {
        let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
        let status = NodeStatus::new(self.node.clone(), facts, self.settings.node_lost_after());
        self.with_conn(async |conn| conn.set(&Keys::node_status(round, rank), &encode(&status)).await).await
    }

    /// What republishes this member's status in the current round, over a connection of its
    /// own (opened on first use, again after an error).
    pub fn status_writer(&self) -> Option<StatusWriter> {
        let (round, rank) = self.current.as_ref().map(|m| (m.round, m.rank))?;
        let (store, node, key) = (self.store.clone(), self.node.clone(), Keys::node_status(round, rank));
        let (lost_after, patience) = (self.settings.node_lost_after(), self.settings.heartbeat_timeout);
        let conn: Arc<tokio::sync::Mutex<Option<S::Conn>>> = Arc::default();
        Some(Arc::new(move |facts| {
            let (store, conn, key) = (store.clone(), conn.clone(), key.clone());
            let status = NodeStatus::new(node.clone(), facts, lost_after);
            Box::pin(async move {
                let mut conn = conn.lock().await;
                if conn.is_none() {
                    *conn = Some(store.connect_site(store.active_site(), patience).await?);
                }
                let result = conn.as_mut().expect("connected above").set(&key, &encode(&status)).await;
                if result.is_err() {
                    *conn = None;
                }
                result
            })
        }))
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    pub async fn publish_failure(&mut self, failure: &FailureRecord) -> Result<()> {
        self.with_conn(async |conn| conn.set(Keys::LAST_FAILURE, &encode(failure)).await).await
    }

    /// Stops this node's heartbeats and background work, and the workers' store it serves.
    /// The rendezvous stays open for the other nodes (use [`Self::set_closed`] to end the job).
    pub fn shutdown(&mut self) {
        self.current = None;
    }

    /// [`Self::shutdown`], and closes this node's connection to the store.
    pub fn disconnect(&mut self) {
        self.shutdown();
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

/// Follows the event log from event `seen + 1` and reports what matters to a member of the
/// round; keeps the first change that ended the round and any later ones. A lost connection is
/// made again; a store that comes back without the copy of the state this node knew is a
/// [`MembershipChange::StoreReset`].
fn spawn_change_watcher<S: RendezvousStore>(
    context: RoundContext<S>,
    seen: i64,
    known: Known,
    closed_reason: Arc<Mutex<Option<String>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let round = context.round;
        let patience = context.settings.keep_alive_interval;
        let mut next = seen + 1;
        let mut conn: Option<S::Conn> = None;
        loop {
            let Some(live) = conn.as_mut() else {
                match context.store.connect_site(known.site, patience).await {
                    Ok(mut fresh) => match locate::read_meta(&mut fresh).await {
                        Ok(Some(meta)) if meta.incarnation == known.incarnation => conn = Some(fresh),
                        Ok(_) => {
                            tracing::debug!(
                                round,
                                "the store at {} lost the rendezvous state",
                                context.store.describe()
                            );
                            let _ = context.changes.send(Some(MembershipChange::StoreReset));
                            return;
                        }
                        Err(err) => tracing::debug!(round, "membership watcher: {err}"),
                    },
                    Err(err) => tracing::debug!(round, "membership watcher cannot reconnect yet: {err}"),
                }
                if conn.is_none() {
                    tokio::time::sleep(SITE_RETRY).await;
                }
                continue;
            };
            match events::wait_for(live, next, None).await {
                Ok(event) => {
                    if let Some(Event::Closed { reason: Some(reason), .. }) = &event {
                        *closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reason.clone());
                    }
                    if let Some(change) = event.as_ref().and_then(|event| relevance(event, round)) {
                        tracing::debug!(round, ?change, "membership change"); // the agent says what it does about it
                        if context.changes.send(Some(change)).is_err() {
                            return; // nobody listens any more
                        }
                    }
                    next += 1;
                }
                Err(err) => {
                    tracing::debug!(round, "membership watcher lost its connection: {err}; reconnecting");
                    conn = None;
                }
            }
        }
    })
}

fn relevance(event: &Event, round: u64) -> Option<MembershipChange> {
    match event {
        Event::Opened { round: opened, .. } if *opened > round => {
            Some(MembershipChange::RoundSuperseded { round: *opened })
        }
        Event::Waiting { round: r, .. } if *r == round => Some(MembershipChange::NodesWaiting),
        Event::Lost { round: r, rank, node, .. } if *r == round => {
            Some(MembershipChange::NodeLost { rank: Some(*rank), node: node.clone() })
        }
        Event::Closed { .. } => Some(MembershipChange::Closed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_events_about_this_round_or_later_matter() {
        let node = NodeDesc { order: None, addr: "a".into(), pid: 1, local_id: 0, presence: None };
        assert_eq!(relevance(&Event::Opened { v: 1, round: 3 }, 3), None);
        assert_eq!(
            relevance(&Event::Opened { v: 1, round: 4 }, 3),
            Some(MembershipChange::RoundSuperseded { round: 4 })
        );
        assert_eq!(relevance(&Event::Waiting { v: 1, round: 2, node: node.clone() }, 3), None);
        assert_eq!(relevance(&Event::Waiting { v: 1, round: 3, node }, 3), Some(MembershipChange::NodesWaiting));
        assert_eq!(relevance(&Event::Lost { v: 1, round: 2, rank: 0, node: None }, 3), None);
        assert_eq!(relevance(&Event::Closed { v: 1, reason: None }, 3), Some(MembershipChange::Closed));
    }
}
