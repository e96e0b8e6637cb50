//! What a run reports: how it ended, the result the launcher gets, the root cause, and the
//! console's share (lines dropped for a stalled reader, output that could not be written).

use nix::sys::signal::Signal;

use super::CONSOLE_FLUSH_WAIT;
use crate::agent::config::AgentConfig;
use crate::agent::failure::Failure;
use crate::agent::result::{AgentErrorInfo, AgentResult, RunState, LOGS_INCOMPLETE};
use crate::console::{self, StreamMark};

/// The console's counts at the start of a run, to tell what happened during it.
pub(super) struct ConsoleMarks {
    stdout: StreamMark,
    stderr: StreamMark,
}

impl ConsoleMarks {
    pub(super) fn now() -> ConsoleMarks {
        ConsoleMarks { stdout: console::stdout().mark(), stderr: console::stderr().mark() }
    }

    /// Waits (briefly) for the console to take the run's last lines, mentions lines still
    /// unreported as dropped, and records drops and errors in the report.
    pub(super) async fn finish(self, report: &mut Report) {
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
pub(super) enum End {
    Succeeded,
    /// The workers succeeded, but the log files the run keeps are incomplete.
    LogsIncomplete,
    Failed,
    Interrupted(Signal),
}

impl End {
    /// The run's state and exit code.
    pub(super) fn state(&self) -> (&'static str, i32) {
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
pub(super) struct Report {
    pub(super) restart_count: i64,
    pub(super) group_rank: Option<u32>,
    pub(super) group_world_size: Option<u32>,
    pub(super) log_dir: Option<String>,
    pub(super) global_ranks: Vec<u32>,
    pub(super) failures: Vec<Failure>,
    pub(super) summary: Option<String>,
    pub(super) error: Option<AgentErrorInfo>,
    pub(super) dropped_output_lines: u64,
    pub(super) output_errors: Vec<String>,
    /// Whether the run's log files are kept (not a temporary directory removed at the end).
    pub(super) logs_kept: bool,
    /// Whether a log file could not be written completely.
    pub(super) logs_incomplete: bool,
    /// Whether any of this node's workers failed or hung in this run (its logs and stacks are
    /// then kept, though the job succeeds after a restart).
    pub(super) workers_failed: bool,
    /// The members this node saw lost, most recent last (a few at most).
    pub(super) lost: Vec<String>,
}

impl Report {
    /// Why the run failed, in one line: the error that ended it (for a failure elsewhere, its
    /// last line: the exception), else the root cause among this node's failures.
    pub(super) fn root_cause(&self) -> Option<String> {
        let Some(error) = &self.error else {
            return crate::agent::failure::root_cause(&self.failures).map(|root| self.failures[root].headline());
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
    pub(super) fn logs_verdict(&self, end: End) -> End {
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

    pub(super) fn finish(self, end: End) -> AgentResult {
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

/// What failed, as the summary names it: the configured name, the script for Python
/// workers, else the program.
pub(super) fn entrypoint_name(config: &AgentConfig) -> String {
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
pub(super) fn print_summary(text: &str) {
    console::stderr().line(format!("{}\n", text.trim_end_matches('\n')).into_bytes());
}
