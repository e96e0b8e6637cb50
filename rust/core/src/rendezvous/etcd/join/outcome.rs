//! Steps 2 and 3 of joining a round: waiting, from the round's outcome watch, for its seal and
//! size (sealing it when this node's turn comes), then this node's place in it.

use std::ops::ControlFlow;

use elastix_etcd::pb::etcdserverpb::TxnRequest;
use elastix_etcd::pb::mvccpb::event::EventType;
use elastix_etcd::{EtcdError, WatchItem, Watcher};
use tokio::time::Instant;

use super::{member_id, Ctx, Joined, Outcome, SealAttempt, SealMark, Size};
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::etcd::keys::KeyKind;
use crate::rendezvous::etcd::ops;
use crate::rendezvous::records::{decode, Master};

/// What a node waiting for round r's outcome has seen, and when it acts next.
struct Waiting<'j> {
    joined: &'j Joined,
    deadline: Instant,
    /// The running round is full: this node is a spare and waits as long as it takes.
    spare: bool,
    /// When this node tries to seal the round (the round is full, or its last call ran out).
    seal_at: Option<Instant>,
    /// Round r-1's members, watched until none is left (the seal waits for that), and how many.
    previous: Option<(Watcher, u64)>,
    /// The seal's revision and cutoff, once seen.
    cutoff: Option<(i64, u32)>,
    size: Option<Size>,
    master: Option<Master>,
    report_at: Instant,
    /// A sealer that dies before it publishes the size: anyone reads it at the seal, from then.
    size_due: Option<Instant>,
}

impl<'j> Waiting<'j> {
    fn new(ctx: &Ctx<'_>, joined: &'j Joined, deadline: Instant) -> Self {
        let settings = ctx.settings;
        let (min, max) = (u64::from(settings.min_nodes), u64::from(settings.max_nodes));
        let full = joined.arrival >= max || (joined.moved && joined.previous_live == 0 && joined.arrival >= min);
        let seal_at = if full {
            Some(Instant::now())
        } else {
            (joined.arrival >= min).then(|| joined.entered_at + settings.last_call_timeout)
        };
        Waiting {
            joined,
            deadline,
            spare: !joined.moved && joined.previous_live >= max,
            seal_at,
            previous: None,
            cutoff: None,
            size: None,
            master: None,
            report_at: Instant::now() + settings.progress_interval,
            size_due: None,
        }
    }

    /// The next moment a timer has something to do.
    fn wake(&mut self, ctx: &Ctx<'_>) -> Instant {
        if self.cutoff.is_some() && self.size_due.is_none() {
            // sealed: only the size is awaited now
            self.size_due = Some(Instant::now() + ctx.settings.node_lost_after() * 2);
            (self.seal_at, self.previous) = (None, None);
        }
        let deadline = (!self.spare && self.cutoff.is_none()).then_some(self.deadline);
        [self.seal_at, self.size_due, deadline].into_iter().flatten().fold(self.report_at, Instant::min)
    }

    fn closed(&self, reason: String) -> ControlFlow<Outcome> {
        ControlFlow::Break(Outcome::Closed { reason, spare: self.spare })
    }
}

