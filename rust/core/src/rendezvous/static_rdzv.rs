//! The `static` backend: a fixed set of nodes with given ranks (`--node-rank`, `--nnodes N`),
//! meeting at a fixed master address. Rank 0 serves the store, which the workers share
//! (torch's behaviour); there is no elasticity, so nothing is ever waiting or closed.

use std::time::Duration;

use tokio::time::Instant;

use super::backend::{Backend, Fut};
use super::change::RendezvousInfo;
use super::endpoint::parse_endpoint;
use super::error::{RendezvousError, Result};
use super::node::NodeDesc;
use super::records::{encode, Arrival, FORMAT_VERSION};
use super::store::{RendezvousStore, StoreConn, TcpRendezvousStore, DEFAULT_READ_TIMEOUT};
use crate::auth::{PlainClients, Secret};
use crate::rendezvous::config::conf::{RendezvousConf, STATIC_KEYS};
use crate::rendezvous::config::params::{job_secret, progress_interval, RendezvousParams};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::store::{AnyServer, ConnectOptions, ServerConfig};

/// torch's `timeout` default for the static backend.
const DEFAULT_STATIC_TIMEOUT: Duration = Duration::from_secs(600);
/// torch's default master port for the static backend.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// `--rdzv-backend static`'s configuration, parsed and checked (without side effects).
pub(crate) struct StaticOptions {
    rank: u32,
    timeout: Duration,
    endpoint: (String, u16),
    secret: Option<Secret>,
    progress_interval: Duration,
}

impl StaticOptions {
    pub(crate) fn parse(params: &RendezvousParams) -> Result<StaticOptions> {
        let mut conf = RendezvousConf::from_input(&params.conf, STATIC_KEYS)?;
        let secret = job_secret(&conf)?;
        if let Some(rank) = params.node_rank {
            conf.insert("rank", &rank.to_string(), STATIC_KEYS)?;
        }
        let rank = conf
            .int("rank")?
            .ok_or_else(|| RendezvousError::Config("static rendezvous needs the node rank (--node-rank)".into()))?;
        let rank = u32::try_from(rank)
            .map_err(|_| RendezvousError::Config(format!("static rendezvous: node rank {rank} is negative")))?;
        let timeout = conf.duration("timeout", DEFAULT_STATIC_TIMEOUT)?;
        conf.duration("read_timeout", DEFAULT_READ_TIMEOUT)?;
        let endpoint = parse_endpoint(&params.endpoint, DEFAULT_MASTER_PORT)?;
        let progress_interval = progress_interval(RendezvousSettings::DEFAULT_PROGRESS_INTERVAL)?;
        Ok(StaticOptions { rank, timeout, endpoint, secret, progress_interval })
    }
}

pub struct StaticRendezvous {
    run_id: String,
    rank: u32,
    world_size: u32,
    master_addr: String,
    master_port: u16,
    timeout: Duration,
    /// How often a node waiting for the others says so.
    progress_interval: Duration,
    node: NodeDesc,
    /// Rank 0 serves the store for the whole job.
    server: Option<AnyServer>,
    store: TcpRendezvousStore,
    rounds: u64,
    /// Restarts after failures (static nodes do not share them).
    restarts: i64,
    /// The job secret: the store requires it, and every connection proves it.
    secret: Option<Secret>,
}

impl StaticRendezvous {
    /// The static backend for `options`.
    pub(crate) fn create(params: &RendezvousParams, options: StaticOptions) -> Result<StaticRendezvous> {
        let StaticOptions { rank, timeout, endpoint, secret, progress_interval } = options;
        let mut rdzv = StaticRendezvous::new(
            &params.run_id,
            rank,
            params.max_nodes,
            endpoint,
            timeout,
            params.local_addr.as_deref(),
            secret,
        )?;
        rdzv.progress_interval = progress_interval;
        Ok(rdzv)
    }

    pub fn new(
        run_id: &str,
        rank: u32,
        world_size: u32,
        master: (String, u16),
        timeout: Duration,
        local_addr: Option<&str>,
        secret: Option<Secret>,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(RendezvousError::Config(format!(
                "static rendezvous: node rank {rank} is not in 0..{world_size} (--node-rank must be below --nnodes)"
            )));
        }
        // Rank 0 given port 0 serves at once on a port the kernel picks ([`Self::hosted_port`]),
        // so that the other ranks can be pointed at it without probing for a free port.
        let server = if master.1 == 0 && rank == 0 { Some(serve(0, secret.as_ref())?) } else { None };
        if master.1 == 0 && server.is_none() {
            return Err(RendezvousError::Config("static rendezvous needs a master port (--master-port)".into()));
        }
        let master = (master.0, server.as_ref().map_or(master.1, AnyServer::port));
        let options =
            ConnectOptions { secret: secret.clone(), ..ConnectOptions::new(master.0.clone(), master.1, Some(timeout)) };
        let store = TcpRendezvousStore::new(options, format!("/elastix/static/{run_id}/"), timeout);
        Ok(StaticRendezvous {
            run_id: run_id.to_owned(),
            rank,
            world_size,
            master_addr: master.0,
            master_port: master.1,
            timeout,
            progress_interval: RendezvousSettings::DEFAULT_PROGRESS_INTERVAL,
            node: NodeDesc::this_process(local_addr),
            server,
            store,
            rounds: 0,
            restarts: 0,
            secret,
        })
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The store's port, once rank 0 serves it.
    pub fn hosted_port(&self) -> Option<u16> {
        self.server.as_ref().map(AnyServer::port)
    }

