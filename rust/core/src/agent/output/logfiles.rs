//! Writing the workers' log files off the agent's runtime: one writer thread per agent, fed
//! by a bounded channel. A pump waits (asynchronously) for room, so log files lose nothing and
//! a slow disk slows only the workers' output, as writing the files directly would; the
//! runtime's threads never block on the disk.
//!
//! A write error (a full disk, an I/O error) is reported once on stderr, later lines to that
//! file are discarded, and the run's outcome lists every file left incomplete.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::console;

/// Lines queued for the disk before the pumps wait.
const FILE_QUEUE_LINES: usize = 1024;
/// Most lines written between two flushes of the buffers, when the queue never runs empty.
const FLUSH_EVERY: usize = 4096;
/// Each file's buffer.
const FILE_BUFFER: usize = 64 << 10;

enum Message {
    Line(Arc<Target>, Vec<u8>),
    /// Answered once every line sent before it was written.
    Flush(oneshot::Sender<()>),
}

struct Target {
    path: PathBuf,
    /// Only the writer thread uses it (the mutex makes the target shareable).
    file: Mutex<BufWriter<File>>,
    failed: AtomicBool,
}

/// What the writer thread found, shared with the agent.
#[derive(Default)]
struct Errors {
    /// "<path>: <error>", one per file that could not be written.
    files: Mutex<Vec<String>>,
    reported: AtomicBool,
}

/// The writer thread of one agent's log files.
pub struct LogWriter {
    sender: mpsc::Sender<Message>,
    errors: Arc<Errors>,
}

/// One log file, written through its agent's [`LogWriter`].
#[derive(Clone)]
pub struct LogFile {
    sender: mpsc::Sender<Message>,
    target: Arc<Target>,
}

impl LogWriter {
    pub fn start() -> io::Result<LogWriter> {
        Self::with_capacity(FILE_QUEUE_LINES)
    }

    fn with_capacity(capacity: usize) -> io::Result<LogWriter> {
        let (sender, receiver) = mpsc::channel(capacity);
        let errors = Arc::new(Errors::default());
        let thread_errors = errors.clone();
        std::thread::Builder::new()
            .name("elastix-logs".to_owned())
            .spawn(move || write_lines(receiver, &thread_errors))?;
        Ok(LogWriter { sender, errors })
    }

    /// Creates (truncates) `path` for writing through this writer.
    pub fn create(&self, path: &Path) -> io::Result<LogFile> {
        let file = File::create(path)
            .map_err(|err| io::Error::new(err.kind(), format!("cannot create log file {}: {err}", path.display())))?;
        Ok(self.writing(path, file))
    }

    /// Opens `path` for appending (creating it if missing): several writers may share it,
    /// and each buffer reaches it whole.
    pub fn append(&self, path: &Path) -> io::Result<LogFile> {
        let file = File::options()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|err| io::Error::new(err.kind(), format!("cannot open {}: {err}", path.display())))?;
        Ok(self.writing(path, file))
    }

    fn writing(&self, path: &Path, file: File) -> LogFile {
        let target = Target {
            path: path.to_owned(),
            file: Mutex::new(BufWriter::with_capacity(FILE_BUFFER, file)),
            failed: AtomicBool::new(false),
        };
        LogFile { sender: self.sender.clone(), target: Arc::new(target) }
    }

    /// Waits up to `within` for every line queued so far to reach its file, then returns the
    /// files that could not be written completely (`"<path>: <error>"`).
    pub async fn finish(&self, within: Duration) -> Vec<String> {
        let (done, written) = oneshot::channel();
        let flushed = match tokio::time::timeout(within, self.sender.send(Message::Flush(done))).await {
            Ok(Ok(())) => matches!(tokio::time::timeout(within, written).await, Ok(Ok(()))),
            _ => false,
        };
        let mut errors = self.errors.files.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if !flushed {
            errors.push(format!("the log files were still being written after {within:?}"));
        }
        errors
    }
}

