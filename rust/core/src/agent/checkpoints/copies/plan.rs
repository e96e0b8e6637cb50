//! What each agent holds, as it tells the others at the start of a round, and what a node
//! must copy from its peers before its workers start: pure decisions, no I/O.
//!
//! A worker of global rank `r` restores the state saved by rank `r` while `r` was in the
//! world that saved it, else by rank `r % saved world size` (a job that grew: its new ranks
//! start from a replica's state, right for data parallelism). The Python side
//! (`elastix.checkpoint`) applies the same rule; the agent gives it the saved world size.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One whole step a member holds of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub step: u64,
    /// The world size it was saved in.
    pub world_size: u32,
}

/// What one agent holds in memory (its own ranks' slots and the copies its peers sent), and
/// where it serves them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holdings {
    /// `host:port` of its copy server (`None`: it serves none).
    pub serves: Option<String>,
    pub ranks: BTreeMap<u32, Vec<Held>>,
}

/// A copy to take from a peer before the workers start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetch {
    /// The rank whose state it is.
    pub rank: u32,
    pub step: u64,
    /// The member (its group rank) that holds it.
    pub from: usize,
}

/// The world size the job's newest saved step was saved in (`None`: nothing saved yet).
pub fn saved_world(all: &[Holdings]) -> Option<u32> {
    all.iter()
        .flat_map(|holdings| holdings.ranks.values().flatten())
        .max_by_key(|held| held.step)
        .map(|held| held.world_size)
}

/// The rank whose saved state global rank `rank` restores.
pub fn source(rank: u32, saved_world: u32) -> u32 {
    if saved_world == 0 {
        rank
    } else {
        rank % saved_world
    }
}

/// The copies member `me` must take so that, for each of its workers' global `ranks`, it holds
/// the newest step any member holds of that worker's source rank.
pub fn fetches(all: &[Holdings], me: usize, ranks: &[u32]) -> Vec<Fetch> {
    let Some(world) = saved_world(all) else { return Vec::new() };
    let mut wanted: Vec<u32> = ranks.iter().map(|&rank| source(rank, world)).collect();
    wanted.sort_unstable();
    wanted.dedup();
    wanted
        .into_iter()
        .filter_map(|rank| {
            let newest = |holdings: &Holdings| holdings.ranks.get(&rank)?.iter().map(|held| held.step).max();
            let holders = all.iter().enumerate().filter(|(_, holdings)| holdings.serves.is_some());
            let (from, step) = holders.filter_map(|(member, holdings)| Some((member, newest(holdings)?))).max_by_key(
                // the newest step; among equals the nearest member after this one (a buddy)
                |&(member, step)| (step, std::cmp::Reverse((member + all.len() - me) % all.len())),
            )?;
            let mine = all.get(me).and_then(newest);
            (mine < Some(step) && from != me).then_some(Fetch { rank, step, from })
        })
        .collect()
}

/// The member this one copies its checkpoints to: the next in the round, if there is another.
pub fn buddy(me: u32, members: u32) -> Option<u32> {
    (members > 1).then(|| (me + 1) % members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(serves: bool, ranks: &[(u32, &[u64])], world_size: u32) -> Holdings {
        Holdings {
            serves: serves.then(|| "h:1".to_owned()),
            ranks: ranks
                .iter()
                .map(|(rank, steps)| (*rank, steps.iter().map(|&step| Held { step, world_size }).collect()))
                .collect(),
        }
    }

    #[test]
    fn a_lost_node_s_ranks_come_from_the_member_holding_their_copy() {
        // three nodes of two ranks saved at world 6; node 1 is gone, node 2 held its copies;
        // the new round has the old nodes 0 and 2 (now members 0 and 1)
        let all = [
            holds(true, &[(0, &[40, 41]), (1, &[40, 41])], 6),
            holds(true, &[(2, &[40]), (3, &[40]), (4, &[41]), (5, &[41])], 6),
        ];
        assert_eq!(saved_world(&all), Some(6));
        // member 1's workers are ranks 2 and 3: it holds them already
        assert!(fetches(&all, 1, &[2, 3]).is_empty());
        // member 0 would have to take them if it ran them
        assert_eq!(fetches(&all, 0, &[2]), [Fetch { rank: 2, step: 40, from: 1 }]);
    }

    #[test]
    fn a_node_that_joins_takes_its_ranks_from_a_peer_and_a_grown_world_restores_replicas() {
        let all = [holds(true, &[(0, &[7]), (1, &[7])], 2), holds(true, &[], 0)];
        assert_eq!(
            fetches(&all, 1, &[2, 3]),
            [Fetch { rank: 0, step: 7, from: 0 }, Fetch { rank: 1, step: 7, from: 0 }]
        );
        assert_eq!(source(3, 2), 1);
        assert_eq!(source(1, 4), 1);
    }

    #[test]
    fn nothing_is_taken_from_a_member_that_serves_none_or_when_nothing_was_saved() {
        let all = [holds(false, &[(0, &[7])], 1), holds(true, &[], 0)];
        assert!(fetches(&all, 1, &[0]).is_empty());
        assert!(fetches(&[holds(true, &[], 0), holds(true, &[], 0)], 0, &[0, 1]).is_empty());
        assert_eq!(saved_world(&[]), None);
    }

    #[test]
    fn the_buddy_is_the_next_member_in_a_ring() {
        assert_eq!(buddy(0, 3), Some(1));
        assert_eq!(buddy(2, 3), Some(0));
        assert_eq!(buddy(0, 1), None);
    }
}
