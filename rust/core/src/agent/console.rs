//! The agent's console: worker lines and agent messages reach stdout and stderr through one
//! writer thread per stream, fed by a bounded channel, so a reader that stops reading (a
//! stalled pipe, a full terminal buffer) never blocks the agent's runtime: heartbeats,
//! restarts and signal handling go on. When a stream's channel is full, lines are dropped and
//! counted, and a notice says how many once the stream takes lines again.
//!
//! A write error (a closed pipe) is reported once on stderr (or nowhere, when stderr itself
//! failed) and kept for the run's outcome; later lines to that stream are discarded.
//!
//! Both streams are process-wide, as stdout and stderr are: every agent in a process shares
//! them. [`stderr_writer`] gives an `io::Write` for agent messages (e.g. a tracing
//! subscriber's writer) that never blocks either.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

/// Lines a stream holds while its reader is slow; past that, lines are dropped.
pub const CONSOLE_QUEUE_LINES: usize = 8192;
/// Bytes a stream holds while its reader is slow (long lines fill it before the line count).
pub const CONSOLE_QUEUE_BYTES: usize = 16 << 20;

enum Message {
    Line(Vec<u8>),
    /// Answered once every line sent before it was written (or discarded after an error).
    Flush(oneshot::Sender<()>),
}

