//! Warm standby workers: one interpreter per local rank, started ahead of a restart, so that a
//! restart does not pay for a cold interpreter start (tens of milliseconds for Python, more
//! with site packages that do work at start-up).
//!
//! A standby is the configured standby command (the launcher builds it: a Python bootstrap)
//! started like a worker, with the agent's environment plus the configured variables, and one
//! more descriptor: the read end of a pipe as fd [`ACTIVATION_FD`]. To make it a worker, the
//! agent writes one JSON object, `{"args": [...], "env": {...}}` (the worker's arguments and
//! variables, as a cold start would get them) and closes the pipe; the standby reads to EOF,
//! applies them and runs the program. EOF with nothing written tells it to exit: dropping a
//! standby is always safe. A standby that cannot be used (it died, the write failed) is killed
//! and the worker starts cold: slower, never different.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::process::{Output, Supervised, SupervisedCommand};
use super::reaper;

/// The descriptor a standby reads its activation from.
pub const ACTIVATION_FD: i32 = 3;

pub struct Standby {
    pid: u32,
    /// Both `None` once activated: the process is a worker then, and no longer ours to kill.
    process: Option<Supervised>,
    activation: Option<File>,
}

impl Standby {
    pub fn spawn(command: &[String], env: &BTreeMap<String, String>, output: Output) -> std::io::Result<Standby> {
        let (program, args) = command.split_first().ok_or_else(|| std::io::Error::other("empty standby command"))?;
        let (read_end, write_end) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        // a full pipe must fail the activation rather than block the agent
        fcntl(&write_end, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        // it waits in the job's cgroup; the worker group it joins takes it into its own
        let mut command = SupervisedCommand::new(program, args, env, output, reaper::standby_cgroup());
        let read_fd = read_end.as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec: dup2(2) and fcntl(2) are
        // async-signal-safe and nothing allocates. `read_fd` is open in the parent at the fork
        // (`read_end` is dropped only after spawn), so the child has it too.
        unsafe {
            command.command_mut().pre_exec(move || {
                let fd = if read_fd == ACTIVATION_FD {
                    // dup2 onto itself would keep close-on-exec
                    libc::fcntl(read_fd, libc::F_SETFD, 0)
                } else {
                    libc::dup2(read_fd, ACTIVATION_FD)
                };
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let process = command.spawn()?;
        drop::<OwnedFd>(read_end);
        Ok(Standby { pid: process.pid, process: Some(process), activation: Some(File::from(write_end)) })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Hands the standby its worker's arguments and environment; it is that worker from now on.
    pub fn activate(mut self, args: &[String], env: &BTreeMap<String, String>) -> std::io::Result<Supervised> {
        let process = self.process.as_mut().ok_or_else(|| std::io::Error::other("already activated"))?;
        if let Some(status) = process.child.try_wait()? {
            return Err(std::io::Error::other(format!("the standby exited before it was needed ({status})")));
        }
        let message = serde_json::json!({ "args": args, "env": env });
        let mut pipe = self.activation.take().ok_or_else(|| std::io::Error::other("already activated"))?;
        pipe.write_all(message.to_string().as_bytes())?;
        drop(pipe); // EOF: the message is complete
        self.process.take().ok_or_else(|| std::io::Error::other("already activated"))
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        if self.process.is_some() {
            // an idle standby exits by itself on EOF; SIGKILL makes sure it is gone now (and
            // only then does the watchdog stop watching its group)
            let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
        }
    }
}

/// One standby slot per local rank.
pub struct StandbyPool {
    command: Option<Vec<String>>,
    env: BTreeMap<String, String>,
    slots: Vec<Option<Standby>>,
    /// Each local rank's output, which its standby has from the start.
    outputs: Vec<Output>,
}

impl StandbyPool {
    /// `command: None` keeps the pool empty: every worker starts cold. One slot per output.
    pub fn new(command: Option<Vec<String>>, env: BTreeMap<String, String>, outputs: Vec<Output>) -> StandbyPool {
        let slots = outputs.iter().map(|_| None).collect();
        StandbyPool { command: command.filter(|c| !c.is_empty()), env, slots, outputs }
    }

    /// Starts a standby in every empty slot. A standby that cannot start turns standbys off
    /// for the rest of the run, with a warning: workers then start cold, as without them.
    pub fn refill(&mut self) {
        let Some(command) = &self.command else { return };
        for (slot, output) in self.slots.iter_mut().zip(&self.outputs).filter(|(slot, _)| slot.is_none()) {
            match Standby::spawn(command, &self.env, *output) {
                Ok(standby) => *slot = Some(standby),
                Err(err) => {
                    tracing::warn!("cannot start a standby worker ({command:?}): {err}; restarts start cold");
                    self.command = None;
                    return;
                }
            }
        }
    }

    pub fn take(&mut self, local_rank: u32) -> Option<Standby> {
        self.slots.get_mut(local_rank as usize).and_then(Option::take)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::*;

    /// A standby that echoes its activation message (or nothing) to stdout, then exits.
    fn echo_command() -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), "cat <&3; exit 7".into()]
    }

    fn alive(pid: u32) -> bool {
        // a zombie still answers kill(0); /proc says whether it runs
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| !stat.rsplit(") ").next().unwrap_or("").starts_with('Z'))
            .unwrap_or(false)
    }

    #[tokio::test]
    async fn activation_hands_over_args_and_env_and_the_process_becomes_the_worker() {
        let standby = Standby::spawn(&echo_command(), &BTreeMap::new(), Output::Piped).unwrap();
        let env = BTreeMap::from([("RANK".to_owned(), "3".to_owned())]);
        let mut child = standby.activate(&["-u".into(), "train.py".into()], &env).unwrap().child;
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
        let message: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(message, serde_json::json!({"args": ["-u", "train.py"], "env": {"RANK": "3"}}));
        assert_eq!(child.wait().await.unwrap().code(), Some(7));
    }

    #[tokio::test]
    async fn an_unused_standby_is_gone_when_dropped() {
        let command = vec!["/bin/sh".into(), "-c".into(), "sleep 30 <&3".into()];
        let standby = Standby::spawn(&command, &BTreeMap::new(), Output::Piped).unwrap();
        let pid = standby.pid();
        assert!(alive(pid));
        drop(standby);
        for _ in 0..200 {
            if !alive(pid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("standby {pid} still runs after being dropped");
    }

    #[tokio::test]
    async fn a_standby_that_died_is_refused() {
        let command = vec!["/bin/sh".into(), "-c".into(), "exit 0".into()];
        let standby = Standby::spawn(&command, &BTreeMap::new(), Output::Piped).unwrap();
        let pid = standby.pid();
        for _ in 0..200 {
            if !alive(pid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let err = standby.activate(&[], &BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("exited before it was needed"), "{err}");
    }

    #[tokio::test]
    async fn a_pool_without_a_command_stays_empty_and_one_that_cannot_start_turns_off() {
        let mut pool = StandbyPool::new(None, BTreeMap::new(), vec![Output::Piped; 2]);
        pool.refill();
        assert!(pool.take(0).is_none());
        let mut pool =
            StandbyPool::new(Some(vec!["/nonexistent/python".into()]), BTreeMap::new(), vec![Output::Piped; 2]);
        pool.refill();
        assert!(pool.take(0).is_none() && pool.command.is_none());
        let mut pool = StandbyPool::new(Some(echo_command()), BTreeMap::new(), vec![Output::Piped; 2]);
        pool.refill();
        assert!(pool.take(1).is_some() && pool.take(1).is_none() && pool.take(5).is_none());
    }
}
