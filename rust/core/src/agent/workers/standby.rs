//! Warm standby workers: one interpreter per local rank, started ahead of a restart, so that a
//! restart does not pay for a cold interpreter start (tens of milliseconds for Python, more
//! with site packages that do work at start-up).
//!
//! A standby is the worker's own command line (its program and arguments, as a cold start
//! runs them), started like a worker with the agent's environment plus the configured
//! variables, the standby variables (for Python, a `sitecustomize` that waits) and
//! [`ACTIVATION_VAR`] naming one more descriptor: the read end of a pipe as fd
//! [`ACTIVATION_FD`]. To make it a worker, the agent writes the worker's whole environment,
//! `KEY=VALUE` entries each ended by a NUL byte (as `/proc/<pid>/environ`), and closes the
//! pipe; the standby reads to EOF, takes that environment and goes on starting up as the
//! cold start would. EOF with nothing written tells it to exit: dropping a standby is always
//! safe. A standby that cannot be used (it died, the write failed) is killed and the worker
//! starts cold: slower, never different.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sched::CpuSet;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::agent::config::AgentConfig;
use crate::agent::workers::env::worker_args;
use crate::agent::workers::process::{child_environment, Output, Supervised, SupervisedCommand};
use crate::agent::workers::reaper;

/// The descriptor a standby reads its activation from.
pub const ACTIVATION_FD: i32 = 3;
/// The variable that tells a standby where its activation comes from.
pub const ACTIVATION_VAR: &str = "ELASTIX_STANDBY_FD";

pub struct Standby {
    pid: u32,
    /// The arguments it was started with: it can stand in for a worker with these only.
    args: Vec<String>,
    /// Both `None` once activated: the process is a worker then, and no longer ours to kill.
    process: Option<Supervised>,
    activation: Option<File>,
}

