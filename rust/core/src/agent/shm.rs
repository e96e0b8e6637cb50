//! Where the agent keeps what it shares with its workers (heartbeat pages, checkpoint memory,
//! the control socket): shared memory, and the files of agents that died without removing
//! theirs.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// `/dev/shm`, else the temporary directory.
pub fn dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Removes the files in `dir` named `<prefix><pid>-...` or `<prefix><pid>.<ext>` whose agent
/// (`pid`) is no longer running.
pub fn remove_orphans(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|rest| rest.split(['-', '.']).next());
        let Some(pid) = pid.and_then(|pid| pid.parse::<i32>().ok()) else { continue };
        if !is_running(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Opens and locks `dir` for as long as the returned file stays open: the kernel lets go of
/// the lock when this process ends, however it ends, so [`remove_orphan_dirs`] can tell a
/// directory whose owner died from one whose owner runs, in any pid namespace.
pub fn hold(dir: &Path) -> std::io::Result<Flock<File>> {
    Flock::lock(File::open(dir)?, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, err)| std::io::Error::other(format!("cannot lock {}: {err}", dir.display())))
}

/// Removes the directories in `dir` named `<prefix>...-<pid>` whose agent (`pid`) is no longer
/// running and whose lock ([`hold`]) nobody holds (a pid can be reused, or be another pid
/// namespace's). Returns each removed directory and the bytes it held.
pub fn remove_orphan_dirs(dir: &Path, prefix: &str) -> Vec<(PathBuf, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().filter(|n| n.starts_with(prefix)).and_then(|n| n.rsplit('-').next());
        let Some(pid) = pid.and_then(|pid| pid.parse::<i32>().ok()) else { continue };
        let path = entry.path();
        if !path.is_dir() || is_running(pid) || hold(&path).is_err() {
            continue;
        }
        let bytes = bytes_under(&path);
        if std::fs::remove_dir_all(&path).is_ok() {
            removed.push((path, bytes));
        }
    }
    removed
}

/// Whether a process `pid` runs (ESRCH: none; EPERM: one runs, under another user).
fn is_running(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) != Err(nix::errno::Errno::ESRCH)
}

fn bytes_under(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(kind) if kind.is_dir() => bytes_under(&entry.path()),
            Ok(_) => entry.metadata().map_or(0, |meta| meta.len()),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_of_dead_agents_are_removed_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("elastix-shm-orphans-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // a pid past the kernel's limit never runs
        let dead = dir.join(format!("p-{}-0", i32::MAX));
        let dead_socket = dir.join(format!("p-{}.sock", i32::MAX));
        let live = dir.join(format!("p-{}-0", std::process::id()));
        let other = dir.join("unrelated-file");
        for path in [&dead, &dead_socket, &live, &other] {
            std::fs::write(path, b"").unwrap();
        }
        remove_orphans(&dir, "p-");
        assert!(!dead.exists() && !dead_socket.exists() && live.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn directories_of_dead_agents_are_removed_unless_locked_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("elastix-shm-orphan-dirs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dead = dir.join(format!("p-job-a-{}", i32::MAX));
        // a dead pid, but its lock is held (another pid namespace's agent, or a reused pid)
        let locked = dir.join(format!("p-job-b-{}", i32::MAX - 1));
        let live = dir.join(format!("p-job-{}", std::process::id()));
        let file = dir.join(format!("p-file-{}", i32::MAX));
        for path in [&dead, &locked, &live] {
            std::fs::create_dir_all(path.join("rank-0")).unwrap();
            std::fs::write(path.join("rank-0").join("slot-0.data"), [0u8; 100]).unwrap();
        }
        std::fs::write(&file, b"").unwrap();
        let _held = hold(&locked).unwrap();
        let removed = remove_orphan_dirs(&dir, "p-");
        assert_eq!(removed, vec![(dead.clone(), 100)]);
        assert!(!dead.exists() && locked.exists() && live.exists() && file.exists());
        assert!(hold(&locked).is_err(), "a second lock is refused while the first is held");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
