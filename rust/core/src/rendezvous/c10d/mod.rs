//! `--rdzv-backend c10d`: the elastic rendezvous over TCPStore servers (one endpoint, or a list
//! of sites), each hosted by an agent or by `elastix-store`.
//!
//! * [`dynamic`]: the handler; [`round`]: forming one round in O(1) store operations per node;
//! * [`liveness`]: heartbeats and the ring monitor; [`contact`]: this node's contact with the
//!   store;
//! * [`locate`]: where the state lives among the sites, and moving it; [`events`]: the run's
//!   event log in the store;
//! * [`keys`]: where the state lives in the store; [`status`]: reading it for `elastix status`.
//!
//! [`C10dRendezvous`] is the backend an agent holds: the handler over TCPStore sites, serving
//! the ones that are this node's.

mod contact;
pub mod dynamic;
mod events;
pub mod keys;
mod liveness;
mod locate;
mod round;
pub(crate) mod status;
mod trust;

use std::io;
use std::time::Duration;

use self::dynamic::DynamicRendezvous;
use self::keys::run_prefix;
use super::endpoint::{is_local_addr, is_loopback_name, is_this_machine, parse_endpoints, DEFAULT_PORT};
use super::error::{RendezvousError, Result};
use super::store::{TcpRendezvousStore, DEFAULT_READ_TIMEOUT};
use crate::auth::PlainClients;
use crate::rendezvous::config::conf::{RendezvousConf, DYNAMIC_KEYS};
use crate::rendezvous::config::params::{dynamic_settings, RendezvousParams};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::store::{AnyServer, ServerConfig};

/// `--rdzv-backend c10d`'s configuration, parsed and checked (without side effects).
pub(crate) struct C10dOptions {
    settings: RendezvousSettings,
    read_timeout: Duration,
    sites: Vec<(String, u16)>,
    /// `is_host` as given (None: decided per site from the addresses).
    is_host: Option<bool>,
}

impl C10dOptions {
    pub(crate) fn parse(params: &RendezvousParams) -> Result<C10dOptions> {
        let conf = RendezvousConf::from_input(&params.conf, DYNAMIC_KEYS)?;
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
        Ok(C10dOptions { settings, read_timeout, sites, is_host })
    }
}

/// The c10d backend: the handler, serving the store sites that are this node's.
pub type C10dRendezvous = DynamicRendezvous<TcpRendezvousStore>;

impl C10dRendezvous {
    /// Serves the sites that are this node's and makes the handler. Must run inside a tokio
    /// runtime (the sites are served on it).
    pub(crate) async fn create(params: &RendezvousParams, options: C10dOptions) -> Result<C10dRendezvous> {
        let C10dOptions { settings, read_timeout, mut sites, is_host: explicit } = options;
        let listed = sites.len() > 1;
        let mut servers = Vec::new();
        // who serves a single store, for the warnings of a node that cannot reach it
        let mut served_by = None;
        for site in sites.iter_mut() {
            let hosting = match (explicit, &params.local_addr) {
                (Some(explicit), _) => explicit,
                (None, Some(local_addr)) if listed => is_local_addr(&site.0, local_addr).await,
                (None, _) => is_this_machine(&site.0).await,
            };
            if !hosting {
                if site.1 == 0 {
                    return Err(RendezvousError::Config(format!(
                        "--rdzv-endpoint {}:0: port 0 names no server to reach; only the node that hosts the store \
                         may let it pick a port (as --standalone does): give the store's port",
                        site.0
                    )));
                }
                let by = if explicit.is_some() { "a store" } else { "the agent" };
                served_by = Some(format!("it is served by {by} on {} (not started yet, ended, or cut off)", site.0));
                continue;
            }
            match host_site(site, &settings, params.max_nodes, explicit, listed)? {
                Hosted::Here(server) => servers.push(server),
                Hosted::Elsewhere(by) => served_by = Some(by),
            }
        }
        // A single store that starts later than this agent is waited for, up to the join
        // timeout; with several sites, one that does not answer soon is passed over.
        let patience = if sites.len() == 1 { settings.join_timeout } else { settings.heartbeat_timeout };
        let prefix = run_prefix(&params.run_id);
        let mut store = TcpRendezvousStore::with_sites(
            sites,
            Some(patience),
            prefix.clone(),
            read_timeout,
            settings.secret.clone(),
        );
        if let Some(served_by) = served_by.filter(|_| !listed) {
            store = store.with_hint(served_by);
        }
        Ok(DynamicRendezvous::new(store, settings, prefix)?.hosting(servers))
    }
}

/// Whether a site this node may host is served here (`Here`) or by another agent of this
/// machine that got there first (`Elsewhere`: who, for the warnings of a node that cannot
/// reach it); anything else that keeps it from serving is a configuration error.
enum Hosted {
    Here(AnyServer),
    Elsewhere(String),
}

fn host_site(
    site: &mut (String, u16),
    settings: &RendezvousSettings,
    max_nodes: u32,
    explicit: Option<bool>,
    listed: bool,
) -> Result<Hosted> {
    // only agents connect to the rendezvous store, and with a secret they all prove it
    let auth = settings.secret.clone().map(|secret| (secret, PlainClients::Refuse));
    // a store for agents on this machine alone (--standalone) is reachable from it alone
    let host = is_loopback_name(&site.0).then(|| site.0.clone());
    match AnyServer::start(&ServerConfig { host, port: site.1, auth, ..ServerConfig::default() }) {
        Ok(server) => {
            site.1 = server.port();
            if !listed && max_nodes > 1 {
                let first = if explicit.is_none() { " (the first agent started on this machine does)" } else { "" };
                tracing::info!(
                    "this agent hosts the rendezvous store at {}:{}{first}: the other nodes need it, and wait for it \
                     to come back if this agent ends (list several --rdzv-endpoint sites, or use etcd, so that no one \
                     node is needed)",
                    site.0,
                    site.1
                );
            }
            Ok(Hosted::Here(server))
        }
        // another agent on this machine got there first: use its store
        // (the error names the port's holder where it can be told)
        Err(err) if explicit.is_none() && err.kind() == io::ErrorKind::AddrInUse => {
            tracing::info!(
                "port {} is taken on this machine: using the rendezvous store served there, not hosting one ({err})",
                site.1
            );
            let holder = crate::store::server::port_holder::holder(site.1)
                .map_or_else(String::new, |pid| format!(" (pid {pid})"));
            Ok(Hosted::Elsewhere(format!("it is served by the agent started first on this machine{holder}")))
        }
        Err(err) => Err(RendezvousError::Config(format!("cannot host the rendezvous store on port {}: {err}", site.1))),
    }
}
