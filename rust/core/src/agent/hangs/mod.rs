//! Hung workers, and what they were doing: the heartbeat slots and the verdict ([`heartbeats`]),
//! the kernel's evidence that a worker's main thread made progress ([`activity`]), stack dumps
//! of hung workers ([`stacks`]) and on demand across nodes ([`dumps`]), and which rank holds
//! the others up in a collective ([`flight`]).

pub mod activity;
pub mod dumps;
pub mod flight;
pub mod heartbeats;
pub mod stacks;
