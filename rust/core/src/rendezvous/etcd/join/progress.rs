//! What a node waiting for a round says: its progress at INFO, and the error when it times out.

use elastix_etcd::pb::etcdserverpb::RangeRequest;
use tokio::time::Instant;

use super::{Ctx, Joined, NAMED};
use crate::rendezvous::error::RendezvousError;
use crate::rendezvous::records::{decode, Arrival};

impl Ctx<'_> {
    /// How many members round r has now, and the names of the first [`NAMED`].
    async fn arrivals(&self, r: u64) -> (u64, Vec<String>) {
        let range = self.keys.members(r);
        let request = RangeRequest { key: range.key, range_end: range.end, limit: NAMED, ..Default::default() };
        let Ok(response) = self.client.range(request).await else { return (0, Vec::new()) };
        let count = response.count.max(0) as u64;
        let mut names: Vec<String> = response
            .kvs
            .iter()
            .filter_map(|kv| decode::<Arrival>(&kv.value, "member record").ok()?.node.map(|node| node.to_string()))
            .collect();
        if count > NAMED as u64 {
            names.push(format!("... {} more", count - NAMED as u64));
        }
        (count, names)
    }

    /// Says, at INFO, what this node waits for, from whom, and until when.
    pub(super) async fn report_progress(&self, joined: &Joined, spare: bool, deadline: Instant) {
        let settings = self.settings;
        let (count, names) = self.arrivals(joined.round).await;
        let (min, max) = (settings.min_nodes, settings.max_nodes);
        let at = format!("etcd {}, run ID {}", self.client.endpoints(), settings.run_id);
        let remaining = deadline.saturating_duration_since(Instant::now()).as_secs();
        if spare {
            tracing::info!(
                "waiting as a spare: round {} is full ({max} node(s)) at {at}; this node joins when a slot opens",
                joined.round.saturating_sub(1)
            );
        } else if joined.previous_live > 0 && !joined.moved {
            tracing::info!(
                "waiting for round {} ({} node(s)) to re-form with this node at {at}, deadline in {remaining}s",
                joined.round - 1,
                joined.previous_live
            );
        } else if count < u64::from(min) {
            tracing::info!(
                "waiting for {} more node(s): {count} joined ({}) of {min}..{max} at {at}, deadline in {remaining}s",
                u64::from(min) - count,
                names.join(", ")
            );
        } else {
            tracing::info!(
                "last call: waiting for up to {} more node(s): {count} joined ({}) of {min}..{max} at {at}",
                u64::from(max).saturating_sub(count),
                names.join(", ")
            );
        }
    }

    pub(super) async fn timeout_error(&self, joined: &Joined) -> RendezvousError {
        let settings = self.settings;
        let r = joined.round;
        if joined.previous_live > 0 && !joined.moved {
            return RendezvousError::Timeout(format!(
                "rendezvous {:?}: waited {:.0?} (join_timeout) as a late node for round {} ({} node(s)) to re-form, \
                 but its nodes did not come back",
                settings.run_id,
                settings.join_timeout,
                r - 1,
                joined.previous_live
            ));
        }
        let (count, names) = self.arrivals(r).await;
        RendezvousError::Timeout(format!(
            "rendezvous {:?} round {r} timed out after {:.0?} (join_timeout): {count} node(s) joined [{}], but the \
             round needs at least {} (at most {}); {} more node(s) missing",
            settings.run_id,
            settings.join_timeout,
            names.join(", "),
            settings.min_nodes,
            settings.max_nodes,
            u64::from(settings.min_nodes).saturating_sub(count),
        ))
    }
}
