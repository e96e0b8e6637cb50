//! The agent's line to its elastic workers (`elastix.elastic`): a Unix socket the workers of
//! this agent connect to. A worker that says hello on it is one the agent may keep running
//! through a re-form: the agent tells it at once to stop its collectives (`abort`), and, once
//! the next round formed, gives it its new place (`assign`: the environment a new worker would
//! start with). For a node that joins, nothing is lost, so the workers are rather told to stop
//! at a step boundary the members agreed on (`drain`: after their checkpoint save of that step),
//! and say when they did (`drained`). The worker tells when it trains again (`reformed`), and
//! when a collective failed before the agent said anything (`broken`: a peer's death reaches
//! the workers first).
//!
//! Which worker is on a line is what the kernel says (the peer's pid, `SO_PEERCRED`), never what
//! it claims: the group keeps a worker only if the pid on the line is that worker's.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::agent::shm;

/// The variable that tells a worker where its agent's line is.
pub const SOCKET_VAR: &str = "ELASTIX_CONTROL_SOCKET";
/// Sockets are named `<SOCKET_PREFIX><agent pid>-<n>.sock` (a socket path must stay under the
/// kernel's 108 bytes).
const SOCKET_PREFIX: &str = "elastix-control-";
/// Longest line a worker may send (its messages are a few dozen bytes).
const MAX_LINE: usize = 64 * 1024;

/// What the agent tells a worker.
#[derive(Serialize, Debug)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToWorker<'a> {
    /// The answer to its hello: how long a worker whose collective failed waits for the agent
    /// to say whether the job re-forms (the time the agent takes to count a member lost).
    Welcome { notice_within_ms: u64 },
    /// The job re-forms (`why`): stop every collective now; the next place comes within
    /// `deadline_ms`, or the worker exits.
    Abort { round: u64, why: &'a str, deadline_ms: u64 },
    /// The new round's place: every variable a worker started now would get.
    Assign { round: u64, env: &'a BTreeMap<String, String> },
    /// The job re-forms (`why`) once every worker saved step `step`: stop after that save (at
    /// once if it is done already), and say so; the next place comes within `deadline_ms`.
    Drain { round: u64, step: u64, why: &'a str, deadline_ms: u64 },
}

/// What a worker tells the agent.
#[derive(Deserialize, Debug, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum FromWorker {
    Hello {
        local_rank: u32,
    },
    Reformed {
        round: u64,
        took_ms: u64,
        /// When it had left its group: its code saw the abort (at its next collective), its
        /// group was destroyed and its checkpoint closed.
        #[serde(default)]
        left_ms: Option<u64>,
        /// When its place came (the rest: joining the round's group, opening its checkpoint).
        #[serde(default)]
        placed_ms: Option<u64>,
    },
    /// A collective failed before the agent said why (a peer's death reaches the workers
    /// first): the agent asks whether a member is lost.
    Broken {
        why: String,
    },
    /// It stopped for the drain of `round` and left its group; its last save (of `step`, if
    /// any) is whole.
    Drained {
        round: u64,
        #[serde(default)]
        step: Option<u64>,
    },
}

/// One worker's line: its local rank, as it said, and what goes to it.
struct Line {
    local_rank: u32,
    out: mpsc::UnboundedSender<Vec<u8>>,
}

type Lines = Arc<Mutex<HashMap<u32, Line>>>;
/// Where the lines report what a worker says outside the hello: its failed collectives, its
/// drains.
#[derive(Clone)]
struct Reports {
    broken: mpsc::UnboundedSender<(u32, String)>,
    drained: mpsc::UnboundedSender<Drained>,
}

/// What the workers report while they drain.
#[derive(Debug, PartialEq, Eq)]
pub enum DrainReport {
    Drained(Drained),
    /// A worker's collective failed (its pid, why).
    Broken((u32, String)),
}

/// A worker that stopped for a drain: its pid, the round, the step of its last save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drained {
    pub pid: u32,
    pub round: u64,
    pub step: Option<u64>,
}

