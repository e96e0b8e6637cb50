//! The per-node agent: rendezvous, rank assignment, worker processes, their output, failure
//! detection and restarts, signals, the exit barrier and the root-cause summary.
//!
//! * [`run`]: the agent's loop; [`group`]: one attempt's worker processes; [`logs`]: where
//!   their output goes; [`pump`]: relaying it; [`crate::console`] and [`logfiles`]: the
//!   threads that write it, so the agent never blocks on a stalled reader or a full disk;
//!   [`failure`]: what a failure left behind, the root-cause rule and the summary;
//!   [`heartbeats`], [`activity`] and [`stacks`]: hung workers and their stack dumps; [`flight`]:
//!   which rank holds the others up in a collective; [`dumps`]: stack dumps on demand, and
//!   flight records across nodes; [`progress`]: the workers' progress for `elastix status`.
//! * [`events`]: the event log of every state change; [`finished`]: what a job leaves on its
//!   machines for `elastix status` once its store is gone.
//! * [`config`], [`env`], [`ranks`]: what workers are started with; [`process`]: how a child
//!   is started; [`standby`]: warm interpreters that make restarts fast; [`signals`], [`result`].

pub mod activity;
pub mod config;
pub mod dumps;
pub mod env;
pub mod error;
pub mod events;
pub mod failure;
pub mod finished;
pub mod flight;
pub mod group;
pub mod heartbeats;
pub mod logfiles;
pub mod logs;
pub mod process;
pub mod progress;
pub mod pump;
pub mod ranks;
pub mod reaper;
pub mod result;
pub mod run;
pub mod signals;
pub mod stacks;
pub mod standby;

pub use config::AgentConfig;
pub use error::AgentError;
pub use result::{AgentResult, RunState};
pub use run::run_agent;
