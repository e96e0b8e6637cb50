//! Sending this node's checkpoints to its buddy (the next member of the round), so that a
//! lost node's part of a step is held by a survivor, and that step by every survivor too.
//!
//! The members copy the same steps, one at a time, so that a whole step is always held
//! somewhere for every rank. The round's first member names a target step a little ahead of
//! its workers (`{prefix}/checkpoints/target`); every agent pins it in its memory
//! ([`super::super::layout::PINNED`]) so its workers keep it when they save the next steps,
//! sends it to its buddy once its workers saved it, and reports it done
//! (`{prefix}/checkpoints/copied/<member>`). Once every member copied it, it is the job's safe
//! step: pinned until the next target is copied everywhere, then replaced by it. A member whose
//! workers passed the target before they saw the pin reports it missed, and the first member
//! names another.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::super::layout::{FORMAT_VERSION, PINNED};
use super::super::persist::newest_slots;
use super::super::quiet::Quiet;
use super::peer::{Peer, Put};
use super::replica::Offering;
use super::wire::find_slot;
pub use crate::agent::round_store::RoundStore;
use crate::store::{StoreError, TcpStore};

/// How often the agent looks at the target and its workers' newest steps.
pub const SEND_EVERY: Duration = Duration::from_millis(500);

/// This member's place in the round's ring.
#[derive(Clone, Debug)]
pub struct RingRound {
    pub buddy: Peer,
    /// The global ranks of this node's workers.
    pub ranks: Vec<u32>,
    pub store: RoundStore,
    pub me: u32,
    pub members: u32,
}

/// The round, and what the buddy holds.
#[derive(Default)]
pub struct Ring {
    round: Option<RingRound>,
    /// Counts rounds, so that the sending task starts each one afresh.
    entered: u64,
    /// Each rank's newest step the buddy holds, and when it got it (ms since the epoch).
    sent: HashMap<u32, (u64, u64)>,
}

pub type Shared = Arc<Mutex<Ring>>;

pub fn lock(ring: &Shared) -> std::sync::MutexGuard<'_, Ring> {
    ring.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ring {
    /// A new round (`None`: a round of one, with nobody to copy to); the buddy has nothing yet.
    pub fn enter_round(&mut self, round: Option<RingRound>) {
        self.round = round;
        self.entered += 1;
        self.sent.clear();
    }

    /// The buddy's newest step of `rank`, and when it got it.
    pub fn sent(&self, rank: u32) -> Option<(u64, u64)> {
        self.sent.get(&rank).copied()
    }
}

/// How long a member waits on the round's store before it looks at the round again.
const WAIT: Duration = SEND_EVERY;
/// How often a member looks whether its workers saved the target step.
const POLL: Duration = Duration::from_millis(20);
/// How far ahead of the first member's workers a target goes, at first: it doubles each time
/// a member missed one (its workers saved past it before it was pinned). One step: the ranks
/// of a data-parallel job save in step, and the next target is named as soon as one is
/// copied everywhere, so a lost host costs at most the step after the safe one.
const LEAD: u64 = 1;
const MAX_LEAD: u64 = 4096;

/// Copies targets to the buddy, round after round, forever (the task is aborted when the
/// agent ends).
pub async fn send_now_and_then(memory: PathBuf, ring: Shared, rate: u64, quiet: Arc<Quiet>) {
    // kept across rounds: they protect steps until the new round's are known
    let mut pinned = Vec::new();
    let mut failing = false;
    loop {
        let (round, entered) = {
            let ring = lock(&ring);
            (ring.round.clone(), ring.entered)
        };
        let Some(round) = round else {
            tokio::time::sleep(SEND_EVERY).await;
            continue;
        };
        let mut copier = Copier {
            round: &round,
            entered,
            memory: &memory,
            ring: &ring,
            rate,
            quiet: &quiet,
            pinned: &mut pinned,
            offering: HashMap::new(),
        };
        match copier.run(&mut failing).await {
            Ok(()) => {}
            // a copy of the round that just ended, refused by a buddy already in the next one
            // (another key): the next round's copier starts at once
            Err(_) if lock(&ring).entered != entered => {}
            Err(err) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(
                        "cannot copy checkpoints to member {} ({}): {err}; they are held on this node (and on disk) only",
                        round.buddy.them,
                        round.buddy.addr
                    );
                }
                tokio::time::sleep(SEND_EVERY).await;
            }
        }
    }
}

