//! The elastic rendezvous on an etcd v3 cluster, with the dynamic handler's interface and
//! semantics (min:max, last call, late nodes and spares, the job-wide restart count, lost
//! nodes, closing with a reason), built on etcd's own means: each agent's lease is its
//! liveness, rounds form in transactions and watches ([`super::join`]), and members watch
//! their round with one watch ([`super::member`]). No node is special.

mod backend;
mod questions;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use elastix_etcd::pb::etcdserverpb::TxnRequest;
use elastix_etcd::{EtcdClient, KeepAlive, Lease, LeaseState};

use super::join::{member_id, wait_master, Ctx, Entry, Joined, Outcome};
use super::keys::{EtcdKeys, KeyKind};
use super::member::{self, RoundWatch};
use super::ops::{self, etcd_error};
use crate::rendezvous::backend::{Backend, Fut, StatusWriter};
use crate::rendezvous::change::{MembershipChange, RendezvousInfo};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::presence::{self, Census, Presence, ASK_PATIENCE, PROBE_TIMEOUT};
use crate::rendezvous::records::{
    decode, encode, round_store, AgentFacts, Arrival, FailureRecord, Master, Meta, NodeStatus, FORMAT_VERSION,
};
use crate::rendezvous::trust::let_in;
use crate::rendezvous::trust::workers_store_config;
use crate::store::StoreServer;

/// How long a node waits before it tries etcd again after losing it.
const RETRY: Duration = Duration::from_millis(500);
/// How often a census looks for the answers of the members it asked.
const ASK_POLL: Duration = Duration::from_millis(25);

/// A member a census asked: where it answers, and what the answer must be.
struct Asked {
    rank: u32,
    node: NodeDesc,
    lease: i64,
    key: Vec<u8>,
    answer: Vec<u8>,
}