/// One console stream (stdout or stderr) and the thread that writes it.
pub struct ConsoleStream {
    name: &'static str,
    sender: SyncSender<Message>,
    /// Lines dropped because the queue was full, since the process started.
    dropped: AtomicU64,
    /// Dropped lines not yet mentioned in a notice.
    unreported: AtomicU64,
    /// The first write error, set by the writer thread.
    error: Arc<OnceLock<String>>,
    /// Bytes queued and not yet written.
    queued: Arc<AtomicUsize>,
    max_queued: usize,
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
        let (sender, receiver) = sync_channel(capacity.lines);
        let error = Arc::new(OnceLock::new());
        let queued = Arc::new(AtomicUsize::new(0));
        let writer = Writer { name, error: error.clone(), queued: queued.clone(), on_error };
        std::thread::Builder::new().name(format!("elastix-{name}")).spawn(move || writer.run(receiver, open()))?;
        Ok(ConsoleStream {
            name,
            sender,
            dropped: AtomicU64::new(0),
            unreported: AtomicU64::new(0),
            error,
            queued,
            max_queued: capacity.bytes,
        })
    }

    /// Queues one complete line (written with one write, so lines from different workers
    /// never interleave mid-line). Never blocks: with the queue full, the line is dropped and
    /// counted (false).
    pub fn line(&self, line: Vec<u8>) -> bool {
        let size = line.len();
        let sent = if self.queued.fetch_add(size, Ordering::Relaxed) + size > self.max_queued {
            Err(TrySendError::Full(()))
        } else {
            self.sender.try_send(Message::Line(line)).map_err(|_| TrySendError::Full(()))
        };
        match sent {
            Ok(()) => {
                let missed = self.unreported.swap(0, Ordering::Relaxed);
                if missed > 0 {
                    report_drops(self.name, missed);
                }
                true
            }
            Err(_) => {
                self.queued.fetch_sub(size, Ordering::Relaxed);
                self.dropped.fetch_add(1, Ordering::Relaxed);
                self.unreported.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Waits up to `within` for every line queued so far to be written; false if it was not
    /// (the reader is stalled).
    pub async fn flush(&self, within: Duration) -> bool {
        let (done, written) = oneshot::channel();
        if self.sender.try_send(Message::Flush(done)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, written).await, Ok(Ok(())))
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

    /// The first write error, as "stdout: <error>".
    pub fn error(&self) -> Option<String> {
        self.error.get().map(|err| format!("{}: {err}", self.name))
    }
}

/// How much a stream queues before it drops lines.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub lines: usize,
    pub bytes: usize,
}

const CONSOLE_CAPACITY: Capacity = Capacity { lines: CONSOLE_QUEUE_LINES, bytes: CONSOLE_QUEUE_BYTES };

/// The writer thread's side of a stream.
struct Writer {
    name: &'static str,
    error: Arc<OnceLock<String>>,
    queued: Arc<AtomicUsize>,
    on_error: fn(&str),
}

impl Writer {
    fn run<W: Write>(self, receiver: Receiver<Message>, mut out: W) {
        while let Ok(message) = receiver.recv() {
            match message {
                Message::Line(line) => {
                    if self.error.get().is_none() {
                        if let Err(err) = out.write_all(&line).and_then(|()| out.flush()) {
                            let _ = self.error.set(err.to_string());
                            let name = self.name;
                            (self.on_error)(&format!(
                                "[elastix] cannot write to {name} ({err}); further output to it is discarded\n"
                            ));
                        }
                    }
                    self.queued.fetch_sub(line.len(), Ordering::Relaxed);
                }
                Message::Flush(done) => {
                    let _ = done.send(());
                }
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
    let (sender, _) = sync_channel(0);
    let error = Arc::new(OnceLock::new());
    let _ = error.set(format!("cannot start the writer thread: {err}"));
    ConsoleStream {
        name,
        sender,
        dropped: AtomicU64::new(0),
        unreported: AtomicU64::new(0),
        error,
        queued: Arc::new(AtomicUsize::new(0)),
        max_queued: 0,
    }
}

/// An `io::Write` for agent messages to stderr that never blocks: complete lines are queued
/// on [`stderr()`] (a partial line waits in the writer for its end, or its drop). For a
/// tracing subscriber: `.with_writer(elastix_core::agent::console::stderr_writer)`.
pub fn stderr_writer() -> LineWriter {
    LineWriter { stream: stderr(), pending: Vec::new() }
}

pub struct LineWriter {
    stream: &'static ConsoleStream,
    pending: Vec<u8>,
}

impl Write for LineWriter {
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

impl Drop for LineWriter {
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

    impl Stalled {
        fn release(&self) {
            let (lock, wake) = &*self.released;
            *lock.lock().unwrap() = true;
            wake.notify_all();
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

    #[tokio::test]
    async fn a_stalled_reader_drops_and_counts_lines_without_blocking() {
        let stalled = Stalled::default();
        let writer = stalled.clone();
        let stream =
            ConsoleStream::start("test-out", Capacity { lines: 4, bytes: 1 << 20 }, move || writer, ignore).unwrap();
        // the thread holds one line in its write; the queue holds 4 more; the rest are dropped
        let accepted = (0..100).filter(|i| stream.line(format!("line {i}\n").into_bytes())).count();
        assert!((4..=5).contains(&accepted), "{accepted} lines accepted");
        assert_eq!(stream.mark(), StreamMark { dropped: 100 - accepted as u64, failed: false });
        assert!(!stream.flush(Duration::from_millis(50)).await, "a stalled stream does not flush");
        stalled.release();
        // the queue empties once the reader reads again (bounded wait for the thread)
        let mut caught_up = false;
        for _ in 0..3000 {
            if stream.flush(Duration::from_secs(30)).await {
                caught_up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(caught_up, "the stream never caught up");
        assert!(stream.line(b"after\n".to_vec()));
        assert!(stream.flush(Duration::from_secs(30)).await);
        let written = String::from_utf8(stalled.written.lock().unwrap().clone()).unwrap();
        assert!(written.starts_with("line 0\n") && written.ends_with("after\n"), "{written}");
    }

    #[test]
    fn long_lines_are_dropped_past_the_byte_budget() {
        let stalled = Stalled::default();
        let writer = stalled.clone();
        let capacity = Capacity { lines: 1000, bytes: 100 };
        let stream = ConsoleStream::start("test-bytes", capacity, move || writer, ignore).unwrap();
        assert!(stream.line(vec![b'a'; 60]));
        assert!(!stream.line(vec![b'b'; 60]), "past the byte budget");
        assert!(stream.line(vec![b'c'; 40]));
        assert_eq!(stream.mark().dropped, 1);
        stalled.release();
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
            stream.line(b"x\n".to_vec());
        }
        assert!(stream.flush(Duration::from_secs(30)).await);
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
}
