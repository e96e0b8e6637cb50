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
    // SAFETY: only async-signal-safe system calls run between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // die with the agent; if it already died, do not start at all
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            if nix::unistd::getppid() != agent_pid {
                return Err(std::io::Error::other("the agent exited before the child started"));
            }
            Ok(())
        });
    }
    command
}
