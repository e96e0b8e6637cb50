//! The pair handshake every authenticated elastix connection starts with (the store's, RPC's and
//! the collectives' TCP connections), before anything else crosses it:
//!
//! ```text
//! connector → acceptor   HELLO      magic (8) | version (1) | mode_c (1) | binding | nonce_c (32)
//! acceptor  → connector  CHALLENGE  status (1) | mode_a (1) | nonce_a (32)
//! connector → acceptor   PROOF      HMAC(key, label | "connect" | modes | binding | nonce_c | nonce_a) (32)
//! acceptor  → connector  VERDICT    1 | HMAC(key, label | "accept" | modes | binding | nonce_c | nonce_a) (32)
//!                                   or 0 | 32 zero bytes: the proof was wrong
//! ```
//!
//! (`modes` is mode_c | mode_a.) Everything after the handshake travels in a session
//! ([`super::session`]) whose keys come from the same key and both nonces, in the stronger of
//! the two modes the sides asked for: both proofs cover the modes, so nobody on the path can
//! talk the sides down to a weaker one.
//!
//! The connector proves first, so an acceptor sends nothing derived from the key to a peer
//! that has not proven it holds the key: a stranger who connects learns a random nonce and
//! nothing to test guesses against offline. (A connector only dials the endpoints it was
//! given.) Both proofs cover nonces the other side drew, so a recorded exchange cannot be
//! replayed, and their labels differ, so neither can be reflected as the other. `binding` (its
//! length fixed per [`Purpose`]) ties a proof to what the connection is for, such as the pair
//! of ranks. Proofs are compared in constant time; callers bound the exchange with a deadline.
//!
//! [`Connector`] and [`Acceptor`] are the two sides without I/O (Python's collectives drive
//! them from their own event loop); [`connect`] and [`accept`] run them on a tokio stream.

use rand::RngCore;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::key::Key;
use super::session::{Mode, Session, Transcript};

const VERSION: u8 = 3;
const NONCE: usize = 32;
pub const PROOF_LEN: usize = 32;
pub const CHALLENGE_LEN: usize = 2 + NONCE;
pub const VERDICT_LEN: usize = 1 + PROOF_LEN;

const GO_ON: u8 = 1;
/// The acceptor holds no key (a store run without a job secret): final.
const NO_SECRET: u8 = 2;
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;

/// What a kind of connection is for: its opening bytes, the label its proofs carry, and how
/// long its binding is.
#[derive(Debug, PartialEq, Eq)]
pub struct Purpose {
    pub magic: [u8; 8],
    pub label: &'static [u8],
    pub binding_len: usize,
}

/// The store's connections. No TCPStore request starts with a byte of 0x80 or more, so a
/// server tells them from torch's plain clients by the first byte.
pub const STORE: Purpose = Purpose { magic: *b"\xe1elxauth", label: b"elastix store", binding_len: 0 };
/// RPC: bound to (connector rank, acceptor rank), two little-endian u32.
pub const RPC: Purpose = Purpose { magic: *b"ELXRPC02", label: b"elastix rpc", binding_len: 8 };
/// Collectives over TCP: bound to (connector rank, acceptor rank), two little-endian u64.
pub const COLLECTIVES: Purpose = Purpose { magic: *b"ELXCOL02", label: b"elastix collectives", binding_len: 16 };

impl Purpose {
    pub fn hello_len(&self) -> usize {
        self.magic.len() + 2 + self.binding_len + NONCE
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("the peer closed the connection during authentication")]
    Closed,
    #[error("the peer did not start with elastix's authentication")]
    NotAHello,
    #[error("the peer speaks authentication version {0}, this elastix {VERSION}")]
    Version(u8),
    #[error("the peer asks for session mode {0}, which this elastix does not know")]
    Mode(u8),
    #[error("{0}")]
    Unwanted(String),
    /// Said by the acceptor: final for the connector.
    #[error("the server runs without a job secret")]
    NoSecret,
    /// The acceptor's finding: the connector does not hold the key.
    #[error("its proof is wrong: it does not hold the key")]
    WrongProof,
    /// The connector's finding, said by the acceptor: the connector does not hold its key.
    #[error("the peer checked this side's proof and refused it: the two hold different keys")]
    Refused,
    /// The connector's finding: the acceptor accepted but cannot prove the key.
    #[error("the peer does not hold the key (it accepted without being able to prove it)")]
    Impostor,
    #[error("i/o error during authentication: {0}")]
    Io(std::io::Error),
}

