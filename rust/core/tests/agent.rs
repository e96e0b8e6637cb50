//! The agent end to end with shell-script workers: the environment contract, restarts after a
//! failure, the root cause of a failure that uses up the budget, and the log files.

use std::path::{Path, PathBuf};

use elastix_core::agent::{run_agent, AgentConfig, RunState};
use serde_json::json;

/// A directory of the test's own, removed when dropped (after a failed assertion too).
struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("elastix-agent-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

/// A standalone single-node job running `script` with `sh -c` in each of `n` workers.
fn config(n: usize, script: &str, max_restarts: u32, log_dir: Option<&Path>) -> AgentConfig {
    let value = json!({
        "run_id": format!("test-{}", fastrand::u64(..)), "role": "trainer", "local_world_size": n,
        "entrypoint": "/bin/sh", "args": ["-c", script, "worker", "${local_rank}"], "env": {"EXTRA": "yes"},
        "rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0", "rdzv_conf": "", "min_nodes": 1, "max_nodes": 1,
        "node_rank": null, "local_addr": "127.0.0.1", "master_addr": null, "master_port": null,
        "max_restarts": max_restarts, "signals_to_handle": ["SIGTERM"], "shutdown_timeout": 5.0,
        "exit_barrier_timeout": 30.0, "log_dir": log_dir.map(|d| d.to_string_lossy().into_owned()),
        "redirects": vec![0; n], "tee": vec![0; n], "local_ranks_filter": null, "line_prefix": null,
        "virtual_local_rank": false
    });
    AgentConfig::from_json(&value.to_string()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_the_torch_environment_contract() {
    let out = temp_dir("env");
    let script = format!(
        "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $ROLE_NAME $ROLE_RANK $ROLE_WORLD_SIZE \
         $LOCAL_WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_USE_AGENT_STORE $EXTRA $1 $MASTER_PORT\" > {}/$LOCAL_RANK",
        out.display()
    );
    let result = run_agent(config(2, &script, 0, None)).await;
    assert_eq!(result.state, RunState::Succeeded, "{result:?}");
    assert_eq!(result.global_ranks, vec![0, 1]);
    for rank in 0..2 {
        let line = std::fs::read_to_string(out.join(rank.to_string())).unwrap();
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            &fields[..13],
            &[
                &rank.to_string(),
                &rank.to_string(),
                "2",
                "0",
                "1",
                "trainer",
                &rank.to_string(),
                "2",
                "2",
                "0",
                "True",
                "yes",
                &rank.to_string()
            ],
            "{line}"
        );
        assert!(fields[13].parse::<u16>().unwrap() > 0, "MASTER_PORT is a real port: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_fails_once_is_restarted_and_the_job_succeeds() {
    let out = temp_dir("restart");
    let script = format!(
        "if [ \"$LOCAL_RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 3; fi; \
         echo $TORCHELASTIC_RESTART_COUNT > {}/$LOCAL_RANK; [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ] || sleep 30",
        out.display()
    );
    let result = run_agent(config(2, &script, 1, None)).await;
    assert_eq!(result.state, RunState::Succeeded, "{result:?}");
    assert_eq!(result.restart_count, 1);
    for rank in 0..2 {
        assert_eq!(std::fs::read_to_string(out.join(rank.to_string())).unwrap().trim(), "1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_budget_the_job_fails_with_the_root_cause() {
    let script = "if [ \"$LOCAL_RANK\" = 1 ]; then echo 'disk on fire' >&2; kill -SEGV $$; fi; sleep 30";
    let result = run_agent(config(2, script, 0, None)).await;
    assert_eq!((result.state, result.exit_code), (RunState::Failed, 1));
    let failure = &result.failures[0];
    assert_eq!((failure.global_rank, failure.local_rank, failure.exitcode), (1, 1, -11));
    assert_eq!(failure.signal.as_deref(), Some("SIGSEGV"));
    assert_eq!(failure.message, "disk on fire");
    let summary = result.summary.unwrap();
    assert!(
        summary.contains("Root Cause") && summary.contains("SIGSEGV") && summary.contains("disk on fire"),
        "{summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirected_and_teed_output_lands_in_per_attempt_files() {
    let logs = temp_dir("logs");
    let mut config = config(2, "echo out-$LOCAL_RANK; echo err-$LOCAL_RANK >&2", 0, Some(&*logs));
    config.redirects = vec![3, 0];
    config.tee = vec![0, 1];
    let result = run_agent(config).await;
    assert_eq!(result.state, RunState::Succeeded);
    let run_dir = std::fs::read_dir(&*logs).unwrap().next().unwrap().unwrap().path();
    let attempt = run_dir.join("attempt_0");
    assert_eq!(std::fs::read_to_string(attempt.join("0/stdout.log")).unwrap(), "out-0\n");
    assert_eq!(std::fs::read_to_string(attempt.join("0/stderr.log")).unwrap(), "err-0\n");
    assert_eq!(std::fs::read_to_string(attempt.join("1/stdout.log")).unwrap(), "out-1\n");
    assert!(!attempt.join("1/stderr.log").exists(), "rank 1's stderr is neither redirected nor tee'd");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstartable_worker_is_a_clear_failure() {
    let mut config = config(1, "true", 0, None);
    config.entrypoint = "/nonexistent/python".into();
    let result = run_agent(config).await;
    assert_eq!(result.state, RunState::Failed);
    let summary = result.summary.unwrap();
    assert!(summary.contains("/nonexistent/python"), "{summary}");
}
