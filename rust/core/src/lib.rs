//! elastix core: everything that is logic, with no Python in sight.
//!
//! * [`store`]: a key-value store that speaks torch's TCPStore wire protocol byte for byte
//!   (server, client, and the in-process and file-backed stores used for `file://` init).
//! * [`rendezvous`]: elastic membership of a job's nodes over a store.
//! * [`agent`]: the per-node agent that runs and supervises the workers.
//! * [`logging`]: the command-line programs' log output; [`console`]: stdout and stderr
//!   written by threads of their own (a stalled reader never blocks); [`address_log`]:
//!   warnings about peers, once a minute per address.
//! * [`interrupt`]: how a caller (Python's Ctrl-C) stops a blocked call.
//! * [`collectives`]: the reduction kernels and shared-memory waits of the CPU collectives
//!   (the algorithms themselves are in the Python package).

pub mod address_log;
pub mod agent;
pub mod auth;
pub mod collectives;
pub mod console;
pub mod interrupt;
pub mod logging;
pub mod metrics;
pub mod rendezvous;
pub mod rpc;
pub mod store;
