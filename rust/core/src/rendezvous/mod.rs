//! Rendezvous: how the agents of a job find each other, agree on membership and ranks, and
//! re-form when nodes join, leave or die.
//!
//! * [`backend`]: the interface every backend implements; [`Rendezvous`] (create.rs): the one
//!   the launcher names, its configuration parsed once, up front;
//! * the backends: [`c10d`] (over TCPStore servers: one endpoint or a list of sites),
//!   [`etcd`] (on an etcd v3 cluster's leases, transactions and watches), [`static_rdzv`];
//! * shared: [`store`] (the TCP store as the rendezvous uses it), [`change`] (what ends a
//!   round), [`presence`] (asking the other members' agents whether they are still there),
//!   [`records`] (the versioned JSON state), [`node`], [`config`] (params, conf, settings),
//!   [`endpoint`], [`error`];
//! * [`status`]: the job's state as `elastix status` reads it, from any machine
//!   ([`job_status`] asks the backend's reader).

pub mod backend;
pub mod c10d;
mod change;
pub mod config;
mod create;
pub mod endpoint;
pub mod error;
pub mod etcd;
mod job_status;
mod kind;
pub mod node;
mod participant;
pub mod presence;
pub mod records;
pub mod static_rdzv;
pub mod status;
pub mod store;
mod trust;

pub use backend::Backend;
pub use c10d::dynamic::DynamicRendezvous;
pub use change::{MembershipChange, RendezvousInfo};
pub use config::conf::ConfInput;
pub(crate) use config::params::job_secret;
pub use config::params::RendezvousParams;
pub use config::settings::RendezvousSettings;
pub use create::Rendezvous;
pub use error::RendezvousError;
pub use job_status::{job_runs, job_status};
pub use kind::BackendKind;
pub use node::NodeDesc;
