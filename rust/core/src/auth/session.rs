//! What protects an elastix connection after its handshake ([`super::pair`]): every byte either
//! side sends travels in sealed records, so a relay that passed the handshake through cannot
//! add, change, drop, reorder or replay a single one.
//!
//! ```text
//! record = length (4, little-endian) | payload (length bytes) | tag (16)
//! ```
//!
//! Each direction has a key of its own and counts its records; the count is the AEAD nonce
//! (ChaCha20-Poly1305, RustCrypto's), so a record is valid only in its place. The keys come
//! from HKDF-SHA256 over the handshake's key, with both sides' nonces as the salt and the
//! purpose, binding, agreed mode and direction as the info: a session's keys are new for every
//! connection, and no record of one connection opens in another.
//!
//! [`Mode::Authenticated`] (the default) sends the payload as it is and the tag covers it and
//! the length (the AEAD's associated data, nothing encrypted): a relay can read but not forge.
//! [`Mode::Encrypted`] encrypts the payload too. The mode a connection uses is the stronger of
//! the two sides' (`ELASTIX_SESSION`), agreed in the handshake and covered by its proofs.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Nonce, Tag};
use hkdf::Hkdf;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::key::Key;

/// Bytes a record adds to its payload.
pub const HEAD: usize = 4;
pub const TAG: usize = 16;
pub const OVERHEAD: usize = HEAD + TAG;
/// The largest payload of one record: larger writes are cut in several.
pub const MAX_RECORD: usize = 64 * 1024;
/// Names the mode a process asks for: `authenticated` (the default) or `encrypted`.
pub const MODE_VAR: &str = "ELASTIX_SESSION";

/// How a session's records are protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// Sent as they are, each with a tag over its bytes: nothing can be forged, all can be read.
    Authenticated = 1,
    /// Encrypted as well.
    Encrypted = 2,
}

impl Mode {
    /// What this process asks for ([`MODE_VAR`]); an unknown value is an error naming the two.
    pub fn from_env() -> Result<Mode, String> {
        match std::env::var(MODE_VAR) {
            Err(_) => Ok(Mode::Authenticated),
            Ok(value) => Mode::parse(&value),
        }
    }

    pub fn parse(text: &str) -> Result<Mode, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "authenticated" => Ok(Mode::Authenticated),
            "encrypted" => Ok(Mode::Encrypted),
            other => Err(format!("{MODE_VAR}={other:?}: use \"authenticated\" (the default) or \"encrypted\"")),
        }
    }

    /// What this process asks for; an unusable setting is said once and the default used.
    pub fn wanted() -> Mode {
        Mode::from_env().unwrap_or_else(|why| {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::error!("{why}; using authenticated sessions"));
            Mode::Authenticated
        })
    }

    pub fn byte(self) -> u8 {
        self as u8
    }

    pub fn from_byte(byte: u8) -> Option<Mode> {
        match byte {
            1 => Some(Mode::Authenticated),
            2 => Some(Mode::Encrypted),
            _ => None,
        }
    }

    /// The mode two sides that ask for `a` and `b` use: the stronger.
    pub fn agreed(a: Mode, b: Mode) -> Mode {
        a.max(b)
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Authenticated => "authenticated",
            Mode::Encrypted => "encrypted",
        }
    }
}

/// A session's two keys and its mode, from one side's point of view.
pub struct Session {
    pub mode: Mode,
    send: [u8; 32],
    recv: [u8; 32],
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({})", self.mode.name())
    }
}

/// What a handshake fixed, from which both sides derive the same session.
pub struct Transcript<'a> {
    pub label: &'a [u8],
    pub binding: &'a [u8],
    pub connector_nonce: &'a [u8],
    pub acceptor_nonce: &'a [u8],
    pub mode: Mode,
}

