//! The agent's life: rendezvous, start the workers, wait for the first event (a worker
//! failed, all succeeded, the membership changed, a signal), react, repeat.
//!
//! * A worker failure stops the local workers and reports the failure to the rendezvous;
//!   the first report of a round spends one job-wide restart. Within the budget the agent
//!   re-joins (which opens the next round and restarts every node); past it, the job is
//!   closed as failed and every agent exits 1 with the root cause.
//! * A membership change (late nodes waiting, a node lost, a newer round) restarts the
//!   workers without spending the budget.
//! * A signal is forwarded to the workers, which are then stopped; the agent exits with
//!   128+N and leaves the rendezvous open (the other nodes re-form without it).
//! * All local workers succeeding leads to the exit barrier; once every node is through, the
//!   job is done and the rendezvous is closed as succeeded.
//! * Worker output never holds the agent (see [`crate::console`], [`super::logfiles`]): the
//!   result counts the console lines dropped for a stalled reader and lists what could not be
//!   written; a success whose kept log files are incomplete exits [`LOGS_INCOMPLETE`].

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::watch;

use super::config::AgentConfig;
use super::dumps::DumpRequests;
use super::env::worker_name;
use super::error::{AgentError, Result};
use super::events::EventLog;
use super::failure::{summary, Failure};
use super::finished::FinishedJob;
use super::group::{GroupOutcome, Launch, Waited, WorkerGroup, FAILED_TOGETHER};
use super::logfiles::LogWriter;
use super::logs::{worker_outputs, LogDirs};
use super::process::Output;
use super::progress::ProgressPublisher;
use super::ranks::{self, RoleInfo};
use super::result::{AgentErrorInfo, AgentResult, RunState, LOGS_INCOMPLETE};
use super::signals::Signals;
use super::standby::StandbyPool;
use crate::auth::Secret;
use crate::console::{self, StreamMark};
use crate::metrics::{self, Exposes, MetricsServer};
use crate::rendezvous::node::host_name;
use crate::rendezvous::records::{AgentFacts, FailureRecord, FORMAT_VERSION};
use crate::rendezvous::{MembershipChange, NodeDesc, Rendezvous, RendezvousError, RendezvousInfo};
use crate::store::{TcpStore, TcpStoreOptions};

/// The reason a successful job closes its rendezvous with.
const SUCCEEDED: &str = "succeeded";
/// Prefix of the reason a failed job closes its rendezvous with (the summary follows).
const FAILED: &str = "failed: ";
/// Bound on the rank exchange and other agent-side store waits.
const STORE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the exit barrier waits for the store on each reconnect.
const BARRIER_RECONNECT: Duration = Duration::from_secs(5);
/// How often the exit barrier looks at who has not arrived (and whether they are still there).
const BARRIER_LOOK_EVERY: Duration = Duration::from_secs(2);
/// Consecutive worker starts that may fail for a lost store before the run fails.
const MAX_LOST_STARTS: u32 = 3;
/// Lost members named in a failed run's summary, at most.
const LOST_NAMED: usize = 4;
/// Beyond the loss window, how long a failure waits for a silent member to be reported lost
/// (the monitor's reading of the store, and its report, take a moment).
const LOSS_VERDICT_SLACK: Duration = Duration::from_secs(2);

/// Runs an agent to the end and reports how it went. Must run inside a multi-thread tokio
/// runtime that lives as long as the call (workers die with the thread that started them).
pub async fn run_agent(config: AgentConfig) -> AgentResult {
    // every connection is a descriptor: a stranger's flood must meet the door's limits, not a
    // default soft limit of 1024 (the workers inherit the raised limit)
    match crate::store::server::listener::raise_open_file_limit() {
        Ok(limit) => tracing::debug!("open-file limit: {limit}"),
        Err(err) => tracing::warn!("cannot raise the open-file limit to the hard limit: {err}"),
    }
    let mut report = Report::default();
    let console = ConsoleMarks::now();
    let mut agent = None;
    let outcome = match Agent::start(config, &mut report).await {
        Ok(started) => agent.insert(started).run(&mut report).await,
        Err(err) => Err(err),
    };
    let end = match outcome {
        Ok(end) => end,
        Err(AgentError::Interrupted(signal)) => {
            tracing::info!("received {signal} while starting; no worker was started");
            End::Interrupted(signal)
        }
        Err(err) => {
            // a job that ends for want of nodes ends because of the ones it lost: name them
            let message = match report.lost.as_slice() {
                [] => err.to_string(),
                lost => format!("{err}; lost before: {}", lost.join("; ")),
            };
            tracing::error!("agent failed: {message}");
            report.summary = Some(message.clone());
            report.error = Some(AgentErrorInfo { kind: err.kind().to_owned(), message });
            End::Failed
        }
    };
    crate::auth::remove_children_file();
    if let Some(agent) = agent.as_mut() {
        agent.store = None;
        if !matches!(end, End::Interrupted(_)) {
            // the job is over: the other nodes may still be reading how from the store hosted here
            agent.rdzv.linger(STORE_LINGER).await;
        }
    }
    if let Some(agent) = &agent {
        let (state, exit_code) = end.state();
        let cause = (state == "FAILED").then(|| report.root_cause()).flatten();
        agent.events.job_finished(state, exit_code, cause.as_deref()).await;
        let store = agent.rdzv.describe_store();
        FinishedJob {
            v: 1,
            run_id: agent.rdzv.run_id(),
            backend: agent.rdzv.name(),
            endpoint: &agent.config.rdzv_endpoint,
            store: &store,
            state,
            exit_code,
            finished: FinishedJob::now(),
            host: &agent.host,
            pid: std::process::id(),
            root_cause: cause.as_deref(),
            log_dir: report.log_dir.as_deref().filter(|_| report.logs_kept),
        }
        .remember();
        // a signal asks for a prompt exit: a hung disk gets less time then
        let within = if matches!(end, End::Interrupted(_)) { CONSOLE_FLUSH_WAIT } else { LOG_FLUSH_WAIT };
        report.output_errors = agent.log_writer.finish(within).await;
        report.logs_incomplete = !report.output_errors.is_empty();
    }
    let end = report.logs_verdict(end);
    console.finish(&mut report).await;
    report.finish(end)
}

