//! The mutual challenge-response every RPC connection starts with, under the group's key
//! (HMAC of the job secret and a nonce drawn for this RPC group, as the collectives do):
//!
//! ```text
//! connector -> acceptor   MAGIC (8) | connector rank u32 | nonce_c (32)
//! acceptor  -> connector  nonce_a (32) | HMAC(key, "accept"  | nonce_c | nonce_a | ranks)
//! connector -> acceptor                  HMAC(key, "connect" | nonce_c | nonce_a | ranks)
//! ```
//!
//! `ranks` is (connector, acceptor) as two u32: a proof is bound to its pair of workers, and
//! fresh nonces on both sides make a recorded exchange worthless.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::rpc::ids::WorkerId;

const MAGIC: [u8; 8] = *b"ELXRPC01";
const NONCE: usize = 32;
const PROOF: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("it does not speak elastix RPC")]
    NotRpc,
    #[error("it claims rank {0}, which is not in this RPC group")]
    UnknownRank(WorkerId),
    #[error("it does not hold this RPC group's key (a stranger, another job, or a different secret)")]
    WrongProof,
    #[error("i/o error during the handshake: {0}")]
    Io(#[from] std::io::Error),
}

fn proof(
    key: &[u8],
    side: &[u8],
    nonce_c: &[u8],
    nonce_a: &[u8],
    connector: WorkerId,
    acceptor: WorkerId,
) -> [u8; PROOF] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    for part in [side, nonce_c, nonce_a, &connector.to_le_bytes(), &acceptor.to_le_bytes()] {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

fn nonce() -> [u8; NONCE] {
    let mut nonce = [0u8; NONCE];
    rand::thread_rng().fill_bytes(&mut nonce);
    nonce
}

/// The connecting side; `acceptor` is the rank it means to reach.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &[u8],
    me: WorkerId,
    acceptor: WorkerId,
) -> Result<(), HandshakeError> {
    let nonce_c = nonce();
    let mut hello = Vec::with_capacity(MAGIC.len() + 4 + NONCE);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&me.to_le_bytes());
    hello.extend_from_slice(&nonce_c);
    stream.write_all(&hello).await?;
    let mut reply = [0u8; NONCE + PROOF];
    stream.read_exact(&mut reply).await?;
    let (nonce_a, their_proof) = reply.split_at(NONCE);
    let expected = proof(key, b"accept", &nonce_c, nonce_a, me, acceptor);
    if !bool::from(expected.ct_eq(their_proof)) {
        return Err(HandshakeError::WrongProof);
    }
    stream.write_all(&proof(key, b"connect", &nonce_c, nonce_a, me, acceptor)).await?;
    Ok(())
}

/// The accepting side: the rank of the worker that connected.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &[u8],
    me: WorkerId,
    world: u32,
) -> Result<WorkerId, HandshakeError> {
    let mut hello = [0u8; 8 + 4 + NONCE];
    stream.read_exact(&mut hello).await?;
    if hello[..8] != MAGIC {
        return Err(HandshakeError::NotRpc);
    }
    let connector = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes"));
    if connector >= world {
        return Err(HandshakeError::UnknownRank(connector));
    }
    let nonce_c = &hello[12..];
    let nonce_a = nonce();
    let mut reply = Vec::with_capacity(NONCE + PROOF);
    reply.extend_from_slice(&nonce_a);
    reply.extend_from_slice(&proof(key, b"accept", nonce_c, &nonce_a, connector, me));
    stream.write_all(&reply).await?;
    let mut their_proof = [0u8; PROOF];
    stream.read_exact(&mut their_proof).await?;
    let expected = proof(key, b"connect", nonce_c, &nonce_a, connector, me);
    if !bool::from(expected.ct_eq(&their_proof)) {
        return Err(HandshakeError::WrongProof);
    }
    Ok(connector)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs both sides; each closes its end when done, as a real connection would.
    async fn pair(
        connect_key: &[u8],
        connector: WorkerId,
        accept_key: &[u8],
    ) -> (Result<(), HandshakeError>, Result<WorkerId, HandshakeError>) {
        let (mut a, mut b) = tokio::io::duplex(1024);
        tokio::join!(async move { connect(&mut a, connect_key, connector, 0).await }, async move {
            accept(&mut b, accept_key, 0, 4).await
        })
    }

    #[tokio::test]
    async fn both_sides_agree_only_with_the_same_key() {
        let (connected, accepted) = pair(b"k", 2, b"k").await;
        connected.unwrap();
        assert_eq!(accepted.unwrap(), 2);

        let (connected, accepted) = pair(b"other", 2, b"k").await;
        assert!(matches!(connected, Err(HandshakeError::WrongProof)));
        assert!(accepted.is_err());

        let (connected, accepted) = pair(b"k", 9, b"k").await;
        assert!(matches!(accepted, Err(HandshakeError::UnknownRank(9))));
        assert!(connected.is_err());
    }
}
