//! The workers' output: where it goes ([`logs`]: the console, per-attempt files, or both),
//! relaying it line by line with prefixes and filters ([`pump`]), and the thread that writes
//! the files ([`logfiles`]), so the agent never blocks on a stalled reader or a full disk.

pub mod logfiles;
pub mod logs;
pub mod pump;
