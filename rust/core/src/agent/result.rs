//! What the agent reports back to the launcher (as JSON).

use serde::Serialize;

use super::failure::Failure;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunState {
    Succeeded,
    Failed,
    Interrupted,
}

#[derive(Clone, Debug, Serialize)]
pub struct AgentResult {
    pub state: RunState,
    /// What the launching process should exit with: 0, 1 on failure, 128+N after signal N,
    /// [`LOGS_INCOMPLETE`] when the workers succeeded but their kept log files are incomplete.
    pub exit_code: i32,
    pub restart_count: i64,
    pub group_rank: Option<u32>,
    pub group_world_size: Option<u32>,
    pub log_dir: Option<String>,
    /// Global rank of each local rank in the last attempt.
    pub global_ranks: Vec<u32>,
    pub failures: Vec<Failure>,
    /// The root-cause text, already printed to stderr.
    pub summary: Option<String>,
    /// Set when the run failed for a reason other than a local worker's failure.
    pub error: Option<AgentErrorInfo>,
    /// Lines of worker output not shown on the console because it was not being read.
    pub dropped_output_lines: u64,
    /// Output that could not be written: `"<log file>: <error>"`, `"stdout: <error>"`...
    pub output_errors: Vec<String>,
}

/// The exit code of a run whose workers succeeded but whose log files could not be written
/// completely (a full disk...): not a plain success, and not a worker failure.
pub const LOGS_INCOMPLETE: i32 = 3;

/// A failure not tied to a local worker, typed so the launcher can raise the right error.
#[derive(Clone, Debug, Serialize)]
pub struct AgentErrorInfo {
    /// "config", "rendezvous_timeout", "rendezvous_closed", "rendezvous", "store", "spawn",
    /// "io", or "remote_failure" (workers failed on another node).
    pub kind: String,
    pub message: String,
}

impl AgentResult {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("the result always serializes")
    }
}
