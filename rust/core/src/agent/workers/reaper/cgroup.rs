//! The job's cgroup (v2): a directory `elastix-<agent pid>[-<n>]` under the agent's own cgroup,
//! with one numbered leaf per worker group. Every worker joins its group's leaf before it runs its
//! program, and everything it starts stays in it, whatever process group or session it moves
//! to; `cgroup.kill` (Linux >= 5.14) then kills the whole leaf at once. Standby interpreters
//! wait in the job directory itself and are moved into a leaf when they become workers, so
//! stopping one attempt's workers never touches the next attempt's standbys. No controller is
//! enabled anywhere: the cgroups only track membership, so processes may sit in the inner
//! directory next to the leaves.
//!
//! The cgroup file system may be shared with other containers (other pid namespaces) and
//! outlive any one of them, so a name can be taken by a live agent elsewhere or by one that
//! died with its watchdog (a whole host killed). A taken name is never reused: the next free
//! one is. The agent and its watchdog hold an `flock` on the job directory for as long as
//! either lives; a directory nobody locks, that holds no process and is older than
//! [`STALE_AFTER`] was left by an agent that died with its watchdog, and the next agent that
//! starts beside it removes it.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use nix::fcntl::Flock;

/// How long a leaf's removal waits for its killed processes to leave it.
const RMDIR_WAIT: Duration = Duration::from_secs(10);
const RMDIR_RETRY: Duration = Duration::from_millis(10);
/// How many names `elastix-<pid>`, `elastix-<pid>-1`, ... are tried.
const NAME_TRIES: u32 = 64;
/// How old an unlocked job directory must be to be taken for a dead agent's: its creator
/// locks it within microseconds of making it, and older agents (which did not lock) were idle
/// without a single process in it for this long.
const STALE_AFTER: Duration = Duration::from_secs(60);

/// A cgroup a child can join between fork and exec.
#[derive(Clone, Debug)]
pub struct Cgroup {
    /// `<dir>/cgroup.procs`, prepared before the fork (the child must not allocate).
    procs: CString,
    /// The cgroup's path as `/proc/<pid>/cgroup` shows it, to check that a child got in.
    path: String,
}

impl Cgroup {
    fn new(dir: &Path, path: String) -> io::Result<Cgroup> {
        let procs = CString::new(dir.join("cgroup.procs").as_os_str().as_bytes())
            .map_err(|_| io::Error::other("a NUL byte in the cgroup path"))?;
        Ok(Cgroup { procs, path })
    }

    /// Moves the calling process into this cgroup. Only async-signal-safe calls (open, write,
    /// close) and no allocation: this runs in a child between fork and exec.
    pub fn join_from_child(&self) -> io::Result<()> {
        // SAFETY: `procs` is a valid NUL-terminated path; open(2), write(2) and close(2) are
        // async-signal-safe, and the buffers are static.
        unsafe {
            let fd = libc::open(self.procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let written = libc::write(fd, b"0".as_ptr().cast(), 1);
            let err = io::Error::last_os_error();
            libc::close(fd);
            if written != 1 {
                return Err(err);
            }
        }
        Ok(())
    }

    /// Moves a running process (an idle standby) into this cgroup.
    pub fn adopt(&self, pid: u32) -> io::Result<()> {
        std::fs::write(Path::new(std::ffi::OsStr::from_bytes(self.procs.as_bytes())), pid.to_string())
    }

    /// Whether `pid` is in this cgroup; `None` when that cannot be read (it already exited).
    pub fn holds(&self, pid: u32) -> Option<bool> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        Some(unified_path(&text) == Some(self.path.as_str()))
    }

    pub fn path(&self) -> &str {
        &self.path
    }
}

/// The job's directory: created once per agent process, removed by the watchdog when the
/// agent is gone (it may still hold standbys and leaves until then).
#[derive(Debug)]
pub struct JobCgroup {
    dir: PathBuf,
    /// The directory, NUL-terminated, for the watchdog (which must not allocate).
    dir_c: CString,
    cgroup: Cgroup,
    next_leaf: AtomicU32,
    /// The directory, open and `flock`ed: the watchdog keeps a copy, so that it stays locked
    /// while the agent or its watchdog lives.
    lock: Flock<File>,
}

