//! How the agent starts a child (a worker or a standby): as the leader of a session of its
//! own (so of its own process group, and one signal reaches everything it starts), as
//! torchrun starts workers; with a parent-death signal, so it dies with the agent; in the
//! job's cgroup where there is one, and watched by the cleanup watchdog, so that what it
//! starts does not outlive the agent either ([`crate::agent::workers::reaper`]). stdin is shared; stdout and
//! stderr are piped to the agent, or shared too ([`Output`]).
//!
//! A session of its own matters on a terminal: the terminal is not the child's controlling
//! terminal, so reading it (`breakpoint()`, `input()`) is never stopped by SIGTTIN as a
//! background process group's read would be, while Ctrl-C reaches only the agent's foreground
//! group, and the agent forwards it.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::process::Stdio;

use nix::sched::CpuSet;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::agent::workers::reaper::{self, Cgroup, Watch};

/// A started child: the process, its pid (the id of its process group) and the watchdog's
/// hold on that group.
#[derive(Debug)]
pub struct Supervised {
    pub child: Child,
    pub pid: u32,
    pub watch: Watch,
}

/// Where a child's stdout and stderr go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// To the agent, through pipes (see [`crate::agent::output::logs`]).
    Piped,
    /// Straight to the agent's own stdout and stderr (a terminal, see [`crate::agent::output::logs::output_of`]).
    Shared,
}

/// The environment a child started with `env` has: the agent's own, plus `env`, less the
/// secret (a child gets the file, `ELASTIX_AUTH_TOKEN_FILE`).
pub fn child_environment(env: &BTreeMap<String, String>) -> BTreeMap<OsString, OsString> {
    let mut all: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    all.extend(env.iter().map(|(key, value)| (key.into(), value.into())));
    all.remove(OsStr::new(crate::auth::TOKEN_VAR));
    all
}

pub struct SupervisedCommand {
    command: Command,
    cgroup: Option<Cgroup>,
}

impl SupervisedCommand {
    /// A command for `program`, to join `cgroup` before it runs.
    pub fn new(
        program: &str,
        args: &[String],
        env: &BTreeMap<String, String>,
        output: Output,
        cgroup: Option<Cgroup>,
    ) -> SupervisedCommand {
        // the watchdog exists before the first child does
        reaper::ensure_started();
        let mut command = Command::new(program);
        command
            .args(args)
            .envs(env)
            // the secret itself never reaches a child: it gets the file (ELASTIX_AUTH_TOKEN_FILE)
            .env_remove(crate::auth::TOKEN_VAR)
            .stdin(Stdio::inherit());
        if output == Output::Piped {
            command.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let agent_pid = nix::unistd::getpid();
        let join = cgroup.clone();
        // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
        // work is allowed: setsid(2), open(2), write(2), close(2), prctl(2) and getppid(2) are, and nothing
        // allocates (the cgroup path was prepared before the fork; errors are raw OS errors, no
        // message is formatted), so no lock held by another agent thread is needed.
        unsafe {
            command.pre_exec(move || {
                // cannot fail: a child just forked is no process group leader
                nix::unistd::setsid()?;
                if let Some(cgroup) = &join {
                    // a failure leaves the child in the agent's cgroup: checked after the spawn
                    let _ = cgroup.join_from_child();
                }
                // die with the agent; if it already died, do not start at all
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                if nix::unistd::getppid() != agent_pid {
                    // the agent exited before the child started: no one is left to read why
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        SupervisedCommand { command, cgroup }
    }

    /// Binds the child to `cpus` before it runs its program (`--numa-binding`), as `numactl
    /// --physcpubind` would: the threads and processes it starts inherit the binding. Failing
    /// (CPUs the child may not use) fails the spawn.
    pub fn bind_to(&mut self, cpus: CpuSet) -> &mut SupervisedCommand {
        // SAFETY: the closure runs in the child between fork and exec: sched_setaffinity(2) is a
        // bare system call (no lock, no allocation), on `cpus`, a copy made before the fork; an
        // error is a raw OS error, nothing is formatted.
        unsafe {
            self.command.pre_exec(move || {
                nix::sched::sched_setaffinity(Pid::from_raw(0), &cpus)?;
                Ok(())
            });
        }
        self
    }

    /// For more set-up in the child (see [`Command::pre_exec`]).
    pub fn command_mut(&mut self) -> &mut Command {
        &mut self.command
    }

    pub fn spawn(mut self) -> std::io::Result<Supervised> {
        let child = self.command.spawn()?;
        let pid = child.id().ok_or_else(|| std::io::Error::other("the child exited before its pid was known"))?;
        let watch = reaper::watch(pid);
        if let Some(cgroup) = &self.cgroup {
            reaper::check_joined(cgroup, pid);
        }
        Ok(Supervised { child, pid, watch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPUs the current process may run on.
    fn own_cpus() -> Vec<usize> {
        let set = nix::sched::sched_getaffinity(Pid::from_raw(0)).unwrap();
        (0..CpuSet::count()).filter(|cpu| set.is_set(*cpu).unwrap()).collect()
    }

    #[tokio::test]
    async fn a_bound_child_and_what_it_starts_run_on_its_cpus_only() {
        let cpu = *own_cpus().last().unwrap();
        let mut cpus = CpuSet::new();
        cpus.set(cpu).unwrap();
        // grep is the shell's child: the binding is inherited
        let args = ["-c".to_owned(), "grep Cpus_allowed_list /proc/self/status".to_owned()];
        let mut command = SupervisedCommand::new("/bin/sh", &args, &BTreeMap::new(), Output::Piped, None);
        command.bind_to(cpus);
        let output = command.spawn().unwrap().child.wait_with_output().await.unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        assert_eq!(text.split_whitespace().collect::<Vec<_>>(), ["Cpus_allowed_list:", &cpu.to_string()]);
    }

    #[tokio::test]
    async fn a_binding_to_cpus_the_agent_may_not_use_fails_the_spawn() {
        let mut cpus = CpuSet::new();
        // a CPU id no machine this runs on has, so none it may use
        cpus.set(CpuSet::count() - 1).unwrap();
        let mut command = SupervisedCommand::new("/bin/true", &[], &BTreeMap::new(), Output::Piped, None);
        command.bind_to(cpus);
        let err = command.spawn().unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
    }
}
