//! [`State::Preflight`]: the job's first round checks its nodes and links before it trains
//! (`--preflight`, see [`crate::agent::preflight`]). Named nodes leave where `--nnodes`
//! allows, and the others re-form without them; a check that could not finish, or named
//! nodes the job cannot do without, are warned about and training starts.

use super::agent::Agent;
use super::report::{End, Report};
use super::State;
use crate::agent::error::Result;
use crate::agent::preflight::{may_leave, Check, Verdict};
use crate::rendezvous::RendezvousInfo;

impl Agent {
    /// Runs the check (-> [`State::Start`], [`State::Rendezvous`] without named nodes, or the
    /// end of a node that leaves).
    pub(super) async fn preflight(&mut self, info: RendezvousInfo, report: &mut Report) -> Result<State> {
        let Some(command) = self.config.preflight.clone() else { return Ok(State::Start(info)) };
        let check = Check { command: &command, env: &self.config.env, info: &info, node: &self.host };
        let verdict = tokio::select! {
            verdict = check.run() => verdict,
            (signal, _) = self.signals.recv() => {
                tracing::info!("received {signal} during the pre-flight check (no worker running); stopping");
                return Ok(State::End(End::Interrupted(signal)));
            }
        };
        let verdict = match verdict {
            Ok(verdict) if verdict.complete => verdict,
            Ok(_) => {
                tracing::warn!(
                    "pre-flight check: no verdict came from the round's first member (it died or ran out of time); \
                     training starts without one"
                );
                return Ok(State::Start(info));
            }
            Err(why) => {
                tracing::warn!("pre-flight check failed on this node: {why}; training starts without it");
                return Ok(State::Start(info));
            }
        };
        self.say(&info, &verdict);
        let named: Vec<u32> = verdict.nodes.iter().filter_map(|n| u32::try_from(n.member).ok()).collect();
        let elastic = self.config.rdzv_backend != "static";
        let allowed = may_leave(named.len(), info.world_size, self.config.min_nodes, elastic);
        let decision = match (named.is_empty(), &allowed) {
            (true, _) => "go on".to_owned(),
            (false, Ok(())) => "leave out".to_owned(),
            (false, Err(why)) => format!("keep: {why}"),
        };
        self.events.preflight(info.round, &verdict.nodes, &verdict.links, &decision).await;
        if named.is_empty() {
            return Ok(State::Start(info));
        }
        if let Err(why) = allowed {
            tracing::warn!("pre-flight check: the nodes named stay in the job ({why}); training starts");
            return Ok(State::Start(info));
        }
        if let Some(mine) = verdict.nodes.iter().find(|n| n.member == i64::from(info.rank)) {
            return self.leave_job(&format!("the pre-flight check named it: {}", mine.why), report).await;
        }
        let left: Vec<&str> = verdict.nodes.iter().map(|n| n.node.as_str()).collect();
        tracing::warn!("pre-flight check: re-forming without {}", left.join(", "));
        Ok(State::Rendezvous)
    }

    /// The check's table (from the round's first member) and what it named.
    fn say(&self, info: &RendezvousInfo, verdict: &Verdict) {
        if info.rank == 0 {
            if let Some(table) = &verdict.table {
                tracing::info!("{table}");
            }
        }
        for node in &verdict.nodes {
            tracing::warn!("pre-flight check: node {} (member {}) is {}", node.node, node.member, node.why);
        }
        for link in &verdict.links {
            tracing::warn!("pre-flight check: the link between members {} is slow: {}", link.node, link.why);
        }
    }
}
