//! The per-node agent: rendezvous, rank assignment, worker processes, their output, failure
//! detection and restarts, signals, the exit barrier and the root-cause summary.
//!
//! * [`run`]: the agent's life as a state machine (rendezvous, start, watch, barrier, end),
//!   one handler per state.
//! * [`workers`]: how an attempt's workers are launched, kept and reaped; [`output`]: where
//!   their output goes; [`hangs`]: hung workers, stack dumps, who holds a collective up.
//! * [`failure`]: what a failure left behind, the root-cause rule and the summary;
//!   [`progress`]: the workers' progress for `elastix status`; [`events`]: the event log of
//!   every state change; [`finished`]: what a job leaves on its machines once it ended.
//! * [`checkpoints`]: the workers' checkpoints, held in memory and persisted by the agent.
//! * [`config`]: what the agent is told; [`signals`], [`result`], [`error`]; [`shm`]: where
//!   what it shares with its workers lives; [`round_store`]: where a round's store is, for the
//!   background tasks.
//! * [`stragglers`]: each rank's pace from its collectives, and the slow ranks named.

pub mod checkpoints;
pub mod config;
pub mod error;
pub mod events;
pub mod failure;
pub mod finished;
pub mod hangs;
pub mod numa;
pub mod output;
pub mod preflight;
pub mod progress;
pub mod result;
pub mod round_store;
pub mod run;
pub mod shm;
pub mod signals;
pub mod stragglers;
pub mod workers;

pub use config::AgentConfig;
pub use error::AgentError;
pub use result::{AgentResult, RunState};
pub use run::run_agent;
