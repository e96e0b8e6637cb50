//! The signals the agent handles (torch's SIGTERM, SIGINT, SIGHUP, SIGQUIT by default, plus
//! those named in --signals-to-handle): caught from the agent's start, so a signal during the
//! rendezvous is handled like any other.

use std::str::FromStr;

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use super::error::{AgentError, Result};

pub struct Signals {
    received: mpsc::UnboundedReceiver<Signal>,
}

impl Signals {
    /// Installs handlers for `names` ("SIGTERM", "SIGUSR1", ...). Must run in a tokio runtime.
    pub fn install(names: &[String]) -> Result<Signals> {
        let (sender, received) = mpsc::unbounded_channel();
        for name in names {
            let parsed = Signal::from_str(name.trim())
                .map_err(|_| AgentError::Config(format!("--signals-to-handle: unknown signal {name:?}")))?;
            if matches!(parsed, Signal::SIGKILL | Signal::SIGSTOP | Signal::SIGCHLD) {
                return Err(AgentError::Config(format!("--signals-to-handle: {name} cannot be handled")));
            }
            let mut stream = signal(SignalKind::from_raw(parsed as i32))?;
            let sender = sender.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if sender.send(parsed).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Signals { received })
    }

    /// The next signal received.
    pub async fn recv(&mut self) -> Signal {
        match self.received.recv().await {
            Some(signal) => signal,
            None => std::future::pending().await,
        }
    }
}
