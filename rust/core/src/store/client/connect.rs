//! Opening a connection: resolve, connect, VALIDATE, PING; retried with backoff until the
//! deadline, because a client commonly starts before its server.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use tokio::net::{lookup_host, TcpStream};
use tokio::time::Instant;

use super::backoff::Backoff;
use crate::auth::pair::{self, HandshakeError, Proven, STORE};
use crate::auth::session::Mode;
use crate::auth::{Key, Secret, SECRET_REQUIRED, TOKEN_FILE_VAR};
use crate::store::error::{Result, StoreError};
use crate::store::protocol::VALIDATION_MAGIC;
use crate::store::request::Request;
use crate::store::transport::Transport;

/// Where and how long to try.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub host: String,
    pub port: u16,
    /// Give up after this long; `None` retries forever. At least one attempt is always made.
    pub timeout: Option<Duration>,
    pub backoff: Backoff,
    /// Give up after this many attempts even before the deadline (`None`: no limit). A probe
    /// that only asks whether a server is up uses it: a refusal is answer enough.
    pub max_attempts: Option<u32>,
    /// The job secret to prove to the server before any request. Default: none.
    pub secret: Option<Secret>,
    /// Say failures at DEBUG only: for a background task's connection, retried in a loop of
    /// its own, whose outage the task's owner reports once (a user sees one countdown per
    /// wait, not one per task). Default: false.
    pub quiet: bool,
    /// What to do about a store that stays away, added to the WARNs. Default: none.
    pub hint: Option<String>,
}

impl ConnectOptions {
    pub fn new(host: impl Into<String>, port: u16, timeout: Option<Duration>) -> Self {
        ConnectOptions {
            host: host.into(),
            port,
            timeout,
            backoff: Backoff::default(),
            max_attempts: None,
            secret: None,
            quiet: false,
            hint: None,
        }
    }
}

/// A client commonly starts moments before its server: failures within this long after the
/// first attempt are routine (DEBUG); the first one after it is worth a WARN.
const QUIET_START: Duration = Duration::from_secs(1);
/// While the server stays away, the WARN is repeated this often (with the attempts so far and
/// the time left): a store that never comes back must not look like a hang.
const SAY_AGAIN_EVERY: Duration = Duration::from_secs(10);

/// Connects and completes the handshake, retrying refused, reset, timed-out and unresolvable
/// attempts until the deadline. Never silent for long: the first failure past [`QUIET_START`]
/// is a WARN naming the address, the error and the deadline, repeated every
/// [`SAY_AGAIN_EVERY`] while it lasts, and a later success an INFO.
pub(super) async fn connect(options: &ConnectOptions) -> Result<(Transport, SocketAddr)> {
    let start = Instant::now();
    let deadline = options.timeout.map(|timeout| start + timeout);
    let mut backoff = options.backoff.clone();
    let mut tried: Vec<String> = Vec::new();
    let mut attempts = 0;
    let mut last_error = String::new();
    let mut warned: Option<Instant> = None;
    loop {
        attempts += 1;
        match attempt(options, deadline, &mut tried).await {
            Ok(connected) => {
                if warned.is_some() && !options.quiet {
                    tracing::info!(
                        "connected to the store at {}:{} after {attempts} attempts ({:.1?})",
                        options.host,
                        options.port,
                        start.elapsed()
                    );
                }
                return Ok(connected);
            }
            // the server answered: it and this client do not share the secret
            Err(AttemptFailure { refused: Some(reason), .. }) => {
                return Err(StoreError::Auth { peer: format!("{}:{}", options.host, options.port), reason });
            }
            // something answered, and it is no store: final as well
            Err(AttemptFailure { not_a_store: Some(detail), .. }) => {
                return Err(StoreError::NotAStore { peer: format!("{}:{}", options.host, options.port), detail });
            }
            // An attempt cut short by the deadline says less than the failure before it.
            Err(failure) if failure.deadline_hit && !last_error.is_empty() => {}
            Err(failure) => last_error = failure.message,
        }
        let now = Instant::now();
        let remaining = deadline.map(|deadline| deadline.saturating_duration_since(now));
        if remaining == Some(Duration::ZERO) || options.max_attempts.is_some_and(|max| attempts >= max) {
            return Err(StoreError::ConnectTimeout {
                host: options.host.clone(),
                port: options.port,
                elapsed: now - start,
                attempts,
                tried: if tried.is_empty() { "none".into() } else { tried.join(", ") },
                last_error,
            });
        }
        let say = !options.quiet
            && match warned {
                None => now.duration_since(start) >= QUIET_START,
                Some(said) => now.duration_since(said) >= SAY_AGAIN_EVERY,
            };
        if say {
            let until = remaining.map_or_else(|| "no deadline".to_owned(), |r| format!("giving up in {:.0?}", r));
            let (host, port) = (&options.host, options.port);
            let hint = options.hint.as_deref().map_or_else(String::new, |hint| format!("; {hint}"));
            match warned {
                None => {
                    tracing::warn!(
                        "cannot connect to the store at {host}:{port} ({last_error}); retrying, {until}{hint}"
                    )
                }
                Some(_) => tracing::warn!(
                    "still no store at {host}:{port} after {attempts} attempts over {:.0?} ({last_error}); retrying, \
                     {until}{hint}",
                    now.duration_since(start)
                ),
            }
            warned = Some(now);
        } else {
            tracing::debug!(host = %options.host, port = options.port, attempts, "store connect failed, retrying: {last_error}");
        }
        let delay = backoff.next_delay();
        tokio::time::sleep(remaining.map_or(delay, |remaining| delay.min(remaining))).await;
    }
}

