//! The agent's life, as a state machine: each state has one handler, and each handler returns
//! the next state. A node's life reads in order:
//!
//! ```text
//!   Rendezvous --round formed--> Start --workers up--> Watch --all succeeded--> Barrier
//!      ^  ^  |                     ^ |                     |                         |
//!      |  |  +-> Preflight --------+ |                     |                         |
//!      |  |      (the job's first    |                     |                         |
//!      |  |       round, --preflight)|                     |                         |
//!      |  +--- re-join --------------+ (a member or the store lost as it began;       |
//!      |                                 from Preflight: named nodes left out)       |
//!      +------------ re-join ----------------------------+-------------------------+
//!                    (a failure within the budget,          (another node restarted)
//!                     a membership change)
//!   any state --a signal, the job closed, the budget spent, every node through--> End
//! ```
//!
//! * [`rendezvous`]: joins the next round ([`State::Rendezvous`] -> [`State::Start`]; a node
//!   named a straggler leaves instead under `--exclude-stragglers`).
//! * [`preflight`]: the job's first round checks its nodes and links first (`--preflight`);
//!   named nodes leave, the others re-form without them.
//! * [`start`]: exchanges ranks and starts the local workers (-> [`State::Watch`]).
//! * [`watch`]: waits for the first event of the attempt: a worker failed, all succeeded, the
//!   membership changed, a signal. A failure spends one job-wide restart (the first report of
//!   a round) unless [`loss`] finds that a member's loss broke the workers; within the budget
//!   the agent re-joins, which opens the next round everywhere; past it, the job is closed as
//!   failed and every agent exits 1 with the root cause. A membership change re-forms without
//!   spending the budget; for a node that joins, the elastic workers first finish the step
//!   they compute ([`drain`]). Each member watches the next one ([`neighbor`]): its death is asked
//!   about the moment its connection closes. A signal is forwarded to the workers, which are then stopped; the
//!   agent exits with 128+N and leaves the rendezvous open (the others re-form without it).
//! * [`barrier`]: this node's workers succeeded; once every node is through, the job is done
//!   and the rendezvous is closed as succeeded.
//! * [`restart`]: what follows a failure or a change: a restart or a re-form; [`reform`]:
//!   workers that run `elastix.elastic` are kept through it and placed in the next round.
//! * [`report`]: what the run reports (the result, the root cause); [`publish`]: what it tells
//!   `elastix status` on the way.
//!
//! Worker output never holds the agent (see [`crate::console`], [`crate::agent::output::logfiles`]): the
//! result counts the console lines dropped for a stalled reader and lists what could not be
//! written; a success whose kept log files are incomplete exits
//! [`super::result::LOGS_INCOMPLETE`].

mod agent;
mod barrier;
mod changes;
mod drain;
mod loss;
mod neighbor;
mod preflight;
mod publish;
mod reform;
mod rendezvous;
mod report;
mod restart;
mod round_store;
mod start;
mod watch;

use std::time::Duration;

use self::agent::Agent;
use self::loss::describe;
use self::report::{ConsoleMarks, End, Report};
use self::watch::Attempt;
use self::watch::Watched;
use super::config::AgentConfig;
use super::error::{AgentError, Result};
use super::finished::FinishedJob;
use super::result::{AgentErrorInfo, AgentResult};
use crate::rendezvous::RendezvousInfo;

/// Where a node is in its life; each handler returns the next one.
enum State {
    /// Joining the next round: the first, or after a restart or a re-form.
    Rendezvous,
    /// The job's first round formed: checking its nodes and links (`--preflight`).
    Preflight(RendezvousInfo),
    /// A round formed: exchanging ranks, starting the local workers.
    Start(RendezvousInfo),
    /// The workers run: waiting for the first event of the attempt.
    Watch(Attempt),
    /// This node's workers succeeded: waiting for every node's.
    Barrier(Watched),
    /// The run is over.
    End(End),
}

/// The reason a successful job closes its rendezvous with.
const SUCCEEDED: &str = "succeeded";
/// Prefix of the reason a failed job closes its rendezvous with (the summary follows).
const FAILED: &str = "failed: ";
/// Consecutive worker starts that may fail for a lost store before the run fails.
const MAX_LOST_STARTS: u32 = 3;
/// Lost members named in a failed run's summary, at most.
const LOST_NAMED: usize = 4;

impl Agent {
    /// The state machine: from the rendezvous to the end.
    async fn run(&mut self, report: &mut Report) -> Result<End> {
        let mut state = State::Rendezvous;
        loop {
            state = match state {
                State::Rendezvous => self.rendezvous(report).await?,
                State::Preflight(info) => self.preflight(info, report).await?,
                State::Start(info) => self.start(info, report).await?,
                State::Watch(attempt) => self.watch(attempt, report).await?,
                State::Barrier(watched) => self.barrier(watched, report).await?,
                State::End(end) => return Ok(end),
            };
        }
    }
}

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
    let outcome = match Agent::set_up(config, &mut report).await {
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
        agent.stop_kept().await; // an error ended the run while its workers were kept
        if let Some(checkpoints) = agent.checkpoints.as_mut() {
            // whatever ended the run, what the workers saved reaches the disk before the memory goes
            checkpoints.flush(agent.config.shutdown_timeout()).await;
        }
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

/// How long an agent hosting the rendezvous store keeps it up at the end for the other nodes.
const STORE_LINGER: Duration = Duration::from_secs(5);
/// How long the end of a run waits for the log files to be written.
const LOG_FLUSH_WAIT: Duration = Duration::from_secs(10);
/// How long the end of a run waits for the console to take the last lines (a stalled reader
/// must not hold the agent's exit).
const CONSOLE_FLUSH_WAIT: Duration = Duration::from_secs(1);