impl HandshakeError {
    /// A verified disagreement over the key, which no retry can fix (a close, a timeout or
    /// garbage may be a busy or shedding server, or a stranger in the middle: worth a retry).
    pub fn is_final(&self) -> bool {
        matches!(self, HandshakeError::NoSecret | HandshakeError::Refused | HandshakeError::Impostor)
    }
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

/// What both proofs and the session cover, once both hellos are in.
struct Exchange {
    binding: Vec<u8>,
    connector_nonce: [u8; NONCE],
    acceptor_nonce: [u8; NONCE],
    modes: [u8; 2],
}

impl Exchange {
    fn proof(&self, key: &Key, purpose: &Purpose, side: &[u8]) -> [u8; PROOF_LEN] {
        key.mac(&[purpose.label, b" ", side, &self.modes, &self.binding, &self.connector_nonce, &self.acceptor_nonce])
    }

    fn session(&self, key: &Key, purpose: &Purpose, connector: bool) -> Session {
        let (mode_c, mode_a) = (Mode::from_byte(self.modes[0]), Mode::from_byte(self.modes[1]));
        let mode = Mode::agreed(mode_c.expect("checked on arrival"), mode_a.expect("checked on arrival"));
        let transcript = Transcript {
            label: purpose.label,
            binding: &self.binding,
            connector_nonce: &self.connector_nonce,
            acceptor_nonce: &self.acceptor_nonce,
            mode,
        };
        Session::derive(key, &transcript, connector)
    }
}

fn same(expected: &[u8; PROOF_LEN], got: &[u8]) -> bool {
    bool::from(expected.as_slice().ct_eq(got))
}

/// The connecting side, without I/O: [`Connector::new`] gives the HELLO to send, then feed it
/// the CHALLENGE and the VERDICT.
pub struct Connector {
    key: Key,
    purpose: &'static Purpose,
    binding: Vec<u8>,
    mine: [u8; NONCE],
    mode: Mode,
    exchange: Option<Exchange>,
}

impl Connector {
    /// `binding` must be `purpose.binding_len` bytes long; `mode`: the session this side asks for.
    pub fn new(key: &Key, purpose: &'static Purpose, binding: &[u8], mode: Mode) -> (Connector, Vec<u8>) {
        assert_eq!(binding.len(), purpose.binding_len, "the binding of a {:?} handshake", purpose.magic);
        let mine = nonce();
        let mut hello = Vec::with_capacity(purpose.hello_len());
        hello.extend_from_slice(&purpose.magic);
        hello.push(VERSION);
        hello.push(mode.byte());
        hello.extend_from_slice(binding);
        hello.extend_from_slice(&mine);
        (Connector { key: key.clone(), purpose, binding: binding.to_vec(), mine, mode, exchange: None }, hello)
    }

    /// The PROOF that answers `challenge`.
    pub fn on_challenge(&mut self, challenge: &[u8; CHALLENGE_LEN]) -> Result<[u8; PROOF_LEN], HandshakeError> {
        match challenge[0] {
            GO_ON => {}
            NO_SECRET => return Err(HandshakeError::NoSecret),
            _ => return Err(HandshakeError::NotAHello),
        }
        Mode::from_byte(challenge[1]).ok_or(HandshakeError::Mode(challenge[1]))?;
        let exchange = Exchange {
            binding: self.binding.clone(),
            connector_nonce: self.mine,
            acceptor_nonce: challenge[2..].try_into().expect("a challenge holds a nonce"),
            modes: [self.mode.byte(), challenge[1]],
        };
        let proof = exchange.proof(&self.key, self.purpose, b"connect");
        self.exchange = Some(exchange);
        Ok(proof)
    }

