//! A node's identity in the rendezvous: (order, address, pid, local id), ordered in that order,
//! which makes ranks deterministic and stable while the same agents stay. The order is a
//! scheduler's node index where one is given (`--rdzv-conf node_order`), else none.

use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

use super::error::{RendezvousError, Result};

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeDesc {
    /// Ranks before the address where given (nodes without one rank first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<u32>,
    pub addr: String,
    pub pid: u32,
    /// Distinguishes several handlers in one process.
    pub local_id: u32,
    /// The port of the agent's presence listener at `addr` ([`super::presence`]), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence: Option<u16>,
}

impl NodeDesc {
    /// This process's next node identity at `addr` (default: the host name).
    pub fn this_process(addr: Option<&str>) -> NodeDesc {
        static NEXT_LOCAL_ID: AtomicU32 = AtomicU32::new(0);
        NodeDesc {
            order: None,
            addr: addr.map_or_else(host_name, str::to_owned),
            pid: std::process::id(),
            local_id: NEXT_LOCAL_ID.fetch_add(1, Ordering::Relaxed),
            presence: None,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a node description always serializes")
    }

    pub fn from_json(bytes: &[u8]) -> Result<NodeDesc> {
        serde_json::from_slice(bytes).map_err(|err| {
            RendezvousError::State(format!("unreadable node description {:?}: {err}", String::from_utf8_lossy(bytes)))
        })
    }
}

impl std::fmt::Display for NodeDesc {
    /// torch's form: `addr_pid_localid`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}_{}_{}", self.addr, self.pid, self.local_id)
    }
}

/// This machine's host name, or "localhost" if it has none.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|name| name.into_string().ok())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_order_by_address_then_pid_then_local_id() {
        let node =
            |addr: &str, pid, local_id| NodeDesc { order: None, addr: addr.into(), pid, local_id, presence: None };
        let mut nodes = [node("b", 1, 0), node("a", 9, 1), node("a", 9, 0), node("a", 10, 0)];
        nodes.sort();
        let order: Vec<String> = nodes.iter().map(ToString::to_string).collect();
        assert_eq!(order, ["a_9_0", "a_9_1", "a_10_0", "b_1_0"]);
    }

    #[test]
    fn a_schedulers_order_comes_before_the_address() {
        let node = |order, addr: &str| NodeDesc { order, addr: addr.into(), pid: 1, local_id: 0, presence: None };
        let mut nodes = [node(Some(2), "n2"), node(Some(10), "n10"), node(Some(1), "n9"), node(None, "z")];
        nodes.sort();
        let addrs: Vec<&str> = nodes.iter().map(|node| node.addr.as_str()).collect();
        assert_eq!(addrs, ["z", "n9", "n2", "n10"]);
        let json = nodes[1].to_json();
        assert_eq!(NodeDesc::from_json(&json).unwrap(), nodes[1]);
        // a record written without an order (an older agent) still reads
        assert_eq!(NodeDesc::from_json(br#"{"addr":"a","pid":1,"local_id":0}"#).unwrap().order, None);
    }

    #[test]
    fn local_ids_differ_within_a_process_and_json_round_trips() {
        let a = NodeDesc::this_process(Some("127.0.0.2"));
        let b = NodeDesc::this_process(Some("127.0.0.2"));
        assert_ne!(a, b);
        assert_eq!(NodeDesc::from_json(&a.to_json()).unwrap(), a);
        assert!(NodeDesc::from_json(b"garbage").is_err());
        assert!(!NodeDesc::this_process(None).addr.is_empty());
    }
}
