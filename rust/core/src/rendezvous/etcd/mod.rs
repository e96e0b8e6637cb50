//! `--rdzv-backend etcd` (alias `etcd-v3`): the elastic rendezvous on an etcd v3 cluster, from
//! `--rdzv-endpoint host1:2379,host2:2379,...` and `--rdzv-conf` (torch's key names where torch
//! has them; see [`crate::rendezvous::config::conf::ETCD_KEYS`]).
//!
//! * [`handler`]: the handler ([`EtcdRendezvous`]); [`join`]: forming one round;
//!   [`member`]: what a member of a running round watches;
//! * [`keys`]: where the state lives; [`ops`]: transactions and their answers;
//! * [`status`]: the job's state as `elastix status` shows it.

mod handler;
mod join;
mod keys;
mod member;
mod ops;
mod status;

pub use handler::EtcdRendezvous;

use std::time::Duration;

use elastix_etcd::{EtcdClient, EtcdOptions, TlsFiles};

use super::endpoint::parse_endpoints;
use super::error::{RendezvousError, Result};
use super::status::{JobStatus, StatusQuery};
use crate::rendezvous::config::conf::{RendezvousConf, ETCD_KEYS};
use crate::rendezvous::config::params::{dynamic_settings, job_secret, RendezvousParams};
use crate::rendezvous::config::settings::RendezvousSettings;

/// etcd's client port.
pub const DEFAULT_ETCD_PORT: u16 = 2379;
const DEFAULT_KEY_PREFIX: &str = "/elastix/rdzv/";

/// `--rdzv-backend etcd`'s configuration, parsed and checked (the TLS files read).
pub(crate) struct EtcdRdzvOptions {
    settings: RendezvousSettings,
    client: EtcdOptions,
    prefix: String,
}

impl EtcdRdzvOptions {
    /// Parses and checks the etcd backend's configuration (the TLS files read), with no
    /// other side effect.
    pub(crate) fn parse(params: &RendezvousParams) -> Result<EtcdRdzvOptions> {
        let mut conf = RendezvousConf::from_input(&params.conf, ETCD_KEYS)?;
        if let Some(timeout) = conf.get("timeout").map(str::to_owned) {
            if conf.get("join_timeout").is_none() {
                conf.insert("join_timeout", &timeout, ETCD_KEYS)?;
            }
        }
        if conf.get("lease_ttl").is_some() {
            if conf.get("keep_alive_interval").is_some() || conf.get("keep_alive_max_attempt").is_some() {
                return Err(RendezvousError::Config(
                    "--rdzv-conf lease_ttl sets keep_alive_interval and keep_alive_max_attempt; give one or the other"
                        .into(),
                ));
            }
            let ttl = conf.duration("lease_ttl", Duration::ZERO)?;
            if ttl < Duration::from_millis(300) {
                return Err(RendezvousError::Config(format!("--rdzv-conf lease_ttl={ttl:?} is too short")));
            }
            conf.insert("keep_alive_interval", &format!("{}ms", (ttl / 3).as_millis()), ETCD_KEYS)?;
            conf.insert("keep_alive_max_attempt", "3", ETCD_KEYS)?;
        }
        let mut settings = dynamic_settings(params, &conf)?;
        // The keep-alive retries up to the join timeout; the round's watch decides sooner,
        // when the lease would lapse: a node cut off stops its workers then, while a cluster
        // that refuses everyone (down for all: a new leader renews every lease) is waited for.
        settings.store_outage_limit = Some(settings.join_timeout);
        let client = client_options(&conf, &params.endpoint, settings.heartbeat_timeout)?;
        let prefix = run_prefix(&conf, &params.run_id);
        Ok(EtcdRdzvOptions { settings, client, prefix })
    }
}

impl EtcdRendezvous {
    /// The etcd backend for `options`.
    pub(crate) fn create(options: EtcdRdzvOptions) -> Result<EtcdRendezvous> {
        let EtcdRdzvOptions { settings, client, prefix } = options;
        let client = EtcdClient::new(&client).map_err(|err| RendezvousError::Config(err.to_string()))?;
        EtcdRendezvous::new(client, settings, prefix)
    }
}

