//! What the launcher hands the agent: one JSON object (the CLI and `elastix.launch` build it),
//! versioned by its fields; unknown fields are refused so a typo cannot pass silently.
//!
//! This is the one schema of an agent's configuration, and the one place it is checked: the
//! Python side only derives the values from torchrun's flags (and calls [`AgentConfig::from_json`]
//! through the binding before it starts anything). Errors name the command-line flag.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use nix::sched::CpuSet;
use serde::Deserialize;

use super::error::{AgentError, Result};
use super::numa::NumaBinding;
use crate::rendezvous::{BackendKind, ConfInput, Rendezvous, RendezvousParams};

/// Most workers one agent runs: each is a process with pipes, a log pair and a standby
/// interpreter; more than this on one machine is a typo (an extra digit), not a job.
pub const MAX_LOCAL_WORKERS: u32 = 1024;

/// The names `--rdzv-backend` takes (see [`BackendKind`]).
pub const BACKENDS: &[&str] = BackendKind::NAMES;

/// Which of a worker's streams go to a file (torch's `Std` mask).
pub const STD_OUT: u8 = 1;
pub const STD_ERR: u8 = 2;

/// torch's way of turning log files (and error files) off: `--log-dir /dev/null`.
pub(crate) const NO_LOGS: &str = "/dev/null";

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub run_id: String,
    pub role: String,
    pub local_world_size: u32,
    /// Program each worker executes, and its arguments (`${local_rank}` is substituted).
    pub entrypoint: String,
    pub args: Vec<String>,
    /// Added to every worker's environment, on top of the agent's own.
    pub env: BTreeMap<String, String>,
    pub rdzv_backend: String,
    pub rdzv_endpoint: String,
    pub rdzv_conf: ConfInput,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub node_rank: Option<u32>,
    pub local_addr: Option<String>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    /// Job-wide: rounds that may end in a failure before the job gives up.
    pub max_restarts: u32,
    pub signals_to_handle: Vec<String>,
    /// Seconds between the stop signal and SIGKILL.
    pub shutdown_timeout: f64,
    /// Seconds without a heartbeat after which a worker that sent one is hung (`None`: only
    /// workers' own progress windows and timers count).
    #[serde(default)]
    pub worker_timeout: Option<f64>,
    pub exit_barrier_timeout: f64,
    pub log_dir: Option<String>,
    /// Per local rank: streams written to files only, and streams written to files and echoed.
    pub redirects: Vec<u8>,
    pub tee: Vec<u8>,
    /// Local ranks whose output reaches the console (`None`: all).
    pub local_ranks_filter: Option<Vec<u32>>,
    /// Template for console line prefixes: `{role}`, `{rank}`, `{local_rank}`, `{host}`.
    pub line_prefix: Option<String>,
    /// Lines of tee'd stdout (stderr) containing any of these are also written, prefixed, to
    /// `attempt_<n>/filtered_stdout.log` (`filtered_stderr.log`), as torchrun does.
    #[serde(default)]
    pub duplicate_stdout_filters: Vec<String>,
    #[serde(default)]
    pub duplicate_stderr_filters: Vec<String>,
    /// The file every state change is appended to as a JSON line ([`super::events`]).
    #[serde(default)]
    pub event_log: Option<String>,
    /// Whether those lines also go to stderr (`--event-log-handler jsonl`).
    #[serde(default)]
    pub event_log_stderr: bool,
    pub virtual_local_rank: bool,
    /// What the failure summary calls the job (default: the script or program).
    #[serde(default)]
    pub name: Option<String>,
    /// The variables that make a worker's command line a warm standby (see
    /// [`crate::agent::workers::standby`]); `None`: restarts start every worker cold.
    #[serde(default)]
    pub standby: Option<BTreeMap<String, String>>,
    /// Serve Prometheus metrics over HTTP on this port (`--metrics-port`; 0: a free one,
    /// logged); `None`: no endpoint.
    #[serde(default)]
    pub metrics_port: Option<u16>,
    /// The address the metrics endpoint binds (`--metrics-addr`); `None`: `--local-addr`
    /// when given (loopback under `--standalone`), else every IPv4 address.
    #[serde(default)]
    pub metrics_addr: Option<String>,
    /// `--numa-binding`: the CPUs each local rank's worker, and its standby, are bound to
    /// (the launcher reads them from the machine's topology: `elastix.launch.numa`); `None`:
    /// workers run where the agent may.
    #[serde(default)]
    pub numa_binding: Option<NumaBinding>,
    /// `--checkpoint-dir`: where the workers' checkpoints are persisted (under the run ID);
    /// `None`: they are held in memory only.
    #[serde(default)]
    pub checkpoint_dir: Option<String>,
    /// `--checkpoint-keep`: how many of the newest steps stay on disk.
    #[serde(default = "default_checkpoint_keep")]
    pub checkpoint_keep: u32,
    /// `--checkpoint-copy-rate`: MB a second this node's checkpoints go to its buddy at most
    /// (0: unlimited).
    #[serde(default = "default_checkpoint_copy_rate")]
    pub checkpoint_copy_rate: u64,
    /// `--preflight`: the command that runs this node's part of the pre-flight check before
    /// the job's first round trains (`None`: no check).
    #[serde(default)]
    pub preflight: Option<Vec<String>>,
    /// `--exclude-stragglers`: a node named a straggler leaves at the next re-form, where
    /// `--nnodes` allows.
    #[serde(default)]
    pub exclude_stragglers: bool,
}

