//! Where the job's state lives: with several sites, every one is asked, only a node that
//! reaches a majority may run the job, and the best copy is settled on (see [`crate::rendezvous::c10d::locate`]).

use super::*;

impl<S: RendezvousStore> DynamicRendezvous<S> {
    /// Finds the copy of the state to work with ([`super::locate`]), setting one up where the
    /// rules say so, and fails fast if other agents use different bounds or another format.
    /// With several sites every one is asked each time: only a node that reaches a majority
    /// of them may run the job, and the best copy may be anywhere.
    pub(super) async fn place(&mut self, deadline: Instant) -> Result<()> {
        let mut reported = Instant::now();
        let mut said_minority = false;
        loop {
            let probes = self.probe_sites().await?;
            let choice = locate::choose(&probes, self.known);
            match choice {
                Choice::Join(site) => {
                    let Probe::Answer(Some(meta)) = probes[site].clone() else {
                        unreachable!("joined sites hold the state")
                    };
                    return self.settle(site, meta).await;
                }
                Choice::Create { site, generation } => {
                    self.move_to(site);
                    let ours = Meta {
                        v: FORMAT_VERSION,
                        min_nodes: self.me.settings.min_nodes,
                        max_nodes: self.me.settings.max_nodes,
                        incarnation: fastrand::u64(1..),
                        generation,
                    };
                    let mine = encode(&ours);
                    let stored = self.with_conn(async |conn| conn.compare_set(Keys::META, b"", &mine).await).await?;
                    if stored[..] == mine[..] {
                        // this node made the run's state: the store's list of runs names it
                        let run_id = self.me.settings.run_id.clone();
                        if let Err(err) = self.with_conn(async |conn| conn.register_run(&run_id).await).await {
                            tracing::debug!("cannot add run {run_id:?} to the store's list of runs: {err}");
                        }
                    }
                    return self.settle(site, decode(&stored, "metadata")?).await;
                }
                Choice::Wait | Choice::Minority => {
                    let now = Instant::now();
                    let (reached, silent) = locate::split_sites(&self.store, &probes);
                    let what = match choice {
                        Choice::Minority => format!(
                            "a majority of the {} rendezvous sites (this node reaches {}; not {}): it is on the \
                             minority side of a partition, and the job may run on the other side",
                            probes.len(),
                            list_or_none(&reached),
                            silent.join(", ")
                        ),
                        _ => format!(
                            "a rendezvous store site to answer: {}",
                            reached
                                .iter()
                                .map(|site| format!("{site} (no state)"))
                                .chain(silent)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    };
                    if now >= deadline {
                        return Err(RendezvousError::Timeout(format!(
                            "rendezvous {:?}: waited {:?} (join_timeout) for {what}",
                            self.me.settings.run_id, self.me.settings.join_timeout,
                        )));
                    }
                    if choice == Choice::Minority && !said_minority {
                        // said at once: this node's workers are not running, and this is why
                        said_minority = true;
                        reported = now;
                        tracing::warn!("waiting for {what}; deadline in {}s", deadline.duration_since(now).as_secs());
                    } else if now.duration_since(reported) >= self.me.settings.progress_interval {
                        reported = now;
                        tracing::info!("waiting for {what}; deadline in {}s", deadline.duration_since(now).as_secs());
                    }
                    tokio::time::sleep(SITE_RETRY.min(deadline.duration_since(now))).await;
                }
            }
        }
    }

    /// What each site holds. A single store is asked through the main connection, which
    /// waits for it (up to the store's patience) as an unreachable store always did.
    pub(super) async fn probe_sites(&mut self) -> Result<Vec<Probe>> {
        if self.store.sites() == 1 {
            let meta = self.with_conn(async |conn| locate::read_meta(conn).await).await?;
            return Ok(vec![Probe::Answer(meta)]);
        }
        Ok(locate::probe_all(&self.store).await)
    }

    pub(super) fn move_to(&mut self, site: usize) {
        if site != self.store.active_site() {
            self.store.set_active_site(site);
            self.conn = None;
        }
    }

    /// Works with the copy `meta` at `site` from now on.
    pub(super) async fn settle(&mut self, site: usize, meta: Meta) -> Result<()> {
        let (min, max) = (self.me.settings.min_nodes, self.me.settings.max_nodes);
        if (meta.min_nodes, meta.max_nodes) != (min, max) {
            return Err(RendezvousError::Config(format!(
                "this node was started with --nnodes {min}:{max} but rendezvous {:?} runs with --nnodes {}:{}",
                self.me.settings.run_id, meta.min_nodes, meta.max_nodes
            )));
        }
        self.move_to(site);
        let known = Known { site, generation: meta.generation, incarnation: meta.incarnation };
        let previous = self.known.replace(known);
        if previous.is_some_and(|previous| previous != known) {
            tracing::info!(
                "the rendezvous state is now at {} (generation {}); carrying the restart count ({}) over",
                self.store.describe(),
                known.generation,
                self.restarts_seen
            );
            self.carry_restarts().await?;
        }
        Ok(())
    }

    /// Raises the job-wide restart count of a new copy of the state to what this node had
    /// seen (every node does, so the copy ends with the highest count anyone saw).
    pub(super) async fn carry_restarts(&mut self) -> Result<()> {
        let seen = self.restarts_seen;
        if seen == 0 {
            return Ok(());
        }
        self.with_conn(async |conn| {
            let mut expected = Vec::new();
            for _ in 0..8 {
                let stored = conn.compare_set(Keys::RESTARTS, &expected, seen.to_string().as_bytes()).await?;
                let now: i64 = String::from_utf8_lossy(&stored).trim().parse().unwrap_or(0);
                if now >= seen {
                    return Ok(());
                }
                expected = stored.to_vec();
            }
            tracing::warn!("could not carry the restart count over to the new copy of the rendezvous state");
            Ok(())
        })
        .await
    }
}
