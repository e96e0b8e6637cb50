//! The job secret, and proving it on every connection between elastix components.
//!
//! * [`secret`]: where the secret comes from (a file only its owner may read; an environment
//!   variable, with a warning), and the one this process uses.
//! * [`handshake`]: the mutual challenge-response (HMAC-SHA256 over fresh nonces from both
//!   sides) a connection starts with.
//! * [`gate`]: what a server holding a secret admits: clients that prove it, and plain clients
//!   (torch's, which cannot) only from where its policy allows.

pub mod gate;
pub mod handshake;
pub mod secret;

pub use gate::{Gate, PlainClients};
pub use handshake::HandshakeError;
pub use secret::{
    children_file, process_secret, process_secret_or_log, remove_children_file, use_secret, Secret, SecretError,
    TOKEN_FILE_VAR, TOKEN_VAR,
};
