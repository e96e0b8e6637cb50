//! The per-node agent: rendezvous, rank assignment, worker processes, their output, failure
//! detection and restarts, signals, the exit barrier and the root-cause summary.
//!
//! * [`run`]: the agent's loop; [`group`]: one attempt's worker processes; [`logs`]: their
//!   output; [`failure`]: what a failure left behind and the summary.
//! * [`config`], [`env`], [`ranks`]: what workers are started with; [`signals`], [`result`].

pub mod config;
pub mod env;
pub mod error;
pub mod failure;
pub mod group;
pub mod logs;
pub mod ranks;
pub mod result;
pub mod run;
pub mod signals;

pub use config::AgentConfig;
pub use error::AgentError;
pub use result::{AgentResult, RunState};
pub use run::run_agent;
