//! Naming the slow rank. Each agent measures its workers' pace from their flight recorders
//! ([`pace`]: compute between collectives, wait inside them, on each rank's own clock), and
//! every [`WINDOW`] writes each rank's latest to the round's store; the round's first member reads every
//! member's, judges ([`judge`]: a rank that stays clearly behind the others' median is named,
//! a slow window or a job-wide slowdown names no one), writes every rank's standing back for
//! the others, and says who is named or cleared (a WARN, the event log). Every agent shows its
//! ranks' standings in `elastix status` and in its metrics. One write per member per window,
//! and one read of them all by the first member: a job of thousands of nodes adds little to
//! its store.

pub mod judge;
pub mod pace;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use self::judge::{Change, Judge, Standing};
use self::pace::{Pace, PaceMeter};
use crate::agent::events::EventLog;
use crate::agent::round_store::RoundStore;
use crate::metrics;
use crate::rendezvous::records::now_ms;
use crate::store::{StoreError, TcpStore};

/// How often paces are exchanged and judged.
pub const WINDOW: Duration = Duration::from_secs(2);

/// This node's workers' meters, by local index, each with its worker's global rank: the group
/// feeds them at every look at the heartbeat page, the exchange takes a window's paces.
pub type Meters = Arc<Mutex<Vec<(u32, PaceMeter)>>>;
/// The standings the first member last published, by global rank.
pub type Standings = Arc<Mutex<HashMap<u32, Standing>>>;

pub fn lock<T>(shared: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a member writes each window.
#[derive(Serialize, Deserialize)]
struct MemberPaces {
    at_ms: u64,
    node: String,
    paces: Vec<Pace>,
}

/// Where the exchange runs: the round's store, this member's place, its node's name.
pub struct Exchange {
    pub store: RoundStore,
    pub me: u32,
    pub members: u32,
    pub node: String,
}

/// The running exchange of one attempt; stopped when dropped.
pub struct StragglerWatch {
    task: JoinHandle<()>,
}

impl StragglerWatch {
    pub fn start(exchange: Exchange, meters: Meters, standings: Standings, events: Arc<EventLog>) -> StragglerWatch {
        StragglerWatch { task: tokio::spawn(exchange.run(meters, standings, events)) }
    }
}

impl Drop for StragglerWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Exchange {
    async fn run(self, meters: Meters, standings: Standings, events: Arc<EventLog>) {
        let mut store: Option<TcpStore> = None;
        let mut judge = Judge::default();
        let mut ticks = tokio::time::interval(WINDOW);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is at once: a window has to pass first
                            // each rank's latest pace: written every window, so a window in which a rank of slow
                            // steps finished too few collectives for a new one still judges the others against it
        let mut latest: BTreeMap<u32, Pace> = BTreeMap::new();
        loop {
            ticks.tick().await;
            for (rank, meter) in lock(&meters).iter_mut() {
                if let Some(pace) = meter.take(*rank, judge::MIN_SAMPLES) {
                    latest.insert(*rank, pace);
                }
            }
            let paces: Vec<Pace> = latest.values().cloned().collect();
            if store.is_none() {
                store = self.store.open().await.ok(); // a store that does not answer: next window
            }
            let Some(connection) = store.as_mut() else { continue };
            match self.window(connection, paces, &mut judge, &events).await {
                Ok(Some(judged)) => {
                    publish(&standings, judged);
                    let ranks: Vec<u32> = lock(&meters).iter().map(|(rank, _)| *rank).collect();
                    set_metrics(&standings, &ranks);
                }
                Ok(None) => {}
                Err(err) => {
                    tracing::debug!("stragglers: the round's store failed ({err}); trying again next window");
                    store = None;
                }
            }
        }
    }

    /// One window: this member's paces written, judged by the first member, the standings read.
    async fn window(
        &self,
        store: &mut TcpStore,
        paces: Vec<Pace>,
        judge: &mut Judge,
        events: &EventLog,
    ) -> Result<Option<Vec<Standing>>, StoreError> {
        let prefix = &self.store.prefix;
        let mine = MemberPaces { at_ms: now_ms(), node: self.node.clone(), paces };
        let value = serde_json::to_vec(&mine).expect("paces serialize");
        store.set(format!("{prefix}/stragglers/pace/{}", self.me).as_bytes(), &value).await?;
        let key = format!("{prefix}/stragglers/standings");
        if self.me == 0 {
            let heard = self.read_members(store).await?;
            let (standings, changes) = judge.window(&heard, now_ms());
            for change in &changes {
                say(change, events).await;
            }
            store.set(key.as_bytes(), &serde_json::to_vec(&standings).expect("standings serialize")).await?;
            return Ok(Some(standings));
        }
        if !store.check(&[key.as_bytes()]).await? {
            return Ok(None);
        }
        Ok(serde_json::from_slice(&store.get(key.as_bytes()).await?).ok())
    }

    /// Every member's paces of the last two windows (older ones are a member that stopped
    /// writing: not judged on them).
    async fn read_members(&self, store: &mut TcpStore) -> Result<Vec<(String, Pace)>, StoreError> {
        let fresh_after = now_ms().saturating_sub(2 * WINDOW.as_millis() as u64);
        let mut heard = Vec::new();
        for member in 0..self.members {
            let key = format!("{}/stragglers/pace/{member}", self.store.prefix);
            if !store.check(&[key.as_bytes()]).await? {
                continue;
            }
            let Ok(written) = serde_json::from_slice::<MemberPaces>(&store.get(key.as_bytes()).await?) else {
                continue;
            };
            if written.at_ms >= fresh_after {
                heard.extend(written.paces.into_iter().map(|pace| (written.node.clone(), pace)));
            }
        }
        Ok(heard)
    }
}

/// Keeps the standings for `elastix status` and this node's metrics.
fn publish(shared: &Standings, standings: Vec<Standing>) {
    let mut held = lock(shared);
    held.clear();
    held.extend(standings.into_iter().map(|standing| (standing.rank, standing)));
}

/// This node's ranks' standings, as metrics.
fn set_metrics(standings: &Standings, ranks: &[u32]) {
    let held = lock(standings);
    let mine: Vec<(u32, f64, bool)> =
        ranks.iter().filter_map(|rank| held.get(rank)).map(|s| (s.rank, s.score, s.straggler)).collect();
    metrics::agent::get().paces(&mine);
}

async fn say(change: &Change, events: &EventLog) {
    match change {
        Change::Named(s) => {
            tracing::warn!(
                "rank {} on {} is a straggler: it computes {:.1}x as long as the others between collectives ({:.0} ms \
                 against their median {:.0} ms), for {} windows of {}s now; the others wait for it in {}",
                s.rank,
                s.node,
                s.compute_ms / s.others_ms.max(f64::MIN_POSITIVE),
                s.compute_ms,
                s.others_ms,
                judge::NAME_AFTER,
                WINDOW.as_secs(),
                s.waited_in
            );
            events.straggler(s, true).await;
        }
        Change::Cleared(s) => {
            tracing::info!("rank {} on {} keeps pace again (score {:.2})", s.rank, s.node, s.score);
            events.straggler(s, false).await;
        }
    }
}