/// The round this node is a member of, with what runs for it.
struct Membership {
    round: u64,
    /// This node's group rank in the round.
    rank: u32,
    /// The revision the round was sealed at, and the creation revision of its last member:
    /// the members as sealed, in entry order, are its ranks.
    sealed_at: i64,
    last_member: i64,
    task: JoinHandle<()>,
    changes: watch::Receiver<Option<MembershipChange>>,
    /// The workers' store, when this node is rank 0.
    _master: Option<StoreServer>,
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub struct EtcdRendezvous {
    client: EtcdClient,
    keys: EtcdKeys,
    settings: RendezvousSettings,
    node: NodeDesc,
    lease: Option<(Lease, KeepAlive)>,
    /// This node's member key: its round and name.
    placed: Option<(u64, String)>,
    /// The last sealed round, as last learned.
    latest: Option<u64>,
    /// The run's metadata was checked (or written).
    checked: bool,
    current: Option<Membership>,
    /// The last round this node was in (it enters the next one when it comes back).
    last_round: Option<u64>,
    /// How the job ended, as the close said.
    closed_reason: Arc<Mutex<Option<String>>>,
    /// The port of the workers' store this node last served, tried first next time (a
    /// restarted job keeps its MASTER_PORT).
    workers_store_port: Option<u16>,
    /// What the other members probe to ask whether this node's agent is still there.
    _presence: Option<Presence>,
}

impl EtcdRendezvous {
    /// `prefix` holds the run's keys (ends with `/`); leases last `settings.node_lost_after()`.
    pub fn new(client: EtcdClient, settings: RendezvousSettings, prefix: String) -> Result<Self> {
        settings.validate()?;
        let mut node = NodeDesc::this_process(settings.local_addr.as_deref());
        let presence = Presence::start(&node.addr);
        node.presence = presence.as_ref().map(Presence::port);
        Ok(EtcdRendezvous {
            client,
            keys: EtcdKeys::new(prefix),
            settings,
            node,
            lease: None,
            placed: None,
            latest: None,
            checked: false,
            current: None,
            last_round: None,
            closed_reason: Arc::default(),
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

    /// The cluster, for messages.
    pub fn describe_store(&self) -> String {
        format!("etcd {}", self.client.endpoints())
    }

    fn error(&self, err: elastix_etcd::EtcdError) -> RendezvousError {
        etcd_error(err, &self.client)
    }

    /// Joins the next round and returns this node's place in it, up to `join_timeout` (spares
    /// wait without a deadline). etcd out of reach meanwhile is tried again until the deadline.
    pub async fn next_rendezvous(&mut self) -> Result<RendezvousInfo> {
        let deadline = Instant::now() + self.settings.join_timeout;
        if let Some(membership) = self.current.take() {
            self.last_round = Some(membership.round);
        }
        let mut spare = false;
        loop {
            match self.try_round(deadline, &mut spare).await {
                Ok(Some(info)) => return Ok(info),
                Ok(None) => {}
                Err(err) if err.is_store_unreachable() && Instant::now() < deadline => {
                    tracing::warn!("lost etcd at {}: {err}; trying again", self.client.endpoints());
                    tokio::time::sleep(RETRY).await;
                }
                // cut off longer than its TTL, the node's lease expired before it knew
                Err(RendezvousError::LeaseGone(why)) if Instant::now() < deadline => {
                    tracing::warn!("this node's etcd lease is gone ({why}); entering again with a new one");
                    self.lease = None; // nothing to revoke: etcd has forgotten it
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// One entry into a round: `Some` when this node is a member, `None` to try the next one.
    async fn try_round(&mut self, deadline: Instant, spare: &mut bool) -> Result<Option<RendezvousInfo>> {
        self.check_meta().await?;
        let (lease, lease_state) = self.lease().await?;
        let target = [self.last_round, self.latest].into_iter().flatten().map(|r| r + 1).max().unwrap_or(0);
        let ctx = Ctx {
            client: &self.client,
            keys: &self.keys,
            settings: &self.settings,
            node: &self.node,
            lease,
            lease_state,
        };
        let joined = match ctx.enter(target, self.placed.clone()).await? {
            Entry::Closed { reason } => return Err(self.closed(reason, *spare)),
            Entry::Taken { latest } => {
                self.latest = Some(latest.unwrap_or(target).max(target));
                return Ok(None);
            }
            Entry::Joined(joined) => joined,
        };
        self.placed = Some((target, member_id(lease)));
        match ctx.outcome(&joined, deadline).await? {
            Outcome::Closed { reason, spare: waited_as_spare } => Err(self.closed(reason, *spare || waited_as_spare)),
            Outcome::Next { spare: left_out } => {
                *spare = left_out;
                self.last_round = Some(target);
                Ok(None)
            }
            Outcome::LeaseLost(state) => {
                tracing::warn!("this node's etcd lease ended ({state}); entering again with a new one");
                self.drop_lease().await;
                Ok(None)
            }
            Outcome::Member { rank, world_size, sealed_at, last_member, mut watcher, master } => {
                let rank0 = self.start_rank0(rank, target).await?;
                if let Some((server, _)) = &rank0 {
                    self.trust_members(server, target, sealed_at, last_member).await;
                }
                let master = match (&rank0, master) {
                    (Some((_, published)), _) => published.clone(),
                    (None, Some(master)) => master,
                    (None, None) => {
                        // a live rank 0 publishes its address as the round seals: one that has
                        // not within two loss windows died with the seal, and the round with it
                        let patience = Instant::now() + self.settings.node_lost_after() * 2;
                        match wait_master(&ctx, target, &mut watcher, deadline.min(patience)).await {
                            Ok(master) => master,
                            Err(RendezvousError::Timeout(why)) if Instant::now() < deadline => {
                                tracing::warn!(round = target, "{why}: it is lost; forming the next round");
                                self.last_round = Some(target);
                                return Ok(None);
                            }
                            Err(err) => return Err(err),
                        }
                    }
                };
                drop(watcher);
                Ok(Some(self.start_membership(&joined, rank, world_size, sealed_at, last_member, master, rank0)))
            }
        }
    }

    fn closed(&self, reason: String, spare: bool) -> RendezvousError {
        *self.closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reason);
        let run_id = self.settings.run_id.clone();
        if spare {
            RendezvousError::GracefulExit { run_id }
        } else {
            RendezvousError::Closed { run_id }
        }
    }

    /// Writes the run's metadata, or checks it against this node's bounds; refuses a prefix
    /// that holds keys of something else (they would be written among). Once per agent.
    async fn check_meta(&mut self) -> Result<()> {
        if self.checked {
            return Ok(());
        }
        let keys = &self.keys;
        let ours = Meta {
            v: FORMAT_VERSION,
            min_nodes: self.settings.min_nodes,
            max_nodes: self.settings.max_nodes,
            incarnation: 0,
            generation: 0,
        };
        let request = TxnRequest {
            compare: vec![ops::absent(&keys.meta()), ops::empty(&keys.all())],
            success: vec![ops::put(&keys.meta(), &encode(&ours), 0)],
            // the run's keys are counted (all read) only for the error of a prefix not ours
            failure: vec![
                ops::get(&keys.meta()),
                ops::only_if(ops::absent(&keys.meta()), ops::count(&keys.all(), 0)),
                ops::get(&keys.round()),
            ],
        };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        if !response.succeeded {
            let Some(meta) = ops::value(&response, 0) else {
                return Err(RendezvousError::Config(format!(
                    "etcd at {} holds {} key(s) under {:?} that are not an elastix rendezvous; choose another \
                     --rdzv-id or --rdzv-conf key_prefix",
                    self.client.endpoints(),
                    ops::counted_if(&response, 1).unwrap_or_default(),
                    keys.prefix()
                )));
            };
            let meta: Meta = decode(&meta, "metadata")?;
            let (min, max) = (self.settings.min_nodes, self.settings.max_nodes);
            if (meta.min_nodes, meta.max_nodes) != (min, max) {
                return Err(RendezvousError::Config(format!(
                    "this node was started with --nnodes {min}:{max} but rendezvous {:?} runs with --nnodes {}:{}",
                    self.settings.run_id, meta.min_nodes, meta.max_nodes
                )));
            }
            let latest = ops::value(&response, 2).map(|bytes| ops::number(&bytes, "round")).transpose()?;
            self.latest = latest.map(|r| r.max(0) as u64);
        }
        self.checked = true;
        Ok(())
    }

    /// This node's live lease, granted (and kept alive) when it has none.
    async fn lease(&mut self) -> Result<(Lease, watch::Receiver<LeaseState>)> {
        if let Some((lease, keep_alive)) = &self.lease {
            if !keep_alive.state().borrow().is_over() {
                return Ok((*lease, keep_alive.state()));
            }
            self.drop_lease().await;
        }
        let ttl = self.settings.node_lost_after();
        let lease = self.client.grant_lease(ttl).await.map_err(|err| self.error(err))?;
        let keep_alive = self.client.keep_alive(lease, self.settings.store_outage_limit());
        let state = keep_alive.state();
        self.lease = Some((lease, keep_alive));
        Ok((lease, state))
    }

    /// Ends this node's lease: its keys go with it (if etcd still has it).
    async fn drop_lease(&mut self) {
        if let Some((lease, _)) = self.lease.take() {
            let revoking = self.client.revoke_lease(lease);
            if let Ok(Err(err)) = tokio::time::timeout(RETRY, revoking).await {
                tracing::debug!("revoking this node's old etcd lease: {err}");
            }
        }
    }

    /// Starts the workers' store when this node is rank 0, and publishes its address.
    async fn start_rank0(&self, rank: u32, round: u64) -> Result<Option<(StoreServer, Master)>> {
        if rank != 0 {
            return Ok(None);
        }
        let config = workers_store_config(&self.node.addr, self.settings.secret.as_ref());
        let server = StoreServer::start_preferring(&config, self.workers_store_port)
            .map_err(|err| RendezvousError::Config(format!("cannot start the workers' store: {err}")))?;
        let master = Master { v: FORMAT_VERSION, addr: self.node.addr.clone(), port: server.port() };
        self.client.put(&self.keys.master(round), &encode(&master)).await.map_err(|err| self.error(err))?;
        Ok(Some((server, master)))
    }

    /// Lets the sealed round's members' plain (torch) clients into the workers' store this node
    /// serves (see [`crate::rendezvous::trust`]).
    async fn trust_members(&self, server: &StoreServer, round: u64, sealed_at: i64, last_member: i64) {
        let request = ops::members_as_sealed(&self.keys.members(round), sealed_at, last_member);
        let response = match self.client.range(request).await {
            Ok(response) => response,
            Err(err) => return tracing::warn!(round, "cannot read the round's members for the workers' store: {err}"),
        };
        let trusts = server.trusts();
        for kv in &response.kvs {
            if let Ok(Arrival { node: Some(node), .. }) = decode::<Arrival>(&kv.value, "member") {
                let_in(&trusts, &node, round).await;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_membership(
        &mut self,
        joined: &Joined,
        rank: u32,
        world_size: u32,
        sealed_at: i64,
        last_member: i64,
        master: Master,
        rank0: Option<(StoreServer, Master)>,
    ) -> RendezvousInfo {
        let round = joined.round;
        if let Some((server, _)) = &rank0 {
            self.workers_store_port = Some(server.port());
        }
        let (lease, keep_alive) = self.lease.as_ref().expect("a member has a lease");
        let (sender, changes) = watch::channel(None);
        let task = member::spawn(RoundWatch {
            client: self.client.clone(),
            keys: self.keys.clone(),
            round,
            world_size,
            max_nodes: self.settings.max_nodes,
            me: member_id(*lease),
            sealed_at,
            last_member,
            lease_ttl: lease.ttl,
            lease_state: keep_alive.state(),
            changes: Arc::new(sender),
            closed_reason: self.closed_reason.clone(),
        });
        let _master = rank0.map(|(server, _)| server);
        self.current = Some(Membership { round, rank, sealed_at, last_member, task, changes, _master });
        self.latest = Some(self.latest.map_or(round, |latest| latest.max(round)));
        tracing::info!("rendezvous complete: round {round}, {world_size} node(s); this node is rank {rank}");
        RendezvousInfo {
            run_id: self.settings.run_id.clone(),
            round,
            rank,
            world_size,
            master_addr: master.addr.clone(),
            master_port: master.port,
            store_host: master.addr,
            store_port: master.port,
            store_prefix: format!("{}{}", self.keys.prefix().trim_start_matches('/'), round_store(round)),
        }
    }

    /// Changes to the current round (`None` until one happens).
    pub fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        self.current.as_ref().map(|membership| membership.changes.clone())
    }

    pub async fn num_nodes_waiting(&mut self) -> Result<u32> {
        let Some(round) = self.current.as_ref().map(|m| m.round) else { return Ok(0) };
        let request = TxnRequest { success: vec![ops::count(&self.keys.members(round + 1), 0)], ..Default::default() };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        Ok(ops::counted(&response, 0) as u32)
    }

    pub async fn is_closed(&mut self) -> Result<bool> {
        Ok(self.read(&self.keys.closed()).await?.is_some())
    }

    pub async fn set_closed(&mut self) -> Result<()> {
        self.set_closed_with("closed").await
    }

    /// Ends the job's rendezvous with a reason every node can read: no node may enter any
    /// more, and the members of the live rounds (and those waiting for the next) are told
    /// through their rounds' watches. The first reason stays.
    pub async fn set_closed_with(&mut self, reason: &str) -> Result<()> {
        let reason = if reason.is_empty() { "closed" } else { reason };
        let close_timeout = self.settings.close_timeout;
        let closing = async {
            let latest = self.read(&self.keys.round()).await?.map(|bytes| ops::number(&bytes, "round")).transpose()?;
            let mut rounds: Vec<u64> = [latest.map(|r| r.max(0) as u64), self.last_round, self.current_round()]
                .into_iter()
                .flatten()
                .flat_map(|r| [r, r + 1])
                .collect();
            rounds.sort_unstable();
            rounds.dedup();
            let mut success = vec![ops::put(&self.keys.closed(), reason.as_bytes(), 0)];
            success.extend(rounds.iter().map(|r| ops::put(&self.keys.closed_marker(*r), reason.as_bytes(), 0)));
            let request = TxnRequest { compare: vec![ops::absent(&self.keys.closed())], success, failure: vec![] };
            self.client.txn(request).await.map_err(|err| self.error(err))
        };
        match tokio::time::timeout(close_timeout, closing).await {
            Ok(result) => {
                if result?.succeeded {
                    *self.closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                        Some(reason.to_owned());
                }
                Ok(())
            }
            Err(_) => Err(RendezvousError::Timeout(format!(
                "closing rendezvous {:?} took longer than {close_timeout:?} (close_timeout)",
                self.settings.run_id
            ))),
        }
    }

    /// Why the rendezvous was closed, if it is: as the close said, else from etcd.
    pub async fn closed_reason(&mut self) -> Result<Option<String>> {
        let announced = self.closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        if announced.is_some() {
            return Ok(announced);
        }
        Ok(self.read(&self.keys.closed()).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned()))
    }

    /// Reports that this node's round ended in a failure. One crash often fails workers on
    /// every node, so a round's reports count one job-wide restart: the count is the number
    /// of keys under `failures/`, and writing one is the same however often it is retried
    /// (a reply lost in a leader change cannot count twice). Returns the restarts so far.
    pub async fn report_failure(&mut self) -> Result<i64> {
        let Some(round) = self.current_round().or(self.last_round) else { return self.restart_count().await };
        self.count_restart(self.keys.failures(&round.to_string())).await
    }

    /// Counts one restart after a failure, job-wide; returns the new total.
    pub async fn record_restart(&mut self) -> Result<i64> {
        self.count_restart(self.keys.failures(&format!("by-hand-{:016x}", fastrand::u64(..)))).await
    }

    /// Restarts after failures so far, job-wide.
    pub async fn restart_count(&mut self) -> Result<i64> {
        let request = TxnRequest { success: vec![ops::count(&self.keys.all_failures(), 0)], ..Default::default() };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        Ok(ops::counted(&response, 0) as i64)
    }

    async fn count_restart(&self, key: Vec<u8>) -> Result<i64> {
        let request = TxnRequest {
            success: vec![ops::put(&key, b"", 0), ops::count(&self.keys.all_failures(), 0)],
            ..Default::default()
        };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        Ok(ops::counted(&response, 1) as i64)
    }

    /// Publishes what this member's agent knows about itself, for `elastix status`.
    pub async fn publish_node_status(&mut self, facts: AgentFacts) -> Result<()> {
        let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
        let status = NodeStatus::new(self.node.clone(), facts, self.settings.node_lost_after());
        let key = self.keys.node_status(round, rank);
        self.client.put(&key, &encode(&status)).await.map_err(|err| self.error(err))
    }

    /// What republishes this member's status in the current round.
    pub fn status_writer(&self) -> Option<StatusWriter> {
        let (round, rank) = self.current.as_ref().map(|m| (m.round, m.rank))?;
        let (client, node, key) = (self.client.clone(), self.node.clone(), self.keys.node_status(round, rank));
        let lost_after = self.settings.node_lost_after();
        Some(Arc::new(move |facts| {
            let (client, key) = (client.clone(), key.clone());
            let status = NodeStatus::new(node.clone(), facts, lost_after);
            Box::pin(async move {
                client.put(&key, &encode(&status)).await.map(drop).map_err(|err| etcd_error(err, &client))
            })
        }))
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    pub async fn publish_failure(&mut self, failure: &FailureRecord) -> Result<()> {
        let key = self.keys.last_failure();
        self.client.put(&key, &encode(failure)).await.map_err(|err| self.error(err))
    }

    async fn read(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.client.get(key).await.map_err(|err| self.error(err))?.0)
    }

    /// Stops this node's part: its round's watch, the workers' store it serves, and the
    /// renewal of its lease (which then expires: the others count this node gone). The
    /// rendezvous stays open for the other nodes.
    pub fn shutdown(&mut self) {
        self.current = None;
        self.lease = None;
    }

    /// [`Self::shutdown`].
    pub fn disconnect(&mut self) {
        self.shutdown();
    }
}
