//! What the launcher gives a rendezvous backend, and the settings of the dynamic backends.

use super::conf::{parse_duration, ConfInput, RendezvousConf};
use super::error::{RendezvousError, Result};
use super::settings::RendezvousSettings;

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

/// The settings of a dynamic backend: the node bounds, `--local-addr` and the conf's timings.
pub(crate) fn dynamic_settings(params: &RendezvousParams, conf: &RendezvousConf) -> Result<RendezvousSettings> {
    let mut settings = RendezvousSettings::new(&params.run_id, params.min_nodes, params.max_nodes)?.with_conf(conf)?;
    settings.local_addr = params.local_addr.clone();
    if let Ok(text) = std::env::var(PROGRESS_INTERVAL_VAR) {
        settings.progress_interval =
            parse_duration(&text).ok().filter(|interval| !interval.is_zero()).ok_or_else(|| {
                RendezvousError::Config(format!("{PROGRESS_INTERVAL_VAR}={text:?} is not a positive duration"))
            })?;
    }
    Ok(settings)
}

/// Makes the job secret `--rdzv-conf auth_token_file` names this process's (and checks the
/// environment's): an unusable secret is a configuration error, before anything connects.
pub(crate) fn apply_secret(conf: &RendezvousConf) -> Result<()> {
    let config = |err: crate::auth::SecretError| RendezvousError::Config(err.to_string());
    if let Some(path) = conf.get("auth_token_file") {
        let secret = crate::auth::Secret::from_file(std::path::Path::new(path)).map_err(config)?;
        crate::auth::use_secret(secret).map_err(config)?;
    }
    crate::auth::process_secret().map_err(config)?;
    Ok(())
}