impl Session {
    /// The session of the connector (`connector`) or the acceptor of the handshake `transcript`
    /// under `key`.
    pub fn derive(key: &Key, transcript: &Transcript<'_>, connector: bool) -> Session {
        let salt = [transcript.connector_nonce, transcript.acceptor_nonce].concat();
        let kdf = Hkdf::<Sha256>::new(Some(&salt), key.bytes());
        let direction = |name: &[u8]| {
            let info = [transcript.label, b" session ", name, &[transcript.mode.byte()], transcript.binding].concat();
            let mut out = [0u8; 32];
            kdf.expand(&info, &mut out).expect("32 bytes is a valid HKDF-SHA256 length");
            out
        };
        let (to_acceptor, to_connector) = (direction(b"c2a"), direction(b"a2c"));
        let (send, recv) = if connector { (to_acceptor, to_connector) } else { (to_connector, to_acceptor) };
        Session { mode: transcript.mode, send, recv }
    }

    /// The sending and receiving halves.
    pub fn split(self) -> (Sealer, Opener) {
        (Sealer::new(&self.send, self.mode), Opener::new(&self.recv, self.mode))
    }
}

fn nonce(seq: u64) -> Nonce {
    let mut nonce = Nonce::default();
    nonce[4..].copy_from_slice(&seq.to_le_bytes());
    nonce
}

/// Seals what one side sends.
pub struct Sealer {
    cipher: ChaCha20Poly1305,
    mode: Mode,
    seq: u64,
}

impl Sealer {
    fn new(key: &[u8; 32], mode: Mode) -> Sealer {
        Sealer { cipher: ChaCha20Poly1305::new(key.into()), mode, seq: 0 }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Appends `plain` to `out` as records of at most [`MAX_RECORD`] bytes each (none for
    /// nothing: an empty record would read as the end of the stream).
    pub fn seal(&mut self, plain: &[u8], out: &mut BytesMut) {
        for chunk in plain.chunks(MAX_RECORD) {
            let head = (chunk.len() as u32).to_le_bytes();
            out.reserve(OVERHEAD + chunk.len());
            out.put_slice(&head);
            let start = out.len();
            out.put_slice(chunk);
            let nonce = nonce(self.seq);
            self.seq += 1;
            let tag = match self.mode {
                Mode::Encrypted => self.cipher.encrypt_in_place_detached(&nonce, &head, &mut out[start..]),
                // the head and the payload, as they lie in `out`: no copy of the record
                Mode::Authenticated => self.cipher.encrypt_in_place_detached(&nonce, &out[start - HEAD..], &mut []),
            }
            .expect("ChaCha20-Poly1305 seals any record of at most MAX_RECORD bytes");
            out.put_slice(&tag);
        }
    }
}

/// Why a received record was refused.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("a sealed record claims {0} bytes, more than any record holds ({MAX_RECORD})")]
    Oversized(usize),
    #[error("a sealed record failed to verify: the connection was altered after its handshake, or is not the peer's")]
    Forged,
}

impl From<OpenError> for io::Error {
    fn from(err: OpenError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, err)
    }
}

/// Opens what the other side sent.
pub struct Opener {
    cipher: ChaCha20Poly1305,
    mode: Mode,
    seq: u64,
}

impl Opener {
    fn new(key: &[u8; 32], mode: Mode) -> Opener {
        Opener { cipher: ChaCha20Poly1305::new(key.into()), mode, seq: 0 }
    }

    /// How many bytes the record at the front of `raw` takes, once its head is in.
    pub fn record_len(raw: &[u8]) -> Result<Option<usize>, OpenError> {
        let Some(head) = raw.get(..HEAD) else { return Ok(None) };
        let len = u32::from_le_bytes(head.try_into().expect("HEAD bytes")) as usize;
        if len > MAX_RECORD {
            return Err(OpenError::Oversized(len));
        }
        Ok(Some(OVERHEAD + len))
    }