/// The socket and the workers on it, by pid.
pub struct Control {
    path: PathBuf,
    lines: Lines,
    accept: JoinHandle<()>,
    /// Workers whose collective failed: their pids and why.
    broken: mpsc::UnboundedReceiver<(u32, String)>,
    /// Workers that stopped for a drain.
    drained: mpsc::UnboundedReceiver<Drained>,
}

impl Control {
    /// Listens at `<shared memory>/elastix-control-<agent pid>-<n>.sock`, for this user only
    /// (the first one of a process removes the sockets of agents that were SIGKILLed).
    /// `notice_within`: see [`ToWorker::Welcome`].
    pub fn start(notice_within: Duration) -> io::Result<Control> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            shm::remove_orphans(&shm::dir(), SOCKET_PREFIX);
        }
        let path = shm::dir().join(format!("{SOCKET_PREFIX}{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path); // a socket left by an agent of the same pid
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let lines: Lines = Arc::default();
        let welcome = encode(&ToWorker::Welcome { notice_within_ms: millis(notice_within) });
        let (broken_tx, broken) = mpsc::unbounded_channel();
        let (drained_tx, drained) = mpsc::unbounded_channel();
        let reports = Reports { broken: broken_tx, drained: drained_tx };
        let accept = tokio::spawn(serve(listener, lines.clone(), welcome, reports));
        Ok(Control { path, lines, accept, broken, drained })
    }

    /// The variable that points the workers at the socket.
    pub fn worker_env(&self) -> (String, String) {
        (SOCKET_VAR.to_owned(), self.path.to_string_lossy().into_owned())
    }

    /// The local rank process `pid` said hello as, if it is on a line.
    pub fn local_rank_of(&self, pid: u32) -> Option<u32> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner).get(&pid).map(|line| line.local_rank)
    }

    /// The next worker whose collective failed (its pid, and why), and any others that said
    /// so meanwhile.
    pub async fn broken(&mut self) -> Vec<(u32, String)> {
        let Some(first) = self.broken.recv().await else { return std::future::pending().await };
        let mut all = vec![first];
        while let Ok(more) = self.broken.try_recv() {
            all.push(more);
        }
        all
    }

    /// Forgets the failed collectives and drains reported so far (they were of a round that
    /// is over).
    pub fn forget_broken(&mut self) {
        while self.broken.try_recv().is_ok() {}
        while self.drained.try_recv().is_ok() {}
    }

    /// What the workers report next while they drain: one stopped, or collectives failed.
    pub async fn drain_report(&mut self) -> DrainReport {
        tokio::select! {
            Some(drained) = self.drained.recv() => DrainReport::Drained(drained),
            Some(broken) = self.broken.recv() => DrainReport::Broken(broken),
            else => std::future::pending().await,
        }
    }

    /// Sends `message` to process `pid`; false if it is not on a line (any more).
    pub fn send(&self, pid: u32, message: &ToWorker<'_>) -> bool {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines.get(&pid).is_some_and(|line| line.out.send(encode(message)).is_ok())
    }

    #[cfg(test)]
    fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.accept.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Accepts workers' connections until the agent drops the [`Control`].
async fn serve(listener: UnixListener, lines: Lines, welcome: Vec<u8>, reports: Reports) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                tracing::debug!("control socket: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(pid) = stream.peer_cred().ok().and_then(|cred| cred.pid()).and_then(|pid| u32::try_from(pid).ok())
        else {
            continue;
        };
        tokio::spawn(talk(stream, pid, lines.clone(), welcome.clone(), reports.clone()));
    }
}

