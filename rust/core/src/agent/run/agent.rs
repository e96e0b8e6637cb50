//! The agent: what it holds for the whole run, and how it is set up (signals first, then the
//! metrics endpoint, the log directories, the rendezvous and the warm standbys).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::report::Report;
use crate::agent::checkpoints::Checkpoints;
use crate::agent::config::AgentConfig;
use crate::agent::error::{AgentError, Result};
use crate::agent::events::EventLog;
use crate::agent::output::logfiles::LogWriter;
use crate::agent::output::logs::{worker_outputs, LogDirs};
use crate::agent::signals::Signals;
use crate::agent::stragglers::Standings;
use crate::agent::workers::control::Control;
use crate::agent::workers::group::WorkerGroup;
use crate::agent::workers::process::Output;
use crate::agent::workers::standby::StandbyPool;
use crate::auth::Secret;
use crate::console;
use crate::metrics::{self, Exposes, MetricsServer};
use crate::rendezvous::node::host_name;
use crate::rendezvous::{Rendezvous, RendezvousError};
use crate::store::TcpStore;

pub(super) struct Agent {
    pub(super) config: AgentConfig,
    pub(super) rdzv: Rendezvous,
    pub(super) signals: Signals,
    pub(super) logs: LogDirs,
    pub(super) log_writer: LogWriter,
    pub(super) host: String,
    pub(super) attempt: u32,
    pub(super) store: Option<TcpStore>,
    /// Ready for the next attempt's workers.
    pub(super) standbys: StandbyPool,
    /// Where each local rank's workers write.
    pub(super) outputs: Vec<Output>,
    pub(super) events: Arc<EventLog>,
    /// The metrics endpoint (`--metrics-port`), served while the agent lives.
    pub(super) metrics_server: Option<MetricsServer>,
    /// The round the workers last started in.
    pub(super) round: u64,
    /// The last round this agent was told of (`None` before the first).
    pub(super) round_seen: Option<u64>,
    /// Rounds in a row whose start lost the store: bounded, so that a store that keeps failing
    /// right after each rendezvous ends the run instead of cycling forever.
    pub(super) lost_starts: u32,
    /// The workers' checkpoints in memory (`None`: shared memory could not be set up).
    pub(super) checkpoints: Option<Checkpoints>,
    /// The line to workers that re-form in process (`None`: the socket could not be made).
    pub(super) control: Option<Control>,
    /// Workers kept running through a re-form, until the next round places them.
    pub(super) kept: Option<WorkerGroup>,
    /// Every rank's pace, as the round's first member last judged it.
    pub(super) standings: Standings,
}

impl Agent {
    /// Everything the run needs before its first rendezvous. A stop signal ends the wait for
    /// the store ([`AgentError::Interrupted`]).
    pub(super) async fn set_up(mut config: AgentConfig, report: &mut Report) -> Result<Agent> {
        // signals first: one that arrives during the rendezvous is handled like any other
        let mut signals = Signals::install(&config.signals_to_handle)?;
        // a port in use is a configuration error, said before any rendezvous
        let metrics = match config.metrics_port {
            Some(port) => Some(
                MetricsServer::start(
                    config.metrics_addr.as_deref().or(config.local_addr.as_deref()),
                    port,
                    Exposes::Agent,
                )
                .map_err(|err| AgentError::Config(format!("--metrics-port: {err}")))?,
            ),
            None => None,
        };
        metrics::agent::get().job_restarts(0, config.max_restarts);
        let logs = LogDirs::create(config.log_dir.as_deref(), &config.run_id)?;
        report.log_dir = logs.run_dir().map(|dir| dir.to_string_lossy().into_owned());
        report.logs_kept = !logs.is_temporary();
        let log_writer = LogWriter::start()?;
        crate::logging::set_node_name(config.local_addr.as_deref().unwrap_or(&host_name()));
        // reaching the store can take up to the join timeout: a stop signal must not wait
        let rdzv = tokio::select! {
            rdzv = Rendezvous::create(config.rendezvous_params()) => rdzv?,
            (signal, _) = signals.recv() => return Err(AgentError::Interrupted(signal)),
        };
        let host = config.local_addr.clone().unwrap_or_else(host_name);
        point_workers_at_the_secret(&mut config, rdzv.secret(), &host)?;
        let checkpoints = hold_checkpoints(&mut config, &host);
        let control = open_control(rdzv.loss_window());
        config.env.extend(control.as_ref().map(Control::worker_env));
        let outputs = worker_outputs(&config, console::on_terminal());
        if outputs.contains(&Output::Shared) {
            tracing::info!(
                "on a terminal: workers whose output is neither redirected, tee'd nor prefixed write to it directly"
            );
        }
        for local_rank in 0..config.local_world_size as usize {
            if let Some(binding) = config.binding_of(local_rank) {
                tracing::info!("{binding} for local rank {local_rank}");
            }
        }
        let standbys = StandbyPool::new(&config, outputs.clone());
        let events =
            EventLog::open(config.event_log.as_deref(), config.event_log_stderr, &config.run_id, &host, &log_writer)
                .map_err(|err| AgentError::Config(format!("--event-log: {err}")))?;
        Ok(Agent {
            config,
            rdzv,
            signals,
            logs,
            log_writer,
            host,
            attempt: 0,
            store: None,
            standbys,
            outputs,
            events: Arc::new(events),
            metrics_server: metrics,
            round: 0,
            round_seen: None,
            lost_starts: 0,
            checkpoints,
            control,
            kept: None,
            standings: Standings::default(),
        })
    }

