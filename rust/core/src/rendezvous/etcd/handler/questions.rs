//! What the agent asks when its workers fail: whether the round ended without this node's
//! watch saying so yet, and whether the other members' agents are still there.

use super::*;

impl EtcdRendezvous {
    /// Nodes that entered the round after the current one (late nodes and spares).
    /// Asks the other members of the current round (`only` these group ranks, if given)
    /// whether they are still there: through etcd first (a member whose agent runs and reaches
    /// etcd answers in its ask key at once), then, for those that do not answer, at their
    /// presence port. A member that does not answer and whose machine refuses the probe is
    /// gone: its lease is revoked, which deletes its member key, so every member's watch sees
    /// it lost now rather than when its lease would have expired. A refusal alone proves
    /// nothing (a firewall that rejects gives one too).
    pub async fn census(&mut self, only: Option<&[u32]>) -> Result<Census> {
        let Some(membership) = &self.current else { return Ok(Census::default()) };
        let (round, me) = (membership.round, membership.rank);
        let request = ops::members_as_sealed(&self.keys.members(round), membership.sealed_at, membership.last_member);
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
                tracing::debug!(round, rank, "could not revoke the lost member's lease ({err}); it expires on its own");
            }
        }
        Ok(census)
    }

    /// A round sealed after this node's, if one was: the others re-formed without it.
    pub async fn round_ended(&mut self) -> Result<Option<MembershipChange>> {
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
    }

    pub(super) fn current_round(&self) -> Option<u64> {
        self.current.as_ref().map(|membership| membership.round)
    }
}
