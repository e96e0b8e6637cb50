//! Worker output: where it goes ([`worker_outputs`]), the log directories, line prefixes.
//! Piped output reaches its file (if redirected or tee'd) and the agent's console (unless
//! redirected or filtered) through [`crate::agent::output::pump`]; files and console are written by threads
//! of their own ([`crate::agent::output::logfiles`], [`crate::console`]).
//!
//! Log directories are never deleted or reused: each start of the workers gets a fresh
//! `attempt_<n>` directory under the run's directory.

use std::io;
use std::path::{Path, PathBuf};

use crate::agent::config::{AgentConfig, NO_LOGS};
use crate::agent::workers::process::Output;

/// The run's log directory and its attempt directories.
pub struct LogDirs {
    /// `None` when logging to files is turned off (`--log-dir /dev/null`, as torch).
    run_dir: Option<PathBuf>,
    /// Made by the agent in the temp directory (removed after a clean run).
    temporary: bool,
}

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

/// Where each local rank's workers write: to the agent's own stdout and stderr when the agent
/// runs on a terminal (stdin and stdout are one) and the rank's output is neither redirected,
/// tee'd nor prefixed, as under torchrun, so that `breakpoint()`, `input()`, `isatty()` and
/// progress bars work; through pipes otherwise ([`crate::agent::output::pump`]).
pub fn worker_outputs(config: &AgentConfig, on_terminal: bool) -> Vec<Output> {
    (0..config.local_world_size as usize)
        .map(|local_rank| {
            let plain = config.file_mask(local_rank) == 0 && config.line_prefix.is_none();
            if on_terminal && plain {
                Output::Shared
            } else {
                Output::Piped
            }
        })
        .collect()
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
}
