//! How the agent starts a child (a worker or a standby): in its own process group, so one
//! signal reaches everything it starts; with a parent-death signal, so it dies with the agent;
//! stdout and stderr piped to the agent, stdin shared.

use std::collections::BTreeMap;
use std::process::Stdio;

use nix::sys::signal::Signal;
use tokio::process::Command;

pub fn supervised_command(program: &str, args: &[String], env: &BTreeMap<String, String>) -> Command {
    let mut command = Command::new(program);
    command.args(args).envs(env).stdin(Stdio::inherit()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let agent_pid = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // work is allowed: prctl(2) and getppid(2) are, and nothing allocates (errors are raw OS
    // errors, no message is formatted), so no lock held by another agent thread is needed.
    unsafe {
        command.pre_exec(move || {
            // die with the agent; if it already died, do not start at all
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            if nix::unistd::getppid() != agent_pid {
                // the agent exited before the child started: no one is left to read why
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    command
}