fn default_checkpoint_keep() -> u32 {
    2
}

fn default_checkpoint_copy_rate() -> u64 {
    1000
}

impl AgentConfig {
    pub fn from_json(text: &str) -> Result<AgentConfig> {
        let mut input = serde_json::Deserializer::from_str(text);
        let config: AgentConfig = serde_path_to_error::deserialize(&mut input).map_err(|err| {
            let field = err.path().to_string();
            let what = flag(&field).map_or_else(|| format!("invalid agent configuration ({field})"), str::to_owned);
            AgentError::Config(format!("{what}: {}", plain_words(err.inner())))
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        let n = self.local_world_size as usize;
        if n == 0 {
            return Err(AgentError::Config("--nproc-per-node must be at least 1, got 0".into()));
        }
        if self.local_world_size > MAX_LOCAL_WORKERS {
            return Err(AgentError::Config(format!(
                "--nproc-per-node {}: at most {MAX_LOCAL_WORKERS} workers per node",
                self.local_world_size
            )));
        }
        if !(0 < self.min_nodes && self.min_nodes <= self.max_nodes) {
            return Err(AgentError::Config(format!(
                "--nnodes: need 0 < MIN <= MAX, got min_nodes={}, max_nodes={}",
                self.min_nodes, self.max_nodes
            )));
        }
        self.check_backend()?;
        if self.checkpoint_keep == 0 {
            return Err(AgentError::Config("--checkpoint-keep must be at least 1 (the newest step), got 0".into()));
        }
        if self.rdzv_backend == "static" {
            // the static rendezvous waits for exactly max_nodes nodes, ranked 0..max_nodes-1
            match self.node_rank {
                Some(rank) if rank < self.max_nodes => {}
                Some(rank) => {
                    return Err(AgentError::Config(format!(
                        "--node-rank {rank}: the static rendezvous has --nnodes {} nodes, ranked 0 to {}",
                        self.max_nodes,
                        self.max_nodes - 1
                    )))
                }
                None => return Err(AgentError::Config("the static rendezvous needs --node-rank".into())),
            }
        }
        if let Some(dir) = self.log_dir.as_deref().filter(|dir| *dir != NO_LOGS).map(Path::new) {
            if dir.exists() && !dir.is_dir() {
                return Err(AgentError::Config(format!("--log-dir: {} exists and is not a directory", dir.display())));
            }
        }
        for (name, masks) in [("redirects", &self.redirects), ("tee", &self.tee)] {
            if masks.len() != n || masks.iter().any(|mask| *mask > 3) {
                return Err(AgentError::Config(format!(
                    "{name} must give a mask 0-3 for each of the {n} local ranks, got {masks:?}"
                )));
            }
        }
        if let Some(binding) = &self.numa_binding {
            binding.check(n)?;
        }
        if let Some(seconds) = self.worker_timeout.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(AgentError::Config(format!(
                "--worker-timeout: must be a positive number of seconds, got {seconds}"
            )));
        }
        for (name, seconds) in
            [("--shutdown-timeout", self.shutdown_timeout), ("--exit-barrier-timeout", self.exit_barrier_timeout)]
        {
            if !(seconds.is_finite() && seconds >= 0.0) {
                return Err(AgentError::Config(format!(
                    "{name}: must be a non-negative number of seconds, got {seconds}"
                )));
            }
        }
        // last: every --rdzv-conf value, the secret's file, the endpoint list
        Rendezvous::check(&self.rendezvous_params()).map_err(|err| AgentError::Config(err.to_string()))
    }

    fn check_backend(&self) -> Result<()> {
        BackendKind::parse(&self.rdzv_backend).map(drop).map_err(|err| AgentError::Config(err.to_string()))
    }

    /// The CPUs `local_rank`'s processes are bound to (`None`: not bound).
    pub fn cpu_set(&self, local_rank: usize) -> Option<CpuSet> {
        self.numa_binding.as_ref()?.cpu_set(local_rank)
    }

    /// `--numa-binding MODE: CPUs 0-3,8` for `local_rank`, for messages (`None`: not bound).
    pub fn binding_of(&self, local_rank: usize) -> Option<String> {
        self.numa_binding.as_ref()?.describe(local_rank)
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.shutdown_timeout)
    }