    /// Opens the whole record at the front of `raw`, if it is all there: it is taken off `raw`
    /// and its payload appended to `out`. `Ok(false)`: more bytes are needed.
    pub fn open(&mut self, raw: &mut BytesMut, out: &mut BytesMut) -> Result<bool, OpenError> {
        let Some(total) = Opener::record_len(raw)? else { return Ok(false) };
        if raw.len() < total {
            return Ok(false);
        }
        // opened where it lies (split off `raw` without a copy), and handed over whole to an
        // `out` that holds no buffer, as a reader's: a record's payload is copied once, to its
        // reader (an `out` made with room for many records gets each appended, as before)
        let mut record = raw.split_to(total);
        let tag = *Tag::from_slice(&record[total - TAG..]);
        let nonce = nonce(self.seq);
        let opened = match self.mode {
            Mode::Encrypted => {
                let (head, payload) = record[..total - TAG].split_at_mut(HEAD);
                self.cipher.decrypt_in_place_detached(&nonce, head, payload, &tag)
            }
            Mode::Authenticated => self.cipher.decrypt_in_place_detached(&nonce, &record[..total - TAG], &mut [], &tag),
        };
        if opened.is_err() {
            return Err(OpenError::Forged);
        }
        self.seq += 1;
        record.truncate(total - TAG);
        record.advance(HEAD);
        if out.capacity() == 0 {
            *out = record;
        } else {
            out.extend_from_slice(&record);
        }
        Ok(true)
    }
}

/// The receiving side of a sealed stream, over a reader of raw records.
pub struct SealedReader {
    opener: Opener,
    raw: BytesMut,
    plain: BytesMut,
}

impl SealedReader {
    pub fn new(opener: Opener) -> SealedReader {
        SealedReader { opener, raw: BytesMut::new(), plain: BytesMut::new() }
    }

    /// Reads payload bytes into `buf` from `inner`; cancel-safe (all it holds is kept here).
    pub fn poll_read<R: AsyncRead + ?Sized>(
        &mut self,
        mut inner: Pin<&mut R>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.plain.is_empty() {
                let n = self.plain.len().min(buf.remaining());
                buf.put_slice(&self.plain[..n]);
                self.plain.advance(n);
                if self.plain.is_empty() {
                    // let go of the record's buffer, which `raw` can then use again
                    self.plain = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            if self.opener.open(&mut self.raw, &mut self.plain)? {
                continue;
            }
            let want = Opener::record_len(&self.raw)?.unwrap_or(HEAD).max(self.raw.len() + 1);
            self.raw.reserve(want.max(OVERHEAD + 4096) - self.raw.len());
            let spare = self.raw.spare_capacity_mut();
            let mut into = ReadBuf::uninit(spare);
            ready!(inner.as_mut().poll_read(cx, &mut into))?;
            let read = into.filled().len();
            if read == 0 {
                return Poll::Ready(if self.raw.is_empty() {
                    Ok(()) // the end of the stream, between records
                } else {
                    Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed in the middle of a record"))
                });
            }
            // SAFETY: `poll_read` initialised the first `read` bytes of the spare capacity.
            unsafe { self.raw.advance_mut(read) };
        }
    }
}

/// The sending side of a sealed stream: each write becomes records, written out as the inner
/// writer takes them; a flush writes everything out (callers flush after each message).
pub struct SealedWriter {
    sealer: Sealer,
    out: BytesMut,
}

/// Sealed bytes a writer holds before it takes no more until they are out.
const HELD: usize = 4 * MAX_RECORD;

impl SealedWriter {
    pub fn new(sealer: Sealer) -> SealedWriter {
        SealedWriter { sealer, out: BytesMut::new() }
    }

    fn poll_drain<W: AsyncWrite + ?Sized>(
        &mut self,
        mut inner: Pin<&mut W>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while !self.out.is_empty() {
            let written = ready!(inner.as_mut().poll_write(cx, &self.out))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out.advance(written);
        }
        Poll::Ready(Ok(()))
    }

    pub fn poll_write<W: AsyncWrite + ?Sized>(
        &mut self,
        mut inner: Pin<&mut W>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.out.len() >= HELD {
            ready!(self.poll_drain(inner.as_mut(), cx))?;
        }
        let taken = buf.len().min(MAX_RECORD);
        self.sealer.seal(&buf[..taken], &mut self.out);
        // out as far as the writer takes it now; the rest goes with the next write or flush
        if let Poll::Ready(Err(err)) = self.poll_drain(inner, cx) {
            return Poll::Ready(Err(err));
        }
        Poll::Ready(Ok(taken))
    }

