//! Where the job's rendezvous state lives, and moving it when that store is lost.
//!
//! A store with several sites (`--rdzv-endpoint a:p,b:p,c:p`, each hosted by the agent at that
//! address) holds the state at one site at a time. Each copy of the state is tagged by its
//! [`Meta`]: `generation` counts the moves, `incarnation` tells one copy from a later one at
//! the same site. Every node applies the same rules on its own, so no node is special:
//!
//! * only a node that reaches a majority of the sites may run the job (join a copy, or move
//!   it): more than half of all the listed sites, or exactly half of them with the first one
//!   among them (so with two sites, the first one's side). A site this node cannot reach counts
//!   against it whatever the network answered: a refused connection is what a dead agent gives,
//!   but also a firewall that rejects or a host half set up, so it never shrinks the electorate.
//!   Of two sides of a partition at most one has a majority, however the cut answers;
//! * the job is at the reachable site holding the best copy: the highest generation, the
//!   earliest site among equals; copies older than what this node already knew are stale and
//!   ignored;
//! * no copy anywhere: a new job starts at the first site (waiting for it to come up); a node
//!   that knew the job at site `i` sets the state up again one generation up, at `i` if `i`
//!   answers (its store restarted empty), else at the next site that answers.
//!
//! Nodes that decide alike create the same copy: the compare-and-set of `meta` keeps the first.
//! Members watch every site ([`spawn_site_watcher`]): one that has not reached a majority for
//! the loss window stops its workers (the other side goes on without it), and a better copy
//! elsewhere (the other side moved, or a link healed) moves everyone there, so copies always
//! meet again.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::keys::Keys;
use crate::rendezvous::change::MembershipChange;
use crate::rendezvous::error::Result;
use crate::rendezvous::presence;
use crate::rendezvous::records::{decode, Meta};
use crate::rendezvous::store::{RendezvousStore, StoreConn};

/// How long probing one site may take: a site that does not answer within this is skipped.
pub(crate) const PROBE_PATIENCE: Duration = Duration::from_secs(1);

/// The copy of the state a node works with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Known {
    pub site: usize,
    pub generation: u64,
    pub incarnation: u64,
}

/// What a probe of one site found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// It answered: the state it holds of this run, if any.
    Answer(Option<Meta>),
    /// Its host refused the connection (a dead agent, or a firewall that rejects: it may
    /// serve others all the same).
    Refused(String),
    /// No answer in time (a dead or stopped machine, a cut link): it may serve others.
    Silent(String),
}

impl Probe {
    fn meta(&self) -> Option<&Meta> {
        match self {
            Probe::Answer(meta) => meta.as_ref(),
            _ => None,
        }
    }

    fn answers(&self) -> bool {
        matches!(self, Probe::Answer(_))
    }
}

/// Whether these probes (one per listed site, in order) reach a majority of the sites: more
/// than half of them, or exactly half with the first site among them. Two disjoint sets of
/// sites never both qualify.
pub(crate) fn has_majority(probes: &[Probe]) -> bool {
    let reached = probes.iter().filter(|probe| probe.answers()).count();
    let first = probes.first().is_some_and(Probe::answers);
    reached > 0 && (2 * reached > probes.len() || (2 * reached == probes.len() && first))
}

/// Whether the copy (`generation`, at `site`) ranks before the copy `than`: the same order on
/// every node, so copies always meet.
pub(crate) fn better(generation: u64, site: usize, than: Known) -> bool {
    (std::cmp::Reverse(generation), site) < (std::cmp::Reverse(than.generation), than.site)
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// The state is at this site.
    Join(usize),
    /// Set the state up at `site` with `generation` (unless someone just did).
    Create { site: usize, generation: u64 },
    /// Nothing usable answers yet.
    Wait,
    /// This node does not reach a majority of the sites: the job may run on the other side.
    Minority,
}

