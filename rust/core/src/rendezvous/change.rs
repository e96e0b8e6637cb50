//! What a rendezvous tells its agent: the node's place in a round, and why a round ends.

use std::time::Duration;

use super::node::NodeDesc;

/// What a completed rendezvous gives its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousInfo {
    pub run_id: String,
    pub round: u64,
    /// This node's rank among the round's nodes (its group rank).
    pub rank: u32,
    /// Nodes in the round (the group world size).
    pub world_size: u32,
    /// Where this round's workers find their store (served by rank 0's agent).
    pub master_addr: String,
    pub master_port: u16,
    /// The rendezvous store, and this round's namespace in it: keys `{store_prefix}/{key}`
    /// (torch's PrefixStore convention, before the TCPStore's own `/`).
    pub store_host: String,
    pub store_port: u16,
    pub store_prefix: String,
}

/// Why the running round should end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipChange {
    /// Late nodes want to join: re-form with them (this does not use the restart budget).
    NodesWaiting,
    /// A member stopped sending heartbeats (or its lease expired). `rank`: its group rank,
    /// when it could be told.
    NodeLost { rank: Option<u32>, node: Option<NodeDesc> },
    /// Another member opened a newer round (it restarted).
    RoundSuperseded { round: u64 },
    /// The store came back without the job's state (it restarted empty): re-form there.
    StoreReset,
    /// This node has not reached the store for as long as the others take to count a node
    /// lost: any node the store still answers re-forms without it, so its workers must stop;
    /// it re-joins when it can. `error`: the last failure (a refused connection means the
    /// store is down for every node, not only out of this node's reach).
    StoreUnreachable { store: String, silent_for: Duration, error: String },
    /// The job's state moved to another site (its store was lost by the others).
    StoreMoved { to: String },
    /// This node has not reached a majority of the rendezvous sites for the loss window: it
    /// is on the minority side of a partition, where the job must not run (the sites it
    /// reached, and the others with why).
    Minority { reached: Vec<String>, silent: Vec<String> },
    /// The job is over.
    Closed,
}

impl MembershipChange {
    /// A short, stable name of the change, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            MembershipChange::NodesWaiting => "nodes_waiting",
            MembershipChange::NodeLost { .. } => "node_lost",
            MembershipChange::RoundSuperseded { .. } => "round_superseded",
            MembershipChange::StoreReset => "store_reset",
            MembershipChange::StoreUnreachable { .. } => "store_unreachable",
            MembershipChange::StoreMoved { .. } => "store_moved",
            MembershipChange::Minority { .. } => "minority",
            MembershipChange::Closed => "closed",
        }
    }

    /// A change about the store alone, not about the nodes.
    pub fn is_about_the_store(&self) -> bool {
        matches!(
            self,
            MembershipChange::StoreReset
                | MembershipChange::StoreUnreachable { .. }
                | MembershipChange::StoreMoved { .. }
                | MembershipChange::Minority { .. }
        )
    }
}
