//! The process's console: the agent's worker lines and every program's log messages reach
//! stdout and stderr through one writer thread per stream, fed by a queue bounded in bytes, so a reader that stops reading
//! (a stalled pipe, a suspended terminal) never blocks the agent's runtime: heartbeats,
//! restarts and signal handling go on.
//!
//! A reader that is merely slow (a terminal that scrolls, a pipe whose reader paused) holds
//! the workers back, as a direct write would: a worker's pump waits (asynchronously) up to
//! [`STALL_WAIT`] for room. Past that the stream counts as stalled and lines are dropped at
//! once, and counted, until the writer gets a line through again; a notice on stderr then
//! says how many were dropped (or at the end of the run).
//!
//! A write error (a closed pipe) is reported once on stderr (or nowhere, when stderr itself
//! failed) and kept for the run's outcome; later lines to that stream are discarded.
//!
//! Both streams are process-wide, as stdout and stderr are: every agent in a process shares
//! them. [`stderr_writer`] gives an `io::Write` for agent messages (e.g. a tracing
//! subscriber's writer) that never blocks either.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};

/// Bytes a stream holds while its reader is slow.
pub const CONSOLE_QUEUE_BYTES: usize = 8 << 20;
/// What a queued line costs beyond its bytes, so that short lines are bounded in number too.
const LINE_OVERHEAD: usize = 64;
/// How long a worker's pump waits for room before the stream counts as stalled.
pub const STALL_WAIT: Duration = Duration::from_secs(1);
/// Bytes the writer thread gathers into one write.
const WRITE_BATCH: usize = 64 << 10;

/// How much a stream queues, and how long a pump waits for room.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub bytes: usize,
    pub stall_wait: Duration,
}

const CONSOLE_CAPACITY: Capacity = Capacity { bytes: CONSOLE_QUEUE_BYTES, stall_wait: STALL_WAIT };

enum Message {
    /// A piece (usually a complete line) and what it cost of the budget.
    Line(Piece, u32),
    /// Answered once every line sent before it was written (or discarded after an error).
    Flush(oneshot::Sender<()>),
}

/// Bytes for the console: a line, or a piece of one writer's output (an agent relays its
/// workers' output in pieces) that ends in `\r` or is unfinished, prefix included.
struct Piece {
    writer: u32,
    bytes: Vec<u8>,
}

/// Who writes agent messages (always whole lines).
const AGENT: u32 = 0;

/// A new writer id for [`ConsoleStream::send_piece`] (one per worker stream).
pub fn writer_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(AGENT + 1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Appends `piece` to `out`. A line left open (a piece without a newline) by another writer
/// is ended first, so different writers never share a line; the writer of the line left open
/// is returned.
fn place(open: Option<u32>, piece: &Piece, out: &mut Vec<u8>) -> Option<u32> {
    if open.is_some_and(|writer| writer != piece.writer) {
        out.push(b'\n');
    }
    out.extend_from_slice(&piece.bytes);
    match piece.bytes.last() {
        Some(b'\n') => None,
        Some(_) => Some(piece.writer),
        None => open,
    }
}

/// One console stream (stdout or stderr) and the thread that writes it.
pub struct ConsoleStream {
    name: &'static str,
    sender: mpsc::UnboundedSender<Message>,
    /// Bytes (plus overhead) that may still be queued.
    room: Arc<Semaphore>,
    capacity: Capacity,
    /// Set when a pump gave up waiting for room; cleared when the writer writes again.
    stalled: Arc<AtomicBool>,
    /// Lines dropped since the process started.
    dropped: AtomicU64,
    /// Dropped lines not yet mentioned in a notice.
    unreported: AtomicU64,
    /// The first write error, set by the writer thread.
    error: Arc<OnceLock<String>>,
}

/// Counts of a stream at one moment, to tell what happened during one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamMark {
    pub dropped: u64,
    pub failed: bool,
}

