//! Ranks of every worker, from all agents' (role, local world size), in O(1) store round
//! trips per agent: each agent publishes its role info; group rank 0 reads them all with one
//! MULTI_GET, computes every agent's bases and writes them with one MULTI_SET; each agent
//! reads its own. Nodes may run different numbers of workers.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::agent::error::{AgentError, Result};
use crate::store::TcpStore;

/// What an agent publishes about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleInfo {
    pub role: String,
    pub local_world_size: u32,
}

/// Where this agent's workers sit: worker `lr` has global rank `global_base + lr` and role rank
/// `role_base + lr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub global_base: u32,
    pub world_size: u32,
    pub role_base: u32,
    pub role_world_size: u32,
}

/// Bases for every agent, in group rank order: running sums of the earlier agents' sizes,
/// overall and per role.
pub fn compute(infos: &[RoleInfo]) -> Vec<Assignment> {
    let world_size = infos.iter().map(|info| info.local_world_size).sum();
    let mut global_base = 0;
    infos
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let same_role = |other: &&RoleInfo| other.role == info.role;
            let role_base = infos[..i].iter().filter(same_role).map(|o| o.local_world_size).sum();
            let role_world_size = infos.iter().filter(same_role).map(|o| o.local_world_size).sum();
            let assignment = Assignment { global_base, world_size, role_base, role_world_size };
            global_base += info.local_world_size;
            assignment
        })
        .collect()
}

/// Runs the exchange in the round's namespace `prefix` of `store`.
pub async fn assign(
    store: &mut TcpStore,
    prefix: &str,
    group_rank: u32,
    group_world_size: u32,
    me: &RoleInfo,
    timeout: Duration,
) -> Result<Assignment> {
    let info_key = |rank: u32| format!("{prefix}/role_info/{rank}");
    let assigned_key = |rank: u32| format!("{prefix}/assigned/{rank}");
    store.set(info_key(group_rank).as_bytes(), &serde_json::to_vec(me).expect("serializes")).await?;
    if group_rank == 0 {
        let keys: Vec<String> = (0..group_world_size).map(info_key).collect();
        let slices: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        store.wait(&slices, Some(timeout)).await?;
        let infos = store
            .multi_get(&slices)
            .await?
            .iter()
            .map(|bytes| serde_json::from_slice(bytes))
            .collect::<std::result::Result<Vec<RoleInfo>, _>>()
            .map_err(|err| AgentError::Config(format!("unreadable role info from another agent: {err}")))?;
        let values: Vec<Vec<u8>> = compute(&infos).iter().map(|a| serde_json::to_vec(a).expect("serializes")).collect();
        let keys: Vec<String> = (0..group_world_size).map(assigned_key).collect();
        let key_slices: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let value_slices: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        store.multi_set(&key_slices, &value_slices).await?;
    }
    let key = assigned_key(group_rank);
    store.wait(&[key.as_bytes()], Some(timeout)).await?;
    let bytes = store.get(key.as_bytes()).await?;
    serde_json::from_slice(&bytes).map_err(|err| AgentError::Config(format!("unreadable rank assignment: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(role: &str, n: u32) -> RoleInfo {
        RoleInfo { role: role.into(), local_world_size: n }
    }

    #[test]
    fn homogeneous_nodes() {
        let assignments = compute(&[info("r", 4), info("r", 4)]);
        assert_eq!(assignments[1], Assignment { global_base: 4, world_size: 8, role_base: 4, role_world_size: 8 });
    }

    #[test]
    fn heterogeneous_nodes_and_roles() {
        let assignments = compute(&[info("trainer", 2), info("reader", 3), info("trainer", 1)]);
        assert_eq!(assignments[0], Assignment { global_base: 0, world_size: 6, role_base: 0, role_world_size: 3 });
        assert_eq!(assignments[1], Assignment { global_base: 2, world_size: 6, role_base: 0, role_world_size: 3 });
        assert_eq!(assignments[2], Assignment { global_base: 5, world_size: 6, role_base: 2, role_world_size: 3 });
    }
}