/// Bound on publishing what `elastix status` shows (a node's facts, a failure).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an agent hosting the rendezvous store keeps it up at the end for the other nodes.
const STORE_LINGER: Duration = Duration::from_secs(5);
/// How long the end of a run waits for the log files to be written.
const LOG_FLUSH_WAIT: Duration = Duration::from_secs(10);
/// How long the end of a run waits for the console to take the last lines (a stalled reader
/// must not hold the agent's exit).
const CONSOLE_FLUSH_WAIT: Duration = Duration::from_secs(1);

/// The console's counts at the start of a run, to tell what happened during it.
struct ConsoleMarks {
    stdout: StreamMark,
    stderr: StreamMark,
}

impl ConsoleMarks {
    fn now() -> ConsoleMarks {
        ConsoleMarks { stdout: console::stdout().mark(), stderr: console::stderr().mark() }
    }

    /// Waits (briefly) for the console to take the run's last lines, mentions lines still
    /// unreported as dropped, and records drops and errors in the report.
    async fn finish(self, report: &mut Report) {
        for (stream, mark) in [(console::stdout(), self.stdout), (console::stderr(), self.stderr)] {
            if !stream.is_stalled() {
                stream.flush(CONSOLE_FLUSH_WAIT).await;
            }
            stream.report_drops();
            let now = stream.mark();
            report.dropped_output_lines += now.dropped - mark.dropped;
            if now.failed && !mark.failed {
                report.output_errors.extend(stream.error());
            }
        }
    }
}

/// How the agent's run ended.
enum End {
    Succeeded,
    /// The workers succeeded, but the log files the run keeps are incomplete.
    LogsIncomplete,
    Failed,
    Interrupted(Signal),
}

impl End {
    /// The run's state and exit code.
    fn state(&self) -> (&'static str, i32) {
        match self {
            End::Succeeded => ("SUCCEEDED", 0),
            End::LogsIncomplete => ("SUCCEEDED", LOGS_INCOMPLETE),
            End::Failed => ("FAILED", 1),
            End::Interrupted(signal) => ("INTERRUPTED", 128 + *signal as i32),
        }
    }
}

/// What the result will say; filled in as the run goes.
#[derive(Default)]
struct Report {
    restart_count: i64,
    group_rank: Option<u32>,
    group_world_size: Option<u32>,
    log_dir: Option<String>,
    global_ranks: Vec<u32>,
    failures: Vec<Failure>,
    summary: Option<String>,
    error: Option<AgentErrorInfo>,
    dropped_output_lines: u64,
    output_errors: Vec<String>,
    /// Whether the run's log files are kept (not a temporary directory removed at the end).
    logs_kept: bool,
    /// Whether a log file could not be written completely.
    logs_incomplete: bool,
    /// Whether any of this node's workers failed or hung in this run (its logs and stacks are
    /// then kept, though the job succeeds after a restart).
    workers_failed: bool,
    /// The members this node saw lost, most recent last (a few at most).
    lost: Vec<String>,
}

impl Report {
    /// Why the run failed, in one line: the error that ended it (for a failure elsewhere, its
    /// last line: the exception), else the root cause among this node's failures.
    fn root_cause(&self) -> Option<String> {
        let Some(error) = &self.error else {
            return super::failure::root_cause(&self.failures).map(|root| self.failures[root].headline());
        };
        let is_rule = |line: &str| line.chars().all(|c| c == '=' || c == '-');
        let last = error.message.lines().rev().map(str::trim).find(|line| !line.is_empty() && !is_rule(line));
        Some(match (error.kind.as_str(), last) {
            ("remote_failure", Some(last)) => format!("workers failed on another node: {last}"),
            (_, Some(last)) if error.message.lines().count() > 1 => last.to_owned(),
            _ => error.message.clone(),
        })
    }

    /// A success whose kept log files are incomplete is not a plain success: it says so
    /// (through the console, so a stalled stderr does not hold the agent) and exits non-zero.
    fn logs_verdict(&self, end: End) -> End {
        if !(matches!(end, End::Succeeded) && self.logs_incomplete && self.logs_kept) {
            return end;
        }
        let text = format!(
            "[elastix] the workers succeeded, but their log files are incomplete ({}); exiting with {LOGS_INCOMPLETE}\n",
            self.output_errors.join("; ")
        );
        console::stderr().line(text.into_bytes());
        End::LogsIncomplete
    }

    fn finish(self, end: End) -> AgentResult {
        let state = match end {
            End::Succeeded | End::LogsIncomplete => RunState::Succeeded,
            End::Failed => RunState::Failed,
            End::Interrupted(_) => RunState::Interrupted,
        };
        let (_, exit_code) = end.state();
        AgentResult {
            state,
            exit_code,
            restart_count: self.restart_count,
            group_rank: self.group_rank,
            group_world_size: self.group_world_size,
            log_dir: self.log_dir,
            global_ranks: self.global_ranks,
            failures: self.failures,
            summary: self.summary,
            error: self.error,
            dropped_output_lines: self.dropped_output_lines,
            output_errors: self.output_errors,
        }
    }
}

/// What starting an attempt's workers came to.
enum Start {
    Running(WorkerGroup),
    /// The round ended before the workers started (a member lost during the rank exchange).
    Changed(MembershipChange),
}

