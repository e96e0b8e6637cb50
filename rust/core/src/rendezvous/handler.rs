//! Creating a rendezvous from launcher parameters, and one interface over the backends.

use std::io;
use std::time::Duration;

use tokio::sync::watch;

use super::conf::{RendezvousConf, DYNAMIC_KEYS, STATIC_KEYS};
use super::dynamic::{DynamicRendezvous, MembershipChange, RendezvousInfo};
use super::endpoint::{
    is_local_addr, is_loopback_name, is_this_machine, parse_endpoint, parse_endpoints, DEFAULT_PORT,
};
use super::error::{RendezvousError, Result};
use super::etcd::{create_etcd, etcd_options, EtcdRendezvous};
use super::keys::run_prefix;
use super::params::{apply_secret, conf_secret, dynamic_settings};
pub use super::params::{RendezvousParams, PROGRESS_INTERVAL_VAR};
use super::presence::Census;
use super::records::{AgentFacts, FailureRecord};
use super::settings::RendezvousSettings;
use super::static_rdzv::StaticRendezvous;
use super::store::TcpRendezvousStore;
use crate::auth::{PlainClients, Secret};
use crate::store::{ServerConfig, StoreServer};

/// torch's store operation timeout for the rendezvous store (`read_timeout`).
const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// torch's `timeout` default for the static backend.
const DEFAULT_STATIC_TIMEOUT: Duration = Duration::from_secs(600);
/// torch's default master port for the static backend.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// `$body` with `$h` bound to the dynamic handler, whichever store it runs on (the c10d TCP
/// store or etcd); `$other` for the static backend.
macro_rules! on_dynamic {
    ($self:expr, $h:ident => $body:expr, static $s:pat => $other:expr) => {
        match $self {
            Rendezvous::Dynamic { handler: $h, .. } => $body,
            Rendezvous::Etcd($h) => $body,
            Rendezvous::Static($s) => $other,
        }
    };
}

#[allow(clippy::large_enum_variant, reason = "one per agent; boxing buys nothing")]
pub enum Rendezvous {
    Dynamic {
        handler: DynamicRendezvous<TcpRendezvousStore>,
        /// The rendezvous store sites this agent hosts (none, or one per listed address of its own).
        servers: Vec<StoreServer>,
    },
    /// The elastic rendezvous on an etcd v3 cluster.
    Etcd(EtcdRendezvous),
    Static(StaticRendezvous),
}

impl Rendezvous {
    /// Builds the backend `params.backend` names. Must run inside a tokio runtime (a hosted
    /// store is served on it).
    pub async fn create(params: RendezvousParams) -> Result<Rendezvous> {
        match params.backend.as_str() {
            "c10d" => create_c10d(&params, c10d_options(&params)?).await,
            "static" => create_static(&params, static_options(&params)?),
            "etcd" | "etcd-v3" => Ok(Rendezvous::Etcd(create_etcd(etcd_options(&params)?)?)),
            other => Err(unknown_backend(other)),
        }
    }

    /// Checks everything `create` would build from `params` (every `--rdzv-conf` value, the
    /// secret's file, the endpoint list) without building anything, binding anything or
    /// installing the secret: a bad value is a configuration error before the agent starts.
    pub fn check(params: &RendezvousParams) -> Result<()> {
        match params.backend.as_str() {
            "c10d" => c10d_options(params).map(drop),
            "static" => static_options(params).map(drop),
            "etcd" | "etcd-v3" => etcd_options(params).map(drop),
            other => Err(unknown_backend(other)),
        }
    }