/// Why one attempt failed.
struct AttemptFailure {
    message: String,
    /// The attempt was cut short by the connect deadline.
    deadline_hit: bool,
    /// The server and this client do not share the job secret: why.
    refused: Option<String>,
    /// What answered is not a TCPStore server: what it said.
    not_a_store: Option<String>,
}

/// One pass over every address the host resolves to. The error describes each failure.
async fn attempt(
    options: &ConnectOptions,
    deadline: Option<Instant>,
    tried: &mut Vec<String>,
) -> Result<(Transport, SocketAddr), AttemptFailure> {
    let addrs =
        within(deadline, lookup_host((options.host.as_str(), options.port))).await.map_err(|err| AttemptFailure {
            message: format!("cannot resolve {:?}: {err}", options.host),
            deadline_hit: err.kind() == io::ErrorKind::TimedOut,
            refused: None,
            not_a_store: None,
        })?;
    let mut failures = Vec::new();
    let mut deadline_hit = false;
    for addr in addrs {
        let shown = addr.to_string();
        if !tried.contains(&shown) {
            tried.push(shown);
        }
        let connected = async {
            let mut stream = within(deadline, TcpStream::connect(addr)).await.map_err(Failed::Io)?;
            stream.set_nodelay(true).map_err(Failed::Io)?;
            crate::store::server::listener::set_keepalive(&stream).map_err(Failed::Io)?;
            let proven = match &options.secret {
                Some(secret) => Some(authenticate(&mut stream, secret, deadline).await?),
                None => None,
            };
            validate(stream, proven, deadline).await
        };
        match connected.await {
            Ok(stream) => return Ok((stream, addr)),
            Err(Failed::Refused(reason)) => {
                let message = reason.clone();
                return Err(AttemptFailure { message, deadline_hit: false, refused: Some(reason), not_a_store: None });
            }
            Err(Failed::NotAStore(detail)) => {
                let message = detail.clone();
                return Err(AttemptFailure { message, deadline_hit: false, refused: None, not_a_store: Some(detail) });
            }
            Err(Failed::Io(err)) => {
                deadline_hit |= err.kind() == io::ErrorKind::TimedOut;
                failures.push(format!("{addr}: {err}"));
            }
        }
    }
    let message = if failures.is_empty() { "no addresses".into() } else { failures.join("; ") };
    Err(AttemptFailure { message, deadline_hit, refused: None, not_a_store: None })
}

/// Why a connection to one address failed.
enum Failed {
    Io(io::Error),
    /// Over the job secret: final.
    Refused(String),
    /// It answered, and is not a TCPStore server: final.
    NotAStore(String),
}

