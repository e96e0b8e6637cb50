//! Where the job's rendezvous state lives, and moving it when that store is lost.
//!
//! A store with several sites (`--rdzv-endpoint a:p,b:p,c:p`, each hosted by the agent at that
//! address) holds the state at one site at a time. Each copy of the state is tagged by its
//! [`Meta`]: `generation` counts the moves, `incarnation` tells one copy from a later one at
//! the same site. Every node applies the same rules on its own, so no node is special:
//!
//! * the job is at the reachable site holding the highest generation (ties: the earliest
//!   site); copies older than what this node already knew are stale and ignored;
//! * no copy anywhere: a new job starts at the first site (waiting for it to come up); a node
//!   that knew the job at site `i` sets the state up again one generation up, at `i` if `i`
//!   answers (its store restarted empty), else at the next site that answers.
//!
//! Nodes that decide alike create the same copy: the compare-and-set of `meta` keeps the first.
//! A node cut off from the sites the others use may set up a copy of its own; it cannot form a
//! round below `min_nodes`, and once the link heals the copies meet at the highest generation
//! (members watch the other sites, [`spawn_site_watcher`]), which costs one re-form.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::change::MembershipChange;
use super::error::Result;
use super::keys::Keys;
use super::records::{decode, Meta};
use super::store::{RendezvousStore, StoreConn};

/// How long probing one site may take: a site that does not answer within this is skipped.
pub(crate) const PROBE_PATIENCE: Duration = Duration::from_secs(1);

/// The copy of the state a node works with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Known {
    pub site: usize,
    pub generation: u64,
    pub incarnation: u64,
}

/// What one site holds: `Err` if it could not be reached (why), `Ok(None)` if it holds no
/// state of this run.
pub(crate) type Probe = std::result::Result<Option<Meta>, String>;

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// The state is at this site.
    Join(usize),
    /// Set the state up at `site` with `generation` (unless someone just did).
    Create { site: usize, generation: u64 },
    /// Nothing usable answers yet.
    Wait,
}

/// Applies the rules of this module to what each site holds.
pub(crate) fn choose(probes: &[Probe], known: Option<Known>) -> Choice {
    let floor = known.map_or(0, |known| known.generation);
    let best = probes
        .iter()
        .enumerate()
        .filter_map(|(site, probe)| Some((site, probe.as_ref().ok()?.as_ref()?.generation)))
        // copies older than the one this node knew were left behind by a move
        .filter(|(_, generation)| *generation >= floor)
        // the highest generation, the earliest site among equals
        .min_by_key(|(site, generation)| (std::cmp::Reverse(*generation), *site));
    if let Some((site, _)) = best {
        return Choice::Join(site);
    }
    let answers = |site: &usize| probes[*site].is_ok();
    match known {
        None => match probes.first() {
            Some(Ok(_)) => Choice::Create { site: 0, generation: 0 },
            _ => Choice::Wait,
        },
        Some(known) => {
            let n = probes.len();
            // the known site first (restarted empty), then the ones after it, wrapping around
            match (0..n).map(|i| (known.site + i) % n).find(answers) {
                Some(site) => Choice::Create { site, generation: known.generation + 1 },
                None => Choice::Wait,
            }
        }
    }
}

/// The run's metadata at the store `conn` is connected to, if any.
pub(crate) async fn read_meta<C: StoreConn>(conn: &mut C) -> Result<Option<Meta>> {
    match conn.try_get(Keys::META).await? {
        Some(bytes) => Ok(Some(decode(&bytes, "metadata")?)),
        None => Ok(None),
    }
}

/// What `site` holds, asked over a new connection that may take [`PROBE_PATIENCE`].
pub(crate) async fn probe<S: RendezvousStore>(store: &S, site: usize) -> Probe {
    let probing = async {
        let mut conn = store.probe_site(site, PROBE_PATIENCE).await?;
        read_meta(&mut conn).await
    };
    match tokio::time::timeout(PROBE_PATIENCE * 2, probing).await {
        Ok(Ok(meta)) => Ok(meta),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {:?}", PROBE_PATIENCE * 2)),
    }
}