    /// The run ID, and a command that shows the job's state from any machine that reaches its
    /// store (the first site in use on c10d, the cluster on etcd).
    pub(super) fn how_to_watch(&self) -> String {
        let (backend, run_id) = (self.rdzv.name(), self.rdzv.run_id());
        let endpoint = match backend {
            "c10d" => self.rdzv.describe_store(),
            "static" => return format!("run ID {run_id} (static rendezvous: no shared job state to show)"),
            _ => self.config.rdzv_endpoint.clone(),
        };
        format!("run ID {run_id}; to watch the job: elastix status --rdzv-backend {backend} --rdzv-endpoint {endpoint} --rdzv-id {run_id}")
    }
}

/// Sets up the memory the workers save checkpoints into, and tells them where it is (and
/// where the job persists); without it, `elastix.checkpoint` says why.
fn hold_checkpoints(config: &mut AgentConfig, host: &str) -> Option<Checkpoints> {
    let dir = config.checkpoint_dir.as_deref().map(Path::new);
    let copy_rate = config.checkpoint_copy_rate.saturating_mul(1_000_000);
    match Checkpoints::start(&config.run_id, dir, config.checkpoint_keep as usize, host, copy_rate) {
        Ok(checkpoints) => {
            config.env.extend(checkpoints.worker_env(&config.run_id, dir));
            Some(checkpoints)
        }
        Err(err) => {
            tracing::warn!("no shared memory for checkpoints ({err}): elastix.checkpoint cannot save in this job");
            None
        }
    }
}

/// Beyond the loss window, how long a worker whose collective failed waits for its agent to
/// say whether the job re-forms (the failure may be a peer's loss the agent has yet to see).
const NOTICE_SLACK: Duration = Duration::from_secs(3);

/// The line to the workers that re-form in process, or why there is none (then every re-form
/// restarts them).
fn open_control(loss_window: Duration) -> Option<Control> {
    Control::start(loss_window + NOTICE_SLACK)
        .map_err(|err| {
            tracing::warn!("cannot open the workers' control socket ({err}): workers will be restarted at each re-form")
        })
        .ok()
}

/// Gives the workers the job secret's file (never the secret itself), or, without a secret on
/// a node others can reach, says once who can reach the job and how to close it.
fn point_workers_at_the_secret(config: &mut AgentConfig, secret: Option<&Secret>, host: &str) -> Result<()> {
    let file = secret.map(crate::auth::children_file).transpose();
    match file.map_err(|err| RendezvousError::Config(err.to_string()))? {
        Some(path) => {
            config.env.insert(crate::auth::TOKEN_FILE_VAR.to_owned(), path.to_string_lossy().into_owned());
        }
        None if !crate::rendezvous::endpoint::is_loopback_name(host) => tracing::warn!(
            "no job secret: anyone who can reach {host} can join this job, end it or feed its workers' \
             collectives; give every node {}=<a file only you can read> (or --rdzv-conf auth_token_file=...)",
            crate::auth::TOKEN_FILE_VAR
        ),
        None => {}
    }
    Ok(())
}