impl ConsoleStream {
    /// A stream written by a thread of its own to what `open` returns (called on the thread).
    /// `on_error` is told of the first write error, on the writer thread.
    pub fn start<W, F>(name: &'static str, capacity: Capacity, open: F, on_error: fn(&str)) -> io::Result<ConsoleStream>
    where
        W: Write,
        F: FnOnce() -> W + Send + 'static,
    {
        let (sender, receiver) = mpsc::unbounded_channel();
        let room = Arc::new(Semaphore::new(capacity.bytes.min(Semaphore::MAX_PERMITS)));
        let stalled = Arc::new(AtomicBool::new(false));
        let error = Arc::new(OnceLock::new());
        let writer = Writer { name, room: room.clone(), stalled: stalled.clone(), error: error.clone(), on_error };
        std::thread::Builder::new().name(format!("elastix-{name}")).spawn(move || writer.run(receiver, open()))?;
        Ok(ConsoleStream {
            name,
            sender,
            room,
            capacity,
            stalled,
            dropped: AtomicU64::new(0),
            unreported: AtomicU64::new(0),
            error,
        })
    }

    /// Queues one complete line (written whole, so lines from different workers never
    /// interleave mid-line). Never blocks: without room, the line is dropped and counted
    /// (false). For agent messages and callers outside the runtime.
    pub fn line(&self, line: Vec<u8>) -> bool {
        let cost = self.cost(&line);
        match self.room.try_acquire_many(cost) {
            Ok(permit) => {
                permit.forget();
                self.queue(Piece { writer: AGENT, bytes: line }, cost)
            }
            Err(_) => self.drop_line(),
        }
    }

    /// Queues one complete line from a worker's pump (see [`Self::send_piece`]).
    pub async fn send(&self, line: Vec<u8>) -> bool {
        self.send_piece(AGENT, line).await
    }

    /// Queues a piece of one writer's output (prefix included): waits (without blocking the
    /// runtime) up to the stall wait for room, unless the stream already counts as stalled;
    /// then drops it.
    pub async fn send_piece(&self, writer: u32, piece: Vec<u8>) -> bool {
        let cost = self.cost(&piece);
        let line = Piece { writer, bytes: piece };
        let permit = match self.room.try_acquire_many(cost) {
            Ok(permit) => Some(permit),
            Err(_) if self.stalled.load(Ordering::Relaxed) => None,
            Err(_) => match tokio::time::timeout(self.capacity.stall_wait, self.room.acquire_many(cost)).await {
                Ok(Ok(permit)) => Some(permit),
                _ => {
                    self.stalled.store(true, Ordering::Relaxed);
                    None
                }
            },
        };
        match permit {
            Some(permit) => {
                permit.forget();
                self.queue(line, cost)
            }
            None => self.drop_line(),
        }
    }

    fn cost(&self, line: &[u8]) -> u32 {
        let budget = self.capacity.bytes.min(u32::MAX as usize);
        (line.len() + LINE_OVERHEAD).min(budget) as u32
    }

    fn queue(&self, line: Piece, cost: u32) -> bool {
        if self.sender.send(Message::Line(line, cost)).is_err() {
            return self.drop_line(); // no writer thread
        }
        let missed = self.unreported.swap(0, Ordering::Relaxed);
        if missed > 0 {
            report_drops(self.name, missed);
        }
        true
    }

    fn drop_line(&self) -> bool {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.unreported.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Waits up to `within` for every line queued so far to be written; false if it was not
    /// (the reader is stalled).
    pub async fn flush(&self, within: Duration) -> bool {
        let (done, written) = oneshot::channel();
        if self.sender.send(Message::Flush(done)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, written).await, Ok(Ok(())))
    }

    /// Whether a pump gave up waiting for room and the writer has not written since.
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Mentions dropped lines no notice has mentioned yet (at the end of a run).
    pub fn report_drops(&self) {
        let missed = self.unreported.swap(0, Ordering::Relaxed);
        if missed > 0 {
            report_drops(self.name, missed);
        }
    }

    pub fn mark(&self) -> StreamMark {
        StreamMark { dropped: self.dropped.load(Ordering::Relaxed), failed: self.error.get().is_some() }
    }

    /// The first write error, as `"stdout: <error>"`.
    pub fn error(&self) -> Option<String> {
        self.error.get().map(|err| format!("{}: {err}", self.name))
    }
}

/// The writer thread's side of a stream.
struct Writer {
    name: &'static str,
    room: Arc<Semaphore>,
    stalled: Arc<AtomicBool>,
    error: Arc<OnceLock<String>>,
    on_error: fn(&str),
}

impl Writer {
    /// Writes the queued lines, several at once when they pile up, until every sender is gone.
    fn run<W: Write>(self, mut receiver: mpsc::UnboundedReceiver<Message>, mut out: W) {
        let mut batch = Vec::with_capacity(WRITE_BATCH);
        let mut flushes = Vec::new();
        let mut open = None;
        while let Some(first) = receiver.blocking_recv() {
            let mut cost = 0usize;
            let mut next = Some(first);
            while let Some(message) = next.take() {
                match message {
                    Message::Line(piece, line_cost) => {
                        open = place(open, &piece, &mut batch);
                        cost += line_cost as usize;
                    }
                    Message::Flush(done) => flushes.push(done),
                }
                if batch.len() < WRITE_BATCH {
                    next = receiver.try_recv().ok();
                }
            }
            self.write(&mut out, &batch);
            batch.clear();
            self.room.add_permits(cost);
            for done in flushes.drain(..) {
                let _ = done.send(());
            }
        }
    }

