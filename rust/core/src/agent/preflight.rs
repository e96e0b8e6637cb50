//! The pre-flight check (`--preflight`): before the first round trains, each agent runs one
//! process (`python -m elastix.preflight`, see python/elastix/preflight) that measures its
//! node's compute and its links to other nodes in pairs; they meet in the round's store, the
//! round's first member judges, and each process hands its agent the verdict on its stdout.
//! Nodes named slow or dead leave the round where `--nnodes` allows ([`may_leave`], also what
//! `--exclude-stragglers` leaves out by); otherwise the agents warn and training goes on.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::AsyncReadExt;

use crate::rendezvous::RendezvousInfo;

/// How long the check may take (a dead peer costs a pair test's timeout, twice at most).
pub const TIMEOUT: Duration = Duration::from_secs(60);
/// When the process is killed: a little beyond [`TIMEOUT`], for it to hand its verdict over.
const KILLED_AFTER: Duration = Duration::from_secs(TIMEOUT.as_secs() + 5);

/// What the round's first member found.
#[derive(Debug, Default, Deserialize)]
pub struct Verdict {
    /// False: the first member's judgment never came (it died, or the check ran out of time).
    #[serde(default)]
    pub complete: bool,
    /// Every node's and link's figures, for the log.
    #[serde(default)]
    pub table: Option<String>,
    /// Nodes named slow or dead, by member.
    #[serde(default)]
    pub nodes: Vec<Named>,
    /// Slow links between nodes not named.
    #[serde(default)]
    pub links: Vec<Named>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Named {
    /// The node's group rank in the round (-1 for a link).
    pub member: i64,
    /// The node's name, or the link's ("a-b").
    pub node: String,
    pub why: String,
}

/// One node's part of the check: the command that runs it and what it is given.
pub struct Check<'a> {
    pub command: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    pub info: &'a RendezvousInfo,
    pub node: &'a str,
}

impl Check<'_> {
    /// Runs this node's part to the end (killed past [`TIMEOUT`]) and reads the verdict.
    pub async fn run(&self) -> Result<Verdict, String> {
        let (program, args) = self.command.split_first().ok_or("no command to run it")?;
        let info = self.info;
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .envs(self.env)
            .env("RANK", info.rank.to_string())
            .env("WORLD_SIZE", info.world_size.to_string())
            .env("ELASTIX_PREFLIGHT_STORE", format!("{}:{}", info.store_host, info.store_port))
            .env("ELASTIX_PREFLIGHT_PREFIX", format!("{}/preflight", info.store_prefix))
            .env("ELASTIX_PREFLIGHT_NODE", self.node)
            .env("ELASTIX_PREFLIGHT_TIMEOUT", TIMEOUT.as_secs().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| format!("cannot start {program}: {err}"))?;
        tracing::info!(
            "pre-flight check: measuring this node's compute and its links with the round's {} nodes; deadline in {}s",
            info.world_size,
            KILLED_AFTER.as_secs()
        );
        let mut stdout = child.stdout.take().ok_or("no stdout to read the verdict from")?;
        let ran = async {
            let mut said = Vec::new();
            stdout.read_to_end(&mut said).await?;
            Ok::<_, std::io::Error>((child.wait().await?, said))
        };
        let (status, said) = match tokio::time::timeout(KILLED_AFTER, ran).await {
            Ok(Ok(done)) => done,
            Ok(Err(err)) => return Err(format!("its process failed: {err}")),
            Err(_) => return Err(format!("it took over {}s", KILLED_AFTER.as_secs())),
        };
        if !status.success() {
            return Err(format!("its process exited with {status}"));
        }
        let last = said.split(|b| *b == b'\n').rev().find(|line| !line.is_empty()).unwrap_or_default();
        serde_json::from_slice(last).map_err(|err| format!("its verdict cannot be read: {err}"))
    }
}

/// Whether `named` of a round's `members` nodes may leave it: where the rendezvous is elastic
/// and at least `min_nodes` are left (else why not). Every agent decides alike from the same
/// names.
pub fn may_leave(named: usize, members: u32, min_nodes: u32, elastic: bool) -> Result<(), String> {
    if !elastic {
        return Err("the static rendezvous forms with every node or none".to_owned());
    }
    let left = members.saturating_sub(u32::try_from(named).unwrap_or(u32::MAX));
    if left < min_nodes {
        return Err(format!("--nnodes allows no fewer than {min_nodes} nodes ({left} would be left)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_nodes_leave_only_where_the_job_can_go_on_without_them() {
        assert_eq!(may_leave(1, 4, 2, true), Ok(()));
        assert_eq!(may_leave(2, 4, 2, true), Ok(()));
        assert!(
            matches!(may_leave(2, 4, 3, true), Err(why) if why.contains("no fewer than 3 nodes (2 would be left)"))
        );
        assert!(matches!(may_leave(1, 4, 1, false), Err(why) if why.contains("static")));
    }

    #[test]
    fn a_verdict_is_read_from_the_last_line_its_process_writes() {
        let script = r#"print("noise"); print('{"complete": true, "table": "t", "nodes": [{"member": 1, "node": "h1", "why": "slow"}]}')"#;
        let command = vec!["python3".to_owned(), "-c".to_owned(), script.to_owned()];
        let info = RendezvousInfo {
            run_id: "r".into(),
            round: 0,
            rank: 0,
            world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            store_host: "127.0.0.1".into(),
            store_port: 1,
            store_prefix: "p".into(),
        };
        let env = BTreeMap::new();
        let check = Check { command: &command, env: &env, info: &info, node: "h0" };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let verdict = runtime.block_on(check.run()).unwrap();
        assert!(verdict.complete && verdict.links.is_empty());
        assert_eq!(verdict.nodes, vec![Named { member: 1, node: "h1".into(), why: "slow".into() }]);
        let failing = vec!["python3".to_owned(), "-c".to_owned(), "raise SystemExit(3)".to_owned()];
        let err = runtime.block_on(Check { command: &failing, ..check }.run()).unwrap_err();
        assert!(err.contains("exit status: 3"), "{err}");
    }
}
