//! What the launcher gives a rendezvous backend, and the settings of the dynamic backends.

use std::path::Path;
use std::time::Duration;

use crate::auth::{Secret, SecretError};
use crate::rendezvous::config::conf::{parse_duration, ConfInput, RendezvousConf};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};

/// What the launcher knows (`--rdzv-backend`, `--rdzv-endpoint`, `--rdzv-id`, `--nnodes`,
/// `--local-addr`, `--rdzv-conf`, `--node-rank`).
#[derive(Clone, Debug)]
pub struct RendezvousParams {
    pub backend: String,
    pub endpoint: String,
    pub run_id: String,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub local_addr: Option<String>,
    pub conf: ConfInput,
    /// The node's rank, for the static backend.
    pub node_rank: Option<u32>,
}

/// How often a waiting node reports (default 15 s); mostly for tests and impatient operators.
pub const PROGRESS_INTERVAL_VAR: &str = "ELASTIX_RDZV_PROGRESS_INTERVAL";

/// The settings of a dynamic backend: the node bounds, `--local-addr`, the conf's timings and
/// the job secret ([`job_secret`]).
pub(crate) fn dynamic_settings(params: &RendezvousParams, conf: &RendezvousConf) -> Result<RendezvousSettings> {
    let mut settings = RendezvousSettings::new(&params.run_id, params.min_nodes, params.max_nodes)?.with_conf(conf)?;
    settings.local_addr = params.local_addr.clone();
    settings.secret = job_secret(conf)?;
    settings.progress_interval = progress_interval(settings.progress_interval)?;
    Ok(settings)
}

/// How often a waiting node says what it waits for: [`PROGRESS_INTERVAL_VAR`], else `default`.
pub(crate) fn progress_interval(default: Duration) -> Result<Duration> {
    let Ok(text) = std::env::var(PROGRESS_INTERVAL_VAR) else { return Ok(default) };
    parse_duration(&text)
        .ok()
        .filter(|interval| !interval.is_zero())
        .ok_or_else(|| RendezvousError::Config(format!("{PROGRESS_INTERVAL_VAR}={text:?} is not a positive duration")))
}

/// The job secret: the file `--rdzv-conf auth_token_file` names, else the environment's
/// (`ELASTIX_AUTH_TOKEN_FILE`, `ELASTIX_AUTH_TOKEN`), read and checked; both given, they must
/// agree. `None` without one.
pub(crate) fn job_secret(conf: &RendezvousConf) -> Result<Option<Secret>> {
    let config = |err: SecretError| RendezvousError::Config(err.to_string());
    let given =
        conf.get("auth_token_file").map(|path| Secret::from_file(Path::new(path))).transpose().map_err(config)?;
    let env = Secret::from_env().map_err(config)?;
    if let (Some(given), Some(env)) = (&given, &env) {
        crate::auth::secret::same_secret(env, given).map_err(config)?;
    }
    Ok(given.or(env))
}