    fn write<W: Write>(&self, out: &mut W, bytes: &[u8]) {
        if bytes.is_empty() || self.error.get().is_some() {
            return;
        }
        match out.write_all(bytes).and_then(|()| out.flush()) {
            // the reader reads again: pumps may wait for room again before dropping
            Ok(()) => self.stalled.store(false, Ordering::Relaxed),
            Err(err) => {
                let _ = self.error.set(err.to_string());
                let name = self.name;
                (self.on_error)(&format!(
                    "[elastix] cannot write to {name} ({err}); further output to it is discarded\n"
                ));
            }
        }
    }
}

fn report_drops(name: &str, count: u64) {
    let text = format!(
        "[elastix] {count} line{} of worker output {} dropped because {name} was not being read\n",
        if count == 1 { "" } else { "s" },
        if count == 1 { "was" } else { "were" },
    );
    // the notice for stderr's own drops goes to stderr too: it says where the gap is
    stderr().line(text.into_bytes());
}

/// A stdout error is worth a line on stderr; a stderr error has nowhere to go.
fn to_stderr(text: &str) {
    stderr().line(text.as_bytes().to_vec());
}

fn ignore(_: &str) {}

/// Whether the agent runs on a terminal someone can type into: stdin and stdout are one.
pub fn on_terminal() -> bool {
    use std::io::IsTerminal;
    io::stdin().is_terminal() && io::stdout().is_terminal()
}

/// The process's stdout stream.
pub fn stdout() -> &'static ConsoleStream {
    static STDOUT: OnceLock<ConsoleStream> = OnceLock::new();
    STDOUT.get_or_init(|| {
        ConsoleStream::start("stdout", CONSOLE_CAPACITY, io::stdout, to_stderr)
            .unwrap_or_else(|err| unwritable("stdout", &err))
    })
}

/// The process's stderr stream.
pub fn stderr() -> &'static ConsoleStream {
    static STDERR: OnceLock<ConsoleStream> = OnceLock::new();
    STDERR.get_or_init(|| {
        ConsoleStream::start("stderr", CONSOLE_CAPACITY, io::stderr, ignore)
            .unwrap_or_else(|err| unwritable("stderr", &err))
    })
}

/// Without a writer thread (the system refused one), a stream that counts every line as
/// dropped: the agent still never blocks, and the outcome says what happened.
fn unwritable(name: &'static str, err: &io::Error) -> ConsoleStream {
    let (sender, _) = mpsc::unbounded_channel();
    let error = Arc::new(OnceLock::new());
    let _ = error.set(format!("cannot start the writer thread: {err}"));
    ConsoleStream {
        name,
        sender,
        room: Arc::new(Semaphore::new(0)),
        capacity: Capacity { bytes: 0, stall_wait: Duration::ZERO },
        stalled: Arc::new(AtomicBool::new(true)),
        dropped: AtomicU64::new(0),
        unreported: AtomicU64::new(0),
        error,
    }
}

/// An `io::Write` for agent messages to stderr that never blocks: complete lines are queued
/// on [`stderr()`] (a partial line waits in the writer for its end, or its drop). For a
/// tracing subscriber: `.with_writer(elastix_core::console::stderr_writer)`.
pub fn stderr_writer() -> MessageWriter {
    MessageWriter { stream: stderr(), pending: Vec::new() }
}

pub struct MessageWriter {
    stream: &'static ConsoleStream,
    pending: Vec<u8>,
}

impl Write for MessageWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        if let Some(end) = self.pending.iter().rposition(|&b| b == b'\n') {
            let rest = self.pending.split_off(end + 1);
            self.stream.line(std::mem::replace(&mut self.pending, rest));
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            let mut line = std::mem::take(&mut self.pending);
            line.push(b'\n');
            self.stream.line(line);
        }
        Ok(())
    }
}

