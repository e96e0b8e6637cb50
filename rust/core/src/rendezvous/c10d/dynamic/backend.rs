//! The agent's interface to the c10d rendezvous ([`Backend`]): rounds, the job-wide facts
//! kept with them (closing and why, restarts, what `elastix status` reads of each member),
//! the questions the agent asks when its workers fail, and the end of this node's part.

use super::*;
use crate::rendezvous::backend::{Backend, Fut};

impl<S: RendezvousStore> Backend for DynamicRendezvous<S> {
    fn name(&self) -> &'static str {
        "c10d"
    }

    fn run_id(&self) -> &str {
        self.me.run_id()
    }

    /// The store site in use, for messages.
    fn describe_store(&self) -> String {
        self.store.describe()
    }

    fn secret(&self) -> Option<&crate::auth::Secret> {
        self.me.secret()
    }

    /// The first site it hosts.
    fn hosted_port(&self) -> Option<u16> {
        self.hosted.first().map(AnyServer::port)
    }

    fn store_lost_advice(&mut self) -> Option<String> {
        let join_timeout = self.me.settings.join_timeout;
        self.lost_store_advice(join_timeout)
    }

    fn loss_window(&self) -> Duration {
        self.me.loss_window()
    }

    /// Joins the next round and returns this node's place in it. Blocks until the round
    /// forms, up to `join_timeout` (spares wait without a deadline, as in torch). A store that
    /// stops answering meanwhile is looked for again (and the state moved if it is lost) until
    /// the deadline.
    fn next_rendezvous(&mut self) -> Fut<'_, RendezvousInfo> {
        Box::pin(async move {
            let deadline = Instant::now() + self.me.settings.join_timeout;
            if let Some(membership) = self.current.take() {
                self.last_round = Some(LastRound::of(&membership, self.store.sites()));
            }
            self.connect_by = Some(ConnectBound { by: deadline, quiet: false });
            let outcome = self.rendezvous_by(deadline).await;
            self.connect_by = None;
            outcome
        })
    }

    /// Reports that this node's round ended in a failure. One crash often fails workers on
    /// every node, so only the first report of a round counts as a job-wide restart. Returns
    /// the number of restarts so far.
    fn report_failure(&mut self) -> Fut<'_, i64> {
        Box::pin(async move {
            let round = self.current.as_ref().map(|m| m.round).or(self.last_round.map(|last| last.round));
            let Some(round) = round else { return self.restart_count().await };
            let restarts = self
                .with_conn(async |conn| {
                    let reports = conn.count_up(&Keys::failures(round)).await?;
                    conn.add(Keys::RESTARTS, i64::from(reports == 1)).await
                })
                .await?;
            Ok(self.saw_restarts(restarts))
        })
    }

    /// Counts one restart after a failure, job-wide; returns the new total.
    fn record_restart(&mut self) -> Fut<'_, i64> {
        Box::pin(async move {
            let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 1).await).await?;
            Ok(self.saw_restarts(restarts))
        })
    }

    /// Restarts after failures so far, job-wide.
    fn restart_count(&mut self) -> Fut<'_, i64> {
        Box::pin(async move {
            let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 0).await).await?;
            Ok(self.saw_restarts(restarts))
        })
    }

    /// Late nodes waiting for the current round to re-form with them (torch's wait list).
    fn num_nodes_waiting(&mut self) -> Fut<'_, u32> {
        Box::pin(async move {
            let Some(round) = self.current.as_ref().map(|m| m.round) else { return Ok(0) };
            let waiting = self.with_conn(async |conn| conn.tally(&Keys::waiting(round)).await).await?;
            Ok(waiting.max(0) as u32)
        })
    }

    fn is_closed(&mut self) -> Fut<'_, bool> {
        Box::pin(async move { self.with_conn(async |conn| conn.check(&[Keys::CLOSED.to_owned()]).await).await })
    }

    /// Closes with a reason every node can read back (`closed_reason`): how the job
    /// ended. The first reason stays.
    fn set_closed_with<'a>(&'a mut self, reason: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            let close_timeout = self.me.settings.close_timeout;
            let reason = if reason.is_empty() { "closed" } else { reason };
            let closing = self.with_conn(async |conn| {
                let stored = conn.compare_set(Keys::CLOSED, b"", reason.as_bytes()).await?;
                if stored.as_ref() == reason.as_bytes() {
                    events::publish(conn, &Event::Closed { v: FORMAT_VERSION, reason: Some(reason.to_owned()) })
                        .await?;
                }
                Ok(())
            });
            match tokio::time::timeout(close_timeout, closing).await {
                Ok(result) => result,
                Err(_) => {
                    self.conn = None;
                    Err(self.me.close_timed_out())
                }
            }
        })
    }

    /// Why the rendezvous was closed, if it is: as the close event said (so a node learns it
    /// even when the store went away with the node that closed it), else from the store.
    fn closed_reason(&mut self) -> Fut<'_, Option<String>> {
        Box::pin(async move {
            let announced = self.me.closed.get();
            if announced.is_some() {
                return Ok(announced);
            }
            self.with_conn(async |conn| {
                let key = Keys::CLOSED.to_owned();
                Ok(conn.try_get(&key).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned()))
            })
            .await
        })
    }

    /// Changes to the current round (`None` until one happens). Stale once the node moves
    /// to another round.
    fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        self.current.as_ref().map(|membership| membership.changes.clone())
    }

    /// Publishes what this member's agent knows about itself, for `elastix status`.
    fn publish_node_status(&mut self, facts: AgentFacts) -> Fut<'_, ()> {
        Box::pin(async move {
            let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
            let status = NodeStatus::new(self.me.node.clone(), facts, self.me.settings.node_lost_after());
            self.with_conn(async |conn| conn.set(&Keys::node_status(round, rank), &encode(&status)).await).await
        })
    }

    /// What republishes this member's status in the current round, over a connection of its
    /// own (opened on first use, again after an error).
    fn status_writer(&self) -> Option<StatusWriter> {
        let (round, rank) = self.current.as_ref().map(|m| (m.round, m.rank))?;
        let (store, node, key) = (self.store.clone(), self.me.node.clone(), Keys::node_status(round, rank));
        let (lost_after, patience) = (self.me.settings.node_lost_after(), self.me.settings.heartbeat_timeout);
        let conn: Arc<tokio::sync::Mutex<Option<S::Conn>>> = Arc::default();
        Some(Arc::new(move |facts| {
            let (store, conn, key) = (store.clone(), conn.clone(), key.clone());
            let status = NodeStatus::new(node.clone(), facts, lost_after);
            Box::pin(async move {
                let mut conn = conn.lock().await;
                if conn.is_none() {
                    *conn = Some(store.connect_site(store.active_site(), patience).await?);
                }
                let result = conn.as_mut().expect("connected above").set(&key, &encode(&status)).await;
                if result.is_err() {
                    *conn = None;
                }
                result
            })
        }))
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    fn publish_failure<'a>(&'a mut self, failure: &'a FailureRecord) -> Fut<'a, ()> {
        Box::pin(async move { self.with_conn(async |conn| conn.set(Keys::LAST_FAILURE, &encode(failure)).await).await })
    }

    /// Reports this node lost in its round, as a member that found it gone would: every
    /// member re-forms without it now.
    fn leave<'a>(&'a mut self, why: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
            let node = Some(self.me.node.clone());
            let outer = self.connect_by.replace(ConnectBound::question(&self.me.settings));
            let left = self.with_conn(async |conn| report_lost(conn, round, rank, node, why).await.map(drop)).await;
            self.connect_by = outer;
            left
        })
    }

    /// Asks the other members of the current round whether their agents are still there
    /// ([`crate::rendezvous::presence`]), and reports the gone ones lost at once (the heartbeat monitor
    /// would, a loss window later), so that every member re-forms without them now.
    /// `only`: the group ranks to ask (default: every other member).
    fn census<'a>(&'a mut self, only: Option<&'a [u32]>) -> Fut<'a, Census> {
        Box::pin(async move {
            let outer = self.connect_by.replace(ConnectBound::question(&self.me.settings));
            let census = self.ask_members(only).await;
            self.connect_by = outer;
            census
        })
    }

    /// The member record of group rank `rank` in the current round, read as a question is.
    fn member_node(&mut self, rank: u32) -> Fut<'_, Option<NodeDesc>> {
        Box::pin(async move {
            let outer = self.connect_by.replace(ConnectBound::question(&self.me.settings));
            let node = self.read_member(rank).await;
            self.connect_by = outer;
            node
        })
    }

    /// What ended this node's round without its watcher having said so yet: a newer round
    /// (the others re-formed without it: this agent was stopped, or cut off, while they did),
    /// the store losing the state the round lived in (it restarted empty), or an event about
    /// the round already in the log (a member reported lost, late nodes: another member's
    /// agent stopped its workers for it, which is how this node's workers came to fail).
    fn round_ended(&mut self) -> Fut<'_, Option<MembershipChange>> {
        Box::pin(async move {
            let outer = self.connect_by.replace(ConnectBound::question(&self.me.settings));
            let ended = self.look_for_round_end().await;
            self.connect_by = outer;
            ended
        })
    }

    /// The address of the store site that holds the job's state now: with several sites, the
    /// one a lost site's nodes moved to (found, or set up, as a re-join would).
    fn locate_store(&mut self) -> Option<Fut<'_, (String, u16)>> {
        Some(Box::pin(async move {
            if self.store.sites() > 1 {
                self.place(Instant::now() + self.me.settings.heartbeat_timeout * 2).await?;
            }
            Ok(self.store.address(self.store.active_site()))
        }))
    }

    /// Stops this node's heartbeats and background work, and the workers' store it serves.
    /// The rendezvous stays open for the other nodes (`set_closed` ends the job).
    fn shutdown(&mut self) {
        self.current = None;
    }

    /// Keeps the sites this agent serves up (at most `within`) while other nodes are still
    /// connected, reading how the job ended.
    fn linger(&mut self, within: Duration) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            self.disconnect();
            let deadline = Instant::now() + within;
            for server in &self.hosted {
                if server.connections() > 0 {
                    tracing::debug!(
                        "keeping the rendezvous store on port {} up for the other nodes ({} connected), at most \
                         {within:?}",
                        server.port(),
                        server.connections()
                    );
                }
                while server.connections() > 0 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if server.connections() > 0 {
                    tracing::debug!(
                        "stopping the rendezvous store on port {} with {} connection(s) still open after {within:?}",
                        server.port(),
                        server.connections()
                    );
                }
            }
        })
    }
}
