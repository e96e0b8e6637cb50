//! How an attempt's workers are launched and kept: one attempt's group ([`group`]), each
//! worker's start ([`spawn`]), the
//! environment each worker gets ([`env`]) from its ranks ([`ranks`]), how a child process is
//! started ([`process`]), warm interpreters that make restarts fast ([`standby`]), and the
//! reaper that leaves no process behind ([`reaper`]), and the line to workers that re-form
//! in process ([`control`]).

pub mod control;
pub mod env;
pub mod group;
pub mod process;
pub mod ranks;
pub mod reaper;
mod spawn;
pub mod standby;