/// One round's copying.
struct Copier<'a> {
    round: &'a RingRound,
    entered: u64,
    memory: &'a Path,
    ring: &'a Shared,
    rate: u64,
    quiet: &'a Quiet,
    pinned: &'a mut Vec<u64>,
    /// Per local rank: whether its copies are offered to the buddy's replica first.
    offering: HashMap<u32, Offering>,
}

impl Copier<'_> {
    /// Copies target after target until the round changes.
    async fn run(&mut self, failing: &mut bool) -> Result<(), String> {
        let mut store = self.round.store.open().await.map_err(|err| format!("the round's store: {err}"))?;
        let (mut turn, mut safe, mut lead) = (0u64, None, LEAD);
        while self.current() {
            let Some(target) = self.target(&mut store, turn, lead).await.map_err(|err| err.to_string())? else {
                continue;
            };
            self.pin([safe, Some(target)].into_iter().flatten().collect());
            let sent = loop {
                match send_target(self, target).await? {
                    Sent::NotYet if self.current() => tokio::time::sleep(POLL).await,
                    Sent::NotYet => return Ok(()),
                    done => break done,
                }
            };
            // a missed target sent nothing: only a copy the buddy kept says it is reached again
            if matches!(sent, Sent::All) && std::mem::take(failing) {
                tracing::info!("checkpoints reach member {} ({}) again", self.round.buddy.them, self.round.buddy.addr);
            }
            let report = if matches!(sent, Sent::All) { &b"done"[..] } else { b"missed" };
            let prefix = &self.round.store.prefix;
            let mine = format!("{prefix}/checkpoints/copied/{turn}/{}", self.round.me);
            store.set(mine.as_bytes(), report).await.map_err(|err| err.to_string())?;
            let Some(everyone) = self.reports(&mut store, turn).await.map_err(|err| err.to_string())? else {
                return Ok(());
            };
            if everyone.iter().all(|report| report.as_ref() == b"done") {
                safe = Some(target);
                lead = LEAD;
            } else {
                lead = (lead * 2).min(MAX_LEAD);
            }
            turn += 1;
        }
        Ok(())
    }

    /// Whether the round this copier serves is still the agent's.
    fn current(&self) -> bool {
        lock(self.ring).entered == self.entered
    }

    /// Target `turn`'s step, once named (the first member names it, `lead` steps ahead of its
    /// workers); `None` after a wait that saw none.
    async fn target(&self, store: &mut TcpStore, turn: u64, lead: u64) -> Result<Option<u64>, StoreError> {
        let key = format!("{}/checkpoints/target/{turn}", self.round.store.prefix);
        if self.round.me == 0 && !store.check(&[key.as_bytes()]).await? {
            let newest = newest_slots(self.memory)
                .into_iter()
                .filter(|(rank, _, _)| self.round.ranks.contains(rank))
                .map(|(_, manifest, _)| manifest.step)
                .min();
            match newest {
                Some(newest) => {
                    tracing::debug!("the members copy step {} next (their workers are at {newest})", newest + lead);
                    store.set(key.as_bytes(), (newest + lead).to_string().as_bytes()).await?;
                }
                None => {
                    tokio::time::sleep(SEND_EVERY).await; // nothing saved yet
                    return Ok(None);
                }
            }
        }
        match store.wait(&[key.as_bytes()], Some(WAIT)).await {
            Err(StoreError::WaitTimeout { .. }) => return Ok(None),
            waited => waited?,
        }
        Ok(std::str::from_utf8(&store.get(key.as_bytes()).await?).ok().and_then(|text| text.parse().ok()))
    }

    /// Every member's report of target `turn`, once all made one (`None`: the round changed).
    async fn reports(&self, store: &mut TcpStore, turn: u64) -> Result<Option<Vec<bytes::Bytes>>, StoreError> {
        let prefix = &self.round.store.prefix;
        let keys: Vec<String> =
            (0..self.round.members).map(|member| format!("{prefix}/checkpoints/copied/{turn}/{member}")).collect();
        let keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
        loop {
            match store.wait(&keys, Some(WAIT)).await {
                Ok(()) => return store.multi_get(&keys).await.map(Some),
                Err(StoreError::WaitTimeout { .. }) if self.current() => continue,
                Err(StoreError::WaitTimeout { .. }) => return Ok(None),
                Err(err) => return Err(err),
            }
        }
    }

    /// Tells the workers which steps to keep (`pinned.json`), when that changed.
    fn pin(&mut self, mut steps: Vec<u64>) {
        steps.sort_unstable();
        steps.dedup();
        if steps.is_empty() || steps == *self.pinned {
            return;
        }
        let json = serde_json::json!({"v": FORMAT_VERSION, "steps": steps});
        let (path, temporary) = (self.memory.join(PINNED), self.memory.join(format!("{PINNED}.tmp")));
        let written = std::fs::write(&temporary, json.to_string()).and_then(|()| std::fs::rename(&temporary, &path));
        match written {
            Ok(()) => *self.pinned = steps,
            Err(err) => tracing::warn!("cannot pin the checkpoints being copied ({}): {err}", path.display()),
        }
    }
}

