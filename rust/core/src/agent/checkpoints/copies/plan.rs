//! What each agent holds, as it tells the others at the start of a round, and what a node
//! must copy from its peers before its workers start: pure decisions, no I/O.
//!
//! A worker of global rank `r` restores the state saved by rank `r` while `r` was in the
//! world that saved it; a rank new to the job (it grew) starts from a replica's state, right
//! for data parallelism: one its node holds if it holds one (no copy to take), else rank
//! `r % saved world size`'s. The agent tells the workers which ([`SOURCES_VAR`]); without it
//! the Python side (`elastix.checkpoint`) applies the `r % saved world size` rule.

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

/// The variable that tells the workers whose state each of their global ranks restores:
/// `rank:source` pairs, comma-separated.
pub const SOURCES_VAR: &str = "ELASTIX_CHECKPOINT_SOURCES";

/// What member `me` restores in a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The newest step whose state every rank of the new world can get from some member's memory.
    pub step: u64,
    /// The copies `me` must take for its workers to hold theirs.
    pub fetches: Vec<Fetch>,
    /// Each of its workers' global ranks, and the rank whose state it restores.
    pub sources: Vec<(u32, u32)>,
}

/// What a round restores: the newest step whose state every rank of the new world (`world`
/// ranks) can get from some member's memory, whose state member `me`'s workers (global
/// `ranks`) restore and the copies it must take for them. `None` when no step is held for
/// every rank (the workers then agree on one from disk, or start afresh).
pub fn restore(all: &[Holdings], me: usize, ranks: &[u32], world: u32) -> Option<Plan> {
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
    // a new rank may take any old rank's state (the step is held for every old rank: a world
    // that grew has them all): one this node holds saves a copy across the network
    let held_here = |rank: u32| all.get(me).is_some_and(|mine| holds(mine, rank));
    let sources: Vec<(u32, u32)> = ranks
        .iter()
        .map(|&rank| match rank < saved {
            true => (rank, rank),
            false => (rank, (0..saved).find(|&old| held_here(old)).unwrap_or_else(|| source(rank, saved))),
        })
        .collect();
    let mut wanted: Vec<u32> = sources.iter().map(|&(_, source)| source).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let fetches = wanted
        .into_iter()
        .filter(|&rank| !held_here(rank))
        .filter_map(|rank| {
            // the nearest member after this one that serves it (its buddy first)
            let from = (1..all.len())
                .map(|offset| (me + offset) % all.len())
                .find(|&member| all[member].serves.is_some() && holds(&all[member], rank))?;
            Some(Fetch { rank, step, from })
        })
        .collect();
    Some(Plan { step, fetches, sources })
}

/// [`SOURCES_VAR`]'s value for `sources`.
pub fn sources_value(sources: &[(u32, u32)]) -> String {
    sources.iter().map(|(rank, source)| format!("{rank}:{source}")).collect::<Vec<_>>().join(",")
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
        assert_eq!(restore(&all, 1, &[1], 2), Some(Plan { step: 40, fetches: vec![], sources: vec![(1, 1)] }));
        // member 0 would take it from member 1 if it ran rank 1
        let fetch = Fetch { rank: 1, step: 40, from: 1 };
        let plan = Plan { step: 40, fetches: vec![fetch], sources: vec![(0, 0), (1, 1)] };
        assert_eq!(restore(&all, 0, &[0, 1], 2), Some(plan));
    }

    #[test]
    fn a_node_that_joins_takes_the_agreed_step_of_its_ranks_from_a_peer() {
        // the two survivors stopped one step apart; the joining node holds nothing
        let all = [holds(true, &[(0, &[7, 8])], 2), holds(true, &[(1, &[6, 7])], 2), holds(true, &[], 0)];
        // a grown world: rank 2 restores rank 0's state (a replica), at the step all can get
        let plan = Plan { step: 7, fetches: vec![Fetch { rank: 0, step: 7, from: 0 }], sources: vec![(2, 0)] };
        assert_eq!(restore(&all, 2, &[2], 3), Some(plan));
        assert_eq!(source(3, 2), 1);
        assert_eq!(source(1, 4), 1);
    }

    #[test]
    fn a_survivor_given_a_new_rank_restores_a_replica_it_holds_and_the_joiner_takes_one() {
        // two survivors of ranks 0 and 1 hold their step 7; a node joins, and the new ranks put
        // it between them: member 1 (the joiner) is rank 1, member 2 (old rank 1) is rank 2
        let all = [holds(true, &[(0, &[6, 7])], 2), holds(true, &[], 0), holds(true, &[(1, &[6, 7])], 2)];
        // rank 2 is new: it restores old rank 1's state, which its node holds (no copy)
        assert_eq!(restore(&all, 2, &[2], 3), Some(Plan { step: 7, fetches: vec![], sources: vec![(2, 1)] }));
        // rank 1 was in the saved world: its own state, from the member that holds it
        let plan = Plan { step: 7, fetches: vec![Fetch { rank: 1, step: 7, from: 2 }], sources: vec![(1, 1)] };
        assert_eq!(restore(&all, 1, &[1], 3), Some(plan));
        assert_eq!(sources_value(&[(2, 1), (5, 0)]), "2:1,5:0");
    }

    #[test]
    fn nothing_is_restored_when_a_rank_s_state_is_held_nowhere_or_nothing_was_saved() {
        let all = [holds(true, &[(0, &[7])], 2), holds(true, &[], 0)];
        assert_eq!(restore(&all, 1, &[1], 2), None, "rank 1's state is in no member's memory");
        assert_eq!(restore(&[holds(true, &[], 0), holds(true, &[], 0)], 0, &[0], 2), None);
        // a member that serves none is not asked
        let all = [holds(false, &[(0, &[7])], 1), holds(true, &[], 0)];
        assert_eq!(restore(&all, 1, &[0], 1), Some(Plan { step: 7, fetches: vec![], sources: vec![(0, 0)] }));
        assert_eq!(saved_world(&[]), None);
    }

    #[test]
    fn the_buddy_is_the_next_member_in_a_ring() {
        assert_eq!(buddy(0, 3), Some(1));
        assert_eq!(buddy(2, 3), Some(0));
        assert_eq!(buddy(0, 1), None);
    }
}
