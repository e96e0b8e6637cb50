//! `elastix.rpc`'s transport and RRef bookkeeping: remote calls between the workers of a
//! job, and remote references counted with the protocol of torch's RRef design notes.
//!
//! * [`ids`]: globally unique RRef and fork ids.
//! * [`frame`]: the wire format.
//! * [`refs`]: the reference-counting protocol, as pure state.
//! * [`endpoint`]: the transport (tokio): connections, calls, control messages with retries.
//! * [`queue`]: where Python's threads wait for work.

pub mod endpoint;
pub mod frame;
pub mod ids;
pub mod queue;
pub mod refs;