    pub fn report_failure(&mut self) -> i64 {
        self.restarts += 1;
        self.restarts
    }

    pub fn restart_count(&self) -> i64 {
        self.restarts
    }

    /// Waits until every rank has checked in (the first time), then returns the fixed layout.
    pub async fn next_rendezvous(&mut self) -> Result<RendezvousInfo> {
        if self.rank == 0 && self.server.is_none() {
            self.server = Some(serve(self.master_port, self.secret.as_ref())?);
        }
        if self.rounds == 0 {
            self.check_in().await?;
        }
        let round = self.rounds;
        self.rounds += 1;
        Ok(RendezvousInfo {
            run_id: self.run_id.clone(),
            round,
            rank: self.rank,
            world_size: self.world_size,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            store_host: self.master_addr.clone(),
            store_port: self.master_port,
            store_prefix: format!("{}round{round}", self.store.prefix().trim_start_matches('/')),
        })
    }

    /// Checks in and waits for every other rank, saying every `progress_interval` whom it
    /// still waits for, until the timeout.
    async fn check_in(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let at = format!("{}:{}", self.master_addr, self.master_port);
        tracing::info!(
            "static rendezvous: node rank {} of {} {} {at}",
            self.rank,
            self.world_size,
            if self.server.is_some() { "serving the job's store at" } else { "meeting the others at" }
        );
        let mut conn = self.store.connect().await?;
        let record = Arrival { v: FORMAT_VERSION, node: Some(self.node.clone()) };
        conn.set(&format!("node/{}", self.rank), &encode(&record)).await?;
        let keys: Vec<String> = (0..self.world_size).map(|rank| format!("node/{rank}")).collect();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if conn.wait(&keys, Some(remaining.min(self.progress_interval))).await? {
                return Ok(());
            }
            let mut missing = Vec::new();
            for (rank, key) in keys.iter().enumerate() {
                if !conn.check(std::slice::from_ref(key)).await? {
                    missing.push(rank.to_string());
                }
            }
            let missing = missing.join(", ");
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(RendezvousError::Timeout(format!(
                    "static rendezvous {:?}: timed out after {:.0?} waiting for node rank(s) [{missing}] of {} at {at}",
                    self.run_id, self.timeout, self.world_size
                )));
            }
            tracing::info!(
                "static rendezvous: waiting for node rank(s) [{missing}] of {} at {at}, deadline in {}s",
                self.world_size,
                remaining.as_secs()
            );
        }
    }
}

/// Rank 0's store, which the whole job shares (its workers' plain clients too). Must run inside
/// a tokio runtime.
fn serve(port: u16, secret: Option<&Secret>) -> Result<AnyServer> {
    let config =
        ServerConfig { port, ..ServerConfig::default() }.requiring(secret, PlainClients::LoopbackAndAuthenticated);
    AnyServer::start(&config)
        .map_err(|err| RendezvousError::Config(format!("static rendezvous: rank 0 cannot serve the store: {err}")))
}

impl Backend for StaticRendezvous {
    fn name(&self) -> &'static str {
        "static"
    }

    fn run_id(&self) -> &str {
        &self.run_id
    }

    fn next_rendezvous(&mut self) -> Fut<'_, RendezvousInfo> {
        Box::pin(StaticRendezvous::next_rendezvous(self))
    }

    fn report_failure(&mut self) -> Fut<'_, i64> {
        let restarts = StaticRendezvous::report_failure(self);
        Box::pin(std::future::ready(Ok(restarts)))
    }

    fn record_restart(&mut self) -> Fut<'_, i64> {
        Backend::report_failure(self)
    }

    fn restart_count(&mut self) -> Fut<'_, i64> {
        Box::pin(std::future::ready(Ok(self.restarts)))
    }

    fn describe_store(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }

    fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }

    fn hosted_port(&self) -> Option<u16> {
        StaticRendezvous::hosted_port(self)
    }
}