/// Applies the rules of this module to what each site holds.
pub(crate) fn choose(probes: &[Probe], known: Option<Known>) -> Choice {
    // (nothing answering at all is waited for below, as for a single store)
    if probes.len() > 1 && probes.iter().any(Probe::answers) && !has_majority(probes) {
        // a node that knows of no job yet, and finds none, waits for the sites to come up
        let nothing = known.is_none() && probes.iter().all(|probe| probe.meta().is_none());
        return if nothing { Choice::Wait } else { Choice::Minority };
    }
    let floor = known.map_or(0, |known| known.generation);
    let best = probes
        .iter()
        .enumerate()
        .filter_map(|(site, probe)| Some((site, probe.meta()?.generation)))
        // copies older than the one this node knew were left behind by a move
        .filter(|(_, generation)| *generation >= floor)
        // the highest generation, the earliest site among equals
        .min_by_key(|(site, generation)| (std::cmp::Reverse(*generation), *site));
    if let Some((site, _)) = best {
        return Choice::Join(site);
    }
    let answers = |site: &usize| probes[*site].answers();
    match known {
        None => match probes.first() {
            Some(Probe::Answer(_)) => Choice::Create { site: 0, generation: 0 },
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

/// What `site` holds, asked over a new connection that may take [`PROBE_PATIENCE`]. A
/// refused connection is told apart from silence, for messages only: neither is reached.
pub(crate) async fn probe<S: RendezvousStore>(store: &S, site: usize) -> Probe {
    let (host, port) = store.address(site);
    match presence::probe(&host, port, PROBE_PATIENCE).await {
        presence::Probe::Present => {}
        presence::Probe::Gone => return Probe::Refused("its host refused the connection".into()),
        presence::Probe::Unsure(why) => return Probe::Silent(why),
    }
    let probing = async {
        let mut conn = store.probe_site(site, PROBE_PATIENCE).await?;
        read_meta(&mut conn).await
    };
    match tokio::time::timeout(PROBE_PATIENCE * 2, probing).await {
        Ok(Ok(meta)) => Probe::Answer(meta),
        Ok(Err(err)) => Probe::Silent(err.to_string()),
        Err(_) => Probe::Silent(format!("no answer within {:?}", PROBE_PATIENCE * 2)),
    }
}

/// Probes every site at once.
pub(crate) async fn probe_all<S: RendezvousStore>(store: &S) -> Vec<Probe> {
    let mut probing = tokio::task::JoinSet::new();
    for site in 0..store.sites() {
        let store = store.clone();
        probing.spawn(async move { (site, probe(&store, site).await) });
    }
    let mut probes = vec![Probe::Silent("the probe did not finish".into()); store.sites()];
    while let Some(done) = probing.join_next().await {
        if let Ok((site, probe)) = done {
            probes[site] = probe;
        }
    }
    probes
}

/// While a member, probes every site every `interval`. A better copy of the state elsewhere
/// (the other side of a partition moved on, or this node's link just healed) means the job
/// lives there now ([`MembershipChange::StoreMoved`]); no majority of the sites for `window`
/// means this node is on the minority side of a partition ([`MembershipChange::Minority`]).
pub(crate) fn spawn_site_watcher<S: RendezvousStore>(
    store: S,
    known: Known,
    interval: Duration,
    window: Duration,
    changes: std::sync::Arc<watch::Sender<Option<MembershipChange>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut minority_since: Option<tokio::time::Instant> = None;
        loop {
            tokio::time::sleep(interval).await;
            let probes = probe_all(&store).await;
            for (site, probe) in probes.iter().enumerate() {
                let Some(meta) = probe.meta() else { continue };
                if better(meta.generation, site, known) {
                    let to = store.describe_site(site);
                    tracing::debug!(site, generation = meta.generation, "the rendezvous state moved to {to}");
                    let _ = changes.send(Some(MembershipChange::StoreMoved { to }));
                    return;
                }
            }
            if has_majority(&probes) {
                minority_since = None;
                continue;
            }
            let since = *minority_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= window {
                let (reached, silent) = split_sites(&store, &probes);
                let _ = changes.send(Some(MembershipChange::Minority { reached, silent }));
                return;
            }
        }
    })
}

/// The sites that answered, and the others with why, for messages.
pub(crate) fn split_sites<S: RendezvousStore>(store: &S, probes: &[Probe]) -> (Vec<String>, Vec<String>) {
    let (mut reached, mut silent) = (Vec::new(), Vec::new());
    for (site, probe) in probes.iter().enumerate() {
        match probe {
            Probe::Answer(_) => reached.push(store.describe_site(site)),
            Probe::Refused(why) | Probe::Silent(why) => silent.push(format!("{} ({why})", store.describe_site(site))),
        }
    }
    (reached, silent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(generation: u64, incarnation: u64) -> Probe {
        Probe::Answer(Some(Meta { v: 1, min_nodes: 1, max_nodes: 2, incarnation, generation }))
    }

    fn empty() -> Probe {
        Probe::Answer(None)
    }

    fn refused() -> Probe {
        Probe::Refused("refused".into())
    }

    fn silent() -> Probe {
        Probe::Silent("no answer".into())
    }

    fn known(site: usize, generation: u64, incarnation: u64) -> Option<Known> {
        Some(Known { site, generation, incarnation })
    }

    #[test]
    fn a_new_job_starts_at_the_first_site_and_waits_for_it() {
        assert_eq!(choose(&[empty(), empty()], None), Choice::Create { site: 0, generation: 0 });
        assert_eq!(choose(&[empty(), empty(), refused()], None), Choice::Create { site: 0, generation: 0 });
        assert_eq!(choose(&[refused(), empty()], None), Choice::Wait, "the other sites are not up yet");
        assert_eq!(choose(&[refused(), meta(0, 7)], None), Choice::Minority, "a job, but no majority to join it");
        assert_eq!(choose(&[refused(), empty(), empty()], None), Choice::Wait);
        assert_eq!(choose(&[refused()], None), Choice::Wait);
    }

    #[test]
    fn joiners_find_the_newest_copy() {
        assert_eq!(choose(&[empty(), meta(0, 7)], None), Choice::Join(1));
        assert_eq!(choose(&[meta(0, 7), meta(1, 8), refused()], None), Choice::Join(1));
        assert_eq!(choose(&[meta(2, 7), meta(2, 8)], None), Choice::Join(0));
    }

    #[test]
    fn a_member_stays_with_its_copy() {
        assert_eq!(choose(&[meta(0, 7)], known(0, 0, 7)), Choice::Join(0));
        assert_eq!(choose(&[meta(0, 7), empty()], known(0, 0, 7)), Choice::Join(0));
    }

    #[test]
    fn a_store_that_restarted_empty_is_set_up_again_one_generation_up() {
        assert_eq!(choose(&[empty()], known(0, 0, 7)), Choice::Create { site: 0, generation: 1 });
        // another node did it first (or a new node started the job afresh there)
        assert_eq!(choose(&[meta(1, 9)], known(0, 0, 7)), Choice::Join(0));
        assert_eq!(choose(&[meta(0, 9)], known(0, 0, 7)), Choice::Join(0));
    }

    #[test]
    fn a_lost_site_moves_the_state_to_the_next_one_that_answers() {
        assert_eq!(choose(&[refused(), empty(), empty()], known(0, 0, 7)), Choice::Create { site: 1, generation: 1 });
        assert_eq!(choose(&[silent(), empty(), empty()], known(0, 0, 7)), Choice::Create { site: 1, generation: 1 });
        let five = [refused(), refused(), empty(), empty(), empty()];
        assert_eq!(choose(&five, known(0, 0, 7)), Choice::Create { site: 2, generation: 1 });
        assert_eq!(choose(&[empty(), refused(), empty()], known(1, 3, 7)), Choice::Create { site: 2, generation: 4 });
        assert_eq!(choose(&[empty(), refused()], known(1, 3, 7)), Choice::Create { site: 0, generation: 4 });
        // stale copies (older generations) left at a site that came back are ignored
        assert_eq!(
            choose(&[meta(0, 5), refused(), empty()], known(1, 1, 7)),
            Choice::Create { site: 2, generation: 2 }
        );
    }

    #[test]
    fn only_a_majority_of_all_the_sites_may_run_the_job_whatever_the_others_answered() {
        // three sites: one side of any partition has two of them; refused or silent alike
        for cut in [silent(), refused()] {
            assert_eq!(choose(&[meta(0, 7), cut.clone(), cut.clone()], known(0, 0, 7)), Choice::Minority);
            assert_eq!(
                choose(&[cut.clone(), empty(), empty()], known(0, 0, 7)),
                Choice::Create { site: 1, generation: 1 }
            );
            assert_eq!(choose(&[refused(), cut.clone(), empty()], known(0, 0, 7)), Choice::Minority);
            // two sites: the first one's side (a tie broken the same way everywhere)
            assert_eq!(choose(&[cut.clone(), empty()], known(0, 0, 7)), Choice::Minority);
            assert_eq!(choose(&[meta(0, 7), cut.clone()], known(0, 0, 7)), Choice::Join(0));
            // five sites: three of them
            let two = [meta(0, 7), empty(), cut.clone(), cut.clone(), cut.clone()];
            assert_eq!(choose(&two, known(0, 0, 7)), Choice::Minority);
            let three = [cut.clone(), cut.clone(), empty(), empty(), empty()];
            assert_eq!(choose(&three, known(0, 0, 7)), Choice::Create { site: 2, generation: 1 });
        }
        // four sites: two with the first, not two without it
        assert!(has_majority(&[empty(), empty(), silent(), refused()]));
        assert!(!has_majority(&[refused(), silent(), empty(), empty()]));
        // one site: the store's side (this node reaches it, or waits for it)
        assert_eq!(choose(&[meta(0, 7)], known(0, 0, 7)), Choice::Join(0));
        assert_eq!(choose(&[silent()], known(0, 0, 7)), Choice::Wait);
    }

    #[test]
    fn two_sides_of_any_cut_never_both_hold_a_majority() {
        // every way of splitting up to six sites between two sides
        for n in 1..=6usize {
            for mask in 0..(1u32 << n) {
                let side = |mine: bool| -> Vec<Probe> {
                    (0..n).map(|site| if ((mask >> site) & 1 == 1) == mine { empty() } else { refused() }).collect()
                };
                assert!(!(has_majority(&side(true)) && has_majority(&side(false))), "{n} sites, split {mask:b}");
            }
        }
    }

    #[test]
    fn copies_rank_by_generation_then_site_on_every_node() {
        let here = Known { site: 1, generation: 2, incarnation: 7 };
        assert!(better(3, 2, here), "a newer generation anywhere");
        assert!(better(2, 0, here), "the same generation at an earlier site: two copies meet there");
        assert!(!better(2, 1, here) && !better(2, 2, here) && !better(1, 0, here));
        assert!(has_majority(&[meta(0, 1), empty(), silent()]));
        assert!(!has_majority(&[refused(), refused(), refused()]), "nothing reached is no majority");
    }
}