impl Standby {
    /// A standby for `program args`, bound to `cpus` when given (its local rank's
    /// `--numa-binding`, which it keeps as the worker).
    pub fn spawn(
        program: &str,
        args: &[String],
        env: &BTreeMap<String, String>,
        output: Output,
        cpus: Option<CpuSet>,
    ) -> std::io::Result<Standby> {
        let (read_end, write_end) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        // a full pipe must fail the activation rather than block the agent
        fcntl(&write_end, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        let mut env = env.clone();
        env.insert(ACTIVATION_VAR.to_owned(), ACTIVATION_FD.to_string());
        // it waits in the job's cgroup; the worker group it joins takes it into its own
        let mut command = SupervisedCommand::new(program, args, &env, output, reaper::standby_cgroup());
        if let Some(cpus) = cpus {
            command.bind_to(cpus);
        }
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
        Ok(Standby {
            pid: process.pid,
            args: args.to_vec(),
            process: Some(process),
            activation: Some(File::from(write_end)),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How it ended, if it ended while it waited (it is reaped then).
    fn ended(&mut self) -> Option<std::process::ExitStatus> {
        self.process.as_mut()?.child.try_wait().ok().flatten()
    }

    /// Hands the standby its worker's environment (the agent's, plus `env`); it is that worker
    /// from now on. Refused unless `args` are the standby's own.
    pub fn activate(mut self, args: &[String], env: &BTreeMap<String, String>) -> std::io::Result<Supervised> {
        if args != self.args {
            return Err(std::io::Error::other(format!("it was started for {:?}, not {args:?}", self.args)));
        }
        let process = self.process.as_mut().ok_or_else(|| std::io::Error::other("already activated"))?;
        if let Some(status) = process.child.try_wait()? {
            return Err(std::io::Error::other(format!("the standby exited before it was needed ({status})")));
        }
        let mut message = Vec::new();
        for (key, value) in child_environment(env) {
            message.extend_from_slice(key.as_bytes());
            message.push(b'=');
            message.extend_from_slice(value.as_bytes());
            message.push(0);
        }
        let mut pipe = self.activation.take().ok_or_else(|| std::io::Error::other("already activated"))?;
        pipe.write_all(&message)?;
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

/// Standbys that may end while waiting (killed, out of memory) before the pool stops
/// replacing them: past this, restarts start cold.
const LOSSES_REPLACED: u32 = 3;

/// One standby slot per local rank.
pub struct StandbyPool {
    program: String,
    args: Vec<String>,
    /// The configured variables and the standby variables; `None`: no standbys.
    env: Option<BTreeMap<String, String>>,
    slots: Vec<Option<Standby>>,
    /// Each local rank's output, which its standby has from the start.
    outputs: Vec<Output>,
    /// Each local rank's CPUs (`--numa-binding`), which its standby has from the start.
    bindings: Vec<Option<CpuSet>>,
    /// Standbys that ended while they waited, so far.
    lost: u32,
}

impl StandbyPool {
    /// Standbys for `config`'s workers when it asks for them (every worker starts cold
    /// otherwise), one slot per output.
    pub fn new(config: &AgentConfig, outputs: Vec<Output>) -> StandbyPool {
        let env = config.standby.as_ref().map(|standby| {
            let mut env = config.env.clone();
            env.extend(standby.iter().map(|(key, value)| (key.clone(), value.clone())));
            env
        });
        let slots = outputs.iter().map(|_| None).collect();
        let bindings = (0..outputs.len()).map(|local_rank| config.cpu_set(local_rank)).collect();
        let (program, args) = (config.entrypoint.clone(), config.args.clone());
        StandbyPool { program, args, env, slots, outputs, bindings, lost: 0 }
    }

    /// Starts a standby in every empty slot. A standby that cannot start turns standbys off
    /// for the rest of the run, with a warning: workers then start cold, as without them.
    pub fn refill(&mut self) {
        let Some(env) = &self.env else { return };
        for (local_rank, (slot, output)) in self.slots.iter_mut().zip(&self.outputs).enumerate() {
            if slot.is_some() {
                continue;
            }
            let args = worker_args(&self.args, local_rank as u32);
            match Standby::spawn(&self.program, &args, env, *output, self.bindings[local_rank]) {
                Ok(standby) => *slot = Some(standby),
                Err(err) => {
                    tracing::warn!(
                        "cannot start a standby worker ({} {args:?}): {err}; restarts start cold",
                        self.program
                    );
                    self.env = None;
                    return;
                }
            }
        }
    }

    /// Says which standbys ended while they waited (nothing else would: they are not workers),
    /// and starts others in their place, [`LOSSES_REPLACED`] times at most.
    pub fn check(&mut self) {
        let mut lost = false;
        for (local_rank, slot) in self.slots.iter_mut().enumerate() {
            let Some(status) = slot.as_mut().and_then(Standby::ended) else { continue };
            let pid = slot.take().map_or(0, |standby| standby.pid);
            self.lost += 1;
            lost = true;
            let next = if self.lost >= LOSSES_REPLACED {
                "no more standbys are started: restarts start cold"
            } else {
                "starting another"
            };
            tracing::warn!(
                "the standby interpreter of local rank {local_rank} (pid {pid}) ended while it waited ({status}); {next}"
            );
        }
        if self.lost >= LOSSES_REPLACED {
            self.env = None;
        } else if lost {
            self.refill();
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
    use crate::agent::config::tests::sample;

    /// A standby that echoes its activation message (or nothing) to stdout, then exits.
    fn echo(env: &BTreeMap<String, String>) -> Standby {
        let script = "cat <&$ELASTIX_STANDBY_FD; exit 7".to_owned();
        Standby::spawn("/bin/sh", &["-c".into(), script], env, Output::Piped, None).unwrap()
    }

    fn alive(pid: u32) -> bool {
        // a zombie still answers kill(0); /proc says whether it runs
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| !stat.rsplit(") ").next().unwrap_or("").starts_with('Z'))
            .unwrap_or(false)
    }

    #[tokio::test]
    async fn activation_hands_over_the_whole_environment_and_the_process_becomes_the_worker() {
        let standby = echo(&BTreeMap::from([("STANDBY_ONLY".to_owned(), "1".to_owned())]));
        let args = standby.args.clone();
        let env = BTreeMap::from([("RANK".to_owned(), "3".to_owned())]);
        let mut child = standby.activate(&args, &env).unwrap().child;
        let mut out = Vec::new();
        child.stdout.take().unwrap().read_to_end(&mut out).await.unwrap();
        let entries: Vec<&[u8]> = out.split(|byte| *byte == 0).collect();
        assert!(entries.contains(&&b"RANK=3"[..]));
        let path = format!("PATH={}", std::env::var("PATH").unwrap());
        assert!(entries.contains(&path.as_bytes()), "the agent's own variables are part of it");
        assert!(!entries.iter().any(|entry| entry.starts_with(b"STANDBY_ONLY=")), "the worker's, not the standby's");
        assert_eq!(child.wait().await.unwrap().code(), Some(7));
    }

    #[tokio::test]
    async fn a_standby_stands_in_for_its_own_command_line_only() {
        let standby = echo(&BTreeMap::new());
        let err = standby.activate(&["-c".into(), "other".into()], &BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("it was started for"), "{err}");
    }

    #[tokio::test]
    async fn an_unused_standby_is_gone_when_dropped() {
        let args = ["-c".to_owned(), "sleep 30 <&3".to_owned()];
        let standby = Standby::spawn("/bin/sh", &args, &BTreeMap::new(), Output::Piped, None).unwrap();
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
        let args = ["-c".to_owned(), "exit 0".to_owned()];
        let standby = Standby::spawn("/bin/sh", &args, &BTreeMap::new(), Output::Piped, None).unwrap();
        let pid = standby.pid();
        for _ in 0..200 {
            if !alive(pid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let err = standby.activate(&args, &BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("exited before it was needed"), "{err}");
    }

    fn pool(entrypoint: &str, standby: Option<BTreeMap<String, String>>) -> StandbyPool {
        pool_of(AgentConfig::from_json(&sample(2).to_string()).unwrap(), entrypoint, standby)
    }

    fn pool_of(mut config: AgentConfig, entrypoint: &str, standby: Option<BTreeMap<String, String>>) -> StandbyPool {
        config.entrypoint = entrypoint.to_owned();
        config.args = vec!["-c".into(), "sleep 30 <&3 # ${local_rank}".into()];
        config.standby = standby;
        StandbyPool::new(&config, vec![Output::Piped; 2])
    }

    #[tokio::test]
    async fn a_standby_that_ends_while_it_waits_is_replaced_a_few_times_then_no_more() {
        let mut pool = pool("/bin/sh", Some(BTreeMap::new()));
        pool.refill();
        for round in 1..=LOSSES_REPLACED {
            let pid = pool.slots[0].as_ref().unwrap().pid();
            nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
            for _ in 0..200 {
                pool.check();
                if pool.slots[0].as_ref().map(Standby::pid) != Some(pid) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(pool.lost, round);
            let replaced = pool.slots[0].is_some();
            assert_eq!(replaced, round < LOSSES_REPLACED, "round {round}");
        }
        assert!(pool.env.is_none() && pool.slots[1].is_some(), "off for new ones; the others stay");
    }

    #[tokio::test]
    async fn a_pool_without_standby_variables_stays_empty_and_one_that_cannot_start_turns_off() {
        let mut empty = pool("/bin/sh", None);
        empty.refill();
        assert!(empty.take(0).is_none());
        let mut failing = pool("/nonexistent/program", Some(BTreeMap::new()));
        failing.refill();
        assert!(failing.take(0).is_none() && failing.env.is_none());
        let mut working = pool("/bin/sh", Some(BTreeMap::new()));
        working.refill();
        let second = working.take(1).unwrap();
        assert_eq!(second.args[1], "sleep 30 <&3 # 1", "each rank's own arguments");
        assert!(working.take(1).is_none() && working.take(5).is_none());
    }

    #[tokio::test]
    async fn each_standby_is_bound_to_its_local_ranks_cpus_and_keeps_them_as_the_worker() {
        let own = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
        let first = (0..CpuSet::count()).find(|cpu| own.is_set(*cpu).unwrap()).unwrap();
        let last = (0..CpuSet::count()).rev().find(|cpu| own.is_set(*cpu).unwrap()).unwrap();
        let mut value = sample(2);
        value["numa_binding"] = serde_json::json!({"mode": "node", "cpus": [[first], [last]]});
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        let mut pool = pool_of(config, "/bin/sh", Some(BTreeMap::new()));
        pool.args = vec!["-c".into(), "cat <&3 >/dev/null; grep Cpus_allowed_list /proc/self/status".into()];
        pool.refill();
        for (local_rank, cpu) in [(0, first), (1, last)] {
            let standby = pool.take(local_rank).unwrap();
            let args = standby.args.clone();
            let worker = standby.activate(&args, &BTreeMap::new()).unwrap();
            let output = worker.child.wait_with_output().await.unwrap();
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            assert_eq!(text.split_whitespace().collect::<Vec<_>>(), ["Cpus_allowed_list:", &cpu.to_string()]);
        }
    }
}
