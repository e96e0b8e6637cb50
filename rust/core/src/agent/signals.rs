//! The signals an agent handles while it runs. SIGINT and SIGTERM always stop the agent
//! cleanly; the signals named in --signals-to-handle (torch's SIGTERM, SIGINT, SIGHUP and
//! SIGQUIT by default, or e.g. SIGUSR1 for preemption notices) are also forwarded to the
//! workers first. Handlers are installed from the agent's start, so a signal during the
//! rendezvous is handled like any other, and the process's previous handlers are put back
//! when the agent ends (an embedding Python program keeps its own: Ctrl-C, SIGTERM...).
//!
//! A handler only writes the signal number to a pipe (async-signal-safe); the agent reads it.
//! Several agents may run in one process: each has a pipe, and every handled signal reaches
//! all of them.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, PoisonError};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

use super::error::{AgentError, Result};

/// Agents that can run at once in one process.
const SLOTS: usize = 64;
/// Write ends of the agents' pipes (-1: free slot); read by the handler.
static PIPES: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
/// For each installed signal: how many agents use it, and the action to put back.
static INSTALLED: Mutex<BTreeMap<i32, (usize, SigAction)>> = Mutex::new(BTreeMap::new());

extern "C" fn on_signal(number: libc::c_int) {
    let byte = number as u8;
    for slot in &PIPES {
        let fd = slot.load(Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: write(2) is async-signal-safe and only reads `byte`, which outlives the
            // call. `fd` is the non-blocking write end of an agent's pipe, kept open by its
            // `Signals` while the slot holds it (Drop clears the slot before closing the fd), so
            // a full pipe drops the byte rather than blocking the handler. A handler that loaded
            // the fd in the instant before that clear writes one byte to a closed descriptor
            // (EBADF), which is harmless.
            unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
        }
    }
}

pub struct Signals {
    reader: pipe::Receiver,
    /// Keeps the write end open while the slot refers to it.
    _writer: OwnedFd,
    slot: usize,
    handled: Vec<Signal>,
    forwarded: Vec<Signal>,
}

impl Signals {
    /// Handles SIGINT, SIGTERM and the signals named in `forward` ("SIGUSR1", ...), which are
    /// also forwarded to the workers. Must run inside a tokio runtime.
    pub fn install(forward: &[String]) -> Result<Signals> {
        let forwarded = forward
            .iter()
            .map(|name| {
                let signal = Signal::from_str(name.trim())
                    .map_err(|_| AgentError::Config(format!("--signals-to-handle: unknown signal {name:?}")))?;
                if matches!(signal, Signal::SIGKILL | Signal::SIGSTOP | Signal::SIGCHLD) {
                    return Err(AgentError::Config(format!("--signals-to-handle: {name} cannot be handled")));
                }
                Ok(signal)
            })
            .collect::<Result<Vec<Signal>>>()?;
        let mut handled = forwarded.clone();
        for always in [Signal::SIGINT, Signal::SIGTERM] {
            if !handled.contains(&always) {
                handled.push(always);
            }
        }
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
            .map_err(|err| AgentError::Config(format!("cannot create the signal pipe: {err}")))?;
        let reader = pipe::Receiver::from_owned_fd(read_end)?;
        let slot = PIPES
            .iter()
            .position(|slot| {
                slot.compare_exchange(-1, write_end.as_raw_fd(), Ordering::AcqRel, Ordering::Relaxed).is_ok()
            })
            .ok_or_else(|| AgentError::Config(format!("more than {SLOTS} agents in one process")))?;
        let signals = Signals { reader, _writer: write_end, slot, handled, forwarded };
        let mut installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
        let action = SigAction::new(SigHandler::Handler(on_signal), SaFlags::SA_RESTART, SigSet::empty());
        for signal in &signals.handled {
            match installed.get_mut(&(*signal as i32)) {
                Some((users, _)) => *users += 1,
                None => {
                    // SAFETY: `on_signal` does only what a handler may (atomic loads and
                    // write(2)); the action it replaces is kept, to be put back on Drop.
                    let previous = unsafe { sigaction(*signal, &action) }
                        .map_err(|err| AgentError::Config(format!("cannot handle {signal}: {err}")))?;
                    installed.insert(*signal as i32, (1, previous));
                }
            }
        }
        Ok(signals)
    }

    /// The next handled signal, and whether the workers should get it too.
    pub async fn recv(&mut self) -> (Signal, bool) {
        loop {
            let Ok(byte) = self.reader.read_u8().await else {
                return std::future::pending().await;
            };
            if let Ok(signal) = Signal::try_from(i32::from(byte)) {
                if self.handled.contains(&signal) {
                    return (signal, self.forwarded.contains(&signal));
                }
            }
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        let mut installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
        for signal in &self.handled {
            if let Some((users, previous)) = installed.get_mut(&(*signal as i32)) {
                *users -= 1;
                if *users == 0 {
                    // SAFETY: puts back the action sigaction returned when the first agent
                    // installed its handler: one that was valid for this signal then.
                    let _ = unsafe { sigaction(*signal, previous) };
                    installed.remove(&(*signal as i32));
                }
            }
        }
        PIPES[self.slot].store(-1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_reaches_the_agent_and_the_old_handler_comes_back() {
        let mut signals = Signals::install(&["SIGUSR2".to_owned()]).unwrap();
        nix::sys::signal::raise(Signal::SIGUSR2).unwrap();
        assert_eq!(signals.recv().await, (Signal::SIGUSR2, true));
        drop(signals);
        // SAFETY: SIG_DFL is always a valid action; installing it returns the current one,
        // which the assertion expects to be SIG_DFL already (so nothing changes).
        let current = unsafe {
            sigaction(Signal::SIGUSR2, &SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty()))
        }
        .unwrap();
        assert!(matches!(current.handler(), SigHandler::SigDfl), "the default action is back");
    }

    #[test]
    fn unknown_and_unhandleable_signals_are_refused() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _entered = runtime.enter();
        assert!(Signals::install(&["SIGNOPE".to_owned()]).is_err());
        assert!(Signals::install(&["SIGKILL".to_owned()]).is_err());
    }
}