    /// Whether the acceptor took this side's proof and proved the key in turn.
    pub fn on_verdict(&self, verdict: &[u8; VERDICT_LEN]) -> Result<(), HandshakeError> {
        let exchange = self.exchange.as_ref().ok_or(HandshakeError::NotAHello)?;
        match verdict[0] {
            ACCEPTED => {}
            REFUSED => return Err(HandshakeError::Refused),
            _ => return Err(HandshakeError::NotAHello),
        }
        if same(&exchange.proof(&self.key, self.purpose, b"accept"), &verdict[1..]) {
            Ok(())
        } else {
            Err(HandshakeError::Impostor)
        }
    }

    /// This side's session, once the challenge is answered (the records it sends may go
    /// behind its proof; the acceptor opens them only once the proof holds).
    pub fn session(&self) -> Option<Session> {
        Some(self.exchange.as_ref()?.session(&self.key, self.purpose, true))
    }
}

/// The accepting side, without I/O: feed it the HELLO (it gives the binding, for the caller to
/// check, and the CHALLENGE to send), then the PROOF (it gives the VERDICT to send).
pub struct Acceptor {
    key: Key,
    purpose: &'static Purpose,
    mode: Mode,
    exchange: Option<Exchange>,
    proven: bool,
}

impl Acceptor {
    /// `mode`: the session this side asks for.
    pub fn new(key: &Key, purpose: &'static Purpose, mode: Mode) -> Acceptor {
        Acceptor { key: key.clone(), purpose, mode, exchange: None, proven: false }
    }

    /// The binding the connector claims, and the CHALLENGE to send.
    pub fn on_hello(&mut self, hello: &[u8]) -> Result<(Vec<u8>, [u8; CHALLENGE_LEN]), HandshakeError> {
        let magic = &self.purpose.magic;
        if hello.len() != self.purpose.hello_len() || !hello.starts_with(magic) {
            return Err(HandshakeError::NotAHello);
        }
        if hello[magic.len()] != VERSION {
            return Err(HandshakeError::Version(hello[magic.len()]));
        }
        let theirs_mode = hello[magic.len() + 1];
        Mode::from_byte(theirs_mode).ok_or(HandshakeError::Mode(theirs_mode))?;
        let rest = &hello[magic.len() + 2..];
        let (binding, theirs) = rest.split_at(self.purpose.binding_len);
        let mine = nonce();
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[0] = GO_ON;
        challenge[1] = self.mode.byte();
        challenge[2..].copy_from_slice(&mine);
        self.exchange = Some(Exchange {
            binding: binding.to_vec(),
            connector_nonce: theirs.try_into().expect("the length was checked"),
            acceptor_nonce: mine,
            modes: [theirs_mode, self.mode.byte()],
        });
        Ok((binding.to_vec(), challenge))
    }

    /// The VERDICT on `proof`: `Ok` to send and serve, or `Err` with the refusal to send.
    pub fn on_proof(
        &mut self,
        proof_bytes: &[u8; PROOF_LEN],
    ) -> Result<[u8; VERDICT_LEN], ([u8; VERDICT_LEN], HandshakeError)> {
        let mut verdict = [0u8; VERDICT_LEN];
        let Some(exchange) = &self.exchange else {
            return Err((verdict, HandshakeError::NotAHello));
        };
        if !same(&exchange.proof(&self.key, self.purpose, b"connect"), proof_bytes) {
            verdict[0] = REFUSED;
            return Err((verdict, HandshakeError::WrongProof));
        }
        verdict[0] = ACCEPTED;
        verdict[1..].copy_from_slice(&exchange.proof(&self.key, self.purpose, b"accept"));
        self.proven = true;
        Ok(verdict)
    }

