//! What a job's agents leave on their machine when it ends, for `elastix status` after the
//! store is gone with it (an agent hosts it, and it ends with the job): one small JSON file
//! per agent, `<state dir>/elastix/finished/<run ID>@<endpoint>@<pid>.json`, where the state
//! dir is `$XDG_STATE_HOME` or `~/.local/state` (the user's own: another user's jobs are not
//! theirs to see). The newest [`KEPT`] are kept. Best effort: a job never fails for it.
//!
//! Read by `python/elastix/ops/finished.py`; fields are only ever added (`v` is the format).

use std::fs;
use std::path::PathBuf;
use std::time::SystemTime;

use serde::Serialize;

/// Records kept per user; older ones are removed as new ones are written.
const KEPT: usize = 200;

/// How one agent saw its job end.
#[derive(Debug, Serialize)]
pub struct FinishedJob<'a> {
    pub v: u32,
    pub run_id: &'a str,
    pub backend: &'a str,
    /// `--rdzv-endpoint` as given, and the store as reached (a hosted store's real port).
    pub endpoint: &'a str,
    pub store: &'a str,
    /// "SUCCEEDED", "FAILED" or "INTERRUPTED", and the agent's exit code.
    pub state: &'a str,
    pub exit_code: i32,
    /// RFC 3339, UTC.
    pub finished: String,
    pub host: &'a str,
    pub pid: u32,
    pub root_cause: Option<&'a str>,
    /// Where the workers' logs are, when kept.
    pub log_dir: Option<&'a str>,
}

impl FinishedJob<'_> {
    pub fn now() -> String {
        humantime::format_rfc3339_millis(SystemTime::now()).to_string()
    }

    /// Writes the record (then renames it into place, so a reader never sees half of one),
    /// and prunes the oldest. Failures are DEBUG: it is a convenience.
    pub fn remember(&self) {
        let Some(dir) = dir() else { return };
        if let Err(err) = self.write(&dir) {
            tracing::debug!("cannot note the job's end in {}: {err}", dir.display());
        }
    }

    fn write(&self, dir: &PathBuf) -> std::io::Result<()> {
        fs::create_dir_all(dir)?;
        let name = format!("{}@{}@{}.json", file_safe(self.run_id), file_safe(self.store), self.pid);
        let temporary = dir.join(format!(".{name}.tmp"));
        fs::write(&temporary, serde_json::to_vec(self).expect("a record serializes"))?;
        fs::rename(&temporary, dir.join(name))?;
        prune(dir);
        Ok(())
    }
}

/// `$XDG_STATE_HOME/elastix/finished`, or `~/.local/state/elastix/finished`.
fn dir() -> Option<PathBuf> {
    let state = match std::env::var_os("XDG_STATE_HOME").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").filter(|home| !home.is_empty())?).join(".local/state"),
    };
    Some(state.join("elastix").join("finished"))
}

fn file_safe(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

fn prune(dir: &PathBuf) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut records: Vec<(SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "json"))
        .filter_map(|entry| Some((entry.metadata().ok()?.modified().ok()?, entry.path())))
        .collect();
    if records.len() <= KEPT {
        return;
    }
    records.sort();
    for (_, path) in &records[..records.len() - KEPT] {
        let _ = fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_safe_for_a_file() {
        assert_eq!(file_safe("127.0.0.1:29400,[::1]:5"), "127.0.0.1_29400____1__5");
        assert_eq!(file_safe("../etc"), ".._etc");
    }

    #[test]
    fn the_oldest_records_go_beyond_the_limit() {
        let path = std::env::temp_dir().join(format!("elastix-finished-test-{}", std::process::id()));
        fs::create_dir_all(&path).unwrap();
        for i in 0..KEPT + 3 {
            let file = path.join(format!("{i}.json"));
            fs::write(&file, "{}").unwrap();
            let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + i as u64);
            fs::File::options().write(true).open(&file).unwrap().set_modified(at).unwrap();
        }
        prune(&path);
        assert_eq!(fs::read_dir(&path).unwrap().count(), KEPT);
        assert!(!path.join("0.json").exists() && !path.join("2.json").exists() && path.join("3.json").exists());
        fs::remove_dir_all(&path).unwrap();
    }
}