impl JobCgroup {
    /// Creates `elastix-<pid>[-<n>]` under the agent's own cgroup, or says why it cannot be
    /// used; first removes what agents that died with their watchdogs left there.
    pub fn create() -> Result<JobCgroup, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|err| format!("/proc/self/cgroup: {err}"))?;
        let own = unified_path(&own).ok_or("the agent is in no cgroup v2 hierarchy")?;
        let mounts =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(|err| format!("/proc/self/mountinfo: {err}"))?;
        let parent = cgroup2_dir(&mounts, own).ok_or("no cgroup2 file system mounted over the agent's cgroup")?;
        // moving a child out of the agent's cgroup needs write access to that cgroup.procs
        let parent_procs = parent.join("cgroup.procs");
        nix::unistd::access(&parent_procs, nix::unistd::AccessFlags::W_OK)
            .map_err(|err| format!("{} is not writable ({err})", parent_procs.display()))?;
        let removed = remove_stale(&parent);
        if !removed.is_empty() {
            tracing::info!(
                "removed {} job cgroup(s) that agents killed with their cleanup watchdogs left in {}: {}",
                removed.len(),
                parent.display(),
                removed.join(", ")
            );
        }
        let name = create_unique(&parent, std::process::id())
            .map_err(|err| format!("cannot create a job cgroup in {}: {err}", parent.display()))?;
        let dir = parent.join(&name);
        let setup = || -> Result<JobCgroup, String> {
            if !dir.join("cgroup.kill").exists() {
                return Err("the kernel has no cgroup.kill (Linux 5.14 or newer is needed)".to_owned());
            }
            let lock = crate::agent::shm::hold(&dir).map_err(|err| err.to_string())?;
            let dir_c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| "a NUL byte in the path".to_owned())?;
            let cgroup =
                Cgroup::new(&dir, format!("{}/{name}", own.trim_end_matches('/'))).map_err(|e| e.to_string())?;
            Ok(JobCgroup { dir: dir.clone(), dir_c, cgroup, next_leaf: AtomicU32::new(0), lock })
        };
        setup().inspect_err(|_| {
            let _ = std::fs::remove_dir(&dir);
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn dir_c(&self) -> &std::ffi::CStr {
        &self.dir_c
    }

    /// The locked descriptor of the directory, for the watchdog to keep open.
    pub fn lock_fd(&self) -> RawFd {
        self.lock.as_raw_fd()
    }

    /// Where standbys wait.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// The next leaf's number; `announce` runs before the directory exists, so that the
    /// watchdog can remove it even if the agent dies right after creating it.
    pub fn create_leaf(&self, announce: impl FnOnce(u32)) -> io::Result<Leaf> {
        let id = self.next_leaf.fetch_add(1, Ordering::Relaxed);
        announce(id);
        let dir = self.dir.join(id.to_string());
        std::fs::create_dir(&dir)?;
        let cgroup = Cgroup::new(&dir, format!("{}/{id}", self.cgroup.path))?;
        Ok(Leaf { id, dir, cgroup })
    }

    /// Removes the (empty) job directory: only a process that never started the watchdog does.
    pub fn remove(&self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// One worker group's cgroup.
#[derive(Debug)]
pub struct Leaf {
    id: u32,
    dir: PathBuf,
    cgroup: Cgroup,
}

impl Leaf {
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// SIGKILL to every process in the leaf, including those that left their process group.
    pub fn kill(&self) {
        if let Err(err) = std::fs::write(self.dir.join("cgroup.kill"), "1") {
            tracing::warn!("cannot kill the processes of cgroup {}: {err}", self.dir.display());
        }
    }

    /// Kills what is left and removes the directory; killed processes take a moment to leave,
    /// so that is retried on a thread of its own. `removed` runs once the directory is gone.
    pub fn remove(self, removed: impl FnOnce(u32) + Send + 'static) {
        self.kill();
        if std::fs::remove_dir(&self.dir).is_ok() {
            return removed(self.id);
        }
        let spawned = std::thread::Builder::new().name("elastix-cgroup-rmdir".into()).spawn(move || {
            let deadline = std::time::Instant::now() + RMDIR_WAIT;
            loop {
                match std::fs::remove_dir(&self.dir) {
                    Ok(()) => return removed(self.id),
                    Err(err) if err.raw_os_error() != Some(libc::EBUSY) || std::time::Instant::now() > deadline => {
                        // the watchdog tries again when the agent is gone
                        return tracing::warn!("cannot remove cgroup {}: {err}", self.dir.display());
                    }
                    Err(_) => std::thread::sleep(RMDIR_RETRY),
                }
            }
        });
        if let Err(err) = spawned {
            tracing::warn!("cannot wait for the removal of a cgroup: {err}");
        }
    }
}

/// Makes the first free directory of `elastix-<pid>`, `elastix-<pid>-1`, ... in `parent` and
/// returns its name. A taken name is never reused: its owner may be alive in another pid
/// namespace.
fn create_unique(parent: &Path, pid: u32) -> io::Result<String> {
    let mut last = None;
    for n in 0..NAME_TRIES {
        let name = if n == 0 { format!("elastix-{pid}") } else { format!("elastix-{pid}-{n}") };
        match std::fs::create_dir(parent.join(&name)) {
            Ok(()) => return Ok(name),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => last = Some(err),
            Err(err) => return Err(err),
        }
    }
    let err = last.unwrap_or_else(|| io::Error::other("no name tried"));
    Err(io::Error::new(err.kind(), format!("elastix-{pid} and {} names after it are taken", NAME_TRIES - 1)))
}

/// Removes the job directories in `parent` that agents killed with their watchdogs left: not
/// locked, older than [`STALE_AFTER`], with no process left in them. Returns their names.
fn remove_stale(parent: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let old =
            entry.metadata().ok().and_then(|meta| meta.modified().ok()).and_then(|at| now.duration_since(at).ok());
        if !name.starts_with("elastix-") || !old.is_some_and(|age| age >= STALE_AFTER) {
            continue;
        }
        let dir = entry.path();
        // held until the directory is gone: a second agent sweeping at once skips it
        let Ok(_lock) = crate::agent::shm::hold(&dir) else {
            continue; // its agent or watchdog lives
        };
        let events = std::fs::read_to_string(dir.join("cgroup.events")).unwrap_or_default();
        if !events.lines().any(|line| line == "populated 0") {
            continue; // processes outlived it: not ours to kill
        }
        let leaves = std::fs::read_dir(&dir).into_iter().flatten().flatten().filter(|leaf| leaf.path().is_dir());
        for leaf in leaves {
            let _ = std::fs::remove_dir(leaf.path());
        }
        if std::fs::remove_dir(&dir).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// The cgroup v2 path in the text of `/proc/<pid>/cgroup` (its `0::` line).
pub fn unified_path(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup.lines().find_map(|line| line.strip_prefix("0::")).filter(|path| path.starts_with('/'))
}

/// Where the cgroup at `path` (as `/proc/self/cgroup` names it) is in the file system: below
/// a cgroup2 mount from `mountinfo` (the text of `/proc/self/mountinfo`) whose root covers it.
pub fn cgroup2_dir(mountinfo: &str, path: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (fields, fs) = line.split_once(" - ")?;
        if fs.split(' ').next()? != "cgroup2" {
            return None;
        }
        let mut fields = fields.split(' ');
        let root = unescape(fields.nth(3)?);
        let mount_point = unescape(fields.next()?);
        let below = if root == "/" {
            path.strip_prefix('/')?
        } else {
            path.strip_prefix(root.as_str())
                .filter(|rest| rest.is_empty() || rest.starts_with('/'))?
                .trim_start_matches('/')
        };
        let dir = Path::new(&mount_point);
        Some(if below.is_empty() { dir.to_path_buf() } else { dir.join(below) })
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
44 31 0:40 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
";

    #[test]
    fn the_unified_line_is_found_among_v1_lines() {
        let text = "9:name=systemd:/\n4:memory:/process_api/7f29\n0::/user.slice/session-3.scope\n";
        assert_eq!(unified_path(text), Some("/user.slice/session-3.scope"));
        assert_eq!(unified_path("4:memory:/x\n"), None);
        assert_eq!(unified_path("0::\n"), None);
    }

    #[test]
    fn a_taken_name_is_skipped_never_reused() {
        let parent = std::env::temp_dir().join(format!("elastix-cgroup-names-{}", std::process::id()));
        std::fs::create_dir_all(parent.join("elastix-7/0")).unwrap();
        std::fs::create_dir(parent.join("elastix-7-1")).unwrap();
        assert_eq!(create_unique(&parent, 7).unwrap(), "elastix-7-2");
        assert_eq!(create_unique(&parent, 8).unwrap(), "elastix-8");
        for n in 3..NAME_TRIES {
            std::fs::create_dir(parent.join(format!("elastix-7-{n}"))).unwrap();
        }
        let err = create_unique(&parent, 7).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert!(err.to_string().contains("elastix-7 and 63 names after it are taken"), "{err}");
        std::fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn a_hybrid_layout_uses_the_unified_mount() {
        assert_eq!(cgroup2_dir(HYBRID, "/"), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_dir(HYBRID, "/a/b.scope"), Some(PathBuf::from("/sys/fs/cgroup/unified/a/b.scope")));
    }

    #[test]
    fn a_mount_of_a_subtree_covers_only_paths_below_its_root() {
        let info = "50 40 0:30 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_dir(info, "/kubepods/pod1"), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(cgroup2_dir(info, "/kubepods/pod1/c"), Some(PathBuf::from("/sys/fs/cgroup/c")));
        assert_eq!(cgroup2_dir(info, "/kubepods/pod10"), None);
        assert_eq!(cgroup2_dir(info, "/other"), None);
    }

    #[test]
    fn no_cgroup2_mount_means_no_directory_and_escapes_are_decoded() {
        assert_eq!(cgroup2_dir("44 31 0:40 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", "/"), None);
        let info = "41 31 0:38 / /mnt/my\\040cgroups rw,relatime shared:1 master:2 - cgroup2 none rw\n";
        assert_eq!(cgroup2_dir(info, "/j"), Some(PathBuf::from("/mnt/my cgroups/j")));
    }
}
