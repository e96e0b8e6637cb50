//! The agent's interface to the etcd rendezvous ([`Backend`]): rounds, the job-wide facts
//! kept with them (closing and why, restarts, what `elastix status` reads of each member),
//! the questions the agent asks when its workers fail, and the end of this node's part.

use super::*;

impl Backend for EtcdRendezvous {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn run_id(&self) -> &str {
        self.me.run_id()
    }

    /// The cluster, for messages.
    fn describe_store(&self) -> String {
        format!("etcd {}", self.client.endpoints())
    }

    fn secret(&self) -> Option<&crate::auth::Secret> {
        self.me.secret()
    }

    fn loss_window(&self) -> Duration {
        self.me.loss_window()
    }

    /// Joins the next round and returns this node's place in it, up to `join_timeout` (spares
    /// wait without a deadline). etcd out of reach meanwhile is tried again until the deadline.
    fn next_rendezvous(&mut self) -> Fut<'_, RendezvousInfo> {
        Box::pin(async move {
            let deadline = Instant::now() + self.me.settings.join_timeout;
            if let Some(membership) = self.current.take() {
                self.last_round = Some(membership.round);
            }
            let mut spare = false;
            loop {
                match self.try_round(deadline, &mut spare).await {
                    Ok(Some(info)) => return Ok(info),
                    Ok(None) => {}
                    Err(err) if err.is_store_unreachable() && Instant::now() < deadline => {
                        tracing::warn!("lost etcd at {}: {err}; trying again", self.client.endpoints());
                        tokio::time::sleep(RETRY).await;
                    }
                    // cut off longer than its TTL, the node's lease expired before it knew
                    Err(RendezvousError::LeaseGone(why)) if Instant::now() < deadline => {
                        tracing::warn!("this node's etcd lease is gone ({why}); entering again with a new one");
                        self.lease = None; // nothing to revoke: etcd has forgotten it
                    }
                    Err(err) => return Err(err),
                }
            }
        })
    }

    /// Reports that this node's round ended in a failure. One crash often fails workers on
    /// every node, so a round's reports count one job-wide restart: the count is the number
    /// of keys under `failures/`, and writing one is the same however often it is retried
    /// (a reply lost in a leader change cannot count twice). Returns the restarts so far.
    fn report_failure(&mut self) -> Fut<'_, i64> {
        Box::pin(async move {
            let Some(round) = self.current_round().or(self.last_round) else { return self.restart_count().await };
            self.count_restart(self.keys.failures(&round.to_string())).await
        })
    }

    /// Counts one restart after a failure, job-wide; returns the new total.
    fn record_restart(&mut self) -> Fut<'_, i64> {
        Box::pin(
            async move { self.count_restart(self.keys.failures(&format!("by-hand-{:016x}", fastrand::u64(..)))).await },
        )
    }

    /// Restarts after failures so far, job-wide.
    fn restart_count(&mut self) -> Fut<'_, i64> {
        Box::pin(async move {
            let request = TxnRequest { success: vec![ops::count(&self.keys.all_failures(), 0)], ..Default::default() };
            let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
            Ok(ops::counted(&response, 0) as i64)
        })
    }

    /// Nodes that entered the round after the current one (late nodes and spares).
    fn num_nodes_waiting(&mut self) -> Fut<'_, u32> {
        Box::pin(async move {
            let Some(round) = self.current.as_ref().map(|m| m.round) else { return Ok(0) };
            let request =
                TxnRequest { success: vec![ops::count(&self.keys.members(round + 1), 0)], ..Default::default() };
            let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
            Ok(ops::counted(&response, 0) as u32)
        })
    }

    fn is_closed(&mut self) -> Fut<'_, bool> {
        Box::pin(async move { Ok(self.read(&self.keys.closed()).await?.is_some()) })
    }

    /// Ends the job's rendezvous with a reason every node can read: no node may enter any
    /// more, and the members of the live rounds (and those waiting for the next) are told
    /// through their rounds' watches. The first reason stays.
    fn set_closed_with<'a>(&'a mut self, reason: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            let reason = if reason.is_empty() { "closed" } else { reason };
            let close_timeout = self.me.settings.close_timeout;
            let closing = async {
                let latest =
                    self.read(&self.keys.round()).await?.map(|bytes| ops::number(&bytes, "round")).transpose()?;
                let mut rounds: Vec<u64> = [latest.map(|r| r.max(0) as u64), self.last_round, self.current_round()]
                    .into_iter()
                    .flatten()
                    .flat_map(|r| [r, r + 1])
                    .collect();
                rounds.sort_unstable();
                rounds.dedup();
                let mut success = vec![ops::put(&self.keys.closed(), reason.as_bytes(), 0)];
                success.extend(rounds.iter().map(|r| ops::put(&self.keys.closed_marker(*r), reason.as_bytes(), 0)));
                let request = TxnRequest { compare: vec![ops::absent(&self.keys.closed())], success, failure: vec![] };
                self.client.txn(request).await.map_err(|err| self.error(err))
            };
            match tokio::time::timeout(close_timeout, closing).await {
                Ok(result) => {
                    if result?.succeeded {
                        self.me.closed.set(reason.to_owned());
                    }
                    Ok(())
                }
                Err(_) => Err(self.me.close_timed_out()),
            }
        })
    }

    /// Why the rendezvous was closed, if it is: as the close said, else from etcd.
    fn closed_reason(&mut self) -> Fut<'_, Option<String>> {
        Box::pin(async move {
            let announced = self.me.closed.get();
            if announced.is_some() {
                return Ok(announced);
            }
            Ok(self.read(&self.keys.closed()).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned()))
        })
    }

    /// Changes to the current round (`None` until one happens).
    fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        self.current.as_ref().map(|membership| membership.changes.clone())
    }

    /// Publishes what this member's agent knows about itself, for `elastix status`.
    fn publish_node_status(&mut self, facts: AgentFacts) -> Fut<'_, ()> {
        Box::pin(async move {
            let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
            let status = NodeStatus::new(self.me.node.clone(), facts, self.me.settings.node_lost_after());
            let key = self.keys.node_status(round, rank);
            self.client.put(&key, &encode(&status)).await.map_err(|err| self.error(err))
        })
    }

    /// What republishes this member's status in the current round.
    fn status_writer(&self) -> Option<StatusWriter> {
        let (round, rank) = self.current.as_ref().map(|m| (m.round, m.rank))?;
        let (client, node, key) = (self.client.clone(), self.me.node.clone(), self.keys.node_status(round, rank));
        let lost_after = self.me.settings.node_lost_after();
        Some(Arc::new(move |facts| {
            let (client, key) = (client.clone(), key.clone());
            let status = NodeStatus::new(node.clone(), facts, lost_after);
            Box::pin(async move {
                client.put(&key, &encode(&status)).await.map(drop).map_err(|err| etcd_error(err, &client))
            })
        }))
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    fn publish_failure<'a>(&'a mut self, failure: &'a FailureRecord) -> Fut<'a, ()> {
        Box::pin(async move {
            let key = self.keys.last_failure();
            self.client.put(&key, &encode(failure)).await.map_err(|err| self.error(err))
        })
    }

    /// The member key of group rank `rank` in the current round (as sealed), decoded.
    fn member_node(&mut self, rank: u32) -> Fut<'_, Option<NodeDesc>> {
        Box::pin(async move {
            let Some(membership) = &self.current else { return Ok(None) };
            let request = ops::members_as_sealed(
                &self.keys.members(membership.round),
                membership.sealed_at,
                membership.last_member,
            );
            let response = self.client.range(request).await.map_err(|err| self.error(err))?;
            let member = response.kvs.get(rank as usize);
            Ok(member.and_then(|kv| decode::<Arrival>(&kv.value, "member").ok()).and_then(|arrival| arrival.node))
        })
    }

    /// Asks the other members of the current round (`only` these group ranks, if given)
    /// whether they are still there: through etcd first (a member whose agent runs and reaches
    /// etcd answers in its ask key at once), then, for those that do not answer, at their
    /// presence port. A member that does not answer and whose machine refuses the probe is
    /// gone: its lease is revoked, which deletes its member key, so every member's watch sees
    /// it lost now rather than when its lease would have expired. A refusal alone proves
    /// nothing (a firewall that rejects gives one too).
    fn census<'a>(&'a mut self, only: Option<&'a [u32]>) -> Fut<'a, Census> {
        Box::pin(async move {
            let Some(membership) = &self.current else { return Ok(Census::default()) };
            let (round, me) = (membership.round, membership.rank);
            let request =
                ops::members_as_sealed(&self.keys.members(round), membership.sealed_at, membership.last_member);
            let response = self.client.range(request).await.map_err(|err| self.error(err))?;
            let mut asked = Vec::new();
            for (rank, kv) in (0u32..).zip(&response.kvs) {
                if rank == me || only.is_some_and(|only| !only.contains(&rank)) {
                    continue;
                }
                let KeyKind::Member { id, .. } = self.keys.kind(&kv.key) else { continue };
                if let Ok(Arrival { node: Some(node), .. }) = decode::<Arrival>(&kv.value, "member") {
                    let (key, nonce) = (self.keys.ask(round, &id), format!("{:016x}", fastrand::u64(..)));
                    let ask = [b"?".as_slice(), nonce.as_bytes()].concat();
                    self.client.put(&key, &ask).await.map_err(|err| self.error(err))?;
                    let answer = [b"!".as_slice(), nonce.as_bytes()].concat();
                    asked.push(Asked { rank, node, lease: kv.lease, key, answer });
                }
            }
            let deadline = Instant::now() + ASK_PATIENCE;
            loop {
                let mut waiting = Vec::new();
                for entry in asked.drain(..) {
                    let (answer, _) = self.client.get(&entry.key).await.map_err(|err| self.error(err))?;
                    if answer.as_deref() != Some(entry.answer.as_slice()) {
                        waiting.push(entry);
                    }
                }
                asked = waiting;
                if asked.is_empty() || Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(ASK_POLL).await;
            }
            let leases: std::collections::HashMap<u32, i64> = asked.iter().map(|a| (a.rank, a.lease)).collect();
            let census = presence::census(asked.into_iter().map(|a| (a.rank, a.node)).collect(), PROBE_TIMEOUT).await;
            for (rank, node) in &census.gone {
                tracing::warn!(
                    "round {round}: node {node} (group rank {rank}) lost: its agent at {} is gone (it did not answer \
                     through etcd, and its presence port refused the probe); revoking its lease",
                    node.addr
                );
                let lease = Lease { id: leases[rank], ttl: Duration::ZERO };
                if let Err(err) = self.client.revoke_lease(lease).await {
                    tracing::debug!(
                        round,
                        rank,
                        "could not revoke the lost member's lease ({err}); it expires on its own"
                    );
                }
            }
            Ok(census)
        })
    }

    /// A round sealed after this node's, if one was: the others re-formed without it.
    fn round_ended(&mut self) -> Fut<'_, Option<MembershipChange>> {
        Box::pin(async move {
            let Some(membership) = &self.current else { return Ok(None) };
            let (round, sealed_at, last_member) = (membership.round, membership.sealed_at, membership.last_member);
            let latest = self.read(&self.keys.round()).await?.map(|bytes| ops::number(&bytes, "round")).transpose()?;
            if let Some(newer) = latest.map(|latest| latest.max(0) as u64).filter(|latest| *latest > round) {
                return Ok(Some(MembershipChange::RoundSuperseded { round: newer }));
            }
            // a member whose key is gone already (lost, or gone on to the next round) ended the
            // round, though this node's watch may not have said so yet: another member's agent
            // stopped its workers for it, which is how this node's workers came to fail
            let members = self.keys.members(round);
            let sealed = ops::members_as_sealed(&members, sealed_at, last_member);
            let now = ops::members_as_sealed(&members, 0, last_member);
            let (sealed, now) = (self.client.range(sealed), self.client.range(now));
            let (sealed, now) = tokio::try_join!(sealed, now).map_err(|err| self.error(err))?;
            let present: std::collections::HashSet<&[u8]> = now.kvs.iter().map(|kv| kv.key.as_slice()).collect();
            let gone = (0u32..).zip(&sealed.kvs).find(|(_, kv)| !present.contains(kv.key.as_slice()));
            Ok(gone.map(|(rank, kv)| {
                let node = decode::<Arrival>(&kv.value, "member").ok().and_then(|arrival| arrival.node);
                MembershipChange::NodeLost { rank: Some(rank), node }
            }))
        })
    }

    /// Stops this node's part: its round's watch, the workers' store it serves, and the
    /// renewal of its lease (which then expires: the others count this node gone). The
    /// rendezvous stays open for the other nodes.
    fn shutdown(&mut self) {
        self.current = None;
        self.lease = None;
    }

    fn linger(&mut self, _within: Duration) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        self.shutdown();
        Box::pin(std::future::ready(()))
    }
}
