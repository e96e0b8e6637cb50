//! A rendezvous's configuration, from what the launcher knows to what a backend runs with:
//! [`params`] (`--rdzv-backend`, `--rdzv-endpoint`, `--rdzv-id`, `--nnodes`, `--local-addr`,
//! `--rdzv-conf`, `--node-rank`), [`conf`] (the `--rdzv-conf` keys, checked strictly, with
//! units), and [`settings`] (the timings and bounds of a dynamic backend, with torch's
//! defaults, and the job secret).

pub mod conf;
pub mod params;
pub mod settings;