impl Ctx<'_> {
    /// Steps 2 and 3: waits for round `joined.round` to be sealed (sealing it when this node's
    /// turn comes) and returns this node's place in it.
    pub async fn outcome(&self, joined: &Joined, deadline: Instant) -> Result<Outcome> {
        let range = self.keys.outcome(joined.round);
        let mut watcher = self.client.watch(&range.key, &range.end, joined.revision + 1, false);
        let mut lease_state = self.lease_state.clone();
        let mut wait = Waiting::new(self, joined, deadline);
        let size = loop {
            if let Some(size) = wait.size.take() {
                break size;
            }
            let wake = wait.wake(self);
            let flow = tokio::select! {
                item = watcher.next() => self.on_outcome(&mut wait, &mut watcher, item).await?,
                item = next_of(&mut wait.previous) => self.on_previous(&mut wait, item).await?,
                Ok(()) = lease_state.changed() => {
                    let state = lease_state.borrow().clone();
                    if state.is_over() { ControlFlow::Break(Outcome::LeaseLost(state)) } else { ControlFlow::Continue(()) }
                },
                _ = tokio::time::sleep_until(wake) => self.on_timer(&mut wait).await?,
            };
            if let ControlFlow::Break(outcome) = flow {
                return Ok(outcome);
            }
        };
        let state = lease_state.borrow().clone();
        if state.is_over() {
            return Ok(Outcome::LeaseLost(state)); // this node's key may be gone at the seal
        }
        self.place(joined, size, watcher, wait.master).await
    }

    /// What round r's outcome watch brought: its seal, size, rank 0's address, or its end.
    async fn on_outcome(
        &self,
        wait: &mut Waiting<'_>,
        watcher: &mut Watcher,
        item: std::result::Result<WatchItem, EtcdError>,
    ) -> Result<ControlFlow<Outcome>> {
        match item.map_err(|err| self.error(err))? {
            WatchItem::Events(events) => {
                for event in events {
                    let Some(kv) = event.kv.filter(|_| event.r#type == EventType::Put as i32) else { continue };
                    match self.keys.kind(&kv.key) {
                        KeyKind::Seal { .. } => {
                            let mark: SealMark = decode(&kv.value, "seal")?;
                            wait.cutoff = Some((kv.mod_revision, mark.cutoff));
                        }
                        KeyKind::Size { .. } => wait.size = Some(decode(&kv.value, "round size")?),
                        KeyKind::Master { .. } => wait.master = Some(decode(&kv.value, "master address")?),
                        KeyKind::Closed { .. } => {
                            return Ok(wait.closed(String::from_utf8_lossy(&kv.value).into_owned()))
                        }
                        _ => {}
                    }
                }
            }
            WatchItem::Compacted { revision } => {
                let r = wait.joined.round;
                tracing::info!(
                    round = r,
                    "etcd compacted the history up to revision {revision}; reading the round's outcome again"
                );
                let (read, revision) = self.read_outcome(r).await?;
                if let Some(reason) = read.closed {
                    return Ok(wait.closed(reason));
                }
                wait.cutoff = read.cutoff.or(wait.cutoff);
                wait.size = read.size.or(wait.size.take());
                wait.master = read.master.or(wait.master.take());
                watcher.restart(revision + 1);
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// What round r-1's members' watch brought: one left or came; none left means seal now.
    async fn on_previous(
        &self,
        wait: &mut Waiting<'_>,
        item: std::result::Result<WatchItem, EtcdError>,
    ) -> Result<ControlFlow<Outcome>> {
        let Some((watcher, count)) = wait.previous.as_mut() else { return Ok(ControlFlow::Continue(())) };
        match item.map_err(|err| self.error(err))? {
            WatchItem::Events(events) => {
                for event in events {
                    if event.r#type == EventType::Delete as i32 {
                        *count = count.saturating_sub(1);
                    } else if event.kv.as_ref().is_some_and(|kv| kv.version == 1) {
                        *count += 1;
                    }
                }
            }
            WatchItem::Compacted { .. } => {
                let members = self.keys.members(wait.joined.round - 1);
                let request = TxnRequest { success: vec![ops::count(&members, 0)], ..Default::default() };
                let response = self.txn(request).await?;
                *count = ops::counted(&response, 0);
                watcher.restart(ops::revision(&response) + 1);
            }
        }
        if *count == 0 {
            wait.previous = None;
            wait.seal_at = Some(Instant::now());
        }
        Ok(ControlFlow::Continue(()))
    }

    /// A timer ran out: seal the round, read a size its sealer never published, report
    /// progress, or give up at the deadline.
    async fn on_timer(&self, wait: &mut Waiting<'_>) -> Result<ControlFlow<Outcome>> {
        let (now, r) = (Instant::now(), wait.joined.round);
        if wait.seal_at.is_some_and(|at| at <= now) && wait.cutoff.is_none() {
            wait.seal_at = None;
            match self.try_seal(r, self.settings.max_nodes).await? {
                SealAttempt::Sealed(sealed) => wait.size = Some(sealed),
                SealAttempt::Taken => {} // the watch brings it
                SealAttempt::PreviousBusy { count, revision } => {
                    let range = self.keys.members(r - 1);
                    wait.previous = Some((self.client.watch(&range.key, &range.end, revision + 1, false), count));
                }
            }
        }
        if let (Some((sealed_at, cutoff)), None) = (wait.cutoff, &wait.size) {
            if wait.size_due.is_some_and(|due| due <= now) {
                tracing::warn!(round = r, "round sealed but its size was not published; reading it");
                wait.size = Some(self.publish_size(r, sealed_at, cutoff, None).await?);
            }
        }
        if wait.report_at <= now {
            wait.report_at = now + self.settings.progress_interval;
            self.report_progress(wait.joined, wait.spare, wait.deadline).await;
        }
        if !wait.spare && wait.cutoff.is_none() && wait.deadline <= now {
            let err = self.timeout_error(wait.joined).await;
            let _ = self.client.delete(&self.keys.member(r, &member_id(self.lease))).await;
            return Err(err);
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Step 3: this node's rank in the sealed round of `size`, or why it is not a member.
    async fn place(&self, joined: &Joined, size: Size, watcher: Watcher, master: Option<Master>) -> Result<Outcome> {
        let r = joined.round;
        if size.live < u64::from(self.settings.min_nodes) {
            tracing::warn!(round = r, live = size.live, "round cannot form: fewer than min_nodes live members");
            return Ok(Outcome::Next { spare: false });
        }
        let rank = if size.live == size.joins {
            joined.index.saturating_sub(1)
        } else {
            let request = ops::keys_created_before(&self.keys.members(r), size.revision, joined.created);
            self.client.range(request).await.map_err(|err| self.error(err))?.kvs.len() as u64
        };
        if rank >= u64::from(size.cutoff) {
            return Ok(Outcome::Next { spare: true });
        }
        Ok(Outcome::Member {
            rank: rank as u32,
            world_size: size.world_size(),
            sealed_at: size.revision,
            last_member: size.last_member,
            watcher: Box::new(watcher),
            master,
        })
    }
}

/// The next item of an optional watch; never, without one.
async fn next_of(watch: &mut Option<(Watcher, u64)>) -> std::result::Result<WatchItem, EtcdError> {
    match watch.as_mut() {
        Some((watcher, _)) => watcher.next().await,
        None => std::future::pending().await,
    }
}

/// The workers' store address of round `r`, from the round's outcome watch, up to `deadline`.
pub(in crate::rendezvous::etcd) async fn wait_master(
    ctx: &Ctx<'_>,
    r: u64,
    watcher: &mut Watcher,
    deadline: Instant,
) -> Result<Master> {
    let waiting = async {
        loop {
            match watcher.next().await.map_err(|err| ctx.error(err))? {
                WatchItem::Events(events) => {
                    for event in events {
                        let Some(kv) = event.kv else { continue };
                        match ctx.keys.kind(&kv.key) {
                            KeyKind::Master { .. } => return decode(&kv.value, "master address"),
                            KeyKind::Closed { .. } => {
                                return Err(RendezvousError::Closed { run_id: ctx.settings.run_id.clone() })
                            }
                            _ => {}
                        }
                    }
                }
                WatchItem::Compacted { .. } => {
                    let (read, revision) = ctx.read_outcome(r).await?;
                    if let Some(master) = read.master {
                        return Ok(master);
                    }
                    watcher.restart(revision + 1);
                }
            }
        }
    };
    match tokio::time::timeout(ctx.settings.master_wait(deadline), waiting).await {
        Ok(result) => result,
        Err(_) => Err(RendezvousError::Timeout(format!(
            "rendezvous {:?} round {r}: rank 0 never published the workers' store address",
            ctx.settings.run_id
        ))),
    }
}