impl LogFile {
    /// Queues one line (a newline is added when missing), waiting for room in the queue.
    pub async fn line(&self, line: &[u8]) {
        let mut owned = Vec::with_capacity(line.len() + 1);
        owned.extend_from_slice(line);
        if !line.ends_with(b"\n") {
            owned.push(b'\n');
        }
        self.write(owned).await;
    }

    /// Queues bytes as they are (a piece of a worker's output), waiting for room in the queue.
    pub async fn write(&self, bytes: Vec<u8>) {
        // the thread outlives every sender, so this only fails if it panicked
        let _ = self.sender.send(Message::Line(self.target.clone(), bytes)).await;
    }
}

/// Writes queued lines through each file's buffer; the buffers are flushed whenever the queue
/// runs empty (and at least every [`FLUSH_EVERY`] lines), so files stay current without a
/// system call per line.
fn write_lines(mut receiver: mpsc::Receiver<Message>, errors: &Errors) {
    let mut dirty: Vec<Arc<Target>> = Vec::new();
    let mut since_flush = 0usize;
    loop {
        let message = match receiver.try_recv() {
            Ok(message) => message,
            Err(mpsc::error::TryRecvError::Empty) => {
                flush(&mut dirty, errors);
                match receiver.blocking_recv() {
                    Some(message) => message,
                    None => break,
                }
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
        };
        match message {
            Message::Line(target, line) => {
                if target.failed.load(Ordering::Relaxed) {
                    continue;
                }
                let result = target.file.lock().unwrap_or_else(PoisonError::into_inner).write_all(&line);
                match result {
                    Ok(()) if !dirty.iter().any(|d| Arc::ptr_eq(d, &target)) => dirty.push(target),
                    Ok(()) => {}
                    Err(err) => failed(errors, &target, &err),
                }
                since_flush += 1;
                if since_flush >= FLUSH_EVERY {
                    flush(&mut dirty, errors);
                    since_flush = 0;
                }
            }
            Message::Flush(done) => {
                flush(&mut dirty, errors);
                let _ = done.send(());
            }
        }
    }
    flush(&mut dirty, errors);
}

fn flush(dirty: &mut Vec<Arc<Target>>, errors: &Errors) {
    for target in dirty.drain(..) {
        if let Err(err) = target.file.lock().unwrap_or_else(PoisonError::into_inner).flush() {
            failed(errors, &target, &err);
        }
    }
}

fn failed(errors: &Errors, target: &Target, err: &io::Error) {
    if target.failed.swap(true, Ordering::Relaxed) {
        return;
    }
    let text = format!("{}: {err}", target.path.display());
    if !errors.reported.swap(true, Ordering::Relaxed) {
        console::stderr().line(format!("[elastix] log files incomplete: {text}\n").into_bytes());
    }
    errors.files.lock().unwrap_or_else(PoisonError::into_inner).push(text);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_reach_their_files_in_order() {
        let dir = std::env::temp_dir().join(format!("elastix-logfiles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let writer = LogWriter::with_capacity(2).unwrap();
        let (a, b) = (writer.create(&dir.join("a")).unwrap(), writer.create(&dir.join("b")).unwrap());
        for i in 0..50 {
            a.line(format!("a{i}\n").as_bytes()).await;
            b.line(format!("b{i}").as_bytes()).await;
        }
        assert!(writer.finish(Duration::from_secs(30)).await.is_empty());
        let expected: String = (0..50).map(|i| format!("a{i}\n")).collect();
        assert_eq!(std::fs::read_to_string(dir.join("a")).unwrap(), expected);
        assert!(std::fs::read_to_string(dir.join("b")).unwrap().ends_with("b49\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_write_error_is_kept_once_per_file() {
        // /dev/full fails every write with ENOSPC, like a full disk
        let writer = LogWriter::start().unwrap();
        let full = writer.create(Path::new("/dev/full")).unwrap();
        for _ in 0..10 {
            full.line(b"lost\n").await;
        }
        let errors = writer.finish(Duration::from_secs(30)).await;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("/dev/full: ") && errors[0].contains("No space left"), "{errors:?}");
    }
}