    pub fn worker_timeout(&self) -> Option<Duration> {
        self.worker_timeout.map(Duration::from_secs_f64)
    }

    pub fn exit_barrier_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.exit_barrier_timeout)
    }

    /// Streams of `local_rank` that are written to a file.
    pub fn file_mask(&self, local_rank: usize) -> u8 {
        self.redirects[local_rank] | self.tee[local_rank] | self.filtered_out_mask(local_rank)
    }

    /// Streams of `local_rank` that reach the console.
    pub fn console_mask(&self, local_rank: usize) -> u8 {
        if self.filtered_out_mask(local_rank) != 0 {
            return 0;
        }
        (STD_OUT | STD_ERR) & !self.redirects[local_rank] | self.tee[local_rank]
    }

    /// A rank kept off the console by `--local-ranks-filter` still has its output kept, in
    /// files (torch drops it).
    fn filtered_out_mask(&self, local_rank: usize) -> u8 {
        match &self.local_ranks_filter {
            Some(shown) if !shown.contains(&(local_rank as u32)) => STD_OUT | STD_ERR,
            _ => 0,
        }
    }

    pub fn rendezvous_params(&self) -> RendezvousParams {
        // static without an endpoint meets at the master address, as torch does
        let endpoint = match (&self.rdzv_endpoint, self.rdzv_backend.as_str()) {
            (endpoint, "static") if endpoint.is_empty() => format!(
                "{}:{}",
                self.master_addr.as_deref().unwrap_or("127.0.0.1"),
                self.master_port.unwrap_or(crate::rendezvous::static_rdzv::DEFAULT_MASTER_PORT)
            ),
            (endpoint, _) => endpoint.clone(),
        };
        RendezvousParams {
            backend: self.rdzv_backend.clone(),
            endpoint,
            run_id: self.run_id.clone(),
            min_nodes: self.min_nodes,
            max_nodes: self.max_nodes,
            local_addr: self.local_addr.clone(),
            conf: self.rdzv_conf.clone(),
            node_rank: self.node_rank,
        }
    }
}