    pub fn poll_flush<W: AsyncWrite + ?Sized>(
        &mut self,
        mut inner: Pin<&mut W>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(inner.as_mut(), cx))?;
        inner.poll_flush(cx)
    }

    pub fn poll_shutdown<W: AsyncWrite + ?Sized>(
        &mut self,
        mut inner: Pin<&mut W>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(inner.as_mut(), cx))?;
        inner.poll_shutdown(cx)
    }
}

/// A stream whose both directions are sealed.
pub struct SealedStream<S> {
    inner: S,
    reader: SealedReader,
    writer: SealedWriter,
}

impl<S> SealedStream<S> {
    pub fn new(inner: S, session: Session) -> SealedStream<S> {
        let (sealer, opener) = session.split();
        SealedStream { inner, reader: SealedReader::new(opener), writer: SealedWriter::new(sealer) }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn mode(&self) -> Mode {
        self.writer.sealer.mode()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SealedStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.reader.poll_read(Pin::new(&mut this.inner), cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SealedStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.writer.poll_write(Pin::new(&mut this.inner), cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.writer.poll_flush(Pin::new(&mut this.inner), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.writer.poll_shutdown(Pin::new(&mut this.inner), cx)
    }
}

/// One half of a split stream, sealed: the reading half.
pub struct SealedRead<R> {
    inner: R,
    reader: SealedReader,
}

impl<R> SealedRead<R> {
    pub fn new(inner: R, opener: Opener) -> SealedRead<R> {
        SealedRead { inner, reader: SealedReader::new(opener) }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SealedRead<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.reader.poll_read(Pin::new(&mut this.inner), cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn pair(mode: Mode) -> (Session, Session) {
        let key = Key::from_bytes(b"the job key");
        let transcript = Transcript {
            label: b"elastix test",
            binding: &[1, 2],
            connector_nonce: &[3; 32],
            acceptor_nonce: &[4; 32],
            mode,
        };
        (Session::derive(&key, &transcript, true), Session::derive(&key, &transcript, false))
    }

    #[test]
    fn both_sides_agree_and_each_direction_has_its_key() {
        let (connector, acceptor) = pair(Mode::Authenticated);
        assert_eq!((connector.send, connector.recv), (acceptor.recv, acceptor.send));
        assert_ne!(connector.send, connector.recv);
        let (encrypted, _) = pair(Mode::Encrypted);
        assert_ne!(encrypted.send, connector.send, "the mode is part of the key");
        assert_eq!(Mode::agreed(Mode::Authenticated, Mode::Encrypted), Mode::Encrypted);
        assert_eq!(Mode::parse("Encrypted"), Ok(Mode::Encrypted));
        assert!(Mode::parse("tls").unwrap_err().contains("authenticated"));
    }

    #[test]
    fn records_open_in_order_only_and_refuse_any_change() {
        for mode in [Mode::Authenticated, Mode::Encrypted] {
            let (connector, acceptor) = pair(mode);
            let (mut sealer, _) = connector.split();
            let (_, mut opener) = acceptor.split();
            let mut wire = BytesMut::new();
            sealer.seal(b"first", &mut wire);
            sealer.seal(b"second", &mut wire);
            let shown = String::from_utf8_lossy(&wire).contains("first");
            assert_eq!(shown, mode == Mode::Authenticated, "{mode:?}: in the clear only when not encrypted");
            let mut out = BytesMut::new();
            let (first, second) = (wire.clone().split_to(OVERHEAD + 5), wire.clone().split_off(OVERHEAD + 5));
            // the second record first: its count does not match
            let (_, mut fresh) = pair(mode).1.split();
            assert!(matches!(fresh.open(&mut second.clone(), &mut out), Err(OpenError::Forged)));
            // one bit changed anywhere
            for at in [0, HEAD, OVERHEAD + 4] {
                let mut changed = first.clone();
                changed[at] ^= 1;
                let (_, mut fresh) = pair(mode).1.split();
                assert!(fresh.open(&mut changed, &mut BytesMut::new()).is_err(), "{mode:?}: bit at {at}");
            }
            assert!(opener.open(&mut wire, &mut out).unwrap() && opener.open(&mut wire, &mut out).unwrap());
            assert_eq!(&out[..], b"firstsecond");
            assert!(!opener.open(&mut wire, &mut out).unwrap(), "nothing more");
        }
    }

    #[test]
    fn a_record_is_its_length_its_payload_and_the_aeads_tag_over_them() {
        for mode in [Mode::Authenticated, Mode::Encrypted] {
            let (connector, _) = pair(mode);
            let cipher = ChaCha20Poly1305::new((&connector.send).into());
            let (mut sealer, _) = connector.split();
            let mut wire = BytesMut::new();
            sealer.seal(b"first", &mut wire);
            sealer.seal(b"second", &mut wire);
            for (seq, payload) in [(0u64, &b"first"[..]), (1, b"second")] {
                let head = (payload.len() as u32).to_le_bytes();
                let mut body = payload.to_vec();
                let tag = match mode {
                    Mode::Encrypted => cipher.encrypt_in_place_detached(&nonce(seq), &head, &mut body),
                    Mode::Authenticated => {
                        cipher.encrypt_in_place_detached(&nonce(seq), &[&head[..], payload].concat(), &mut [])
                    }
                }
                .unwrap();
                let record = wire.split_to(OVERHEAD + payload.len());
                assert_eq!(&record[..], &[&head[..], &body, &tag].concat()[..], "{mode:?}, record {seq}");
            }
        }
    }

    #[test]
    fn a_record_claiming_more_than_any_holds_is_refused_before_it_is_read() {
        let (_, mut opener) = pair(Mode::Authenticated).1.split();
        let mut raw = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
        assert!(matches!(opener.open(&mut raw, &mut BytesMut::new()), Err(OpenError::Oversized(_))));
    }

    #[tokio::test]
    async fn a_sealed_stream_carries_bytes_both_ways_and_large_writes_span_records() {
        for mode in [Mode::Authenticated, Mode::Encrypted] {
            let (connector, acceptor) = pair(mode);
            let (a, b) = duplex(1 << 16);
            let (mut a, mut b) = (SealedStream::new(a, connector), SealedStream::new(b, acceptor));
            let big: Vec<u8> = (0..3 * MAX_RECORD + 17).map(|i| i as u8).collect();
            let sent = big.clone();
            let writer = tokio::spawn(async move {
                a.write_all(&sent).await.unwrap();
                a.flush().await.unwrap();
                let mut back = [0u8; 2];
                a.read_exact(&mut back).await.unwrap();
                back
            });
            let mut got = vec![0u8; big.len()];
            b.read_exact(&mut got).await.unwrap();
            assert!(got == big);
            b.write_all(b"ok").await.unwrap();
            b.flush().await.unwrap();
            assert_eq!(&writer.await.unwrap(), b"ok");
        }
    }

    #[tokio::test]
    async fn bytes_from_a_relay_that_holds_no_session_key_end_the_stream() {
        let (_, acceptor) = pair(Mode::Authenticated);
        let (mut relay, b) = duplex(1024);
        let mut b = SealedStream::new(b, acceptor);
        // a relay's own request, in a record of the right shape under a key of its own
        let (forger, _) = pair(Mode::Authenticated);
        let (mut sealer, _) = Session { mode: Mode::Authenticated, send: [9; 32], recv: forger.recv }.split();
        let mut wire = BytesMut::new();
        sealer.seal(b"SET mine", &mut wire);
        relay.write_all(&wire).await.unwrap();
        let err = b.read(&mut [0u8; 16]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("failed to verify"), "{err}");
    }
}