impl Drop for MessageWriter {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, Mutex};

    use super::*;

    /// A writer that blocks until released, then records what it was given.
    #[derive(Clone, Default)]
    struct Stalled {
        released: Arc<(Mutex<bool>, Condvar)>,
        written: Arc<Mutex<Vec<u8>>>,
    }

    impl Stalled {
        fn release(&self) {
            let (lock, wake) = &*self.released;
            *lock.lock().unwrap() = true;
            wake.notify_all();
        }
    }

    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let (lock, wake) = &*self.released;
            let mut released = lock.lock().unwrap();
            while !*released {
                released = wake.wait(released).unwrap();
            }
            self.written.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A reader that is slow but keeps reading.
    #[derive(Clone, Default)]
    struct Slow {
        written: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Slow {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            std::thread::sleep(Duration::from_micros(200));
            self.written.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Room for exactly `lines` lines of 8 bytes.
    fn room_for(lines: usize, stall_wait: Duration) -> Capacity {
        Capacity { bytes: lines * (8 + LINE_OVERHEAD), stall_wait }
    }

    #[tokio::test]
    async fn a_stalled_reader_drops_and_counts_lines_without_blocking() {
        let stalled = Stalled::default();
        let writer = stalled.clone();
        let stream =
            ConsoleStream::start("test-out", room_for(4, Duration::from_millis(20)), move || writer, ignore).unwrap();
        // the budget comes back only once lines are written: 4 lines fit, the rest are dropped
        let mut accepted = 0;
        for i in 0..100 {
            accepted += usize::from(stream.send(format!("line {i:02}\n").into_bytes()).await);
        }
        assert_eq!(accepted, 4);
        assert_eq!(stream.mark(), StreamMark { dropped: 96, failed: false });
        assert!(stream.stalled.load(Ordering::Relaxed), "the stream counts as stalled");
        assert!(!stream.flush(Duration::from_millis(50)).await, "a stalled stream does not flush");
        stalled.release();
        assert!(stream.flush(Duration::from_secs(30)).await);
        assert!(!stream.stalled.load(Ordering::Relaxed), "writing again ends the stall");
        assert!(stream.send(b"after\n".to_vec()).await);
        assert!(stream.flush(Duration::from_secs(30)).await);
        let written = String::from_utf8(stalled.written.lock().unwrap().clone()).unwrap();
        assert_eq!(written, "line 00\nline 01\nline 02\nline 03\nafter\n");
    }

    #[tokio::test]
    async fn a_slow_reader_holds_the_pump_back_and_loses_nothing() {
        let slow = Slow::default();
        let writer = slow.clone();
        let stream =
            ConsoleStream::start("test-slow", room_for(3, Duration::from_secs(60)), move || writer, ignore).unwrap();
        let expected: String = (0..300).map(|i| format!("line{i:03}\n")).collect();
        for i in 0..300 {
            assert!(stream.send(format!("line{i:03}\n").into_bytes()).await);
        }
        assert!(stream.flush(Duration::from_secs(60)).await);
        assert_eq!(stream.mark().dropped, 0);
        assert_eq!(String::from_utf8(slow.written.lock().unwrap().clone()).unwrap(), expected);
    }

    #[test]
    fn lines_from_outside_the_runtime_never_wait() {
        let stalled = Stalled::default();
        let writer = stalled.clone();
        let stream = ConsoleStream::start("test-sync", room_for(2, STALL_WAIT), move || writer, ignore).unwrap();
        let accepted = (0..10).filter(|_| stream.line(b"message\n".to_vec())).count();
        assert_eq!((accepted, stream.mark().dropped), (2, 8));
        // a line longer than the whole budget costs the whole budget, and still gets through
        stalled.release();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert!(runtime.block_on(stream.flush(Duration::from_secs(30))));
        assert!(stream.line(vec![b'x'; 10_000]));
    }

    #[tokio::test]
    async fn a_write_error_is_reported_once_and_kept() {
        static REPORTS: AtomicU64 = AtomicU64::new(0);
        fn count(text: &str) {
            assert!(text.contains("cannot write to test-err"), "{text}");
            REPORTS.fetch_add(1, Ordering::Relaxed);
        }
        let stream = ConsoleStream::start("test-err", CONSOLE_CAPACITY, || Broken, count).unwrap();
        for _ in 0..5 {
            stream.send(b"x\n".to_vec()).await;
            // one write per line here: each is refused, and reported only the first time
            assert!(stream.flush(Duration::from_secs(30)).await);
        }
        assert_eq!(REPORTS.load(Ordering::Relaxed), 1);
        assert!(stream.mark().failed);
        assert!(stream.error().unwrap().starts_with("test-err: "), "{:?}", stream.error());
    }

    #[test]
    fn the_line_writer_queues_complete_lines_only() {
        let mut writer = stderr_writer();
        writer.write_all(b"part").unwrap();
        assert_eq!(writer.pending, b"part");
        writer.write_all(b"ial\nnext").unwrap();
        assert_eq!(writer.pending, b"next");
    }

    #[test]
    fn writers_never_share_a_line() {
        let mut out = Vec::new();
        let mut open = None;
        for (writer, text) in [
            (1, "[0]:name: "),    // a prompt, relayed after a pause
            (1, "[0]:ok\n"),      // its rest, prefixed again as torchrun's tail does
            (1, "[0]:10%\r"),     // a progress bar...
            (1, "[0]:20%\r"),     // ...starts over on its line
            (2, "[1]:hello\n"),   // another worker: below the bar
            (1, "[0]:wait"),      // unfinished...
            (AGENT, "message\n"), // ...and ended by an agent message
        ] {
            open = place(open, &Piece { writer, bytes: text.as_bytes().to_vec() }, &mut out);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[0]:name: [0]:ok\n[0]:10%\r[0]:20%\r\n[1]:hello\n[0]:wait\nmessage\n"
        );
        assert!(open.is_none());
    }
}