/// One worker's line, from its hello until it closes.
async fn talk(stream: UnixStream, pid: u32, lines: Lines, welcome: Vec<u8>, reports: Reports) {
    let (mut reader, mut writer) = stream.into_split();
    let (out, mut queue) = mpsc::unbounded_channel::<Vec<u8>>();
    let writes = tokio::spawn(async move {
        while let Some(bytes) = queue.recv().await {
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut buffer = Vec::new();
    let mut registered = false;
    while let Some(line) = next_line(&mut reader, &mut buffer).await {
        match serde_json::from_slice::<FromWorker>(&line) {
            Ok(FromWorker::Hello { local_rank }) if !registered => {
                tracing::debug!("control socket: local rank {local_rank} (pid {pid}) runs elastix.elastic");
                let _ = out.send(welcome.clone());
                lines.lock().unwrap_or_else(PoisonError::into_inner).insert(pid, Line { local_rank, out: out.clone() });
                registered = true;
            }
            Ok(FromWorker::Broken { why }) if registered => {
                let _ = reports.broken.send((pid, why));
            }
            Ok(FromWorker::Drained { round, step }) if registered => {
                let _ = reports.drained.send(Drained { pid, round, step });
            }
            Ok(FromWorker::Reformed { round, took_ms, left_ms, placed_ms }) => {
                let phases = phases(took_ms, left_ms, placed_ms);
                tracing::info!(
                    "worker pid {pid} trains again in round {round}, {took_ms} ms after it was told{phases}"
                );
            }
            Ok(other) => tracing::debug!("control socket: pid {pid} sent {other:?} out of turn"),
            Err(err) => {
                tracing::warn!("control socket: pid {pid} sent a line that is not a message ({err}); closing it");
                break;
            }
        }
    }
    if registered {
        lines.lock().unwrap_or_else(PoisonError::into_inner).remove(&pid);
    }
    writes.abort();
}

/// The next newline-terminated line (without it), or `None` at the end, on an error or on a
/// line longer than [`MAX_LINE`].
async fn next_line(reader: &mut OwnedReadHalf, buffer: &mut Vec<u8>) -> Option<Vec<u8>> {
    loop {
        if let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line = buffer[..end].to_vec();
            buffer.drain(..=end);
            return Some(line);
        }
        if buffer.len() > MAX_LINE {
            return None;
        }
        let mut chunk = [0u8; 4096];
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

fn encode(message: &ToWorker<'_>) -> Vec<u8> {
    let mut bytes = serde_json::to_vec(message).expect("control messages serialize");
    bytes.push(b'\n');
    bytes
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Where a worker's re-form went, as it said (a worker of an older elastix says nothing).
fn phases(took_ms: u64, left_ms: Option<u64>, placed_ms: Option<u64>) -> String {
    let (Some(left), Some(placed)) = (left_ms, placed_ms) else { return String::new() };
    format!(
        " (seeing it and leaving its group took {left} ms, its place came {} ms later, joining took {} ms)",
        placed.saturating_sub(left),
        took_ms.saturating_sub(placed)
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncBufReadExt, BufReader};

    use super::*;

    #[test]
    fn a_re_form_is_told_in_its_phases_and_an_older_worker_s_report_is_read_too() {
        let new = br#"{"kind":"reformed","round":3,"took_ms":600,"left_ms":390,"placed_ms":400}"#;
        let Ok(FromWorker::Reformed { round: 3, took_ms, left_ms, placed_ms }) = serde_json::from_slice(new) else {
            panic!("not a re-form report")
        };
        assert_eq!(
            phases(took_ms, left_ms, placed_ms),
            " (seeing it and leaving its group took 390 ms, its place came 10 ms later, joining took 200 ms)"
        );
        let old = br#"{"kind":"reformed","round":3,"took_ms":600}"#;
        let Ok(FromWorker::Reformed { took_ms, left_ms, placed_ms, .. }) = serde_json::from_slice(old) else {
            panic!("not a re-form report")
        };
        assert_eq!(phases(took_ms, left_ms, placed_ms), "");
    }

    async fn hello(control: &Control, local_rank: u32) -> (BufReader<OwnedReadHalf>, tokio::net::unix::OwnedWriteHalf) {
        let stream = UnixStream::connect(control.path()).await.unwrap();
        let (reader, mut writer) = stream.into_split();
        writer.write_all(format!("{{\"kind\":\"hello\",\"local_rank\":{local_rank}}}\n").as_bytes()).await.unwrap();
        let mut reader = BufReader::new(reader);
        let mut welcome = String::new();
        reader.read_line(&mut welcome).await.unwrap();
        assert_eq!(welcome, "{\"kind\":\"welcome\",\"notice_within_ms\":1500}\n");
        (reader, writer)
    }

    #[tokio::test]
    async fn a_worker_that_said_hello_is_known_by_its_pid_and_hears_what_is_sent() {
        let mut control = Control::start(Duration::from_millis(1500)).unwrap();
        let mode = std::fs::metadata(control.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let me = std::process::id();
        assert_eq!(control.local_rank_of(me), None);
        let (mut reader, writer) = hello(&control, 3).await;
        assert_eq!(control.local_rank_of(me), Some(3));
        let env = BTreeMap::from([("RANK".to_owned(), "5".to_owned())]);
        assert!(control.send(me, &ToWorker::Abort { round: 4, why: "member 1 lost", deadline_ms: 10 }));
        assert!(control.send(me, &ToWorker::Assign { round: 4, env: &env }));
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        assert_eq!(line, "{\"kind\":\"abort\",\"round\":4,\"why\":\"member 1 lost\",\"deadline_ms\":10}\n");
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        assert_eq!(line, "{\"kind\":\"assign\",\"round\":4,\"env\":{\"RANK\":\"5\"}}\n");
        // a failed collective is reported, with why
        let mut writer = writer;
        writer.write_all(b"{\"kind\":\"broken\",\"why\":\"rank 4 died\"}\n").await.unwrap();
        assert_eq!(control.broken().await, vec![(me, "rank 4 died".to_owned())]);
        // a drain is told with its step, and the worker's stop reported
        assert!(control.send(me, &ToWorker::Drain { round: 4, step: 17, why: "a node joins", deadline_ms: 10 }));
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        assert_eq!(line, "{\"kind\":\"drain\",\"round\":4,\"step\":17,\"why\":\"a node joins\",\"deadline_ms\":10}\n");
        writer.write_all(b"{\"kind\":\"drained\",\"round\":4,\"step\":17}\n").await.unwrap();
        assert_eq!(control.drain_report().await, DrainReport::Drained(Drained { pid: me, round: 4, step: Some(17) }));
        // one reported before the round was over is forgotten with its broken collectives
        writer.write_all(b"{\"kind\":\"drained\",\"round\":4}\n{\"kind\":\"broken\",\"why\":\"x\"}\n").await.unwrap();
        assert_eq!(control.broken().await, vec![(me, "x".to_owned())]);
        control.forget_broken();
        assert!(control.drained.try_recv().is_err());
        // a closed line is forgotten
        drop((reader, writer));
        for _ in 0..100 {
            if control.local_rank_of(me).is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(control.local_rank_of(me), None);
        assert!(!control.send(me, &ToWorker::Abort { round: 5, why: "x", deadline_ms: 1 }));
    }

    #[tokio::test]
    async fn garbage_or_a_line_without_end_closes_the_line_and_registers_nothing() {
        let control = Control::start(Duration::from_secs(1)).unwrap();
        let mut garbage = UnixStream::connect(control.path()).await.unwrap();
        garbage.write_all(b"not json\n").await.unwrap();
        let mut rest = Vec::new();
        garbage.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        let mut endless = UnixStream::connect(control.path()).await.unwrap();
        let _ = endless.write_all(&vec![b'x'; MAX_LINE + 8192]).await;
        let mut rest = Vec::new();
        let _ = endless.read_to_end(&mut rest).await;
        assert_eq!(control.local_rank_of(std::process::id()), None);
    }

    #[tokio::test]
    async fn the_socket_goes_with_the_control() {
        let control = Control::start(Duration::from_secs(1)).unwrap();
        let path = control.path().to_owned();
        assert!(path.exists());
        drop(control);
        assert!(!path.exists());
    }
}