/// Proves the job secret to the server; its verdict (and its own proof) is read with the first
/// reply.
async fn authenticate(stream: &mut TcpStream, secret: &Secret, deadline: Option<Instant>) -> Result<Proven, Failed> {
    let exchange =
        async { Ok::<_, io::Error>(pair::prove(stream, &Key::job(secret), &STORE, &[], Mode::wanted()).await) };
    refusal(within(deadline, exchange).await.map_err(Failed::Io)?)
}

/// What a failed authentication means for the connection: only a verified disagreement over
/// the secret is final; a close (a server busy or shedding connections), a timeout or garbage
/// is tried again.
fn refusal<T>(outcome: Result<T, HandshakeError>) -> Result<T, Failed> {
    match outcome {
        Ok(value) => Ok(value),
        Err(HandshakeError::NoSecret) => Err(Failed::Refused(
            "it runs without a job secret, and this process has one (give the store the same secret file)".into(),
        )),
        Err(HandshakeError::Refused | HandshakeError::Impostor) => Err(Failed::Refused(
            "it does not hold this job's secret (is the same secret file given to every node?)".into(),
        )),
        Err(HandshakeError::Closed) => Err(Failed::Io(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "it closed the connection during authentication (a busy server sheds connections waiting to \
             authenticate; a server that is not elastix's closes them too)",
        ))),
        Err(HandshakeError::Io(err)) => Err(Failed::Io(err)),
        Err(other) => Err(Failed::Io(io::Error::new(io::ErrorKind::InvalidData, other.to_string()))),
    }
}

/// VALIDATE, then PING with our pid as nonce, which the server must echo. Written as two
/// separate sends, as torch's client does (torch's libuv server has trouble with both in one
/// segment); the reply is bounded by the connect deadline. `proven`: the server's verdict on
/// this client's proof comes first (a refused client's requests would meet a closed
/// connection, whose reset may swallow the verdict), and the connection goes on in the
/// session its handshake made.
async fn validate(
    mut stream: TcpStream,
    proven: Option<Proven>,
    deadline: Option<Instant>,
) -> Result<Transport, Failed> {
    let mut stream = match proven {
        Some(proven) => {
            let session = proven.session();
            let verdict = async { Ok::<_, io::Error>(proven.verdict(&mut stream).await) };
            refusal(within(deadline, verdict).await.map_err(Failed::Io)?)?;
            Transport::sealed(stream, session)
        }
        None => Transport::Plain(stream),
    };
    let nonce = std::process::id();
    for request in [Request::Validate { magic: VALIDATION_MAGIC }, Request::Ping { nonce }] {
        let mut bytes = BytesMut::with_capacity(5);
        request.encode(&mut bytes);
        within(deadline, stream.write_all(&bytes)).await.map_err(Failed::Io)?;
    }
    let mut echo = BytesMut::with_capacity(4);
    let read = async {
        while echo.len() < 4 {
            if stream.read_buf(&mut echo).await? == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
        }
        Ok(())
    };
    within(deadline, read)
        .await
        .map_err(|err| Failed::Io(io::Error::new(err.kind(), format!("no PING reply: {err}"))))?;
    let echo: [u8; 4] = echo[..4].try_into().expect("4 bytes read");
    let echoed = u32::from_le_bytes(echo);
    if echoed == SECRET_REQUIRED {
        return Err(Failed::Refused(format!(
            "it requires the job's secret, which this process does not have (set {TOKEN_FILE_VAR}, or \
             --rdzv-conf auth_token_file, to a file holding it)"
        )));
    }
    if echoed != nonce {
        return Err(Failed::NotAStore(answered_like(&echo, nonce)));
    }
    Ok(stream)
}

/// What the four bytes a non-store answered to PING look like, for the error.
fn answered_like(echo: &[u8; 4], nonce: u32) -> String {
    let text = String::from_utf8_lossy(echo);
    if echo.iter().all(|byte| byte.is_ascii_graphic()) {
        let like = if text == "HTTP" { "HTTP (a web server)".to_owned() } else { format!("{text:?}") };
        format!("it answered the opening PING like {like}")
    } else {
        format!("it answered {:#010x} to the opening PING, which must echo {nonce}", u32::from_le_bytes(*echo))
    }
}

async fn within<T>(deadline: Option<Instant>, operation: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    match deadline {
        None => operation.await,
        Some(deadline) => tokio::time::timeout_at(deadline, operation)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))),
    }
}
