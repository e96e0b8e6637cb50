//! Rendezvous: how the agents of a job find each other, agree on membership and ranks, and
//! re-form when nodes join, leave or die.
//!
//! * [`handler`]: creating a rendezvous (`c10d`, `etcd`, `static`) and its common interface.
//! * [`etcd`]: the elastic rendezvous on an etcd v3 cluster, on leases, transactions and watches.
//! * [`dynamic`]: the elastic handler; [`round`]: forming one round; [`liveness`]:
//!   heartbeats; [`events`]: the run's event log.
//! * [`store`]: the store operations it needs, as a backend trait (TCPStore protocol here).
//! * [`settings`], [`conf`], [`endpoint`]: configuration; [`records`], [`keys`]: the
//!   versioned JSON state and where it lives.
//! * [`status`]: the job's state as `elastix status` reads it, from any machine.
//! * [`presence`]: asking the other members' agents whether they are still there.

mod change;
pub mod conf;
mod contact;
pub mod dynamic;
pub mod endpoint;
pub mod error;
pub mod etcd;
mod events;
pub mod handler;
pub mod keys;
mod liveness;
mod locate;
pub mod node;
mod params;
pub mod presence;
pub mod records;
mod round;
pub mod settings;
pub mod static_rdzv;
pub mod status;
pub mod store;

pub use conf::ConfInput;
pub use dynamic::{DynamicRendezvous, MembershipChange, RendezvousInfo};
pub use error::RendezvousError;
pub use handler::{Rendezvous, RendezvousParams};
pub use node::NodeDesc;
pub use settings::RendezvousSettings;
