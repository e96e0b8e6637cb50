//! The mutual challenge-response an authenticated connection starts with, before any request:
//!
//! ```text
//! client → server   MAGIC (8) | version (1) | client nonce (32)
//! server → client   server nonce (32) | HMAC(secret, "server" | both nonces) (32)
//! client → server   HMAC(secret, "client" | both nonces) (32)      (after checking the server's)
//! server → client   1: accepted (then the store protocol follows), 0: refused
//! ```
//!
//! The client need not wait for the verdict: it may send its first requests right behind its
//! proof and read the verdict before their replies ([`client`], then [`verdict`]), which saves
//! a round trip per connection.
//!
//! Both sides prove the secret over nonces the other chose, so a recorded exchange cannot be
//! replayed, and neither proof can be reflected as the other (their labels differ). Proofs
//! are compared in constant time. Callers bound the whole exchange with a timeout.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::secret::Secret;

/// Opens an authenticated connection. No TCPStore request starts with a byte of 0x80 or
/// more, so a server tells the two kinds of client apart from the first byte.
pub const MAGIC: [u8; 8] = *b"\xe1elxauth";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const PROOF: usize = 32;
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;

/// What a server answers to a plain client's PING when it requires the secret: no process
/// id (the PING nonce) reaches 2^22, so no plain exchange can produce this value.
pub const SECRET_REQUIRED: u32 = 0xe1a5_0001;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("the peer closed the connection during authentication")]
    Closed,
    #[error("the peer did not start with elastix's authentication")]
    NotAHello,
    #[error("the peer speaks authentication version {0}, this elastix {VERSION}")]
    Version(u8),
    #[error("the peer does not hold this job's secret")]
    WrongProof,
    #[error("the peer refused this side's proof of the job's secret")]
    Refused,
    #[error("i/o error during authentication: {0}")]
    Io(std::io::Error),
}

impl From<std::io::Error> for HandshakeError {
    fn from(err: std::io::Error) -> Self {
        if err.kind() == std::io::ErrorKind::UnexpectedEof {
            HandshakeError::Closed
        } else {
            HandshakeError::Io(err)
        }
    }
}

fn nonce() -> [u8; NONCE] {
    let mut nonce = [0u8; NONCE];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    nonce
}

fn proof(secret: &Secret, label: &[u8], client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; PROOF] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.key()).expect("HMAC takes keys of any length");
    mac.update(b"elastix store auth v1 ");
    mac.update(label);
    mac.update(client);
    mac.update(server);
    mac.finalize().into_bytes().into()
}

fn matches(expected: &[u8; PROOF], got: &[u8; PROOF]) -> bool {
    bool::from(expected.ct_eq(got))
}

/// The client's side up to its proof: checks that the server holds the secret and proves it
/// holds it too. The server's verdict follows ([`verdict`]).
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, secret: &Secret) -> Result<(), HandshakeError> {
    let mine = nonce();
    let mut hello = Vec::with_capacity(MAGIC.len() + 1 + NONCE);
    hello.extend_from_slice(&MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&mine);
    stream.write_all(&hello).await?;
    let mut theirs = [0u8; NONCE];
    let mut server_proof = [0u8; PROOF];
    stream.read_exact(&mut theirs).await?;
    stream.read_exact(&mut server_proof).await?;
    if !matches(&proof(secret, b"server", &mine, &theirs), &server_proof) {
        return Err(HandshakeError::WrongProof);
    }
    stream.write_all(&proof(secret, b"client", &mine, &theirs)).await?;
    Ok(())
}

/// The server's verdict on the client's proof.
pub async fn verdict<S: AsyncRead + Unpin>(stream: &mut S) -> Result<(), HandshakeError> {
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).await?;
    match verdict[0] {
        ACCEPTED => Ok(()),
        _ => Err(HandshakeError::Refused),
    }
}

