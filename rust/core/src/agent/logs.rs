//! Worker output: every line of every worker's stdout and stderr goes to its file (if
//! redirected or tee'd), to the agent's console (unless redirected or filtered), with an
//! optional prefix, and the last stderr lines are kept for the failure summary. Files and
//! console are written by threads of their own ([`super::logfiles`], [`super::console`]).
//!
//! Log directories are never deleted or reused: each start of the workers gets a fresh
//! `attempt_<n>` directory under the run's directory.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::task::JoinHandle;

use super::console::ConsoleStream;
use super::failure::STDERR_TAIL_LINES;
use super::logfiles::LogFile;

/// The run's log directory and its attempt directories.
pub struct LogDirs {
    /// `None` when logging to files is turned off (`--log-dir /dev/null`, as torch).
    run_dir: Option<PathBuf>,
    /// Made by the agent in the temp directory (removed after a clean run).
    temporary: bool,
}

/// torch's way of turning log files (and error files) off.
pub(crate) const NO_LOGS: &str = "/dev/null";

impl LogDirs {
    /// Under `base` (or a new temporary directory): a directory of its own for this run,
    /// `<run_id>_<pid>_<n>`, never one that already exists.
    pub fn create(base: Option<&str>, run_id: &str) -> io::Result<LogDirs> {
        let (base, temporary) = match base {
            Some(NO_LOGS) => return Ok(LogDirs { run_dir: None, temporary: false }),
            Some(base) => (PathBuf::from(base), false),
            None => (std::env::temp_dir(), true),
        };
        std::fs::create_dir_all(&base).map_err(|err| {
            io::Error::new(err.kind(), format!("cannot create log directory {}: {err}", base.display()))
        })?;
        let stem = if temporary { format!("elastix_{run_id}") } else { run_id.to_owned() };
        for n in 0..10_000u32 {
            let candidate = base.join(format!("{stem}_{}_{n}", std::process::id()));
            match std::fs::create_dir(&candidate) {
                Ok(()) => return Ok(LogDirs { run_dir: Some(candidate), temporary }),
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(io::Error::new(err.kind(), format!("cannot create {}: {err}", candidate.display())))
                }
            }
        }
        Err(io::Error::other(format!("no free run directory name under {}", base.display())))
    }

    pub fn run_dir(&self) -> Option<&Path> {
        self.run_dir.as_deref()
    }

    pub fn is_temporary(&self) -> bool {
        self.temporary
    }

    /// `attempt_<n>/<local_rank>/` for every local rank, created fresh (`None` when log files
    /// are off).
    pub fn attempt(&self, attempt: u32, local_world_size: u32) -> io::Result<Option<PathBuf>> {
        let Some(run_dir) = &self.run_dir else { return Ok(None) };
        let dir = run_dir.join(format!("attempt_{attempt}"));
        std::fs::create_dir(&dir)?;
        for local_rank in 0..local_world_size {
            std::fs::create_dir(dir.join(local_rank.to_string()))?;
        }
        Ok(Some(dir))
    }

    /// Removes a temporary run directory (after a clean run nothing in it is needed).
    pub fn remove_if_temporary(&self) {
        if let (true, Some(run_dir)) = (self.temporary, &self.run_dir) {
            let _ = std::fs::remove_dir_all(run_dir);
        }
    }
}

/// Where one worker stream's lines go.
pub struct Sink {
    pub file: Option<LogFile>,
    /// The console stream lines are echoed to ([`super::console::stdout`] or [`super::console::stderr`]).
    pub console: Option<&'static ConsoleStream>,
    pub prefix: Vec<u8>,
    /// Last lines kept (stderr only).
    pub tail: Option<Arc<Mutex<VecDeque<String>>>>,
}