/// What a client of the cluster at `endpoint` (a list) needs, with `conf`'s TLS files; each
/// request is retried for up to `patience`.
fn client_options(conf: &RendezvousConf, endpoint: &str, patience: Duration) -> Result<EtcdOptions> {
    let tls = match conf.get("protocol").unwrap_or("http") {
        "http" => {
            if let Some(key) = ["cacert", "cert", "key"].into_iter().find(|key| conf.get(key).is_some()) {
                return Err(RendezvousError::Config(format!("--rdzv-conf {key} needs protocol=https")));
            }
            None
        }
        "https" => Some(tls_files(conf)?),
        other => {
            return Err(RendezvousError::Config(format!("--rdzv-conf protocol={other:?}: use http or https")));
        }
    };
    let sites = parse_endpoints(endpoint, DEFAULT_ETCD_PORT)?;
    if let Some((host, _)) = sites.iter().find(|(_, port)| *port == 0) {
        return Err(RendezvousError::Config(format!(
            "--rdzv-endpoint {host}:0: port 0 names no etcd member (etcd listens on 2379 by default)"
        )));
    }
    let endpoints = sites.iter().map(|(host, port)| format!("{host}:{port}")).collect();
    Ok(EtcdOptions { endpoints, tls, patience })
}

/// The run's prefix: `key_prefix` (default `/elastix/rdzv/`), then the run ID.
fn run_prefix(conf: &RendezvousConf, run_id: &str) -> String {
    let mut prefix = conf.get("key_prefix").unwrap_or(DEFAULT_KEY_PREFIX).to_owned();
    if !prefix.ends_with('/') {
        prefix.push('/');
    }
    format!("{prefix}{run_id}/")
}

/// `elastix status` on etcd without a run ID: the runs under the key prefix (those with
/// metadata), by name.
pub(crate) async fn etcd_runs(query: &StatusQuery) -> Result<Vec<String>> {
    let conf = RendezvousConf::from_input(&query.conf, ETCD_KEYS)?;
    job_secret(&conf)?;
    let options = client_options(&conf, &query.endpoint, query.timeout)?;
    let client = EtcdClient::new(&options).map_err(|err| RendezvousError::Config(err.to_string()))?;
    let prefix = run_prefix(&conf, "");
    let request = elastix_etcd::pb::etcdserverpb::RangeRequest {
        key: prefix.clone().into_bytes(),
        range_end: keys::prefix_end(prefix.as_bytes()),
        keys_only: true,
        ..Default::default()
    };
    let response = client.range(request).await.map_err(|err| ops::etcd_error(err, &client))?;
    let runs = response.kvs.iter().filter_map(|kv| {
        let key = std::str::from_utf8(&kv.key).ok()?;
        let run = key.strip_prefix(&prefix)?.strip_suffix("/meta")?;
        (!run.is_empty() && !run.contains('/')).then(|| run.to_owned())
    });
    Ok(runs.collect())
}

/// `elastix status` on etcd: the job's state, or `None` if the cluster holds no such run.
pub(crate) async fn etcd_status(query: &StatusQuery) -> Result<Option<JobStatus>> {
    let conf = RendezvousConf::from_input(&query.conf, ETCD_KEYS)?;
    job_secret(&conf)?; // checked as the agents check it, though etcd does not use it
    let options = client_options(&conf, &query.endpoint, query.timeout)?;
    let client = EtcdClient::new(&options).map_err(|err| RendezvousError::Config(err.to_string()))?;
    let keys = keys::EtcdKeys::new(run_prefix(&conf, &query.run_id));
    status::read(&client, &keys, &query.run_id).await
}

fn tls_files(conf: &RendezvousConf) -> Result<TlsFiles> {
    let read = |key: &str| -> Result<Option<Vec<u8>>> {
        let Some(path) = conf.get(key) else { return Ok(None) };
        let bytes = std::fs::read(path)
            .map_err(|err| RendezvousError::Config(format!("--rdzv-conf {key}={path}: cannot read it: {err}")))?;
        if !String::from_utf8_lossy(&bytes).contains("-----BEGIN") {
            return Err(RendezvousError::Config(format!("--rdzv-conf {key}={path}: not a PEM file")));
        }
        Ok(Some(bytes))
    };
    let (cert, key) = (read("cert")?, read("key")?);
    let cert_and_key = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => return Err(RendezvousError::Config("--rdzv-conf cert and key go together".into())),
    };
    Ok(TlsFiles { ca: read("cacert")?, cert_and_key })
}