    pub fn backend(&self) -> &'static str {
        match self {
            Rendezvous::Dynamic { .. } => "c10d",
            Rendezvous::Etcd(_) => "etcd",
            Rendezvous::Static(_) => "static",
        }
    }

    pub fn run_id(&self) -> &str {
        on_dynamic!(self, handler => handler.run_id(), static handler => handler.run_id())
    }

    /// The rendezvous store's port when this agent serves it (the first site it hosts).
    pub fn hosted_port(&self) -> Option<u16> {
        match self {
            Rendezvous::Dynamic { servers, .. } => servers.first().map(StoreServer::port),
            Rendezvous::Etcd(_) => None,
            Rendezvous::Static(handler) => handler.hosted_port(),
        }
    }

    /// Before an agent that hosts the store exits: gives the other nodes up to `within` to
    /// read how the job ended and disconnect, so that the store does not vanish under them.
    pub async fn linger(&mut self, within: Duration) {
        on_dynamic!(self, handler => handler.disconnect(), static _ => {});
        let Rendezvous::Dynamic { servers, .. } = self else { return };
        let deadline = tokio::time::Instant::now() + within;
        for server in servers.iter() {
            if server.connections() > 0 {
                tracing::debug!(
                    "keeping the rendezvous store on port {} up for the other nodes ({} connected), at most {within:?}",
                    server.port(),
                    server.connections()
                );
            }
            while server.connections() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    pub async fn next_rendezvous(&mut self) -> Result<RendezvousInfo> {
        on_dynamic!(self, handler => handler.next_rendezvous().await, static handler => handler.next_rendezvous().await)
    }

    pub async fn num_nodes_waiting(&mut self) -> Result<u32> {
        on_dynamic!(self, handler => handler.num_nodes_waiting().await, static _ => Ok(0))
    }

    pub async fn is_closed(&mut self) -> Result<bool> {
        on_dynamic!(self, handler => handler.is_closed().await, static _ => Ok(false))
    }

    pub async fn set_closed(&mut self) -> Result<()> {
        on_dynamic!(self, handler => handler.set_closed().await, static _ => Ok(()))
    }

    /// Asks the other members of the current round (`only` these group ranks, if given)
    /// whether their agents are still there, and reports the gone ones lost
    /// ([`super::presence`]).
    pub async fn census(&mut self, only: Option<&[u32]>) -> Result<Census> {
        match self {
            Rendezvous::Dynamic { handler, .. } => handler.census(only).await,
            Rendezvous::Etcd(handler) => handler.census(only).await,
            Rendezvous::Static(_) => Ok(Census::default()),
        }
    }

    /// The round opened after this node's, if one was (the others re-formed without it).
    pub async fn newer_round(&mut self) -> Result<Option<u64>> {
        on_dynamic!(self, handler => handler.newer_round().await, static _ => Ok(None))
    }

    /// Where the round's store is now, if it can move (a c10d site list): `None` where the
    /// store a round was given is the only one.
    pub async fn locate_store(&mut self) -> Option<Result<(String, u16)>> {
        match self {
            Rendezvous::Dynamic { handler, .. } => Some(handler.locate_store().await),
            Rendezvous::Etcd(_) | Rendezvous::Static(_) => None,
        }
    }

    /// Where the rendezvous state lives, for messages.
    pub fn describe_store(&self) -> String {
        match self {
            Rendezvous::Dynamic { handler, .. } => handler.describe_store(),
            Rendezvous::Etcd(handler) => handler.describe_store(),
            Rendezvous::Static(_) => "the static rendezvous' store".to_owned(),
        }
    }

    /// How long a member may be silent (heartbeats, lease) before the others count it lost.
    pub fn loss_window(&self) -> Duration {
        on_dynamic!(self, handler => handler.settings().node_lost_after(), static _ => Duration::ZERO)
    }

    /// Changes that should end the current round (dynamic backend only).
    pub fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        on_dynamic!(self, handler => handler.changes(), static _ => None)
    }

    pub async fn set_closed_with(&mut self, reason: &str) -> Result<()> {
        on_dynamic!(self, handler => handler.set_closed_with(reason).await, static _ => Ok(()))
    }

    pub async fn closed_reason(&mut self) -> Result<Option<String>> {
        on_dynamic!(self, handler => handler.closed_reason().await, static _ => Ok(None))
    }

    /// Reports that the current round ended in a failure; returns the restarts so far
    /// (job-wide for c10d, this node's for static).
    pub async fn report_failure(&mut self) -> Result<i64> {
        on_dynamic!(self, handler => handler.report_failure().await, static handler => Ok(handler.report_failure()))
    }

    pub async fn record_restart(&mut self) -> Result<i64> {
        on_dynamic!(self, handler => handler.record_restart().await, static handler => Ok(handler.report_failure()))
    }

    pub async fn restart_count(&mut self) -> Result<i64> {
        on_dynamic!(self, handler => handler.restart_count().await, static handler => Ok(handler.restart_count()))
    }

    /// Publishes what `elastix status` shows about this member (the static backend has no
    /// shared state to show).
    pub async fn publish_node_status(&mut self, facts: AgentFacts) -> Result<()> {
        on_dynamic!(self, handler => handler.publish_node_status(facts).await, static _ => Ok(()))
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    pub async fn publish_failure(&mut self, failure: &FailureRecord) -> Result<()> {
        on_dynamic!(self, handler => handler.publish_failure(failure).await, static _ => Ok(()))
    }

    /// Stops this node's part (heartbeats, the workers' store); the rendezvous stays open.
    pub fn shutdown(&mut self) {
        on_dynamic!(self, handler => handler.shutdown(), static _ => {})
    }
}

fn unknown_backend(name: &str) -> RendezvousError {
    if name == "etcd-v2" {
        return RendezvousError::Config(
            "--rdzv-backend etcd-v2: etcd's v2 API is off by default since etcd 3.4; use etcd (the v3 API)".into(),
        );
    }
    RendezvousError::Config(format!(
        "--rdzv-backend {name:?} is unknown; use c10d (elastic), etcd (elastic, on an etcd v3 cluster) or static"
    ))
}

/// `--rdzv-backend c10d`'s configuration, parsed and checked.
struct C10dOptions {
    settings: RendezvousSettings,
    read_timeout: Duration,
    sites: Vec<(String, u16)>,
    /// `is_host` as given (None: decided per site from the addresses).
    is_host: Option<bool>,
    secret: Option<Secret>,
}

fn c10d_options(params: &RendezvousParams) -> Result<C10dOptions> {
    let conf = RendezvousConf::from_input(&params.conf, DYNAMIC_KEYS)?;
    let secret = conf_secret(&conf)?;
    if let Some(store_type) = conf.get("store_type") {
        if store_type != "tcp" {
            return Err(RendezvousError::Config(format!(
                "--rdzv-conf store_type={store_type}: elastix's c10d backend uses a TCP store (store_type=tcp)"
            )));
        }
    }
    conf.duration("timeout", Duration::ZERO)?; // taken for torch's sake, but still a duration
    let settings = dynamic_settings(params, &conf)?;
    let read_timeout = conf.duration("read_timeout", DEFAULT_READ_TIMEOUT)?;
    let sites = parse_endpoints(&params.endpoint, DEFAULT_PORT)?;
    let is_host = conf.boolean("is_host")?;
    if is_host.is_some() && sites.len() > 1 {
        return Err(RendezvousError::Config(
            "--rdzv-conf is_host applies to a single --rdzv-endpoint; with a list, each agent hosts the entries \
             naming its --local-addr (or this machine)"
                .into(),
        ));
    }
    Ok(C10dOptions { settings, read_timeout, sites, is_host, secret })
}

async fn create_c10d(params: &RendezvousParams, options: C10dOptions) -> Result<Rendezvous> {
    let C10dOptions { settings, read_timeout, mut sites, is_host: explicit, secret } = options;
    apply_secret(secret)?;
    let listed = sites.len() > 1;
    let mut servers = Vec::new();
    for site in sites.iter_mut() {
        let hosting = match (explicit, &params.local_addr) {
            (Some(explicit), _) => explicit,
            (None, Some(local_addr)) if listed => is_local_addr(&site.0, local_addr).await,
            (None, _) => is_this_machine(&site.0).await,
        };
        if !hosting {
            continue;
        }
        // only agents connect to the rendezvous store, and with a secret they all prove it
        let auth = crate::auth::process_secret().ok().flatten().map(|secret| (secret, PlainClients::Refuse));
        // a store for agents on this machine alone (--standalone) is reachable from it alone
        let host = is_loopback_name(&site.0).then(|| site.0.clone());
        match StoreServer::start(&ServerConfig { host, port: site.1, auth, ..ServerConfig::default() }) {
            Ok(server) => {
                site.1 = server.port();
                servers.push(server);
            }
            // another agent on this machine got there first: use its store
            Err(err) if explicit.is_none() && err.kind() == io::ErrorKind::AddrInUse => {}
            Err(err) => {
                return Err(RendezvousError::Config(format!(
                    "cannot host the rendezvous store on port {}: {err}",
                    site.1
                )))
            }
        }
    }
    // A single store that starts later than this agent is waited for, up to the join
    // timeout; with several sites, one that does not answer soon is passed over.
    let patience = if sites.len() == 1 { settings.join_timeout } else { settings.heartbeat_timeout };
    let prefix = run_prefix(&params.run_id);
    let store = TcpRendezvousStore::with_sites(sites, Some(patience), prefix.clone(), read_timeout);
    let handler = DynamicRendezvous::new(store, settings, prefix)?;
    Ok(Rendezvous::Dynamic { handler, servers })
}

/// `--rdzv-backend static`'s configuration, parsed and checked.
struct StaticOptions {
    rank: u32,
    timeout: Duration,
    endpoint: (String, u16),
    secret: Option<Secret>,
}

fn static_options(params: &RendezvousParams) -> Result<StaticOptions> {
    let mut conf = RendezvousConf::from_input(&params.conf, STATIC_KEYS)?;
    let secret = conf_secret(&conf)?;
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
    Ok(StaticOptions { rank, timeout, endpoint, secret })
}

fn create_static(params: &RendezvousParams, options: StaticOptions) -> Result<Rendezvous> {
    let StaticOptions { rank, timeout, endpoint, secret } = options;
    apply_secret(secret)?;
    let handler =
        StaticRendezvous::new(&params.run_id, rank, params.max_nodes, endpoint, timeout, params.local_addr.as_deref())?;
    Ok(Rendezvous::Static(handler))
}
