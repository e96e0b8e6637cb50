//! The cleanup watchdog: a small process that outlives the agent and kills what the agent's
//! workers left behind once the agent is gone, however it went (SIGKILL included).
//!
//! The agent holds one end of a `SOCK_SEQPACKET` socket pair; the watchdog blocks reading the
//! other. Each message is one fixed-size record: watch or unwatch a process group, watch or
//! unwatch a leaf of the job's cgroup. When the read returns end-of-file, every copy of the
//! agent's end is closed: the agent died or exited. The watchdog then SIGKILLs each process
//! group still watched, kills the job's cgroup, removes its directories and the private copy of
//! the job secret (if the agent made one), and exits. Its environment holds no secret: it
//! overwrites `ELASTIX_AUTH_TOKEN`'s value in its copy of the agent's environment first. It
//! keeps the job cgroup's lock open (see [`super::cgroup`]) until it has removed the cgroup.
//!
//! Why a forked process that never calls exec: the agent lives in a Python extension, so there
//! is no binary of ours to exec, and an interpreter or a shell may be missing or slow. The
//! price is that the child of a multi-threaded fork may only make async-signal-safe calls:
//! the watchdog uses raw system calls on fixed-size buffers on its stack, never allocates,
//! takes no lock and logs nothing. It is forked twice (the middle process exits at once), so
//! it is not the agent's child: the agent never has to reap it, and an init process does.
//! Its pages are shared copy-on-write with the agent at the time of the fork.
//! A seqpacket socket rather than a pipe: records keep their boundaries, and `MSG_NOSIGNAL`
//! spares the agent a SIGPIPE if the watchdog was killed.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// How many process groups, and cgroup leaves, the watchdog can hold at once (on its stack).
pub const GROUP_CAPACITY: usize = 4096;
pub const LEAF_CAPACITY: usize = 256;

/// How long the agent waits for a new watchdog to say it is ready.
const START_WAIT_MS: libc::c_int = 5000;
/// After the cgroup was killed, how long the watchdog tries to remove its directories.
const RMDIR_TRIES: u32 = 500;
const RMDIR_PAUSE_NS: libc::c_long = 10_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Op {
    WatchGroup = 1,
    UnwatchGroup = 2,
    WatchLeaf = 3,
    UnwatchLeaf = 4,
}

pub struct Watchdog {
    socket: OwnedFd,
    pid: i32,
}

