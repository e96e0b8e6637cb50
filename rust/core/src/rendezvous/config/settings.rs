//! What a dynamic rendezvous needs to know, with torch's defaults.

use std::time::Duration;

use crate::auth::Secret;
use crate::rendezvous::config::conf::RendezvousConf;
use crate::rendezvous::error::{RendezvousError, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousSettings {
    /// Names the job; agents with the same run id form one rendezvous.
    pub run_id: String,
    pub min_nodes: u32,
    pub max_nodes: u32,
    /// Deadline for one `next_rendezvous` call (waiting nodes included; spares wait freely).
    pub join_timeout: Duration,
    /// Once `min_nodes` joined, how long to wait for more before the round starts.
    pub last_call_timeout: Duration,
    /// Deadline for closing the rendezvous.
    pub close_timeout: Duration,
    /// Deadline for one heartbeat write.
    pub heartbeat_timeout: Duration,
    /// Time between heartbeats.
    pub keep_alive_interval: Duration,
    /// A node missing this many heartbeats in a row is dead.
    pub keep_alive_max_attempt: u32,
    /// The address other nodes (and workers, for rank 0) use to reach this node; also the first
    /// key of the rank order. Default: this machine's host name.
    pub local_addr: Option<String>,
    /// How often a node waiting for others says so (INFO), with who has joined.
    pub progress_interval: Duration,
    /// How long a member may be out of contact with the store before it stops its workers;
    /// `None`: as long as the others take to count it lost ([`Self::node_lost_after`]).
    pub store_outage_limit: Option<Duration>,
    /// The job secret: every store connection proves it, and the stores this node serves
    /// require it.
    pub secret: Option<Secret>,
    /// The first key of this node's rank order, before its address (a scheduler's node
    /// index, so that group ranks follow it); `None` ranks before any number.
    pub node_order: Option<u32>,
}

/// See [`RendezvousSettings::master_wait`].
pub const SEALED_ROUND_GRACE: Duration = Duration::from_secs(2);

impl RendezvousSettings {
    pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
    pub const DEFAULT_LAST_CALL_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_CLOSE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
    pub const DEFAULT_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);
    pub const DEFAULT_KEEP_ALIVE_MAX_ATTEMPT: u32 = 3;
    pub const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_secs(15);

    pub fn new(run_id: impl Into<String>, min_nodes: u32, max_nodes: u32) -> Result<Self> {
        let settings = RendezvousSettings {
            run_id: run_id.into(),
            min_nodes,
            max_nodes,
            join_timeout: Self::DEFAULT_JOIN_TIMEOUT,
            last_call_timeout: Self::DEFAULT_LAST_CALL_TIMEOUT,
            close_timeout: Self::DEFAULT_CLOSE_TIMEOUT,
            heartbeat_timeout: Self::DEFAULT_HEARTBEAT_TIMEOUT,
            keep_alive_interval: Self::DEFAULT_KEEP_ALIVE_INTERVAL,
            keep_alive_max_attempt: Self::DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
            local_addr: None,
            progress_interval: Self::DEFAULT_PROGRESS_INTERVAL,
            store_outage_limit: None,
            secret: None,
            node_order: None,
        };
        settings.validate()?;
        Ok(settings)
    }

    /// Applies the timing keys of a dynamic backend's `--rdzv-conf`.
    pub fn with_conf(mut self, conf: &RendezvousConf) -> Result<Self> {
        self.join_timeout = conf.duration("join_timeout", self.join_timeout)?;
        self.last_call_timeout = conf.duration("last_call_timeout", self.last_call_timeout)?;
        self.close_timeout = conf.duration("close_timeout", self.close_timeout)?;
        self.heartbeat_timeout = conf.duration("heartbeat_timeout", self.heartbeat_timeout)?;
        self.keep_alive_interval = conf.duration("keep_alive_interval", self.keep_alive_interval)?;
        self.keep_alive_max_attempt = conf.positive_int("keep_alive_max_attempt", self.keep_alive_max_attempt)?;
        if let Some(order) = conf.int("node_order")? {
            let order = u32::try_from(order).map_err(|_| {
                RendezvousError::Config(format!("--rdzv-conf node_order must be 0 or more, got {order}"))
            })?;
            self.node_order = Some(order);
        }
        self.validate()?;
        Ok(self)
    }

    pub fn validate(&self) -> Result<()> {
        if self.run_id.is_empty() {
            return Err(RendezvousError::Config("the run id must not be empty".into()));
        }
        if self.min_nodes < 1 {
            return Err(RendezvousError::Config(format!("min_nodes must be at least 1, got {}", self.min_nodes)));
        }
        if self.max_nodes < self.min_nodes {
            return Err(RendezvousError::Config(format!(
                "max_nodes ({}) must be at least min_nodes ({})",
                self.max_nodes, self.min_nodes
            )));
        }
        Ok(())
    }

    /// How long a member of a sealed round waits for rank 0's workers' store address: up to
    /// the join deadline, but never less than [`SEALED_ROUND_GRACE`] (a round that seals at
    /// its deadline would otherwise fail for the moment rank 0 takes to start that store).
    pub fn master_wait(&self, deadline: tokio::time::Instant) -> Duration {
        deadline.saturating_duration_since(tokio::time::Instant::now()).max(SEALED_ROUND_GRACE)
    }

    /// After this long without a heartbeat a node counts as dead.
    pub fn node_lost_after(&self) -> Duration {
        self.keep_alive_interval * self.keep_alive_max_attempt
    }

    /// After this long out of contact with the store a member stops its workers.
    pub fn store_outage_limit(&self) -> Duration {
        self.store_outage_limit.unwrap_or_else(|| self.node_lost_after())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::config::conf::DYNAMIC_KEYS;

    #[test]
    fn defaults_are_torchs() {
        let settings = RendezvousSettings::new("job", 1, 4).unwrap();
        assert_eq!(settings.join_timeout, Duration::from_secs(600));
        assert_eq!(settings.last_call_timeout, Duration::from_secs(30));
        assert_eq!(settings.node_lost_after(), Duration::from_secs(15));
    }

    #[test]
    fn conf_overrides_and_validation() {
        let conf =
            RendezvousConf::parse("join_timeout=2m,keep_alive_interval=1s,keep_alive_max_attempt=2", DYNAMIC_KEYS)
                .unwrap();
        let settings = RendezvousSettings::new("job", 2, 2).unwrap().with_conf(&conf).unwrap();
        assert_eq!(settings.join_timeout, Duration::from_secs(120));
        assert_eq!(settings.node_lost_after(), Duration::from_secs(2));
        assert!(RendezvousSettings::new("", 1, 1).is_err());
        assert!(RendezvousSettings::new("job", 0, 1).is_err());
        let err = RendezvousSettings::new("job", 3, 2).unwrap_err().to_string();
        assert!(err.contains("max_nodes (2) must be at least min_nodes (3)"), "{err}");
    }

    #[test]
    fn node_order_is_a_number_of_zero_or_more() {
        let with = |text| {
            RendezvousSettings::new("job", 1, 2).unwrap().with_conf(&RendezvousConf::parse(text, DYNAMIC_KEYS).unwrap())
        };
        assert_eq!(with("node_order=0").unwrap().node_order, Some(0));
        assert_eq!(with("").unwrap().node_order, None);
        let err = with("node_order=-1").unwrap_err().to_string();
        assert!(err.contains("node_order must be 0 or more"), "{err}");
        assert!(with("node_order=first").is_err());
    }
}
