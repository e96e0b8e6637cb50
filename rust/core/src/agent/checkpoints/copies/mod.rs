//! Checkpoints held by a peer too: each agent sends its node's newest steps to a buddy (the
//! next member of the round, a ring) over connections that prove the round's key, and keeps
//! the copies its own peer sends. When a round forms, the agents tell each other what they
//! hold, and a node whose workers will restore a rank it does not hold (a lost node's, or a
//! joining node's) takes the copy from the member that holds it before its workers start: no
//! storage is read.
//!
//! * [`plan`]: what each member holds, and what a node must take (pure).
//! * [`wire`]: the exchange between two agents.
//! * [`replica`]: a copy the holder makes from its own rank's identical save (data parallelism).
//! * [`holder`]: the server every agent runs; [`peer`]: the client.
//! * [`ring`]: sending to the buddy in the background, the same steps on every member.

pub mod holder;
pub mod peer;
pub mod plan;
pub mod replica;
pub mod ring;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::RngCore;
use tokio::task::JoinHandle;

use self::holder::Holder;
use self::peer::Peer;
use self::plan::{Held, Holdings};
use self::ring::{RingRound, RoundStore};
use super::layout::{peers_dir, rank_dir, rank_of, read_slot, SLOTS};
use super::quiet::Quiet;
use crate::agent::error::{AgentError, Result};
use crate::auth::{Key, Secret};
use crate::store::TcpStore;

/// What a round's members know of each other's checkpoints, once they have told each other.
pub struct Round<'a> {
    pub store: &'a mut TcpStore,
    pub prefix: &'a str,
    /// This member's group rank, and the round's size.
    pub me: u32,
    pub members: u32,
    pub secret: Option<&'a Secret>,
    /// The global ranks of this node's workers, and of the whole round.
    pub ranks: Vec<u32>,
    pub world: u32,
    pub timeout: Duration,
}

/// How often a copy is asked for before the agent gives up, and the pause in between.
const TAKE_ATTEMPTS: u32 = 3;
const TAKE_PAUSE: Duration = Duration::from_millis(200);

/// What a round restores, as this agent found it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restore {
    /// The world size the newest step was saved in (what the workers restore by), if one was.
    pub saved_world: Option<u32>,
    /// The newest step every rank's state is held for in the members' memory.
    pub step: Option<u64>,
    /// The ranks whose state this node took from a peer: (rank, member).
    pub taken: Vec<(u32, u32)>,
    /// This node's workers' global ranks, and the rank whose state each restores.
    pub sources: Vec<(u32, u32)>,
}

/// This agent's copy server and its sending to the buddy.
pub struct Copies {
    memory: PathBuf,
    host: String,
    holder: Holder,
    ring: ring::Shared,
    task: JoinHandle<()>,
}

impl Copies {
    /// Serves `memory` to the round's members and sends to the buddy at most `rate` bytes a
    /// second (0: unlimited), waiting while `quiet` holds it back. Must run inside a tokio
    /// runtime.
    pub fn start(memory: PathBuf, host: &str, rate: u64, quiet: Arc<Quiet>) -> std::io::Result<Copies> {
        let holder = Holder::start(memory.clone(), host)?;
        let ring = ring::Shared::default();
        let task = tokio::spawn(ring::send_now_and_then(memory.clone(), ring.clone(), rate, quiet));
        Ok(Copies { memory, host: host.to_owned(), holder, ring, task })
    }

    /// Tells the round's members what this node holds and learns what they hold; takes the
    /// copies its workers will restore from and does not hold; from now on sends to the
    /// round's buddy.
    pub async fn enter_round(&self, round: Round<'_>) -> Result<Restore> {
        let mine = self.holdings();
        let key = round_key(round.store, round.prefix, round.secret).await?;
        // before this member's holdings are published: a member that reads them may ask at once
        self.holder.enter_round(key.clone(), round.me);
        let all = share(round.store, round.prefix, round.me, round.members, &mine, round.timeout).await?;
        let peer = |them: usize| {
            let addr = all.get(them)?.serves.clone()?;
            Some(Peer { addr, key: key.clone(), me: round.me, them: them as u32 })
        };
        let store = RoundStore {
            host: round.store.host().to_owned(),
            port: round.store.port(),
            prefix: round.prefix.to_owned(),
            secret: round.secret.cloned(),
        };
        let ring_round = plan::buddy(round.me, round.members)
            .and_then(|them| peer(them as usize))
            .map(|buddy| RingRound { buddy, ranks: round.ranks.clone(), store, me: round.me, members: round.members });
        ring::lock(&self.ring).enter_round(ring_round);
        let mut restore = Restore { saved_world: plan::saved_world(&all), ..Restore::default() };
        match plan::restore(&all, round.me as usize, &round.ranks, round.world) {
            Some(plan::Plan { step, fetches, sources }) => {
                tracing::info!("every rank's state of step {step} is in the members' memory: the workers restore it");
                restore.step = Some(step);
                restore.sources = sources;
                for fetch in fetches {
                    let Some(from) = peer(fetch.from) else { continue };
                    if self.take(&from, fetch.rank, fetch.step).await {
                        restore.taken.push((fetch.rank, from.them));
                    }
                }
            }
            None if restore.saved_world.is_some() => tracing::info!(
                "no step is held in memory for every rank: the workers restore one from --checkpoint-dir, if any"
            ),
            None => {}
        }
        Ok(restore)
    }