/// What ended one attempt.
enum Event {
    Workers(GroupOutcome),
    Change(MembershipChange),
    /// A handled signal, and whether to forward it to the workers.
    Signal(Signal, bool),
}

struct Agent {
    config: AgentConfig,
    rdzv: Rendezvous,
    signals: Signals,
    logs: LogDirs,
    log_writer: LogWriter,
    host: String,
    attempt: u32,
    store: Option<TcpStore>,
    /// Ready for the next attempt's workers.
    standbys: StandbyPool,
    /// Where each local rank's workers write.
    outputs: Vec<Output>,
    events: EventLog,
    /// The metrics endpoint (`--metrics-port`), served while the agent lives.
    metrics_server: Option<MetricsServer>,
    /// The round the workers last started in.
    round: u64,
    /// The last round this agent was told of (`None` before the first).
    round_seen: Option<u64>,
}

impl Agent {
    async fn start(mut config: AgentConfig, report: &mut Report) -> Result<Agent> {
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
            events,
            metrics_server: metrics,
            round: 0,
            round_seen: None,
        })
    }

    async fn run(&mut self, report: &mut Report) -> Result<End> {
        // starts in a row that lost the store: bounded, so that a store that keeps failing
        // right after each rendezvous ends the run instead of cycling forever
        let mut lost_starts = 0;
        let counts = metrics::agent::get();
        loop {
            let asked = tokio::time::Instant::now();
            let info = tokio::select! {
                info = self.rdzv.next_rendezvous() => match info {
                    Ok(info) => info,
                    Err(RendezvousError::Closed { .. }) => return self.closed(report).await,
                    Err(RendezvousError::GracefulExit { .. }) => {
                        tracing::info!("the job finished while this node waited as a spare");
                        return Ok(End::Succeeded);
                    }
                    Err(err) => return Err(err.into()),
                },
                (signal, _) = self.signals.recv() => {
                    tracing::info!("received {signal} while waiting for the rendezvous (no worker running); stopping");
                    return Ok(End::Interrupted(signal));
                }
            };
            if self.round_seen.is_none() {
                // the first round: how to look at the job (a --standalone job's run ID is made up)
                tracing::info!("{}", self.how_to_watch());
            }
            self.round_seen = Some(info.round);
            // each round has a store of its own, even where it reuses the last one's address
            // (a restarted job keeps its MASTER_PORT): a connection to the old one is stale
            self.store = None;
            report.failures.clear(); // the result describes the last attempt
            report.group_rank = Some(info.rank);
            report.group_world_size = Some(info.world_size);
            report.restart_count = match self.rdzv.restart_count().await {
                Ok(count) => count,
                Err(err) if err.is_store_unreachable() && lost_starts < MAX_LOST_STARTS => {
                    lost_starts += 1;
                    tracing::warn!("the rendezvous store went away as the round formed ({err}); re-joining");
                    continue;
                }
                Err(err) => return Err(err.into()),
            };
            self.events.round_formed(&info, report.restart_count).await;
            counts.joined_round(info.round, info.world_size, asked.elapsed());
            self.round = info.round;
            counts.job_restarts(report.restart_count, self.config.max_restarts);
            let mut changes = self.rdzv.changes();
            let mut group = match self.start_workers(&info, report.restart_count, &mut changes).await {
                Ok(Start::Running(group)) => {
                    lost_starts = 0;
                    self.events.workers_started(info.round, &group.global_ranks(), &group.pids()).await;
                    group
                }
                // a member lost before it exchanged ranks (it died as the round formed): the
                // round is over before it began, and no restart is charged
                Ok(Start::Changed(change)) => {
                    let description = describe(&change);
                    tracing::info!("{description} while the workers were starting; re-joining");
                    self.events.membership_changed(&change, &description).await;
                    if change == MembershipChange::Closed {
                        return self.closed(report).await;
                    }
                    counts.reformed(change.kind());
                    continue;
                }
                Err(AgentError::Interrupted(signal)) => {
                    tracing::info!("received {signal} while starting the workers; stopping");
                    return Ok(End::Interrupted(signal));
                }
                Err(err) if err.is_store_unreachable() && lost_starts < MAX_LOST_STARTS => {
                    lost_starts += 1;
                    tracing::warn!(
                        "the rendezvous store went away while the workers were starting ({err}); re-joining"
                    );
                    continue;
                }
                Err(err) => return Err(err),
            };
            report.global_ranks = group.global_ranks();
            counts.forget_worker_heartbeats();
            counts.workers_running(self.config.local_world_size);
            // this attempt's: it goes with the attempt (its connection too, which the store
            // hosted here would otherwise wait for at the end)
            let _progress = self.publish_node_status(&mut group).await;
            let mut dumps = DumpRequests::watch(&info, &self.host, self.rdzv.secret());
            // the summary of a failure that ends the job lists all that fail with it
            let last_chance = report.restart_count >= i64::from(self.config.max_restarts);
            let together = if last_chance { FAILED_TOGETHER } else { Duration::ZERO };
            let event = tokio::select! {
                waited = group.wait(&mut dumps, &mut self.standbys, together) => match waited {
                    Waited::Done(outcome) => Event::Workers(outcome),
                    // describing and stopping hung workers (their stacks, who holds them up,
                    // across nodes too) is not cut short by a change another node's failure
                    // brings meanwhile
                    Waited::Hung(hung) => {
                        Event::Workers(GroupOutcome::Failed(group.stop_hung(hung, dumps.exchange()).await))
                    }
                },
                change = next_change(&mut changes) => Event::Change(change),
                (signal, forward) = self.signals.recv() => Event::Signal(signal, forward),
            };
            let grace = self.config.shutdown_timeout();
            count_exits(&event, self.config.local_world_size);
            match event {
                Event::Workers(GroupOutcome::Succeeded) => {
                    // the last lines belong in the log files the run's outcome vouches for
                    group.drain_output().await;
                    drop(group);
                    self.events.workers_stopped(info.round, "succeeded").await;
                    match self.exit_barrier(&info, &mut changes).await? {
                        None => {
                            // every node is through: the job is done
                            let _ = self.rdzv.set_closed_with(SUCCEEDED).await;
                            self.after_success(report);
                            return Ok(End::Succeeded);
                        }
                        Some(Event::Signal(signal, _)) => {
                            tracing::info!(
                                "received {signal} in the exit barrier (this node's workers are done); stopping"
                            );
                            return Ok(End::Interrupted(signal));
                        }
                        Some(Event::Change(MembershipChange::Closed)) => {
                            // closed while this node's workers had finished: the usual cause is
                            // the job's success, and the store may already be gone with its host
                            return Ok(self.closed(report).await.unwrap_or(End::Succeeded));
                        }
                        Some(Event::Change(change)) => {
                            counts.reformed(change.kind()); // another node restarted: run again with it
                            continue;
                        }
                        Some(Event::Workers(_)) => continue,
                    }
                }
                Event::Workers(GroupOutcome::Failed(failures)) => {
                    // a member's death breaks its peers' collectives first: that is its loss
                    let loss = match self.member_loss(&mut changes).await {
                        Ok(loss) => loss,
                        Err(AgentError::Interrupted(signal)) => {
                            self.events.workers_failed(&failures, None).await;
                            tracing::info!(
                                "received {signal} while asking whether a member is lost; stopping the workers"
                            );
                            group.stop(Signal::SIGTERM, grace).await;
                            self.events.workers_stopped(info.round, "signal").await;
                            return Ok(End::Interrupted(signal));
                        }
                        Err(err) => return Err(err),
                    };
                    // the failures go in the log as the loss's consequence, never as a root cause
                    self.events.workers_failed(&failures, loss.as_ref().map(describe).as_deref()).await;
                    if let Some(change) = loss {
                        tracing::info!("the workers failed with the loss of a member: no restart is charged");
                        if let Some(end) = self.on_change(change, &mut group, report).await? {
                            return Ok(end);
                        }
                        continue;
                    }
                    group.stop(Signal::SIGTERM, grace).await;
                    self.events.workers_stopped(info.round, "failed").await;
                    if let Some(end) = self.after_failure(failures, report).await? {
                        return Ok(end);
                    }
                }
                Event::Change(change) => {
                    if let Some(end) = self.on_change(change, &mut group, report).await? {
                        return Ok(end);
                    }
                }
                Event::Signal(signal, forward) => {
                    tracing::info!("received {signal}; stopping the workers");
                    // workers get the signal itself when it is one to forward, else SIGTERM
                    group.stop(if forward { signal } else { Signal::SIGTERM }, grace).await;
                    self.events.workers_stopped(info.round, "signal").await;
                    return Ok(End::Interrupted(signal));
                }
            }
        }
    }

    /// Stops the workers for a membership change; `Some` ends the agent (the job closed).
    async fn on_change(
        &mut self,
        change: MembershipChange,
        group: &mut WorkerGroup,
        report: &mut Report,
    ) -> Result<Option<End>> {
        let closed = change == MembershipChange::Closed;
        let next = if closed { "stopping the workers" } else { "restarting the workers" };
        let description = describe(&change);
        tracing::info!("{description}; {next}");
        if let MembershipChange::StoreUnreachable { store, .. } = &change {
            if let Some(advice) = self.rdzv.store_lost_advice() {
                tracing::warn!("lost the rendezvous store at {store}: {advice}");
            }
        }
        if matches!(change, MembershipChange::NodeLost { .. }) {
            report.lost.push(format!("{description} in round {}", self.round));
            let excess = report.lost.len().saturating_sub(LOST_NAMED);
            report.lost.drain(..excess);
        }
        self.events.membership_changed(&change, &description).await;
        group.stop(Signal::SIGTERM, self.config.shutdown_timeout()).await;
        self.events.workers_stopped(self.round, "changed").await;
        if closed {
            return self.closed(report).await.map(Some);
        }
        self.events.restart(report.restart_count, self.config.max_restarts, &description, false).await;
        metrics::agent::get().reformed(change.kind());
        Ok(None)
    }

    /// Whether the workers failed because a member of the round is gone: a node's death
    /// breaks its peers' collectives at once, a loss window before its heartbeats lapse. The
    /// members' agents are asked directly ([`Rendezvous::census`]; the gone ones are reported
    /// lost to everyone); a member that does not answer is settled by its heartbeats or lease,
    /// waited for up to a loss window. `Some`: the change that explains the failure.
    async fn member_loss(
        &mut self,
        changes: &mut Option<watch::Receiver<Option<MembershipChange>>>,
    ) -> Result<Option<MembershipChange>> {
        // another member may have found the loss first
        if let Some(change) = changes.as_ref().and_then(|changes| changes.borrow().clone()) {
            return Ok(Some(change));
        }
        // Asking goes through the store, which may be what was lost: bounded by the loss
        // window, after which the heartbeats have settled it, and a signal ends it at once.
        let window = self.rdzv.loss_window() + LOSS_VERDICT_SLACK;
        let verdict = tokio::select! {
            verdict = tokio::time::timeout(window, ask_members(&mut self.rdzv)) => match verdict {
                Ok(verdict) => verdict,
                // the heartbeats had the window to settle it
                Err(_) => return Ok(changes.as_ref().and_then(|changes| changes.borrow().clone())),
            },
            change = next_change(changes) => return Ok(Some(change)),
            (signal, _) = self.signals.recv() => return Err(AgentError::Interrupted(signal)),
        };
        let unsure = match verdict {
            Verdict::Change(change) => return Ok(Some(change)),
            Verdict::Own => return Ok(None),
            // the store went with the failure (its host is lost, or this node is cut off): the
            // rendezvous noted it as the round's change; re-joining finds the store, or its
            // next site, or says why not
            Verdict::StoreUnreachable(error) => {
                let noted = changes.as_ref().and_then(|changes| changes.borrow().clone());
                let store = self.rdzv.describe_store();
                return Ok(noted.or(Some(MembershipChange::StoreUnreachable {
                    store,
                    silent_for: Duration::ZERO,
                    error,
                })));
            }
            Verdict::Unsure(unsure) => unsure,
        };
        tracing::info!(
            "the workers failed and {} did not answer; waiting up to {window:.1?} for the heartbeats to say whether it is lost",
            unsure.join(", ")
        );
        tokio::select! {
            change = tokio::time::timeout(window, next_change(changes)) => Ok(change.ok()),
            (signal, _) = self.signals.recv() => Err(AgentError::Interrupted(signal)),
        }
    }

    /// The run ID, and a command that shows the job's state from any machine that reaches its
    /// store (the first site in use on c10d, the cluster on etcd).
    fn how_to_watch(&self) -> String {
        let (backend, run_id) = (self.rdzv.name(), self.rdzv.run_id());
        let endpoint = match backend {
            "c10d" => self.rdzv.describe_store(),
            "static" => return format!("run ID {run_id} (static rendezvous: no shared job state to show)"),
            _ => self.config.rdzv_endpoint.clone(),
        };
        format!("run ID {run_id}; to watch the job: elastix status --rdzv-backend {backend} --rdzv-endpoint {endpoint} --rdzv-id {run_id}")
    }

    /// Exchanges ranks with the other nodes and starts the local workers. A stop signal ends
    /// the exchange ([`AgentError::Interrupted`]): it can take as long as the slowest node.
    async fn start_workers(
        &mut self,
        info: &RendezvousInfo,
        restart_count: i64,
        changes: &mut Option<watch::Receiver<Option<MembershipChange>>>,
    ) -> Result<Start> {
        let me = RoleInfo { role: self.config.role.clone(), local_world_size: self.config.local_world_size };
        let secret = self.rdzv.secret().cloned();
        let exchange = async {
            let at = (info.store_host.clone(), info.store_port);
            let store = connect_store(&mut self.store, &at, secret.as_ref(), STORE_TIMEOUT).await?;
            ranks::assign(store, &info.store_prefix, info.rank, info.world_size, &me, STORE_TIMEOUT).await
        };
        // every member takes part in the exchange: one lost meanwhile never will
        let assignment = tokio::select! {
            assignment = exchange => assignment?,
            change = next_change(changes) => return Ok(Start::Changed(change)),
            (signal, _) = self.signals.recv() => return Err(AgentError::Interrupted(signal)),
        };
        let attempt_dir = self.logs.attempt(self.attempt, self.config.local_world_size)?;
        self.attempt += 1;
        let launch = Launch {
            config: &self.config,
            info,
            assignment: &assignment,
            restart_count,
            attempt_dir: attempt_dir.as_deref(),
            log_writer: &self.log_writer,
            host: &self.host,
            outputs: &self.outputs,
        };
        let group = WorkerGroup::start(&launch, &mut self.standbys)?;
        // the next attempt's interpreters start while this one runs
        self.standbys.refill();
        Ok(Start::Running(group))
    }

    /// A temporary log directory goes after a clean success; after failed attempts it stays,
    /// with the stacks of workers found hung, and the agent says where.
    fn after_success(&self, report: &mut Report) {
        match (&report.log_dir, self.logs.is_temporary()) {
            (Some(dir), true) if report.workers_failed => tracing::info!(
                "the job succeeded after {} restart(s); the logs of every attempt (with the stacks of workers \
                 found hung) are kept in {dir}",
                report.restart_count
            ),
            _ => {
                self.logs.remove_if_temporary();
                report.log_dir = None;
            }
        }
    }

    /// Spends a restart if this is the round's first failure report; past the budget, closes
    /// the job as failed. `Some` ends the agent.
    async fn after_failure(&mut self, failures: Vec<Failure>, report: &mut Report) -> Result<Option<End>> {
        report.workers_failed = true;
        let restarts = match self.rdzv.report_failure().await {
            Ok(restarts) => restarts,
            // the store went away as well: a lost store is a lost node (its host); re-joining
            // finds it or its next site, and the failure is not charged
            Err(err) if err.is_store_unreachable() => {
                tracing::warn!(
                    "could not report the workers' failure: {err}; re-joining without charging a restart (the store's \
                     host is lost, or this node is cut off)"
                );
                self.events
                    .restart(report.restart_count, self.config.max_restarts, "rendezvous store lost", false)
                    .await;
                return Ok(None);
            }
            Err(err) => return Err(err.into()),
        };
        report.restart_count = restarts;
        self.events.failure_reported(restarts, self.config.max_restarts).await;
        metrics::agent::get().job_restarts(restarts, self.config.max_restarts);
        self.publish_failure(&failures, report.restart_count).await;
        let name = entrypoint_name(&self.config);
        let text = summary(&name, &failures);
        report.failures = failures;
        if restarts > i64::from(self.config.max_restarts) {
            print_summary(&text);
            let _ = self.rdzv.set_closed_with(&format!("{FAILED}{text}")).await;
            report.summary = Some(text);
            return Ok(Some(End::Failed));
        }
        let failed: Vec<String> = report
            .failures
            .iter()
            .map(|failure| {
                format!(
                    "{} failed with exit code {}{}",
                    worker_name(failure.global_rank, failure.local_rank, Some(failure.pid)),
                    failure.exitcode,
                    failure.signal.as_deref().map(|s| format!(" ({s})")).unwrap_or_default(),
                )
            })
            .collect();
        tracing::warn!("{}; restart {restarts} of {}", failed.join("; "), self.config.max_restarts);
        self.events.restart(restarts, self.config.max_restarts, "worker failure", true).await;
        let counts = metrics::agent::get();
        counts.reformed("worker_failure");
        counts.restarted();
        Ok(None)
    }

    /// Tells `elastix status` who this member is (best effort, bounded: a slow store must not
    /// hold the agent while its workers run unwatched), then starts republishing it with the
    /// workers' progress, which `group` notes, until the publisher returned is dropped.
    async fn publish_node_status(&mut self, group: &mut WorkerGroup) -> Option<ProgressPublisher> {
        let global_ranks = group.global_ranks();
        let facts = AgentFacts {
            host: self.host.clone(),
            role: self.config.role.clone(),
            local_world_size: self.config.local_world_size,
            first_rank: global_ranks.iter().copied().min().unwrap_or(0),
            max_restarts: self.config.max_restarts,
            metrics_port: self.metrics_server.as_ref().map(MetricsServer::port),
            workers_started_ms: crate::rendezvous::records::now_ms(),
            workers: Vec::new(),
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, self.rdzv.publish_node_status(facts.clone())).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not publish this node's status: {err}"),
            Err(_) => tracing::debug!("publishing this node's status took over {PUBLISH_TIMEOUT:?}; skipped"),
        }
        self.rdzv.status_writer().map(|writer| {
            let (publisher, notes) = ProgressPublisher::start(writer, facts);
            group.note_progress_in(notes);
            publisher
        })
    }

    /// Tells `elastix status` the root cause of this node's failure (best effort, bounded).
    async fn publish_failure(&mut self, failures: &[Failure], restarts_used: i64) {
        let Some(first) = super::failure::root_cause(failures).map(|root| &failures[root]) else { return };
        let record = FailureRecord {
            v: FORMAT_VERSION,
            round: self.round,
            host: first.host.clone(),
            at_ms: (first.timestamp * 1000.0) as u64,
            rank: first.global_rank,
            local_rank: first.local_rank,
            exitcode: first.exitcode,
            signal: first.signal.clone(),
            hung: first.hung.clone(),
            message: super::failure::excerpt(&first.message, FailureRecord::MAX_MESSAGE),
            restarts_used,
            max_restarts: self.config.max_restarts,
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, self.rdzv.publish_failure(&record)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not publish the failure for elastix status: {err}"),
            Err(_) => tracing::debug!("publishing the failure took over {PUBLISH_TIMEOUT:?}; skipped"),
        }
    }

    /// The rendezvous was closed: by a successful job, or by one that failed elsewhere.
    async fn closed(&mut self, report: &mut Report) -> Result<End> {
        let reason = self.rdzv.closed_reason().await?.unwrap_or_default();
        if reason == SUCCEEDED {
            return Ok(End::Succeeded);
        }
        let why = reason.strip_prefix(FAILED).unwrap_or(&reason);
        print_summary(&format!("[elastix] the job was closed after a failure on another node:\n{why}"));
        report.summary = Some(why.to_owned());
        report.error = Some(AgentErrorInfo { kind: "remote_failure".to_owned(), message: why.to_owned() });
        Ok(End::Failed)
    }

    /// Waits until every node's workers are done (`None`), a membership change or a signal
    /// comes first (`Some`), or the timeout passes (`None`, with a warning: this node's
    /// workers did succeed). Each node marks its own key, so the barrier survives the store
    /// going away and coming back (empty, even): it reconnects and marks again, at the site the
    /// state moved to if it moved. A member that does not arrive is asked whether it is still
    /// there: a gone one is not waited for. Changes that are only about the store do not end it.
    async fn exit_barrier(
        &mut self,
        info: &RendezvousInfo,
        changes: &mut Option<watch::Receiver<Option<MembershipChange>>>,
    ) -> Result<Option<Event>> {
        let timeout = self.config.exit_barrier_timeout();
        let deadline = tokio::time::Instant::now() + timeout;
        let key = |rank: u32| format!("{}/terminal/{rank}", info.store_prefix).into_bytes();
        let (rdzv, slot, signals) = (&mut self.rdzv, &mut self.store, &mut self.signals);
        let secret = rdzv.secret().cloned();
        let mut at = (info.store_host.clone(), info.store_port);
        let mut awaited: Vec<u32> = (0..info.world_size).filter(|rank| *rank != info.rank).collect();
        // members reported lost meanwhile (a cut link, a silent machine): not waited for either
        let lost = std::sync::Mutex::new(Vec::<(u32, Option<NodeDesc>)>::new());
        let done = async {
            let mut warned = false;
            let mut said_waiting = false;
            loop {
                let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
                let slice = remaining.min(BARRIER_LOOK_EVERY);
                // everyone there (`None`), or who has not arrived yet
                let attempt = async {
                    let store = connect_store(slot, &at, secret.as_ref(), remaining.min(BARRIER_RECONNECT)).await?;
                    store.set(&key(info.rank), b"1").await?;
                    let keys: Vec<Vec<u8>> = awaited.iter().map(|rank| key(*rank)).collect();
                    let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                    match store.wait(&keys, Some(slice)).await {
                        Ok(()) => return Ok(None),
                        Err(err) if err.is_timeout() && slice < remaining => {}
                        Err(err) => return Err(err.into()),
                    }
                    let mut missing = Vec::new();
                    for rank in awaited.iter().copied() {
                        if !store.check(&[key(rank).as_slice()]).await? {
                            missing.push(rank);
                        }
                    }
                    Ok::<_, AgentError>(Some(missing))
                };
                match attempt.await {
                    Ok(None) => return Ok(true),
                    Ok(Some(mut missing)) => {
                        // is any of them gone?
                        if let Ok(census) = rdzv.census(Some(&missing)).await {
                            for (rank, node) in &census.gone {
                                tracing::warn!(
                                    "exit barrier: node {node} (group rank {rank}) is gone; not waiting for it"
                                );
                            }
                            missing.retain(|rank| census.gone.iter().all(|(gone, _)| gone != rank));
                        }
                        let lost = lost.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        missing.retain(|rank| lost.iter().all(|(gone, _)| gone != rank));
                        if !said_waiting && !missing.is_empty() {
                            said_waiting = true;
                            let ranks: Vec<String> = missing.iter().map(u32::to_string).collect();
                            tracing::info!(
                                "exit barrier: this node's workers are done; waiting up to {}s more for those of group \
                                 rank(s) {}",
                                deadline.saturating_duration_since(tokio::time::Instant::now()).as_secs(),
                                ranks.join(", ")
                            );
                        }
                        awaited = missing;
                    }
                    Err(err) if err.is_store_unreachable() && !remaining.is_zero() => {
                        if !warned {
                            warned = true;
                            tracing::warn!(
                                "exit barrier: the rendezvous store is unreachable ({err}); retrying for up to {:.0?}",
                                remaining
                            );
                        }
                        *slot = None;
                        // with several sites, the state moves as it does for a re-join
                        let located = match rdzv.locate_store() {
                            Some(locating) => locating.await.ok(),
                            None => None,
                        };
                        match located {
                            Some(now) if now != at => {
                                tracing::info!("exit barrier: the rendezvous store is now at {}:{}", now.0, now.1);
                                at = now;
                            }
                            // a store served by a member's agent (etcd's rank 0) went with it:
                            // no one is left to keep it for, and no one can tell who finished
                            _ if located.is_none() && store_host_was_reported_lost(&lost, &at.0) => return Ok(true),
                            _ if located.is_none() && store_host_is_gone(rdzv, &at.0).await => return Ok(true),
                            _ => tokio::time::sleep(Duration::from_millis(200).min(remaining)).await,
                        }
                    }
                    Err(AgentError::Store(err)) if err.is_timeout() => return Ok(false),
                    Err(err) => return Err(err),
                }
            }
        };
        tokio::pin!(done);
        loop {
            tokio::select! {
                biased;
                done = &mut done => {
                    if !done? {
                        tracing::warn!("exit barrier: not every node was seen to finish within {timeout:?}; exiting anyway");
                    }
                    return Ok(None);
                }
                change = new_change(changes) => match change {
                    // a lost member's work is not waited for; this node's workers are done
                    MembershipChange::NodeLost { rank: Some(rank), node } => {
                        let who = node.as_ref().map_or_else(|| format!("group rank {rank}"), |node| format!("node {node} (group rank {rank})"));
                        tracing::warn!("exit barrier: {who} was reported lost; not waiting for it");
                        lost.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((rank, node));
                    }
                    // finished workers are not concerned by the store's blips; another node's
                    // restart, or a store that lost the job's state, makes the job re-form and
                    // run again, with them
                    change if !change.is_about_the_store() || change == MembershipChange::StoreReset => {
                        return Ok(Some(Event::Change(change)))
                    }
                    _ => {}
                },
                (signal, forward) = signals.recv() => return Ok(Some(Event::Signal(signal, forward))),
            }
        }
    }
}