/// Probes every site but `skip` at once.
pub(crate) async fn probe_others<S: RendezvousStore>(store: &S, skip: Option<usize>) -> Vec<Option<Probe>> {
    let mut probing = tokio::task::JoinSet::new();
    for site in (0..store.sites()).filter(|site| Some(*site) != skip) {
        let store = store.clone();
        probing.spawn(async move { (site, probe(&store, site).await) });
    }
    let mut probes = vec![None; store.sites()];
    while let Some(done) = probing.join_next().await {
        if let Ok((site, probe)) = done {
            probes[site] = Some(probe);
        }
    }
    probes
}

/// While a member, watches the sites other than its own every `interval`: a newer copy of the
/// state elsewhere (nodes that lost this site moved on, and this node has just got its link
/// back) means the job now lives there.
pub(crate) fn spawn_site_watcher<S: RendezvousStore>(
    store: S,
    known: Known,
    interval: Duration,
    changes: std::sync::Arc<watch::Sender<Option<MembershipChange>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            for (site, probe) in probe_others(&store, Some(known.site)).await.into_iter().enumerate() {
                let Some(Ok(Some(meta))) = probe else { continue };
                if meta.generation > known.generation {
                    let to = store.describe_site(site);
                    tracing::debug!(site, generation = meta.generation, "the rendezvous state moved to {to}");
                    let _ = changes.send(Some(MembershipChange::StoreMoved { to }));
                    return;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(generation: u64, incarnation: u64) -> Probe {
        Ok(Some(Meta { v: 1, min_nodes: 1, max_nodes: 2, incarnation, generation }))
    }

    fn down() -> Probe {
        Err("refused".into())
    }

    fn known(site: usize, generation: u64, incarnation: u64) -> Option<Known> {
        Some(Known { site, generation, incarnation })
    }

    #[test]
    fn a_new_job_starts_at_the_first_site_and_waits_for_it() {
        assert_eq!(choose(&[Ok(None), Ok(None)], None), Choice::Create { site: 0, generation: 0 });
        assert_eq!(choose(&[down(), Ok(None)], None), Choice::Wait);
        assert_eq!(choose(&[down()], None), Choice::Wait);
    }

    #[test]
    fn joiners_find_the_newest_copy() {
        assert_eq!(choose(&[Ok(None), meta(0, 7)], None), Choice::Join(1));
        assert_eq!(choose(&[meta(0, 7), meta(1, 8), down()], None), Choice::Join(1));
        assert_eq!(choose(&[meta(2, 7), meta(2, 8)], None), Choice::Join(0));
    }

    #[test]
    fn a_member_stays_with_its_copy() {
        assert_eq!(choose(&[meta(0, 7)], known(0, 0, 7)), Choice::Join(0));
        assert_eq!(choose(&[meta(0, 7), Ok(None)], known(0, 0, 7)), Choice::Join(0));
    }

    #[test]
    fn a_store_that_restarted_empty_is_set_up_again_one_generation_up() {
        assert_eq!(choose(&[Ok(None)], known(0, 0, 7)), Choice::Create { site: 0, generation: 1 });
        // another node did it first (or a new node started the job afresh there)
        assert_eq!(choose(&[meta(1, 9)], known(0, 0, 7)), Choice::Join(0));
        assert_eq!(choose(&[meta(0, 9)], known(0, 0, 7)), Choice::Join(0));
    }

    #[test]
    fn a_lost_site_moves_the_state_to_the_next_one_that_answers() {
        assert_eq!(choose(&[down(), Ok(None), Ok(None)], known(0, 0, 7)), Choice::Create { site: 1, generation: 1 });
        assert_eq!(choose(&[down(), down(), Ok(None)], known(0, 0, 7)), Choice::Create { site: 2, generation: 1 });
        assert_eq!(choose(&[Ok(None), down(), down()], known(1, 3, 7)), Choice::Create { site: 0, generation: 4 });
        assert_eq!(choose(&[down(), down()], known(0, 0, 7)), Choice::Wait);
        // stale copies (older generations) left at a site that came back are ignored
        assert_eq!(choose(&[meta(0, 5), down(), Ok(None)], known(1, 1, 7)), Choice::Create { site: 2, generation: 2 });
    }
}