/// The server's side, for a client whose first byte was `MAGIC[0]`.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, secret: &Secret) -> Result<(), HandshakeError> {
    let mut magic = [0u8; MAGIC.len()];
    stream.read_exact(&mut magic).await?;
    if magic != MAGIC {
        return Err(HandshakeError::NotAHello);
    }
    let mut version = [0u8; 1];
    stream.read_exact(&mut version).await?;
    if version[0] != VERSION {
        return Err(HandshakeError::Version(version[0]));
    }
    let mut theirs = [0u8; NONCE];
    stream.read_exact(&mut theirs).await?;
    let mine = nonce();
    let mut answer = Vec::with_capacity(NONCE + PROOF);
    answer.extend_from_slice(&mine);
    answer.extend_from_slice(&proof(secret, b"server", &theirs, &mine));
    stream.write_all(&answer).await?;
    let mut client_proof = [0u8; PROOF];
    stream.read_exact(&mut client_proof).await?;
    if !matches(&proof(secret, b"client", &theirs, &mine), &client_proof) {
        let _ = stream.write_all(&[REFUSED]).await;
        return Err(HandshakeError::WrongProof);
    }
    stream.write_all(&[ACCEPTED]).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::duplex;

    use super::*;

    fn secret(text: &str) -> Secret {
        Secret::from_bytes(text).unwrap()
    }

    #[tokio::test]
    async fn both_sides_holding_the_secret_agree() {
        let (mut a, mut b) = duplex(1024);
        let key = secret("k");
        let both = async { client(&mut a, &key).await.and(verdict(&mut a).await) };
        let (client, server) = tokio::join!(both, server(&mut b, &key));
        assert!(client.is_ok() && server.is_ok(), "{client:?} {server:?}");
    }

    #[tokio::test]
    async fn a_client_with_another_secret_is_told_the_server_does_not_hold_its_own() {
        let (mut a, mut b) = duplex(1024);
        let (mine, theirs) = (secret("mine"), secret("theirs"));
        let (client, server) = tokio::join!(
            async {
                let outcome = client(&mut a, &mine).await;
                drop(a); // a real client closes its connection
                outcome
            },
            server(&mut b, &theirs)
        );
        assert!(matches!(client, Err(HandshakeError::WrongProof)), "{client:?}");
        assert!(matches!(server, Err(HandshakeError::Closed)), "{server:?}");
    }

    #[tokio::test]
    async fn a_replayed_client_proof_is_refused() {
        // record a genuine exchange's client proof, then send it against a fresh server nonce
        let (mut a, mut b) = duplex(1024);
        let key = secret("k");
        let both = async { client(&mut a, &key).await.and(verdict(&mut a).await) };
        let (ok, _) = tokio::join!(both, server(&mut b, &key));
        ok.unwrap();
        let (mut a, mut b) = duplex(1024);
        let replay = async {
            let mut hello = MAGIC.to_vec();
            hello.push(VERSION);
            hello.extend_from_slice(&[7u8; NONCE]);
            a.write_all(&hello).await.unwrap();
            let mut answer = [0u8; NONCE + PROOF];
            a.read_exact(&mut answer).await.unwrap();
            // a proof computed for another server nonce (what an eavesdropper holds)
            a.write_all(&proof(&key, b"client", &[7u8; NONCE], &[9u8; NONCE])).await.unwrap();
            let mut verdict = [9u8; 1];
            a.read_exact(&mut verdict).await.map(|_| verdict[0])
        };
        let (verdict, server) = tokio::join!(replay, server(&mut b, &key));
        assert_eq!(verdict.unwrap(), REFUSED);
        assert!(matches!(server, Err(HandshakeError::WrongProof)), "{server:?}");
    }

    #[tokio::test]
    async fn garbage_and_truncated_hellos_are_refused() {
        let key = secret("k");
        for bytes in [b"\xe1garbage-garbage".to_vec(), MAGIC[..5].to_vec(), [&MAGIC[..], &[2u8]].concat()] {
            let (mut a, mut b) = duplex(1024);
            a.write_all(&bytes).await.unwrap();
            drop(a);
            assert!(server(&mut b, &key).await.is_err(), "{bytes:?}");
        }
    }
}
