//! Where the agent keeps what it shares with its workers (heartbeat pages, checkpoint memory,
//! the control socket): shared memory, and the files of agents that died without removing
//! theirs.

use std::path::{Path, PathBuf};

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
        // ESRCH: no such process (EPERM means one runs, under another user)
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
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
}
