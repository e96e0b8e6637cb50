//! The elastic rendezvous on an etcd v3 cluster, with the dynamic handler's interface and
//! semantics (min:max, last call, late nodes and spares, the job-wide restart count, lost
//! nodes, closing with a reason), built on etcd's own means: each agent's lease is its
//! liveness, rounds form in transactions and watches ([`super::join`]), and members watch
//! their round with one watch ([`super::member`]). No node is special. [`backend`]: the
//! agent's interface.

mod backend;

use std::sync::Arc;
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
use crate::rendezvous::participant::Participant;
use crate::rendezvous::presence::{self, Census, ASK_PATIENCE, PROBE_TIMEOUT};
use crate::rendezvous::records::{
    decode, encode, round_store, AgentFacts, Arrival, FailureRecord, Master, Meta, NodeStatus, FORMAT_VERSION,
};
use crate::rendezvous::trust::let_in;
use crate::rendezvous::trust::workers_store_config;
use crate::store::AnyServer;

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
    _master: Option<AnyServer>,
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub struct EtcdRendezvous {
    client: EtcdClient,
    keys: EtcdKeys,
    /// This node: its settings, description, presence port, and how the job ended.
    me: Participant,
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
}

impl EtcdRendezvous {
    /// `prefix` holds the run's keys (ends with `/`); leases last `settings.node_lost_after()`.
    pub fn new(client: EtcdClient, settings: RendezvousSettings, prefix: String) -> Result<Self> {
        Ok(EtcdRendezvous {
            client,
            keys: EtcdKeys::new(prefix),
            me: Participant::new(settings)?,
            lease: None,
            placed: None,
            latest: None,
            checked: false,
            current: None,
            last_round: None,
        })
    }

    pub fn node(&self) -> &NodeDesc {
        &self.me.node
    }

    pub fn settings(&self) -> &RendezvousSettings {
        &self.me.settings
    }

    fn current_round(&self) -> Option<u64> {
        self.current.as_ref().map(|membership| membership.round)
    }

    fn error(&self, err: elastix_etcd::EtcdError) -> RendezvousError {
        etcd_error(err, &self.client)
    }

    /// One entry into a round: `Some` when this node is a member, `None` to try the next one.
    async fn try_round(&mut self, deadline: Instant, spare: &mut bool) -> Result<Option<RendezvousInfo>> {
        self.check_meta().await?;
        let (lease, lease_state) = self.lease().await?;
        let target = [self.last_round, self.latest].into_iter().flatten().map(|r| r + 1).max().unwrap_or(0);
        let ctx = Ctx {
            client: &self.client,
            keys: &self.keys,
            settings: &self.me.settings,
            node: &self.me.node,
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
                        let patience = Instant::now() + self.me.settings.node_lost_after() * 2;
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
        self.me.closed.set(reason);
        let run_id = self.me.settings.run_id.clone();
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
            min_nodes: self.me.settings.min_nodes,
            max_nodes: self.me.settings.max_nodes,
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
            let (min, max) = (self.me.settings.min_nodes, self.me.settings.max_nodes);
            if (meta.min_nodes, meta.max_nodes) != (min, max) {
                return Err(RendezvousError::Config(format!(
                    "this node was started with --nnodes {min}:{max} but rendezvous {:?} runs with --nnodes {}:{}",
                    self.me.settings.run_id, meta.min_nodes, meta.max_nodes
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
        let ttl = self.me.settings.node_lost_after();
        let lease = self.client.grant_lease(ttl).await.map_err(|err| self.error(err))?;
        let keep_alive = self.client.keep_alive(lease, self.me.settings.store_outage_limit());
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
    async fn start_rank0(&self, rank: u32, round: u64) -> Result<Option<(AnyServer, Master)>> {
        if rank != 0 {
            return Ok(None);
        }
        let config = workers_store_config(&self.me.node.addr, self.me.settings.secret.as_ref());
        let server = AnyServer::start_preferring(&config, self.me.workers_store_port)
            .map_err(|err| RendezvousError::Config(format!("cannot start the workers' store: {err}")))?;
        let master = Master { v: FORMAT_VERSION, addr: self.me.node.addr.clone(), port: server.port() };
        self.client.put(&self.keys.master(round), &encode(&master)).await.map_err(|err| self.error(err))?;
        Ok(Some((server, master)))
    }

    /// Lets the sealed round's members' plain (torch) clients into the workers' store this node
    /// serves (see [`crate::rendezvous::trust`]).
    async fn trust_members(&self, server: &AnyServer, round: u64, sealed_at: i64, last_member: i64) {
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
        rank0: Option<(AnyServer, Master)>,
    ) -> RendezvousInfo {
        let round = joined.round;
        if let Some((server, _)) = &rank0 {
            self.me.workers_store_port = Some(server.port());
        }
        let (lease, keep_alive) = self.lease.as_ref().expect("a member has a lease");
        let (sender, changes) = watch::channel(None);
        let task = member::spawn(RoundWatch {
            client: self.client.clone(),
            keys: self.keys.clone(),
            round,
            world_size,
            max_nodes: self.me.settings.max_nodes,
            me: member_id(*lease),
            sealed_at,
            last_member,
            lease_ttl: lease.ttl,
            lease_state: keep_alive.state(),
            changes: Arc::new(sender),
            closed: self.me.closed.clone(),
        });
        let _master = rank0.map(|(server, _)| server);
        self.current = Some(Membership { round, rank, sealed_at, last_member, task, changes, _master });
        self.latest = Some(self.latest.map_or(round, |latest| latest.max(round)));
        tracing::info!("rendezvous complete: round {round}, {world_size} node(s); this node is rank {rank}");
        RendezvousInfo {
            run_id: self.me.settings.run_id.clone(),
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

    async fn count_restart(&self, key: Vec<u8>) -> Result<i64> {
        let request = TxnRequest {
            success: vec![ops::put(&key, b"", 0), ops::count(&self.keys.all_failures(), 0)],
            ..Default::default()
        };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        Ok(ops::counted(&response, 1) as i64)
    }

    async fn read(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.client.get(key).await.map_err(|err| self.error(err))?.0)
    }
}