impl Watchdog {
    /// Starts the watchdog; `job` is the job's cgroup directory and the descriptor of its lock
    /// (kept open until the directory is removed), if there is one, and `secret_dir` the
    /// directory of the job secret's private copy, if there is one.
    pub fn start(job: Option<(&CStr, RawFd)>, secret_dir: Option<&CStr>) -> io::Result<Watchdog> {
        let mut fds = [0; 2];
        // SAFETY: socketpair(2) writes two descriptors into `fds`, which is large enough.
        if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) }
            < 0
        {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned by nothing else.
        let (agent_end, watchdog_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (job_dir, job_lock) = (job.map(|(dir, _)| dir.to_bytes()), job.map(|(_, lock)| lock));
        let secret_dir = secret_dir.map(CStr::to_bytes);
        // SAFETY: see the module comment: both children only make async-signal-safe calls on
        // memory prepared before the fork (the paths are borrowed for the whole call, and the
        // child sees an unchanging copy of them) and end in _exit, never returning or unwinding.
        let middle = unsafe { libc::fork() };
        if middle < 0 {
            return Err(io::Error::last_os_error());
        }
        if middle == 0 {
            // SAFETY: as above; fork(2) and _exit(2) are async-signal-safe.
            unsafe {
                if libc::fork() == 0 {
                    watch(watchdog_end.as_raw_fd(), job_dir, job_lock, secret_dir);
                }
                libc::_exit(0);
            }
        }
        drop(watchdog_end);
        let mut status = 0;
        // the middle process exits at once: this wait is short
        // SAFETY: waits for our own child, whose pid we were just given; `status` is valid.
        while unsafe { libc::waitpid(middle, &mut status, 0) } < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
        // the watchdog says its pid once it is ready; end-of-file means it could not start
        let mut ready = libc::pollfd { fd: agent_end.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: polls one valid pollfd.
        if unsafe { libc::poll(&mut ready, 1, START_WAIT_MS) } <= 0 {
            return Err(io::Error::other("the watchdog process did not answer"));
        }
        let mut pid = [0u8; 4];
        // SAFETY: reads at most 4 bytes into `pid`; the socket is readable, so this does not block.
        let read = unsafe { libc::recv(agent_end.as_raw_fd(), pid.as_mut_ptr().cast(), pid.len(), libc::MSG_DONTWAIT) };
        if read != pid.len() as isize {
            return Err(io::Error::other("the watchdog process did not start"));
        }
        Ok(Watchdog { socket: agent_end, pid: i32::from_ne_bytes(pid) })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends one record; never blocks and never raises SIGPIPE.
    pub fn send(&self, op: Op, value: i32) -> io::Result<()> {
        let record = encode(op, value);
        // SAFETY: sends the 8 bytes of `record`.
        let sent = unsafe {
            libc::send(
                self.socket.as_raw_fd(),
                record.as_ptr().cast(),
                record.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

fn encode(op: Op, value: i32) -> [u8; 8] {
    let mut record = [0u8; 8];
    record[..4].copy_from_slice(&(op as u32).to_ne_bytes());
    record[4..].copy_from_slice(&value.to_ne_bytes());
    record
}

fn decode(record: &[u8; 8]) -> (u32, i32) {
    let [a, b, c, d, e, f, g, h] = *record;
    (u32::from_ne_bytes([a, b, c, d]), i32::from_ne_bytes([e, f, g, h]))
}

/// A set of ids in a fixed array: no allocation.
struct Set<const N: usize> {
    ids: [i32; N],
    len: usize,
}

impl<const N: usize> Set<N> {
    fn new() -> Self {
        Set { ids: [0; N], len: 0 }
    }

    fn insert(&mut self, id: i32) {
        if self.len < N && !self.ids[..self.len].contains(&id) {
            self.ids[self.len] = id;
            self.len += 1;
        }
    }

    fn remove(&mut self, id: i32) {
        if let Some(i) = self.ids[..self.len].iter().position(|&x| x == id) {
            self.len -= 1;
            self.ids[i] = self.ids[self.len];
        }
    }

    fn iter(&self) -> impl Iterator<Item = i32> + '_ {
        self.ids[..self.len].iter().copied()
    }
}

/// The watchdog's life, in the twice-forked child: it leaves the agent's session, reads what
/// to watch until the agent is gone, then kills and removes all of it.
///
/// # Safety
/// Runs only in a child of fork(2): every call below is async-signal-safe (setsid, signal,
/// chdir, fcntl, dup2, open, close, close_range, getpid, write, read, kill, unlink, rmdir, nanosleep,
/// _exit), buffers are on the stack, nothing allocates, and it never returns.
unsafe fn watch(socket: RawFd, job_dir: Option<&[u8]>, job_lock: Option<RawFd>, secret_dir: Option<&[u8]>) -> ! {
    let mut groups = Set::<GROUP_CAPACITY>::new();
    let mut leaves = Set::<LEAF_CAPACITY>::new();
    // SAFETY: the function's contract, which each step's is.
    unsafe {
        detach(socket, job_lock);
        follow(&mut groups, &mut leaves);
        kill_groups(&groups);
        if let Some(dir) = job_dir {
            remove_cgroups(dir, &leaves);
        }
        if let Some(dir) = secret_dir {
            remove_secret(dir);
        }
        libc::_exit(0)
    }
}

/// Leaves the agent's session, signals and descriptors (but `socket`, which becomes stdin, and
/// `keep`, which becomes descriptor 3), then says it is ready (its pid, on the socket).
///
/// # Safety
/// As [`watch`]'s.
unsafe fn detach(socket: RawFd, keep: Option<RawFd>) {
    // SAFETY: the function's contract; each call gets valid pointers to stack buffers or
    // static NUL-terminated strings.
    unsafe {
        scrub_secret_from_environment();
        // out of the agent's session and process group: a signal meant for them is not for us
        libc::setsid();
        for signal in [
            libc::SIGHUP,
            libc::SIGINT,
            libc::SIGQUIT,
            libc::SIGTERM,
            libc::SIGPIPE,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGALRM,
        ] {
            libc::signal(signal, libc::SIG_IGN);
        }
        // keep no directory busy
        libc::chdir(c"/".as_ptr());
        // keep no descriptor of the agent's open (not its output, sockets or the workers' pipes)
        // but the job cgroup's lock, first copied out of the way of the renumbering below
        let kept = keep.map_or(-1, |fd| libc::fcntl(fd, libc::F_DUPFD, 10));
        if socket != 0 {
            libc::dup2(socket, 0);
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null < 0 {
            libc::close(1);
            libc::close(2);
        } else {
            libc::dup2(null, 1);
            libc::dup2(null, 2);
        }
        if kept >= 0 && libc::dup2(kept, 3) == 3 {
            close_from(4);
        } else {
            close_from(3);
        }
        let pid = libc::getpid().to_ne_bytes();
        libc::write(0, pid.as_ptr().cast(), pid.len());
    }
}

/// Reads the agent's records from stdin until end-of-file (the agent is gone), keeping the
/// process groups and cgroup leaves it watches now.
///
/// # Safety
/// As [`watch`]'s.
unsafe fn follow(groups: &mut Set<GROUP_CAPACITY>, leaves: &mut Set<LEAF_CAPACITY>) {
    // SAFETY: the function's contract; read gets a stack buffer of its length.
    unsafe {
        loop {
            let mut record = [0u8; 8];
            let n = libc::read(0, record.as_mut_ptr().cast(), record.len());
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if n <= 0 {
                return;
            }
            if n as usize != record.len() {
                continue;
            }
            match decode(&record) {
                (op, id) if op == Op::WatchGroup as u32 && id > 1 => groups.insert(id),
                (op, id) if op == Op::UnwatchGroup as u32 => groups.remove(id),
                (op, id) if op == Op::WatchLeaf as u32 && id >= 0 => leaves.insert(id),
                (op, id) if op == Op::UnwatchLeaf as u32 => leaves.remove(id),
                _ => {}
            }
        }
    }
}

/// # Safety
/// As [`watch`]'s.
unsafe fn kill_groups(groups: &Set<GROUP_CAPACITY>) {
    for pgid in groups.iter() {
        // SAFETY: kill is async-signal-safe and takes plain integers.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

/// Kills what is left in the job's cgroup `dir` and removes its leaves and itself.
///
/// # Safety
/// As [`watch`]'s.
unsafe fn remove_cgroups(dir: &[u8], leaves: &Set<LEAF_CAPACITY>) {
    let mut path = PathBuf::new();
    // SAFETY: the function's contract; `path` is NUL-terminated whenever `set` succeeds.
    unsafe {
        if path.set(dir, None, Some(b"cgroup.kill")) {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                libc::write(fd, b"1".as_ptr().cast(), 1);
                libc::close(fd);
            }
        }
        for leaf in leaves.iter() {
            if path.set(dir, Some(leaf as u32), None) {
                remove_dir(&path);
            }
        }
        if path.set(dir, None, None) {
            remove_dir(&path);
        }
    }
}

/// Removes the private copy of the job secret and its directory `dir`.
///
/// # Safety
/// As [`watch`]'s.
unsafe fn remove_secret(dir: &[u8]) {
    let mut path = PathBuf::new();
    // SAFETY: the function's contract; `path` is NUL-terminated whenever `set` succeeds.
    unsafe {
        if path.set(dir, None, Some(crate::auth::secret::PRIVATE_COPY_NAME.as_bytes())) {
            libc::unlink(path.as_ptr());
        }
        if path.set(dir, None, None) {
            libc::rmdir(path.as_ptr());
        }
    }
}

extern "C" {
    /// The process's environment (POSIX): a NULL-terminated array of `NAME=value` strings.
    static mut environ: *mut *mut libc::c_char;
}

/// Overwrites the value of `ELASTIX_AUTH_TOKEN` (with `*`) in this process's environment, in
/// place: what `/proc/<pid>/environ` shows of it is gone too.
///
/// # Safety
/// Only in the watchdog, which has a single thread: nothing else reads or changes the
/// environment meanwhile. Async-signal-safe (plain memory accesses).
unsafe fn scrub_secret_from_environment() {
    const NAME: &[u8] = b"ELASTIX_AUTH_TOKEN=";
    // SAFETY: the function's contract; `environ` and each of its strings are valid and
    // NUL-terminated until the NULL that ends the array.
    unsafe {
        let mut entry = *std::ptr::addr_of!(environ);
        if entry.is_null() {
            return;
        }
        while !(*entry).is_null() {
            let var = (*entry).cast::<u8>();
            if (0..NAME.len()).all(|i| *var.add(i) == NAME[i]) {
                let mut value = var.add(NAME.len());
                while *value != 0 {
                    *value = b'*';
                    value = value.add(1);
                }
            }
            entry = entry.add(1);
        }
    }
}

/// Closes every descriptor from `first` on.
///
/// # Safety
/// Async-signal-safe; closes descriptors that other code may own (only in the watchdog).
unsafe fn close_from(first: libc::c_uint) {
    // SAFETY: the caller's contract; close_range(2) (Linux 5.9) and close(2) take plain numbers.
    unsafe {
        if libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, 0) == 0 {
            return;
        }
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        let last = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 20) as libc::c_int
        } else {
            1024
        };
        for fd in first as libc::c_int..last {
            libc::close(fd);
        }
    }
}

/// Removes a cgroup directory, waiting (bounded) for killed processes to leave it.
///
/// # Safety
/// Async-signal-safe.
unsafe fn remove_dir(path: &PathBuf) {
    for _ in 0..RMDIR_TRIES {
        // SAFETY: `path` is NUL-terminated; rmdir(2) and nanosleep(2) are async-signal-safe.
        unsafe {
            if libc::rmdir(path.as_ptr()) == 0 || *libc::__errno_location() != libc::EBUSY {
                return;
            }
            let pause = libc::timespec { tv_sec: 0, tv_nsec: RMDIR_PAUSE_NS };
            libc::nanosleep(&pause, std::ptr::null_mut());
        }
    }
}

/// A NUL-terminated path built on the stack: `dir[/leaf][/file]`.
struct PathBuf {
    bytes: [u8; libc::PATH_MAX as usize + 32],
}

impl PathBuf {
    fn new() -> Self {
        PathBuf { bytes: [0; libc::PATH_MAX as usize + 32] }
    }

    /// False if it does not fit.
    fn set(&mut self, dir: &[u8], leaf: Option<u32>, file: Option<&[u8]>) -> bool {
        let mut len = 0;
        let mut push = |part: &[u8]| {
            // one byte stays for the NUL
            if len + part.len() >= self.bytes.len() {
                return false;
            }
            self.bytes[len..len + part.len()].copy_from_slice(part);
            len += part.len();
            true
        };
        let mut digits = [0u8; 10];
        let leaf = leaf.map(|leaf| decimal(leaf, &mut digits));
        let ok = push(dir)
            && leaf.map_or(true, |leaf| push(b"/") && push(leaf))
            && file.map_or(true, |file| push(b"/") && push(file));
        if ok {
            self.bytes[len] = 0;
        }
        ok
    }

    fn as_ptr(&self) -> *const libc::c_char {
        self.bytes.as_ptr().cast()
    }
}

/// `n` in decimal, in `digits`.
fn decimal(mut n: u32, digits: &mut [u8; 10]) -> &[u8] {
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &digits[start..];
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use super::*;

    fn alive(pid: i32) -> bool {
        // a zombie still answers kill(0); /proc says whether it runs
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| !stat.rsplit(") ").next().unwrap_or("").starts_with('Z'))
            .unwrap_or(false)
    }

    fn wait_gone(pid: i32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !alive(pid) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    fn sleeper() -> std::process::Child {
        use std::os::unix::process::CommandExt;
        Command::new("sleep").arg("30").process_group(0).spawn().unwrap()
    }

    #[test]
    fn records_and_paths_are_built_without_allocation() {
        assert_eq!(decode(&encode(Op::UnwatchLeaf, -7)), (4, -7));
        let mut digits = [0u8; 10];
        assert_eq!(decimal(0, &mut digits), b"0");
        assert_eq!(decimal(u32::MAX, &mut digits), b"4294967295");
        let mut path = PathBuf::new();
        assert!(path.set(b"/cg/elastix-1", Some(12), Some(b"cgroup.kill")));
        // SAFETY: `set` NUL-terminated it.
        assert_eq!(unsafe { CStr::from_ptr(path.as_ptr()) }, c"/cg/elastix-1/12/cgroup.kill");
        assert!(!path.set(&[b'a'; libc::PATH_MAX as usize + 40], None, None));
        let mut set = Set::<2>::new();
        set.insert(5);
        set.insert(5);
        set.insert(6);
        set.insert(7);
        set.remove(5);
        assert_eq!(set.iter().collect::<Vec<_>>(), vec![6]);
    }

    #[test]
    fn watched_groups_die_when_the_agent_end_closes_and_unwatched_ones_live() {
        let watchdog = Watchdog::start(None, None).unwrap();
        assert!(alive(watchdog.pid()));
        let (watched, unwatched) = (sleeper(), sleeper());
        let (watched_pid, unwatched_pid) = (watched.id() as i32, unwatched.id() as i32);
        watchdog.send(Op::WatchGroup, watched_pid).unwrap();
        watchdog.send(Op::WatchGroup, unwatched_pid).unwrap();
        watchdog.send(Op::UnwatchGroup, unwatched_pid).unwrap();
        let watchdog_pid = watchdog.pid();
        drop(watchdog);
        let (watched_gone, watchdog_gone) = (wait_gone(watched_pid), wait_gone(watchdog_pid));
        let unwatched_alive = alive(unwatched_pid);
        for mut child in [watched, unwatched] {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert!(watched_gone, "a watched group outlived the agent end");
        assert!(watchdog_gone, "the watchdog outlived its agent end");
        assert!(unwatched_alive, "an unwatched group was killed");
    }
}