    /// Takes `rank`'s step `step` from `from`, a few times at most; a failure is said (false),
    /// and the workers then refuse to start afresh (the job holds a step they could not get).
    async fn take(&self, from: &Peer, rank: u32, step: u64) -> bool {
        let started = Instant::now();
        let want = wire::Want { rank, step };
        for attempt in 1..=TAKE_ATTEMPTS {
            let failure = match from.get(&want, &peers_dir(&self.memory)).await {
                Ok(Some(manifest)) => {
                    tracing::info!(
                        "took rank {rank}'s checkpoint of step {step} from member {}'s memory ({} bytes in {:.0?})",
                        from.them,
                        manifest.size,
                        started.elapsed()
                    );
                    return true;
                }
                Ok(None) => format!("member {} no longer holds rank {rank}'s step {step}", from.them),
                Err(err) => format!(
                    "cannot take rank {rank}'s checkpoint of step {step} from member {} ({}): {err}",
                    from.them, from.addr
                ),
            };
            if attempt == TAKE_ATTEMPTS {
                tracing::warn!("{failure} ({attempt} attempts)");
            } else {
                tracing::debug!("{failure}; trying again in {TAKE_PAUSE:?}");
                tokio::time::sleep(TAKE_PAUSE).await;
            }
        }
        false
    }

    /// What this agent holds: its own ranks' whole slots and its peers' copies.
    pub fn holdings(&self) -> Holdings {
        let mut holdings =
            Holdings { serves: Some(format!("{}:{}", self.host, self.holder.port())), ..Default::default() };
        for root in [self.memory.clone(), peers_dir(&self.memory)] {
            for (rank, held) in slots_under(&root) {
                let steps = holdings.ranks.entry(rank).or_default();
                if !steps.contains(&held) {
                    steps.push(held);
                }
            }
        }
        holdings
    }

    /// The buddy's newest step of `rank`, and when it got it (ms since the epoch).
    pub fn sent(&self, rank: u32) -> Option<(u64, u64)> {
        ring::lock(&self.ring).sent(rank)
    }

    /// Sends nothing more to the buddy and serves no one: the run is over for this agent.
    pub fn stop(&self) {
        self.task.abort();
        self.holder.stop();
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Every whole slot under `root`: rank and step.
fn slots_under(root: &Path) -> Vec<(u32, Held)> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let ranks = entries.flatten().filter_map(|entry| entry.file_name().to_str().and_then(rank_of));
    ranks
        .flat_map(|rank| {
            (0..SLOTS).filter_map(move |slot| {
                let (manifest, _) = read_slot(&rank_dir(root, rank), rank, slot)?;
                Some((rank, Held { step: manifest.step, world_size: manifest.world_size }))
            })
        })
        .collect()
}

/// The key of the round's copy connections: derived from the job secret and a nonce in the
/// round's store (drawn by whichever member comes first).
async fn round_key(store: &mut TcpStore, prefix: &str, secret: Option<&Secret>) -> Result<Key> {
    let mut drawn = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut drawn);
    let nonce = store.compare_set(format!("{prefix}/checkpoints/nonce").as_bytes(), b"", &drawn).await?;
    Ok(Key::group(secret, wire::KEY_LABEL, &nonce))
}

/// Publishes `mine` in the round's store and reads every member's.
async fn share(
    store: &mut TcpStore,
    prefix: &str,
    me: u32,
    members: u32,
    mine: &Holdings,
    timeout: Duration,
) -> Result<Vec<Holdings>> {
    let key = |member: u32| format!("{prefix}/checkpoints/held/{member}");
    store.set(key(me).as_bytes(), &serde_json::to_vec(mine).expect("serializes")).await?;
    let keys: Vec<String> = (0..members).map(key).collect();
    let keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
    tracing::debug!("waiting up to {timeout:?} for the {members} members' checkpoint holdings");
    store.wait(&keys, Some(timeout)).await?;
    let all = store
        .multi_get(&keys)
        .await?
        .iter()
        .map(|bytes| serde_json::from_slice(bytes))
        .collect::<std::result::Result<Vec<Holdings>, _>>()
        .map_err(|err| AgentError::Config(format!("unreadable checkpoint holdings from another agent: {err}")))?;
    Ok(all)
}

/// Milliseconds since the epoch.
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64)
}
