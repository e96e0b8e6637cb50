//! Peer authentication: the job secret, and proving it on every connection between elastix
//! components (the store's, RPC's and the collectives' TCP connections).
//!
//! * [`secret`]: where the secret comes from (a file only its owner may read; an environment
//!   variable, with a warning) and the checks it must pass. It is handed explicitly to each
//!   server and client that needs it.
//! * [`key`]: the keys derived from it: the job's (store connections) and a group's (one
//!   round's RPC or collectives connections).
//! * [`pair`]: the handshake every such connection starts with; the connector proves first.
//! * [`session`]: what protects the connection afterwards: every byte in sealed records, under
//!   keys derived from the handshake (authenticated by default, encrypted on request).
//! * [`door`]: connections not yet proven: bounded per source and in all, shed oldest first,
//!   closed after a short deadline.
//! * [`gate`]: what a store server holding a secret admits: clients that prove it, and plain
//!   clients (torch's, which cannot) only from where its policy allows.

pub mod door;
pub mod gate;
pub mod key;
pub mod pair;
pub mod secret;
pub mod session;

pub use door::{Door, DoorLimits, Lobby, HANDSHAKE_DEADLINE};
pub use gate::{Admitted, Gate, PlainClients, SECRET_REQUIRED};
pub use key::Key;
pub use pair::HandshakeError;
pub use secret::{children_file, remove_children_file, Secret, SecretError, TOKEN_FILE_VAR, TOKEN_VAR};
