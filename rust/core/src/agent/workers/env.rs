//! The environment of a worker: torch's variable names, so PyTorch scripts run unchanged,
//! plus `ELASTIX_*` equivalents.

use std::collections::BTreeMap;

use crate::agent::config::AgentConfig;
use crate::agent::workers::ranks::Assignment;
use crate::rendezvous::RendezvousInfo;

/// Everything that describes one worker's place in the job.
#[derive(Clone, Debug)]
pub struct WorkerPlace {
    pub local_rank: u32,
    pub global_rank: u32,
    pub role_rank: u32,
    pub restart_count: i64,
    pub error_file: String,
}

/// How every message names a worker (the same words in logs, summaries and errors).
pub fn worker_name(global_rank: u32, local_rank: u32, pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!("worker rank {global_rank} (local rank {local_rank}, pid {pid})"),
        None => format!("worker rank {global_rank} (local rank {local_rank})"),
    }
}

impl WorkerPlace {
    /// This worker's name in messages (see [`worker_name`]).
    pub fn name(&self, pid: Option<u32>) -> String {
        worker_name(self.global_rank, self.local_rank, pid)
    }

    pub fn new(local_rank: u32, assignment: &Assignment, restart_count: i64, error_file: String) -> Self {
        WorkerPlace {
            local_rank,
            global_rank: assignment.global_base + local_rank,
            role_rank: assignment.role_base + local_rank,
            restart_count,
            error_file,
        }
    }
}

/// The variables set for one worker (the agent's own environment is inherited under them).
pub fn worker_env(
    config: &AgentConfig,
    info: &RendezvousInfo,
    assignment: &Assignment,
    place: &WorkerPlace,
) -> BTreeMap<String, String> {
    let mut env = config.env.clone();
    let local_rank = if config.virtual_local_rank { 0 } else { place.local_rank };
    let (master_addr, master_port) = match (&config.master_addr, config.master_port, config.rdzv_backend.as_str()) {
        // static: the master given on the command line
        (Some(addr), Some(port), "static") => (addr.clone(), port),
        _ => (info.master_addr.clone(), info.master_port),
    };
    let pairs: [(&str, &str, String); 13] = [
        ("LOCAL_RANK", "ELASTIX_LOCAL_RANK", local_rank.to_string()),
        ("RANK", "ELASTIX_RANK", place.global_rank.to_string()),
        ("GROUP_RANK", "ELASTIX_GROUP_RANK", info.rank.to_string()),
        ("ROLE_RANK", "ELASTIX_ROLE_RANK", place.role_rank.to_string()),
        ("ROLE_NAME", "ELASTIX_ROLE_NAME", config.role.clone()),
        ("LOCAL_WORLD_SIZE", "ELASTIX_LOCAL_WORLD_SIZE", config.local_world_size.to_string()),
        ("WORLD_SIZE", "ELASTIX_WORLD_SIZE", assignment.world_size.to_string()),
        ("GROUP_WORLD_SIZE", "ELASTIX_GROUP_WORLD_SIZE", info.world_size.to_string()),
        ("ROLE_WORLD_SIZE", "ELASTIX_ROLE_WORLD_SIZE", assignment.role_world_size.to_string()),
        ("MASTER_ADDR", "ELASTIX_MASTER_ADDR", master_addr),
        ("MASTER_PORT", "ELASTIX_MASTER_PORT", master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", "ELASTIX_RESTART_COUNT", place.restart_count.to_string()),
        ("TORCHELASTIC_ERROR_FILE", "ELASTIX_ERROR_FILE", place.error_file.clone()),
    ];
    for (torch_name, elastix_name, value) in pairs {
        env.insert(torch_name.to_owned(), value.clone());
        env.insert(elastix_name.to_owned(), value);
    }
    env.insert("TORCHELASTIC_MAX_RESTARTS".into(), config.max_restarts.to_string());
    env.insert("ELASTIX_MAX_RESTARTS".into(), config.max_restarts.to_string());
    env.insert("TORCHELASTIC_RUN_ID".into(), config.run_id.clone());
    env.insert("ELASTIX_RUN_ID".into(), config.run_id.clone());
    // MASTER_ADDR:MASTER_PORT is a store the agent already serves: workers connect as clients
    env.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into());
    env.insert("ELASTIX_ROUND".into(), info.round.to_string());
    env.insert("TORCHELASTIC_SIGNALS_TO_HANDLE".into(), config.signals_to_handle.join(","));
    if std::env::var_os("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none() {
        env.insert("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "1".into());
    }
    if config.virtual_local_rank {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let device = match visible.as_deref().filter(|v| !v.is_empty()) {
            Some(list) => list.split(',').nth(place.local_rank as usize).unwrap_or_default().to_owned(),
            None => place.local_rank.to_string(),
        };
        env.insert("CUDA_VISIBLE_DEVICES".into(), device);
    }
    env
}

/// A worker's arguments with `${local_rank}` and `$local_rank` replaced. Unlike torch's
/// `string.Template`, nothing else changes (`$$` stays `$$`).
pub fn worker_args(args: &[String], local_rank: u32) -> Vec<String> {
    let rank = local_rank.to_string();
    args.iter().map(|arg| arg.replace("${local_rank}", &rank).replace("$local_rank", &rank)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::config::tests::sample;

    #[test]
    fn the_torch_contract_and_elastix_names() {
        let config = AgentConfig::from_json(&sample(2).to_string()).unwrap();
        let info = RendezvousInfo {
            run_id: "job".into(),
            round: 3,
            rank: 1,
            world_size: 2,
            master_addr: "host0".into(),
            master_port: 4242,
            store_host: "host0".into(),
            store_port: 29400,
            store_prefix: "p".into(),
        };
        let assignment = Assignment { global_base: 2, world_size: 4, role_base: 2, role_world_size: 4 };
        let place = WorkerPlace::new(1, &assignment, 5, "/logs/error.json".into());
        let env = worker_env(&config, &info, &assignment, &place);
        let get = |key: &str| env.get(key).map(String::as_str);
        assert_eq!(get("RANK"), Some("3"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_WORLD_SIZE"), Some("2"));
        assert_eq!(get("MASTER_ADDR"), Some("host0"));
        assert_eq!(get("MASTER_PORT"), Some("4242"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("5"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("ELASTIX_RANK"), Some("3"));
        assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some("/logs/error.json"));
    }

    #[test]
    fn args_substitute_only_the_local_rank() {
        let args = vec!["--rank=${local_rank}".to_owned(), "$local_rank".into(), "cost=$$5".into()];
        assert_eq!(worker_args(&args, 3), vec!["--rank=3", "3", "cost=$$5"]);
    }
}
