//! The job-wide facts kept with the rendezvous: whether it is closed and why, the restart
//! count, and what `elastix status` reads of each member.

use super::*;

impl<S: RendezvousStore> DynamicRendezvous<S> {
    pub async fn is_closed(&mut self) -> Result<bool> {
        self.with_conn(async |conn| conn.check(&[Keys::CLOSED.to_owned()]).await).await
    }

    /// Ends the job's rendezvous: no node may join any more, and every node is told.
    pub async fn set_closed(&mut self) -> Result<()> {
        self.set_closed_with("closed").await
    }

    /// Closes with a reason every node can read back ([`Self::closed_reason`]): how the job
    /// ended. The first reason stays.
    pub async fn set_closed_with(&mut self, reason: &str) -> Result<()> {
        let close_timeout = self.settings.close_timeout;
        let reason = if reason.is_empty() { "closed" } else { reason };
        let closing = self.with_conn(async |conn| {
            let stored = conn.compare_set(Keys::CLOSED, b"", reason.as_bytes()).await?;
            if stored.as_ref() == reason.as_bytes() {
                events::publish(conn, &Event::Closed { v: FORMAT_VERSION, reason: Some(reason.to_owned()) }).await?;
            }
            Ok(())
        });
        match tokio::time::timeout(close_timeout, closing).await {
            Ok(result) => result,
            Err(_) => {
                self.conn = None;
                Err(RendezvousError::Timeout(format!(
                    "closing rendezvous {:?} took longer than {close_timeout:?} (close_timeout)",
                    self.settings.run_id
                )))
            }
        }
    }

    /// Why the rendezvous was closed, if it is: as the close event said (so a node learns it
    /// even when the store went away with the node that closed it), else from the store.
    pub async fn closed_reason(&mut self) -> Result<Option<String>> {
        let announced = self.closed_reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        if announced.is_some() {
            return Ok(announced);
        }
        self.with_conn(async |conn| {
            let key = Keys::CLOSED.to_owned();
            Ok(conn.try_get(&key).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned()))
        })
        .await
    }

    /// Reports that this node's round ended in a failure. One crash often fails workers on
    /// every node, so only the first report of a round counts as a job-wide restart. Returns
    /// the number of restarts so far.
    pub async fn report_failure(&mut self) -> Result<i64> {
        let round = self.current.as_ref().map(|m| m.round).or(self.last_round.map(|last| last.round));
        let Some(round) = round else { return self.restart_count().await };
        let restarts = self
            .with_conn(async |conn| {
                let reports = conn.count_up(&Keys::failures(round)).await?;
                conn.add(Keys::RESTARTS, i64::from(reports == 1)).await
            })
            .await?;
        Ok(self.saw_restarts(restarts))
    }

    /// Counts one restart after a failure, job-wide; returns the new total.
    pub async fn record_restart(&mut self) -> Result<i64> {
        let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 1).await).await?;
        Ok(self.saw_restarts(restarts))
    }

    /// Restarts after failures so far, job-wide.
    pub async fn restart_count(&mut self) -> Result<i64> {
        let restarts = self.with_conn(async |conn| conn.add(Keys::RESTARTS, 0).await).await?;
        Ok(self.saw_restarts(restarts))
    }

    pub(super) fn saw_restarts(&mut self, restarts: i64) -> i64 {
        self.restarts_seen = self.restarts_seen.max(restarts);
        restarts
    }

    /// Publishes what this member's agent knows about itself, for `elastix status`.
    pub async fn publish_node_status(&mut self, facts: AgentFacts) -> Result<()> {
        let Some((round, rank)) = self.current.as_ref().map(|m| (m.round, m.rank)) else { return Ok(()) };
        let status = NodeStatus::new(self.node.clone(), facts, self.settings.node_lost_after());
        self.with_conn(async |conn| conn.set(&Keys::node_status(round, rank), &encode(&status)).await).await
    }

    /// What republishes this member's status in the current round, over a connection of its
    /// own (opened on first use, again after an error).
    pub fn status_writer(&self) -> Option<StatusWriter> {
        let (round, rank) = self.current.as_ref().map(|m| (m.round, m.rank))?;
        let (store, node, key) = (self.store.clone(), self.node.clone(), Keys::node_status(round, rank));
        let (lost_after, patience) = (self.settings.node_lost_after(), self.settings.heartbeat_timeout);
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
    pub async fn publish_failure(&mut self, failure: &FailureRecord) -> Result<()> {
        self.with_conn(async |conn| conn.set(Keys::LAST_FAILURE, &encode(failure)).await).await
    }
}