/// Whether a member at `host` (the store's host) was reported lost during the barrier.
/// What asking the round's members found after the workers failed.
enum Verdict {
    /// The round ended, or a member is gone: the workers' failure is its consequence.
    Change(MembershipChange),
    /// Every member answered: the failure is the workers' own.
    Own,
    /// The store does not answer (the error).
    StoreUnreachable(String),
    /// These members did not answer.
    Unsure(Vec<String>),
}

/// Asks the round whether it ended without this node's watcher saying so yet (the others
/// re-formed without it while its agent was stopped, or the store lost the state), then asks
/// every member directly ([`Rendezvous::census`]; the gone ones are reported lost to everyone).
async fn ask_members(rdzv: &mut Rendezvous) -> Verdict {
    match rdzv.round_ended().await {
        Ok(Some(change)) => return Verdict::Change(change),
        Err(err) if err.is_store_unreachable() => return Verdict::StoreUnreachable(err.to_string()),
        _ => {}
    }
    match rdzv.census(None).await {
        Ok(census) => match census.gone.into_iter().next() {
            Some((rank, node)) => Verdict::Change(MembershipChange::NodeLost { rank: Some(rank), node: Some(node) }),
            None if census.unsure.is_empty() => Verdict::Own,
            None => {
                Verdict::Unsure(census.unsure.iter().map(|(rank, why)| format!("group rank {rank} ({why})")).collect())
            }
        },
        Err(err) if err.is_store_unreachable() => Verdict::StoreUnreachable(err.to_string()),
        Err(err) => {
            tracing::warn!("could not ask the other members whether they are still there ({err}); counting the failure as the workers' own");
            Verdict::Own
        }
    }
}