    /// This side's session, once the connector proved the key.
    pub fn session(&self) -> Option<Session> {
        let exchange = self.exchange.as_ref().filter(|_| self.proven)?;
        Some(exchange.session(&self.key, self.purpose, false))
    }
}

/// The CHALLENGE of an acceptor that holds no key (a store run without a secret): the
/// connector learns at once that no retry will help.
pub fn no_secret_challenge() -> [u8; CHALLENGE_LEN] {
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge[0] = NO_SECRET;
    challenge
}

/// The connector's side up to and including its proof; the verdict is read with
/// [`Proven::verdict`], so a caller may send its first requests behind the proof (sealed in
/// [`Proven::session`]).
pub async fn prove<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &Key,
    purpose: &'static Purpose,
    binding: &[u8],
    mode: Mode,
) -> Result<Proven, HandshakeError> {
    let (mut connector, hello) = Connector::new(key, purpose, binding, mode);
    stream.write_all(&hello).await?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    stream.read_exact(&mut challenge).await?;
    let proof = connector.on_challenge(&challenge)?;
    stream.write_all(&proof).await?;
    Ok(Proven(connector))
}

/// A connector that sent its proof.
pub struct Proven(Connector);

impl Proven {
    /// The session the connection continues in.
    pub fn session(&self) -> Session {
        self.0.session().expect("a proven connector answered the challenge")
    }

    pub async fn verdict<S: AsyncRead + Unpin>(self, stream: &mut S) -> Result<(), HandshakeError> {
        let mut verdict = [0u8; VERDICT_LEN];
        stream.read_exact(&mut verdict).await?;
        self.0.on_verdict(&verdict)
    }
}

/// The whole connector's side: the session the connection continues in.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &Key,
    purpose: &'static Purpose,
    binding: &[u8],
    mode: Mode,
) -> Result<Session, HandshakeError> {
    let proven = prove(stream, key, purpose, binding, mode).await?;
    let session = proven.session();
    proven.verdict(stream).await?;
    Ok(session)
}

