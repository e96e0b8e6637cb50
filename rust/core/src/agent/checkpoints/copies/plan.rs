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

/// What a round restores: the newest step whose state every rank of the new world (`world`
/// ranks) can get from some member's memory, and the copies member `me` must take for its
/// workers' global `ranks` to hold theirs. `None` when no step is held for every rank (the
/// workers then agree on one from disk, or start afresh).
pub fn restore(all: &[Holdings], me: usize, ranks: &[u32], world: u32) -> Option<(u64, Vec<Fetch>)> {
    let saved = saved_world(all)?;
    let held = |rank: u32| -> Vec<u64> {
        all.iter().filter_map(|holdings| holdings.ranks.get(&rank)).flatten().map(|held| held.step).collect()
    };
    let mut sources: Vec<u32> = (0..world).map(|rank| source(rank, saved)).collect();
    sources.sort_unstable();
    sources.dedup();
    let step = sources
        .iter()
        .map(|&rank| held(rank))
        .reduce(|common, steps| common.into_iter().filter(|step| steps.contains(step)).collect())?
        .into_iter()
        .max()?;
    let holds = |holdings: &Holdings, rank: u32| {
        holdings.ranks.get(&rank).is_some_and(|steps| steps.iter().any(|held| held.step == step))
    };
    let mut wanted: Vec<u32> = ranks.iter().map(|&rank| source(rank, saved)).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let fetches = wanted
        .into_iter()
        .filter(|&rank| !all.get(me).is_some_and(|mine| holds(mine, rank)))
        .filter_map(|rank| {
            // the nearest member after this one that serves it (its buddy first)
            let from = (1..all.len())
                .map(|offset| (me + offset) % all.len())
                .find(|&member| all[member].serves.is_some() && holds(&all[member], rank))?;
            Some(Fetch { rank, step, from })
        })
        .collect();
    Some((step, fetches))
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
        // three nodes of one rank saved at world 3; node 1 is gone, node 2 held its copies; the
        // new round has the old nodes 0 and 2 (now members 0 and 1) and two ranks
        let all = [holds(true, &[(0, &[40, 41])], 3), holds(true, &[(1, &[39, 40]), (2, &[40, 41])], 3)];
        assert_eq!(saved_world(&all), Some(3));
        // step 41 is not held for rank 1: the round restores 40, which member 1 holds for rank 1
        assert_eq!(restore(&all, 1, &[1], 2), Some((40, vec![])));
        // member 0 would take it from member 1 if it ran rank 1
        assert_eq!(restore(&all, 0, &[0, 1], 2), Some((40, vec![Fetch { rank: 1, step: 40, from: 1 }])));
    }

    #[test]
    fn a_node_that_joins_takes_the_agreed_step_of_its_ranks_from_a_peer() {
        // the two survivors stopped one step apart; the joining node holds nothing
        let all = [holds(true, &[(0, &[7, 8])], 2), holds(true, &[(1, &[6, 7])], 2), holds(true, &[], 0)];
        // a grown world: rank 2 restores rank 0's state (a replica), at the step all can get
        assert_eq!(restore(&all, 2, &[2], 3), Some((7, vec![Fetch { rank: 0, step: 7, from: 0 }])));
        assert_eq!(source(3, 2), 1);
        assert_eq!(source(1, 4), 1);
    }

    #[test]
    fn nothing_is_restored_when_a_rank_s_state_is_held_nowhere_or_nothing_was_saved() {
        let all = [holds(true, &[(0, &[7])], 2), holds(true, &[], 0)];
        assert_eq!(restore(&all, 1, &[1], 2), None, "rank 1's state is in no member's memory");
        assert_eq!(restore(&[holds(true, &[], 0), holds(true, &[], 0)], 0, &[0], 2), None);
        // a member that serves none is not asked
        let all = [holds(false, &[(0, &[7])], 1), holds(true, &[], 0)];
        assert_eq!(restore(&all, 1, &[0], 1), Some((7, vec![])));
        assert_eq!(saved_world(&[]), None);
    }

    #[test]
    fn the_buddy_is_the_next_member_in_a_ring() {
        assert_eq!(buddy(0, 3), Some(1));
        assert_eq!(buddy(2, 3), Some(0));
        assert_eq!(buddy(0, 1), None);
    }
}