fn store_host_was_reported_lost(lost: &std::sync::Mutex<Vec<(u32, Option<NodeDesc>)>>, host: &str) -> bool {
    let lost = lost.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let gone = lost.iter().find(|(_, node)| node.as_ref().is_some_and(|node| node.addr == host));
    if let Some((rank, Some(node))) = gone {
        tracing::warn!(
            "exit barrier: the store's host, node {node} (group rank {rank}), was reported lost and the store is \
             gone with it; this node's workers finished, so it does not wait any longer"
        );
    }
    gone.is_some()
}

/// Whether the agent of a member at `host` (the store's host) is gone, as a census says.
async fn store_host_is_gone(rdzv: &mut Rendezvous, host: &str) -> bool {
    let Ok(census) = rdzv.census(None).await else { return false };
    let gone = census.gone.iter().find(|(_, node)| node.addr == host);
    if let Some((rank, node)) = gone {
        tracing::warn!(
            "exit barrier: the store's host, node {node} (group rank {rank}), is gone and the store with it; \
             this node's workers finished, so it does not wait any longer"
        );
    }
    gone.is_some()
}

/// The last `most` bytes of `text` (the end of a traceback says what went wrong), marked as cut.
/// Counts the workers that ended by themselves (not those the agent then stopped) and those
/// the watchdog killed as hung, and that none runs once an attempt ended.
fn count_exits(event: &Event, local_world_size: u32) {
    let counts = metrics::agent::get();
    match event {
        Event::Workers(GroupOutcome::Succeeded) => (0..local_world_size).for_each(|_| counts.worker_exited("0".into())),
        Event::Workers(GroupOutcome::Failed(failures)) => {
            for failure in failures {
                match failure.hung {
                    Some(_) => counts.hung_worker(), // killed by the watchdog, not ended by itself
                    None => {
                        counts.worker_exited(failure.signal.clone().unwrap_or_else(|| failure.exitcode.to_string()))
                    }
                }
            }
        }
        Event::Change(_) | Event::Signal(..) => {}
    }
    counts.workers_running(0);
}