impl Sink {
    /// Never blocks a runtime thread: the tail is kept here (it is never dropped), the console
    /// waits briefly for a slow reader and drops lines a stalled one does not take, and the
    /// file waits (asynchronously) for its writer.
    async fn line(&mut self, line: &[u8]) {
        if let Some(tail) = &self.tail {
            let text = String::from_utf8_lossy(line).trim_end_matches(['\n', '\r']).to_owned();
            let mut tail = tail.lock().unwrap_or_else(PoisonError::into_inner);
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(text);
        }
        if let Some(console) = self.console {
            let mut out = Vec::with_capacity(self.prefix.len() + line.len() + 1);
            out.extend_from_slice(&self.prefix);
            out.extend_from_slice(line);
            if !line.ends_with(b"\n") {
                out.push(b'\n');
            }
            console.send(out).await;
        }
        if let Some(file) = &self.file {
            file.line(line).await;
        }
    }
}

/// Copies `stream` line by line into `sink` until EOF.
pub fn pump(stream: impl AsyncRead + Unpin + Send + 'static, mut sink: Sink) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reader = BufReader::with_capacity(64 * 1024, stream);
        let mut line = Vec::with_capacity(256);
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => sink.line(&line).await,
            }
        }
    })
}

/// Expands a prefix template: `{role}`, `{rank}`, `{local_rank}`, `{host}`.
pub fn expand_prefix(template: &str, role: &str, rank: u32, local_rank: u32, host: &str) -> Vec<u8> {
    template
        .replace("{role}", role)
        .replace("{rank}", &rank.to_string())
        .replace("{local_rank}", &local_rank.to_string())
        .replace("{host}", host)
        .into_bytes()
}

/// torch's prefix of tee'd lines.
pub const DEFAULT_TEE_PREFIX: &str = "[{role}{local_rank}]:";

#[cfg(test)]
mod tests {
    use super::super::logfiles::LogWriter;
    use super::*;

    #[test]
    fn attempts_get_fresh_directories_and_runs_never_collide() {
        let base = std::env::temp_dir().join(format!("elastix-logs-test-{}", std::process::id()));
        let base_text = base.to_string_lossy().into_owned();
        let first = LogDirs::create(Some(&base_text), "job").unwrap();
        let second = LogDirs::create(Some(&base_text), "job").unwrap();
        assert_ne!(first.run_dir(), second.run_dir());
        let attempt = first.attempt(0, 2).unwrap().unwrap();
        assert!(attempt.join("1").is_dir());
        assert!(first.attempt(0, 2).is_err(), "an attempt directory is never reused");
        assert!(!first.is_temporary());
        first.remove_if_temporary();
        assert!(first.run_dir().unwrap().exists());
        std::fs::remove_dir_all(&base).unwrap();
        let off = LogDirs::create(Some("/dev/null"), "job").unwrap();
        assert_eq!((off.run_dir(), off.attempt(0, 2).unwrap()), (None, None));
    }

    #[test]
    fn prefixes_expand() {
        assert_eq!(expand_prefix(DEFAULT_TEE_PREFIX, "default", 5, 1, "h"), b"[default1]:");
        assert_eq!(expand_prefix("{host}:{rank} ", "r", 5, 1, "node3"), b"node3:5 ");
    }

    #[tokio::test]
    async fn lines_reach_file_and_tail() {
        let path = std::env::temp_dir().join(format!("elastix-pump-{}", std::process::id()));
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let writer = LogWriter::start().unwrap();
        let sink =
            Sink { file: Some(writer.create(&path).unwrap()), console: None, prefix: vec![], tail: Some(tail.clone()) };
        let lines: Vec<u8> = (0..30).map(|i| format!("line {i}\n")).collect::<String>().into_bytes();
        let mut input = lines.clone();
        input.extend_from_slice(b"no newline at the end");
        pump(std::io::Cursor::new(input), sink).await.unwrap();
        assert!(writer.finish(std::time::Duration::from_secs(30)).await.is_empty());
        let written = std::fs::read_to_string(&path).unwrap();
        assert!(written.starts_with("line 0\n") && written.ends_with("no newline at the end\n"));
        let tail = tail.lock().unwrap();
        assert_eq!(tail.len(), STDERR_TAIL_LINES);
        assert_eq!(tail.back().unwrap(), "no newline at the end");
        std::fs::remove_file(&path).unwrap();
    }
}
