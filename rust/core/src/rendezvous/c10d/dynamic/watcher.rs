//! The membership watcher: follows the round's event log and tells the member what ended it.

use super::*;

/// Follows the event log from event `seen + 1` and reports what matters to a member of the
/// round; keeps the first change that ended the round and any later ones. A lost connection is
/// made again; a store that comes back without the copy of the state this node knew is a
/// [`MembershipChange::StoreReset`].
pub(super) fn spawn_change_watcher<S: RendezvousStore>(
    context: RoundContext<S>,
    seen: i64,
    known: Known,
    closed: CloseNote,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let round = context.round;
        let patience = context.settings.keep_alive_interval;
        let mut next = seen + 1;
        let mut conn: Option<S::Conn> = None;
        loop {
            let Some(live) = conn.as_mut() else {
                match context.store.connect_site(known.site, patience).await {
                    Ok(mut fresh) => match locate::read_meta(&mut fresh).await {
                        Ok(Some(meta)) if meta.incarnation == known.incarnation => conn = Some(fresh),
                        Ok(_) => {
                            tracing::debug!(
                                round,
                                "the store at {} lost the rendezvous state",
                                context.store.describe()
                            );
                            let _ = context.changes.send(Some(MembershipChange::StoreReset));
                            return;
                        }
                        Err(err) => tracing::debug!(round, "membership watcher: {err}"),
                    },
                    Err(err) => tracing::debug!(round, "membership watcher cannot reconnect yet: {err}"),
                }
                if conn.is_none() {
                    tokio::time::sleep(SITE_RETRY).await;
                }
                continue;
            };
            match events::wait_for(live, next, None).await {
                Ok(event) => {
                    if let Some(Event::Closed { reason: Some(reason), .. }) = &event {
                        closed.set(reason.clone());
                    }
                    if let Some(change) = event.as_ref().and_then(|event| relevance(event, round)) {
                        tracing::debug!(round, ?change, "membership change"); // the agent says what it does about it
                        if context.changes.send(Some(change)).is_err() {
                            return; // nobody listens any more
                        }
                    }
                    next += 1;
                }
                Err(err) => {
                    tracing::debug!(round, "membership watcher lost its connection: {err}; reconnecting");
                    conn = None;
                }
            }
        }
    })
}

pub(super) fn relevance(event: &Event, round: u64) -> Option<MembershipChange> {
    match event {
        Event::Opened { round: opened, .. } if *opened > round => {
            Some(MembershipChange::RoundSuperseded { round: *opened })
        }
        Event::Waiting { round: r, .. } if *r == round => Some(MembershipChange::NodesWaiting),
        Event::Lost { round: r, rank, node, .. } if *r == round => {
            Some(MembershipChange::NodeLost { rank: Some(*rank), node: node.clone() })
        }
        Event::Closed { .. } => Some(MembershipChange::Closed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_events_about_this_round_or_later_matter() {
        let node = NodeDesc { order: None, addr: "a".into(), pid: 1, local_id: 0, presence: None };
        assert_eq!(relevance(&Event::Opened { v: 1, round: 3 }, 3), None);
        assert_eq!(
            relevance(&Event::Opened { v: 1, round: 4 }, 3),
            Some(MembershipChange::RoundSuperseded { round: 4 })
        );
        assert_eq!(relevance(&Event::Waiting { v: 1, round: 2, node: node.clone() }, 3), None);
        assert_eq!(relevance(&Event::Waiting { v: 1, round: 3, node }, 3), Some(MembershipChange::NodesWaiting));
        assert_eq!(relevance(&Event::Lost { v: 1, round: 2, rank: 0, node: None }, 3), None);
        assert_eq!(relevance(&Event::Closed { v: 1, reason: None }, 3), Some(MembershipChange::Closed));
    }
}
