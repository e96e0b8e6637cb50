//! What an elastic handler knows of this node, whichever service holds the job's state (a
//! TCPStore for c10d, etcd): the same for both, so it is one type.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::config::settings::RendezvousSettings;
use super::error::{RendezvousError, Result};
use super::node::NodeDesc;
use super::presence::Presence;
use crate::auth::Secret;

/// This node as a participant of the job's rendezvous.
pub(crate) struct Participant {
    pub settings: RendezvousSettings,
    /// This node as the others see it (its address, process, presence port, order).
    pub node: NodeDesc,
    /// How the job ended, as this node learned it (a round's task may learn it first).
    pub closed: CloseNote,
    /// The port of the workers' store this node last served, tried first next time (a
    /// restarted job keeps its MASTER_PORT).
    pub workers_store_port: Option<u16>,
    /// What the other members probe to ask whether this node's agent is still there.
    _presence: Option<Presence>,
}

impl Participant {
    /// Checks the settings and opens this node's presence port.
    pub fn new(settings: RendezvousSettings) -> Result<Participant> {
        settings.validate()?;
        let mut node = NodeDesc::this_process(settings.local_addr.as_deref());
        node.order = settings.node_order;
        let presence = Presence::start(&node.addr);
        node.presence = presence.as_ref().map(Presence::port);
        Ok(Participant { settings, node, closed: CloseNote::default(), workers_store_port: None, _presence: presence })
    }

    pub fn run_id(&self) -> &str {
        &self.settings.run_id
    }

    /// The job secret every store connection of this node proves.
    pub fn secret(&self) -> Option<&Secret> {
        self.settings.secret.as_ref()
    }

    /// The error of a close that took longer than its `close_timeout`.
    pub fn close_timed_out(&self) -> RendezvousError {
        RendezvousError::Timeout(format!(
            "closing rendezvous {:?} took longer than {:?} (close_timeout)",
            self.settings.run_id, self.settings.close_timeout
        ))
    }

    /// How long a member may be silent before the others count it lost.
    pub fn loss_window(&self) -> Duration {
        self.settings.node_lost_after()
    }
}

/// The reason the job's rendezvous was closed with, once known; shared with the tasks that
/// watch a round, which may hear it first.
#[derive(Clone, Debug, Default)]
pub(crate) struct CloseNote(Arc<Mutex<Option<String>>>);

impl CloseNote {
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn set(&self, reason: String) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
    }
}