/// A connection to the round's store at `at` (host, port), proving `secret`, kept in `slot`
/// while it stays usable; a new one is tried for up to `patience`.
async fn connect_store<'a>(
    slot: &'a mut Option<TcpStore>,
    at: &(String, u16),
    secret: Option<&Secret>,
    patience: Duration,
) -> Result<&'a mut TcpStore> {
    let reusable =
        slot.as_ref().is_some_and(|store| store.client().is_usable() && store.host() == at.0 && store.port() == at.1);
    if !reusable {
        let options = TcpStoreOptions {
            timeout: Some(patience),
            secret: secret.cloned(),
            ..TcpStoreOptions::new(at.0.clone(), at.1)
        };
        *slot = Some(TcpStore::open(options).await?);
    }
    Ok(slot.as_mut().expect("opened above"))
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

/// The next membership change (never, for a backend without any).
async fn next_change(changes: &mut Option<watch::Receiver<Option<MembershipChange>>>) -> MembershipChange {
    let Some(receiver) = changes else { return std::future::pending().await };
    loop {
        if let Some(change) = receiver.borrow_and_update().clone() {
            return change;
        }
        if receiver.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// The next membership change not seen yet (never, for a backend without any).
async fn new_change(changes: &mut Option<watch::Receiver<Option<MembershipChange>>>) -> MembershipChange {
    let Some(receiver) = changes else { return std::future::pending().await };
    loop {
        if receiver.changed().await.is_err() {
            return std::future::pending().await;
        }
        if let Some(change) = receiver.borrow_and_update().clone() {
            return change;
        }
    }
}

fn describe(change: &MembershipChange) -> String {
    match change {
        MembershipChange::NodesWaiting => "new nodes are waiting to join".to_owned(),
        MembershipChange::NodeLost { rank, node } => match (node, rank) {
            (Some(node), Some(rank)) => format!("node {node} (group rank {rank}) stopped responding"),
            (Some(node), None) => format!("node {node} stopped responding"),
            (None, Some(rank)) => format!("group rank {rank} stopped responding"),
            (None, None) => "a node stopped responding".to_owned(),
        },
        MembershipChange::RoundSuperseded { round } => format!("another node restarted (round {round})"),
        MembershipChange::StoreReset => "the rendezvous store restarted without the job's state".to_owned(),
        // Said from this node's side only: it cannot tell a store that is down for everyone
        // from one out of its own reach (the last error often can: a refused connection).
        MembershipChange::StoreUnreachable { store, silent_for, error } if silent_for.is_zero() => {
            format!("the rendezvous store at {store} stopped answering as the workers failed ({error})")
        }
        MembershipChange::StoreUnreachable { store, silent_for, error } => format!(
            "the rendezvous store at {store} has not answered this node for {:.1}s (last error: {error}); \
             a node out of contact this long counts as lost to any node the store still answers",
            silent_for.as_secs_f64()
        ),
        MembershipChange::StoreMoved { to } => format!("the job's rendezvous moved to {to}"),
        MembershipChange::Minority { reached, silent } => format!(
            "this node has reached no majority of the rendezvous sites for the loss window (it reaches {}; not {}): \
             it is on the minority side of a partition, where the job must not run",
            if reached.is_empty() { "none".to_owned() } else { reached.join(", ") },
            silent.join(", ")
        ),
        MembershipChange::Closed => "the job's rendezvous was closed".to_owned(),
    }
}

/// What failed, as the summary names it: the configured name, the script for Python
/// workers, else the program.
fn entrypoint_name(config: &AgentConfig) -> String {
    if let Some(name) = &config.name {
        return name.clone();
    }
    let python_script = config.args.iter().find(|arg| !arg.starts_with('-'));
    let is_python = std::path::Path::new(&config.entrypoint)
        .file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("python"));
    match (is_python, python_script) {
        (true, Some(script)) => script.clone(),
        _ => config.entrypoint.clone(),
    }
}

/// The root-cause summary is the run's product, not a log event: always shown, whatever the
/// log level, through the console (never blocking on a stalled stderr).
fn print_summary(text: &str) {
    console::stderr().line(format!("{}\n", text.trim_end_matches('\n')).into_bytes());
}
