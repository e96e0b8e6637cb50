//! What the agent asks when its workers fail: whether the round ended without this node's
//! watcher saying so yet, and whether the other members' agents are still there.

use super::*;

impl<S: RendezvousStore> DynamicRendezvous<S> {
    /// How group rank `rank` of the current round described itself when it arrived.
    pub(super) async fn read_member(&mut self, rank: u32) -> Result<Option<NodeDesc>> {
        let Some(round) = self.current.as_ref().map(|m| m.round) else { return Ok(None) };
        let bytes = self.with_conn(async |conn| conn.try_get(&member_key(round, rank)).await).await?;
        Ok(bytes.and_then(|bytes| decode::<Arrival>(&bytes, "member").ok()).and_then(|arrival| arrival.node))
    }

    /// `census`, its new connections bounded as a question's: the workers' failure
    /// that prompts it often came with the store's loss.
    pub(super) async fn ask_members(&mut self, only: Option<&[u32]>) -> Result<Census> {
        let Some((round, rank, world_size)) = self.current.as_ref().map(|m| (m.round, m.rank, m.world_size)) else {
            return Ok(Census::default());
        };
        let asked: Vec<u32> =
            (0..world_size).filter(|other| *other != rank && only.map_or(true, |only| only.contains(other))).collect();
        // every member asked at once, then their answers awaited up to one deadline
        let silent = self
            .with_conn(async |conn| {
                let mut before = Vec::with_capacity(asked.len());
                for &other in &asked {
                    before.push((other, ask(conn, round, other).await?));
                }
                let deadline = Instant::now() + ASK_PATIENCE;
                let mut silent = Vec::new();
                for (other, before) in before {
                    let within = deadline.saturating_duration_since(Instant::now());
                    if !answered(conn, round, other, before, within).await? {
                        if let Some(bytes) = conn.try_get(&member_key(round, other)).await? {
                            if let Ok(Arrival { node: Some(node), .. }) = decode::<Arrival>(&bytes, "member") {
                                silent.push((other, node));
                            }
                        }
                    }
                }
                Ok(silent)
            })
            .await;
        let silent = match silent {
            Ok(silent) => silent,
            Err(err) => {
                // the store went with the failure: that ends the round (and with several
                // sites, its host is one of the members not coming back)
                if err.is_store_unreachable() {
                    let change = MembershipChange::StoreUnreachable {
                        store: self.store.describe(),
                        silent_for: Duration::ZERO,
                        error: err.to_string(),
                    };
                    if let Some(membership) = &self.current {
                        membership
                            .notify
                            .send_if_modified(|current| current.is_none() && current.replace(change).is_none());
                    }
                }
                return Err(err);
            }
        };
        if silent.is_empty() {
            return Ok(Census::default());
        }
        // members that did not answer: is their agent gone (its machine refuses), or only
        // silent (stopped, cut off from the store, a dead machine)?
        let mut census = presence::census(silent, PROBE_TIMEOUT).await;
        if !census.gone.is_empty() && !holds_a_majority(&self.store.clone()).await {
            // a refusal seen from the minority side of a partition is no verdict
            let unsure = census.gone.drain(..).map(|(rank, node)| {
                (rank, format!("{} refused, but this node reaches no majority of the sites", node.addr))
            });
            census.unsure.extend(unsure);
        }
        for (lost, node) in &census.gone {
            let why = format!(
                "its agent at {} is gone (it did not answer through the store, and its presence port refused the probe)",
                node.addr
            );
            let node = Some(node.clone());
            self.with_conn(async |conn| report_lost(conn, round, *lost, node, &why).await).await?;
        }
        Ok(census)
    }

    /// `round_ended`, its new connections bounded as a question's.
    pub(super) async fn look_for_round_end(&mut self) -> Result<Option<MembershipChange>> {
        let Some((round, seen)) = self.current.as_ref().map(|m| (m.round, m.events_seen)) else { return Ok(None) };
        let known = self.known;
        let look = async |conn: &mut S::Conn| {
            let meta = locate::read_meta(conn).await?;
            if known.is_some_and(|known| meta.as_ref().map_or(true, |meta| meta.incarnation != known.incarnation)) {
                return Ok(Some(MembershipChange::StoreReset));
            }
            // events are few per round; a producer writes an event's key just after counting
            // it, so one that is not there yet is skipped. A member's loss tells most (it is
            // what broke this node's workers, though the others have moved on since); else
            // the first change, else a newer round.
            let mut first = None;
            for n in seen + 1..=events::count(conn).await? {
                let Some(bytes) = conn.try_get(&Keys::event(n)).await? else { continue };
                match decode::<Event>(&bytes, "event").ok().and_then(|event| relevance(&event, round)) {
                    Some(lost @ MembershipChange::NodeLost { .. }) => return Ok(Some(lost)),
                    Some(change) => first = first.or(Some(change)),
                    None => {}
                }
            }
            if first.is_some() {
                return Ok(first);
            }
            let current = current_round(conn).await?;
            Ok((current > round).then_some(MembershipChange::RoundSuperseded { round: current }))
        };
        match self.with_conn(look).await {
            // the main connection may have gone stale while idle (the store restarted): these
            // reads are safe to make again, on a fresh one
            Err(err) if err.is_store_unreachable() => self.with_conn(look).await,
            found => found,
        }
    }
}