/// A JSON decoding error as a user reads it: no position in a text they never wrote, and the
/// Rust type names turned into what they allow.
fn plain_words(err: &serde_json::Error) -> String {
    let mut text = err.to_string();
    if err.line() > 0 {
        let position = format!(" at line {} column {}", err.line(), err.column());
        if let Some(stripped) = text.strip_suffix(&position) {
            text = stripped.to_owned();
        }
    }
    for (rust, words) in [
        ("expected u8", "expected a whole number from 0 to 255"),
        ("expected u16", "expected a whole number from 0 to 65535"),
        ("expected u32", "expected a whole number from 0 to 4294967295"),
        ("expected f64", "expected a number"),
        ("expected usize", "expected a whole number"),
    ] {
        text = text.replace(rust, words);
    }
    // `invalid value: integer `-1`, expected ...` -> `-1: expected ...`
    if let Some(rest) = text.strip_prefix("invalid value: ") {
        if let Some((kind_and_value, expected)) = rest.split_once(", ") {
            let value = kind_and_value.split('`').nth(1).unwrap_or(kind_and_value);
            text = format!("{value}: {expected}");
        }
    }
    text
}

/// The command-line flag behind a configuration field, for error messages.
fn flag(field: &str) -> Option<&'static str> {
    Some(match field.split(['.', '[']).next()? {
        "local_world_size" => "--nproc-per-node",
        "rdzv_backend" => "--rdzv-backend",
        "rdzv_endpoint" => "--rdzv-endpoint",
        "rdzv_conf" => "--rdzv-conf",
        "min_nodes" | "max_nodes" => "--nnodes",
        "node_rank" => "--node-rank",
        "local_addr" => "--local-addr",
        "master_addr" => "--master-addr",
        "master_port" => "--master-port",
        "max_restarts" => "--max-restarts",
        "signals_to_handle" => "--signals-to-handle",
        "shutdown_timeout" => "--shutdown-timeout",
        "exit_barrier_timeout" => "--exit-barrier-timeout",
        "log_dir" => "--log-dir",
        "redirects" => "--redirects",
        "tee" => "--tee",
        "local_ranks_filter" => "--local-ranks-filter",
        "line_prefix" => "--log-line-prefix-template",
        "duplicate_stdout_filters" => "--duplicate-stdout-filters",
        "worker_timeout" => "--worker-timeout",
        "event_log" => "--event-log",
        "duplicate_stderr_filters" => "--duplicate-stderr-filters",
        "role" => "--role",
        "run_id" => "--rdzv-id",
        "numa_binding" => "--numa-binding",
        _ => return None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(local_world_size: u32) -> serde_json::Value {
        let n = local_world_size as usize;
        serde_json::json!({
            "run_id": "job", "role": "default", "local_world_size": local_world_size,
            "entrypoint": "/bin/true", "args": [], "env": {},
            "rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "rdzv_conf": "",
            "min_nodes": 1, "max_nodes": 1, "node_rank": null, "local_addr": null,
            "master_addr": null, "master_port": null, "max_restarts": 0,
            "signals_to_handle": ["SIGTERM", "SIGINT"], "shutdown_timeout": 30.0,
            "exit_barrier_timeout": 300.0, "log_dir": null,
            "redirects": vec![0; n], "tee": vec![0; n], "local_ranks_filter": null,
            "line_prefix": null, "virtual_local_rank": false
        })
    }

    #[test]
    fn bad_numbers_read_as_plain_words() {
        for (field, value, expected) in [
            ("max_restarts", serde_json::json!(-3), "--max-restarts: -3: expected a whole number from 0 to 4294967295"),
            ("master_port", serde_json::json!(70000), "--master-port: 70000: expected a whole number from 0 to 65535"),
            ("min_nodes", serde_json::json!(-1), "--nnodes: -1: expected a whole number from 0 to 4294967295"),
            (
                "shutdown_timeout",
                serde_json::json!("soon"),
                "--shutdown-timeout: invalid type: string \"soon\", expected a number",
            ),
        ] {
            let mut bad = sample(1);
            bad[field] = value;
            let err = AgentConfig::from_json(&bad.to_string()).unwrap_err().to_string();
            assert_eq!(err, expected);
        }
    }

    #[test]
    fn every_rdzv_conf_value_is_checked_before_anything_starts() {
        for (backend, endpoint, conf, named) in [
            ("c10d", "localhost:0", "join_timeout=-5", "join_timeout=-5"),
            ("c10d", "localhost:0", "timeout=abc", "timeout=abc"),
            ("c10d", "localhost:0", "keep_alive_max_attempt=0", "keep_alive_max_attempt=0"),
            ("c10d", "localhost:0", "is_host=maybe", "is_host=maybe"),
            ("c10d", "localhost:0", "auth_token_file=/nonexistent/secret", "/nonexistent/secret"),
            ("etcd", "localhost:2379", "lease_ttl=abc", "lease_ttl=abc"),
            ("etcd", "localhost:2379", "protocol=gopher", "protocol"),
            ("static", "localhost:29500", "timeout=inf", "timeout=inf"),
        ] {
            let mut bad = sample(1);
            bad["rdzv_backend"] = serde_json::json!(backend);
            bad["rdzv_endpoint"] = serde_json::json!(endpoint);
            bad["rdzv_conf"] = serde_json::json!(conf);
            if backend == "static" {
                bad["node_rank"] = serde_json::json!(0);
            }
            let err = AgentConfig::from_json(&bad.to_string()).unwrap_err().to_string();
            assert!(err.contains(named), "{backend} {conf:?}: {err}");
        }
    }

    #[test]
    fn parses_and_checks_masks() {
        let config = AgentConfig::from_json(&sample(2).to_string()).unwrap();
        assert_eq!(config.console_mask(0), 3);
        assert_eq!(config.file_mask(0), 0);
        let mut bad = sample(2);
        bad["tee"] = serde_json::json!([3]);
        assert!(AgentConfig::from_json(&bad.to_string()).unwrap_err().to_string().contains("tee"));
        let mut typo = sample(1);
        typo["max_restart"] = serde_json::json!(1);
        assert!(AgentConfig::from_json(&typo.to_string()).is_err());
    }

    fn refusal(edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut value = sample(1);
        edit(&mut value);
        AgentConfig::from_json(&value.to_string()).unwrap_err().to_string()
    }

    #[test]
    fn every_rule_is_checked_here_and_names_its_flag() {
        type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|v| v["local_world_size"] = 0.into()), "--nproc-per-node must be at least 1"),
            (Box::new(|v| v["local_world_size"] = 100_000.into()), "--nproc-per-node 100000: at most 1024"),
            (Box::new(|v| v["min_nodes"] = 3.into()), "--nnodes: need 0 < MIN <= MAX"),
            (Box::new(|v| v["min_nodes"] = 0.into()), "--nnodes: need 0 < MIN <= MAX"),
            (Box::new(|v| v["rdzv_backend"] = "etcd-v2".into()), "--rdzv-backend etcd-v2: etcd's v2 API is off"),
            (Box::new(|v| v["rdzv_backend"] = "zookeeper".into()), "unknown backend \"zookeeper\""),
            (Box::new(|v| v["max_restarts"] = (-1).into()), "--max-restarts: -1: expected a whole number"),
            (
                Box::new(|v| v["master_port"] = 70000.into()),
                "--master-port: 70000: expected a whole number from 0 to 65535",
            ),
            (Box::new(|v| v["shutdown_timeout"] = (-1.0).into()), "--shutdown-timeout: must be a non-negative"),
            (Box::new(|v| v["log_dir"] = "/proc/self/stat".into()), "--log-dir: /proc/self/stat exists and is not"),
            (Box::new(|v| v["rdzv_conf"] = 5.into()), "--rdzv-conf: "),
            (Box::new(|v| v["rdzv_conf"] = "heartbeat_timout=10".into()), "unknown key \"heartbeat_timout\""),
            (Box::new(|v| v["typo"] = 1.into()), "unknown field `typo`"),
            (
                Box::new(|v| v["numa_binding"] = serde_json::json!({"mode": "rack", "cpus": [[0]]})),
                "--numa-binding: unknown mode \"rack\"",
            ),
            (
                Box::new(|v| v["numa_binding"] = serde_json::json!({"mode": "node", "cpus": [[0], [1]]})),
                "--numa-binding node: CPUs for 2 local ranks, but there are 1",
            ),
            (
                Box::new(|v| v["numa_binding"] = serde_json::json!({"mode": "node", "cpus": [[]]})),
                "--numa-binding node: no CPU for local rank 0",
            ),
            (
                Box::new(|v| v["numa_binding"] = serde_json::json!({"mode": "socket", "cpus": [[3, 4096]]})),
                "--numa-binding socket: CPU 4096 (local rank 0) is beyond the",
            ),
            (
                Box::new(|v| v["numa_binding"] = serde_json::json!({"mode": "node", "cpus": [[-1]]})),
                "--numa-binding: -1: expected a whole number",
            ),
            (
                Box::new(|v| {
                    v["rdzv_backend"] = "static".into();
                    v["max_nodes"] = 2.into();
                    v["node_rank"] = 2.into();
                }),
                "--node-rank 2: the static rendezvous has --nnodes 2 nodes, ranked 0 to 1",
            ),
        ];
        for (edit, needle) in cases {
            let err = refusal(edit);
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
        }
    }

    #[test]
    fn the_rendezvous_conf_may_be_text_or_a_map() {
        let mut value = sample(1);
        value["rdzv_conf"] = serde_json::json!({"join_timeout": "30s", "is_host": true});
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        assert!(matches!(config.rendezvous_params().conf, ConfInput::Map(_)));
    }

    #[test]
    fn redirects_tee_and_filters_combine() {
        let mut value = sample(3);
        value["redirects"] = serde_json::json!([1, 0, 0]);
        value["tee"] = serde_json::json!([0, 2, 0]);
        value["local_ranks_filter"] = serde_json::json!([0, 1]);
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        assert_eq!((config.file_mask(0), config.console_mask(0)), (STD_OUT, STD_ERR));
        assert_eq!((config.file_mask(1), config.console_mask(1)), (STD_ERR, STD_OUT | STD_ERR));
        assert_eq!((config.file_mask(2), config.console_mask(2)), (STD_OUT | STD_ERR, 0));
    }

    #[test]
    fn each_local_rank_gets_its_own_cpu_set() {
        let mut value = sample(2);
        value["numa_binding"] = serde_json::json!({"mode": "exclusive", "cpus": [[0, 2], [1023]]});
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        let first = config.cpu_set(0).unwrap();
        let ids = |set: CpuSet| (0..CpuSet::count()).filter(|cpu| set.is_set(*cpu).unwrap()).collect::<Vec<_>>();
        assert_eq!(ids(first), [0, 2]);
        assert_eq!(ids(config.cpu_set(1).unwrap()), [1023]);
        assert!(config.cpu_set(2).is_none());
        let unbound = AgentConfig::from_json(&sample(2).to_string()).unwrap();
        assert!(unbound.cpu_set(0).is_none());
    }

    #[test]
    fn a_binding_is_described_with_its_cpu_list() {
        let mut value = sample(1);
        value["numa_binding"] = serde_json::json!({"mode": "socket", "cpus": [[4, 0, 1, 2]]});
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        assert_eq!(config.binding_of(0).as_deref(), Some("--numa-binding socket: CPUs 0-2,4"));
        assert_eq!(config.binding_of(1), None);
    }

    #[test]
    fn static_meets_at_the_master_address() {
        let mut value = sample(1);
        value["rdzv_backend"] = serde_json::json!("static");
        value["node_rank"] = serde_json::json!(0);
        value["rdzv_endpoint"] = serde_json::json!("");
        value["master_addr"] = serde_json::json!("10.0.0.1");
        value["master_port"] = serde_json::json!(1234);
        let config = AgentConfig::from_json(&value.to_string()).unwrap();
        assert_eq!(config.rendezvous_params().endpoint, "10.0.0.1:1234");
    }
}