/// The whole acceptor's side: the connector's binding once it proved the key. `check` sees the
/// binding only then, and may refuse it (`Err(why)`: the connection is closed): a stranger
/// learns nothing from which bindings are refused (which rank listens here, for one).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &Key,
    purpose: &'static Purpose,
    mode: Mode,
    check: impl FnOnce(&[u8]) -> Result<(), String>,
) -> Result<(Vec<u8>, Session), HandshakeError> {
    let mut acceptor = Acceptor::new(key, purpose, mode);
    let mut hello = vec![0u8; purpose.hello_len()];
    stream.read_exact(&mut hello).await?;
    let (binding, challenge) = acceptor.on_hello(&hello)?;
    stream.write_all(&challenge).await?;
    let mut proof = [0u8; PROOF_LEN];
    stream.read_exact(&mut proof).await?;
    match acceptor.on_proof(&proof) {
        Ok(verdict) => {
            check(&binding).map_err(HandshakeError::Unwanted)?;
            stream.write_all(&verdict).await?;
            let session = acceptor.session().expect("the connector proved the key");
            Ok((binding, session))
        }
        Err((refusal, err)) => {
            let _ = stream.write_all(&refusal).await;
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::duplex;

    use super::*;

    const A: Mode = Mode::Authenticated;

    fn key(text: &str) -> Key {
        Key::from_bytes(text.as_bytes())
    }

    fn accept_all(_: &[u8]) -> Result<(), String> {
        Ok(())
    }

    #[tokio::test]
    async fn both_sides_holding_the_key_agree_on_the_binding() {
        let (mut a, mut b) = duplex(1024);
        let k = key("k");
        let (connected, accepted) = tokio::join!(
            connect(&mut a, &k, &RPC, &[1, 0, 0, 0, 2, 0, 0, 0], A),
            accept(&mut b, &k, &RPC, A, accept_all)
        );
        let session = connected.unwrap();
        let (binding, theirs) = accepted.unwrap();
        assert_eq!(binding, [1, 0, 0, 0, 2, 0, 0, 0]);
        // the sessions match: what one seals the other opens
        let ((mut sealer, _), (_, mut opener)) = (session.split(), theirs.split());
        let (mut wire, mut out) = (bytes::BytesMut::new(), bytes::BytesMut::new());
        sealer.seal(b"SET", &mut wire);
        assert!(opener.open(&mut wire, &mut out).unwrap() && &out[..] == b"SET");
    }

    #[tokio::test]
    async fn the_stronger_mode_wins_and_nobody_on_the_path_can_weaken_it() {
        let k = key("k");
        let (mut connector, hello) = Connector::new(&k, &STORE, &[], A);
        let mut acceptor = Acceptor::new(&k, &STORE, Mode::Encrypted);
        let (_, challenge) = acceptor.on_hello(&hello).unwrap();
        let proof = connector.on_challenge(&challenge).unwrap();
        acceptor.on_proof(&proof).unwrap();
        assert_eq!(
            (connector.session().unwrap().mode, acceptor.session().unwrap().mode),
            (Mode::Encrypted, Mode::Encrypted)
        );
        // the acceptor's wish, changed on the way: the proofs no longer agree
        let (mut connector, hello) = Connector::new(&k, &STORE, &[], A);
        let mut acceptor = Acceptor::new(&k, &STORE, Mode::Encrypted);
        let (_, mut challenge) = acceptor.on_hello(&hello).unwrap();
        challenge[1] = A.byte();
        let proof = connector.on_challenge(&challenge).unwrap();
        assert!(matches!(acceptor.on_proof(&proof), Err((_, HandshakeError::WrongProof))));
        assert!(acceptor.session().is_none(), "no session without a proof");
        // an unknown mode is refused at once
        let (_, mut hello) = Connector::new(&k, &STORE, &[], A);
        hello[9] = 7;
        assert!(matches!(Acceptor::new(&k, &STORE, A).on_hello(&hello), Err(HandshakeError::Mode(7))));
    }

    #[tokio::test]
    async fn a_wrong_key_is_a_verified_refusal_on_both_sides() {
        let (mut a, mut b) = duplex(1024);
        let (mine, theirs) = (key("mine"), key("theirs"));
        let (connected, accepted) =
            tokio::join!(connect(&mut a, &mine, &STORE, &[], A), accept(&mut b, &theirs, &STORE, A, accept_all));
        let connected = connected.unwrap_err();
        assert!(matches!(connected, HandshakeError::Refused) && connected.is_final(), "{connected:?}");
        assert!(matches!(accepted, Err(HandshakeError::WrongProof)), "{accepted:?}");
    }

    #[tokio::test]
    async fn the_acceptor_says_nothing_derived_from_the_key_before_the_connectors_proof() {
        // a stranger's view: the same hello answered under two keys differs only in its random
        // nonce, and a wrong proof gets a refusal with no proof in it
        let stranger = |k: Key| async move {
            let (mut a, mut b) = duplex(1024);
            let (_, hello) = Connector::new(&key("guess"), &STORE, &[], A);
            let server = tokio::spawn(async move { accept(&mut b, &k, &STORE, A, accept_all).await });
            a.write_all(&hello).await.unwrap();
            let mut challenge = [0u8; CHALLENGE_LEN];
            a.read_exact(&mut challenge).await.unwrap();
            a.write_all(&[0u8; PROOF_LEN]).await.unwrap();
            let mut verdict = [9u8; VERDICT_LEN];
            a.read_exact(&mut verdict).await.unwrap();
            assert!(matches!(server.await.unwrap(), Err(HandshakeError::WrongProof)));
            (challenge, verdict)
        };
        let (one, refused) = stranger(key("k1")).await;
        let (other, _) = stranger(key("k2")).await;
        assert_eq!((one[0], other[0]), (GO_ON, GO_ON));
        assert_ne!(one[2..], other[2..], "fresh nonces");
        assert_eq!(refused, [0u8; VERDICT_LEN], "a refusal carries nothing");
    }

    #[tokio::test]
    async fn a_replayed_proof_meets_a_fresh_nonce() {
        let k = key("k");
        let (mut connector, hello) = Connector::new(&k, &STORE, &[], A);
        let mut first = Acceptor::new(&k, &STORE, A);
        let (_, challenge) = first.on_hello(&hello).unwrap();
        let recorded = connector.on_challenge(&challenge).unwrap();
        assert!(first.on_proof(&recorded).is_ok());
        let mut second = Acceptor::new(&k, &STORE, A);
        second.on_hello(&hello).unwrap();
        assert!(matches!(second.on_proof(&recorded), Err((_, HandshakeError::WrongProof))));
    }

    #[tokio::test]
    async fn an_acceptor_that_accepts_without_the_key_is_caught() {
        let (mut connector, hello) = Connector::new(&key("k"), &RPC, &[0; 8], A);
        let mut impostor = Acceptor::new(&key("other"), &RPC, A);
        let (_, challenge) = impostor.on_hello(&hello).unwrap();
        connector.on_challenge(&challenge).unwrap();
        let mut verdict = [0u8; VERDICT_LEN];
        verdict[0] = ACCEPTED;
        assert!(matches!(connector.on_verdict(&verdict), Err(HandshakeError::Impostor)));
    }

    #[tokio::test]
    async fn bindings_purposes_and_garbage_are_refused() {
        let k = key("k");
        let (_, rpc_hello) = Connector::new(&k, &RPC, &[0; 8], A);
        assert!(matches!(Acceptor::new(&k, &COLLECTIVES, A).on_hello(&rpc_hello), Err(HandshakeError::NotAHello)));
        let mut old = rpc_hello.clone();
        old[8] = 2;
        assert!(matches!(Acceptor::new(&k, &RPC, A).on_hello(&old), Err(HandshakeError::Version(2))));
        // a proof bound to other ranks does not pass
        let (mut connector, hello) = Connector::new(&k, &RPC, &[1; 8], A);
        let mut acceptor = Acceptor::new(&k, &RPC, A);
        let mut forged = hello.clone();
        forged[10] = 2;
        let (_, challenge) = acceptor.on_hello(&forged).unwrap();
        let proof = connector.on_challenge(&challenge).unwrap();
        assert!(acceptor.on_proof(&proof).is_err());
        // a binding is judged once the key is proven, never before: a stranger that only says
        // hello is challenged whatever it claims, and learns nothing from the claim
        let refuse_seven = |binding: &[u8]| if binding[0] == 7 { Err("no rank 7".to_owned()) } else { Ok(()) };
        let (mut a, mut b) = duplex(1024);
        let (challenged, accepted) = tokio::join!(
            async move {
                let (_, hello) = Connector::new(&key("stranger"), &RPC, &[7; 8], A);
                a.write_all(&hello).await.unwrap();
                let mut challenge = [0u8; CHALLENGE_LEN];
                a.read_exact(&mut challenge).await.map(|_| challenge[0])
                // and it goes away: `a` is dropped here
            },
            accept(&mut b, &k, &RPC, A, refuse_seven)
        );
        assert_eq!(challenged.unwrap(), GO_ON);
        assert!(matches!(accepted, Err(HandshakeError::Closed)), "it never proved anything");
        let (mut a, b) = duplex(1024);
        // (the acceptor's side closes the connection when it refuses: `b` goes with its block)
        let (connected, accepted) = tokio::join!(connect(&mut a, &k, &RPC, &[7; 8], A), async {
            let mut b = b;
            accept(&mut b, &k, &RPC, A, refuse_seven).await
        });
        assert!(matches!(accepted, Err(HandshakeError::Unwanted(why)) if why == "no rank 7"));
        assert!(connected.is_err(), "a member with a claim no member makes is closed on");
        let mut connector = Connector::new(&k, &STORE, &[], A).0;
        assert!(matches!(connector.on_challenge(&no_secret_challenge()), Err(HandshakeError::NoSecret)));
    }
}
