//! What a server holding the job secret admits. A client that starts with elastix's
//! authentication must prove the secret; a plain client (torch's TCPStore client, which has no
//! authentication) is admitted only where the server's [`PlainClients`] policy allows. A
//! refused or slow connection is closed, counted, and logged once per address per minute.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::handshake::{self, MAGIC, SECRET_REQUIRED};
use super::secret::Secret;
use crate::address_log::AddressLog;

/// Bound on a client's authentication, from its connection on.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The plain handshake a refused torch client sends (VALIDATE, PING), read before answering.
const PLAIN_HELLO: usize = 10;

/// Who may connect without proving the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainClients {
    /// Nobody (the rendezvous store: only agents connect, and they authenticate).
    Refuse,
    /// Loopback, and the addresses an authenticated client came from (a round's workers' store:
    /// every member's agent authenticates before its torch workers connect).
    LoopbackAndAuthenticated,
}

pub struct Gate {
    secret: Secret,
    plain: PlainClients,
    /// Addresses that authenticated.
    trusted: Mutex<HashSet<IpAddr>>,
    /// Refusals, counted and said once a minute per address.
    refused: AddressLog,
}

impl Gate {
    pub fn new(secret: Secret, plain: PlainClients) -> Gate {
        Gate { secret, plain, trusted: Mutex::default(), refused: AddressLog::new() }
    }

    /// Serves plain clients from `ip` from now on: a member of the round whose torch workers
    /// connect without the secret, though its agent never authenticated to this server.
    pub fn trust(&self, ip: IpAddr) {
        self.trusted.lock().unwrap_or_else(PoisonError::into_inner).insert(ip.to_canonical());
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.count()
    }

    /// Whether to serve the client at `peer` (`false`: close the connection), deciding within
    /// [`HANDSHAKE_TIMEOUT`].
    pub async fn admit(&self, stream: &mut TcpStream, peer: SocketAddr) -> bool {
        let until = Instant::now() + HANDSHAKE_TIMEOUT;
        let verdict = match tokio::time::timeout_at(until, self.screen(stream, peer)).await {
            Ok(verdict) => verdict,
            Err(_) => Err((format!("no authentication within {HANDSHAKE_TIMEOUT:?}"), false)),
        };
        let Err((reason, plain)) = verdict else { return true };
        // counted before the client hears of it
        self.refuse(peer, &reason);
        if plain {
            // an elastix client without the secret learns why (a torch client sees a PING fail)
            let _ = tokio::time::timeout_at(until, tell_secret_required(stream)).await;
        }
        false
    }

    /// `Ok`: serve the client; `Err`: why not, and whether it is a plain client.
    async fn screen(&self, stream: &mut TcpStream, peer: SocketAddr) -> Result<(), (String, bool)> {
        let mut first = [0u8; 1];
        match stream.peek(&mut first).await {
            Ok(0) => return Err(("closed before saying anything".into(), false)),
            Ok(_) => {}
            Err(err) => return Err((err.to_string(), false)),
        }
        if first[0] == MAGIC[0] {
            handshake::server(stream, &self.secret).await.map_err(|err| {
                let reason = match err {
                    // it saw this server's proof and left: it holds another secret
                    handshake::HandshakeError::Closed => {
                        "it closed the connection during authentication (it holds another job secret?)".to_owned()
                    }
                    handshake::HandshakeError::WrongProof => "it does not hold this job's secret".to_owned(),
                    other => other.to_string(),
                };
                (reason, false)
            })?;
            self.trust(peer.ip());
            return Ok(());
        }
        if self.admits_plain(peer.ip()) {
            return Ok(());
        }
        let reason: String = match self.plain {
            PlainClients::Refuse => "a client without the job's secret".into(),
            PlainClients::LoopbackAndAuthenticated => {
                "a client without the job's secret (a torch client?) from an address no agent of the job \
                 authenticated from"
                    .into()
            }
        };
        Err((reason, true))
    }

    fn admits_plain(&self, ip: IpAddr) -> bool {
        match self.plain {
            PlainClients::Refuse => false,
            PlainClients::LoopbackAndAuthenticated => {
                ip.is_loopback()
                    || ip.to_canonical().is_loopback()
                    || self.trusted.lock().unwrap_or_else(PoisonError::into_inner).contains(&ip.to_canonical())
            }
        }
    }

    fn refuse(&self, peer: SocketAddr, reason: &str) {
        match self.refused.note(peer.ip()) {
            Some(count) => tracing::warn!(
                "refused a connection from {peer}: {reason} ({count} refused so far; said at most once a minute per address)"
            ),
            None => tracing::debug!("refused a connection from {peer}: {reason}"),
        }
    }
}

/// Answers a plain client's opening (VALIDATE, PING) with [`SECRET_REQUIRED`].
async fn tell_secret_required(stream: &mut TcpStream) {
    let mut hello = [0u8; PLAIN_HELLO];
    if stream.read_exact(&mut hello).await.is_ok() {
        let _ = stream.write_all(&SECRET_REQUIRED.to_le_bytes()).await;
    }
}
