//! What a server holding the job secret admits. A client that starts with elastix's
//! authentication must prove the secret ([`super::pair`]); a plain client (torch's TCPStore
//! client, which has no authentication) is admitted only where the server's [`PlainClients`]
//! policy allows. Until it has done either, a connection waits at the [`Door`]: bounded per
//! source and in all, shed when newer ones need the room, closed after
//! [`super::door::HANDSHAKE_DEADLINE`]. A refused, shed or slow connection is closed, counted, and logged
//! once per address per minute.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::door::Door;
use super::key::Key;
use super::pair::{self, HandshakeError, STORE};
use super::secret::Secret;
use super::session::{Mode, Session};
use crate::address_log::AddressLog;

/// What a server answers to a plain client's PING when it requires the secret: no process
/// id (the PING nonce) reaches 2^22, so no plain exchange can produce this value.
pub const SECRET_REQUIRED: u32 = 0xe1a5_0001;
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

/// How a client got in.
#[derive(Debug)]
pub enum Admitted {
    /// It proved the secret: a member of the job, never refused for capacity, whose
    /// connection goes on in this session.
    Member(Box<Session>),
    /// A plain client the policy allows.
    Plain,
}

pub struct Gate {
    key: Key,
    plain: PlainClients,
    door: Arc<Door>,
    /// Addresses that authenticated.
    trusted: Mutex<HashSet<IpAddr>>,
    /// Refusals, counted and said once a minute per address.
    refused: AddressLog,
}

impl Gate {
    pub fn new(secret: Secret, plain: PlainClients) -> Gate {
        Gate {
            key: Key::job(&secret),
            plain,
            door: Door::shared(),
            trusted: Mutex::default(),
            refused: AddressLog::new(),
        }
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

    /// Sheds the oldest connection waiting to authenticate (the process is out of descriptors
    /// and a new one must get in); whether there was one.
    pub fn shed_oldest(&self) -> bool {
        self.door.shed_oldest()
    }

    /// How to serve the client at `peer`, or `None` (close the connection). Everything before
    /// that, the refusal of a plain client included, happens at the door: a connection that
    /// has not proven itself is bounded until it is closed, whatever it sent.
    pub async fn admit(&self, stream: &mut TcpStream, peer: SocketAddr) -> Option<Admitted> {
        let screened = async {
            let verdict = self.screen(stream, peer).await;
            if let Err((reason, plain)) = &verdict {
                // counted before the client hears of it
                self.refuse(peer, reason);
                if *plain {
                    // an elastix client without the secret learns why (a torch client sees
                    // a PING fail)
                    tell_secret_required(stream).await;
                }
            }
            verdict.ok()
        };
        match self.door.hold(peer.ip(), screened).await {
            Ok(admitted) => admitted,
            Err(turned) => {
                self.refuse(peer, &turned.to_string());
                None
            }
        }
    }

    /// `Ok`: serve the client; `Err`: why not, and whether it is a plain client.
    async fn screen(&self, stream: &mut TcpStream, peer: SocketAddr) -> Result<Admitted, (String, bool)> {
        let mut first = [0u8; 1];
        match stream.peek(&mut first).await {
            Ok(0) => return Err(("closed before saying anything".into(), false)),
            Ok(_) => {}
            Err(err) => return Err((err.to_string(), false)),
        }
        if first[0] == STORE.magic[0] {
            let (_, session) =
                pair::accept(stream, &self.key, &STORE, Mode::wanted(), |_| Ok(())).await.map_err(|err| {
                    let reason = match err {
                        HandshakeError::WrongProof => "it does not hold this job's secret".to_owned(),
                        other => other.to_string(),
                    };
                    (reason, false)
                })?;
            self.trust(peer.ip());
            return Ok(Admitted::Member(Box::new(session)));
        }
        if self.admits_plain(peer.ip()) {
            return Ok(Admitted::Plain);
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