enum Sent {
    /// Every local rank's target step is at the buddy.
    All,
    /// A worker saved past the target before it was pinned: that step is gone here.
    Missed,
    /// A worker has not saved the target yet.
    NotYet,
}

/// Sends each local rank's `target` step the buddy does not have yet.
async fn send_target(copier: &mut Copier<'_>, target: u64) -> Result<Sent, String> {
    let (round, memory, ring) = (copier.round, copier.memory, copier.ring);
    let newest: HashMap<u32, u64> = newest_slots(memory).into_iter().map(|(rank, m, _)| (rank, m.step)).collect();
    for &rank in &round.ranks {
        if lock(ring).sent(rank).is_some_and(|(step, _)| step >= target) {
            continue;
        }
        let Some((manifest, data)) = find_slot(memory, rank, target) else {
            return Ok(if newest.get(&rank).is_some_and(|&step| step > target) { Sent::Missed } else { Sent::NotYet });
        };
        let started = Instant::now();
        let offering = copier.offering.entry(rank).or_default();
        let offer = offering.offer();
        let put = round
            .buddy
            .put(memory, &manifest, &data, copier.rate, copier.quiet, offer)
            .await
            .map_err(|err| err.to_string())?;
        let took = started.elapsed();
        if offer && put != Put::Changed {
            offering.offered(put == Put::Replica);
        }
        match put {
            Put::Changed => return Ok(Sent::Missed),
            Put::Replica => tracing::debug!(
                rank,
                step = target,
                "checkpoint held by member {} from its own identical save of the step ({} bytes, none sent; {took:.0?})",
                round.buddy.them,
                manifest.size
            ),
            Put::Sent => tracing::debug!(
                rank,
                step = target,
                "checkpoint copied to member {}: {} bytes in {took:.0?} ({:.0} MB/s)",
                round.buddy.them,
                manifest.size,
                manifest.size as f64 / took.as_secs_f64().max(1e-9) / 1e6
            ),
        }
        let mut ring = lock(ring);
        if ring.round.as_ref().is_some_and(|now| now.buddy.addr == round.buddy.addr) {
            ring.sent.insert(rank, (target, super::now_ms()));
        }
    }
    Ok(Sent::All)
}
