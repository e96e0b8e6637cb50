//! `elastix status` on etcd: reads only (gets and ranges, a constant number of them). etcd
//! holds no heartbeat times (a member's liveness is its lease), so members show no heartbeat
//! age: a member whose key is gone (its lease expired) is listed as lost instead.

use std::collections::BTreeMap;

use elastix_etcd::pb::etcdserverpb::RangeRequest;
use elastix_etcd::EtcdClient;

use super::join::Size;
use super::keys::{EtcdKeys, Range};
use super::ops::{self, etcd_error};
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::records::{decode, now_ms, Arrival, FailureRecord, Master, Meta, NodeStatus};
use crate::rendezvous::status::{
    judge, Evidence, Health, JobStatus, LastFailure, Lost, Member, Restarts, State, STATUS_VERSION,
};

struct Reader<'a> {
    client: &'a EtcdClient,
    keys: &'a EtcdKeys,
}

impl Reader<'_> {
    fn error(&self, err: elastix_etcd::EtcdError) -> RendezvousError {
        etcd_error(err, self.client)
    }

    async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.client.get(key).await.map_err(|err| self.error(err))?.0)
    }

    async fn record<T: serde::de::DeserializeOwned>(&self, key: &[u8], what: &str) -> Result<Option<T>> {
        self.get(key).await?.map(|bytes| decode(&bytes, what)).transpose()
    }

    /// Every key and value in `range`.
    async fn range(&self, range: Range) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let request = RangeRequest { key: range.key, range_end: range.end, ..Default::default() };
        let response = self.client.range(request).await.map_err(|err| self.error(err))?;
        Ok(response.kvs.into_iter().map(|kv| (kv.key, kv.value)).collect())
    }

    /// The nodes whose member keys in round `r` are alive (their leases held).
    async fn live(&self, r: u64) -> Result<Vec<NodeDesc>> {
        let members = self.range(self.keys.members(r)).await?;
        Ok(members.iter().filter_map(|(_, value)| decode::<Arrival>(value, "member").ok()?.node).collect())
    }

    /// What round `r`'s members published, by group rank.
    async fn statuses(&self, r: u64) -> Result<BTreeMap<u32, NodeStatus>> {
        let mut found = BTreeMap::new();
        for (key, value) in self.range(self.keys.node_statuses(r)).await? {
            let rank = String::from_utf8_lossy(&key).rsplit('/').next().and_then(|rank| rank.parse().ok());
            if let (Some(rank), Ok(status)) = (rank, decode::<NodeStatus>(&value, "node status")) {
                found.insert(rank, status);
            }
        }
        Ok(found)
    }

    async fn size(&self, r: u64) -> Result<Option<u32>> {
        Ok(self.record::<Size>(&self.keys.size(r), "round size").await?.map(|size| size.world_size()))
    }

    /// Restarts charged so far: the failure reports counted.
    async fn restarts(&self) -> Result<i64> {
        let request = elastix_etcd::pb::etcdserverpb::TxnRequest {
            success: vec![ops::count(&self.keys.all_failures(), 0)],
            ..Default::default()
        };
        Ok(ops::counted(&self.client.txn(request).await.map_err(|err| self.error(err))?, 0) as i64)
    }

    /// The members of formed `round` (`statuses`) and of the round before it that hold no
    /// lease now (are not `alive`), and the size of the round before when it lost any.
    async fn lost(
        &self,
        round: u64,
        statuses: &BTreeMap<u32, NodeStatus>,
        alive: &[NodeDesc],
    ) -> Result<(Vec<Lost>, Option<u32>)> {
        let mut lost = Vec::new();
        let mut size_before_loss = None;
        if round > 0 {
            // members of the round before that are in no round now: lost between the two
            let now_in: Vec<&NodeDesc> = statuses.values().map(|status| &status.node).collect();
            for (rank, status) in self.statuses(round - 1).await? {
                if !now_in.contains(&&status.node) && !alive.contains(&status.node) {
                    lost.push(Lost { round: round - 1, group_rank: rank, node: Some(status.node.to_string()) });
                }
            }
            if !lost.is_empty() {
                size_before_loss = self.size(round - 1).await?;
            }
        }
        for (rank, status) in statuses {
            if !alive.contains(&status.node) {
                lost.push(Lost { round, group_rank: *rank, node: Some(status.node.to_string()) });
            }
        }
        Ok((lost, size_before_loss))
    }
}

/// The job's state, or `None` if the cluster answers and holds no such run.
pub(super) async fn read(client: &EtcdClient, keys: &EtcdKeys, run_id: &str) -> Result<Option<JobStatus>> {
    let reader = Reader { client, keys };
    let meta: Option<Meta> = match reader.record(&keys.meta(), "metadata").await {
        Ok(meta) => meta,
        Err(err) if err.is_store_unreachable() => {
            return Err(RendezvousError::Config(format!("cannot reach etcd at {}: {err}", client.endpoints())))
        }
        Err(err) => return Err(err),
    };
    let Some(meta) = meta else { return Ok(None) };
    let closed_reason = reader.get(&keys.closed()).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned());
    let sealed = reader.get(&keys.round()).await?.map(|bytes| ops::number(&bytes, "round")).transpose()?;
    let sealed = sealed.map(|round| round.max(0) as u64);
    let restarts = reader.restarts().await?;
    let last_failure: Option<FailureRecord> = reader.record(&keys.last_failure(), "failure record").await?;

    // the last sealed round runs unless its members all moved on to the next one
    let next_round = sealed.map_or(0, |r| r + 1);
    let next = reader.live(next_round).await?;
    let (round, live, statuses, world_size) = match sealed {
        Some(r) => {
            let statuses = reader.statuses(r).await?;
            let world_size = reader.size(r).await?.unwrap_or(statuses.len() as u32);
            (r, reader.live(r).await?, statuses, world_size)
        }
        None => (0, Vec::new(), BTreeMap::new(), 0),
    };
    let formed = sealed.is_some() && !live.is_empty();
    let members: Vec<Member> =
        if formed { (0..world_size).map(|rank| member(rank, statuses.get(&rank))).collect() } else { Vec::new() };
    let (lost, size_before_loss) = match formed {
        true => reader.lost(round, &statuses, &[live.as_slice(), next.as_slice()].concat()).await?,
        false => (Vec::new(), None),
    };
    let round_store = match formed {
        true => reader.record::<Master>(&keys.master(round), "workers' store").await?,
        false => None,
    };
    let round_store = round_store.map(|master| format!("{}:{}", master.addr, master.port));
    let now = now_ms();
    let mut status = JobStatus {
        v: STATUS_VERSION,
        run_id: run_id.to_owned(),
        backend: "etcd",
        endpoint: client.endpoints().to_owned(),
        round_store,
        health: Health::Healthy,
        state: State::Running,
        problems: Vec::new(),
        min_nodes: meta.min_nodes,
        max_nodes: meta.max_nodes,
        round: if formed { round } else { next_round },
        members,
        arrived: if formed { Vec::new() } else { next.iter().map(ToString::to_string).collect() },
        waiting: if formed { next.len() as u64 } else { 0 },
        spares: 0,
        restarts: Restarts {
            used: restarts,
            allowed: statuses
                .values()
                .next()
                .map(|status| status.facts.max_restarts)
                .or(last_failure.as_ref().map(|failure| failure.max_restarts)),
        },
        last_failure: last_failure.map(|failure| LastFailure::from_record(failure, now)),
        lost,
        closed_reason,
    };
    judge(&mut status, &Evidence { formed, size_before_loss });
    Ok(Some(status))
}

fn member(rank: u32, status: Option<&NodeStatus>) -> Member {
    // a lease carries no time: no heartbeat age on etcd
    Member::new(rank, status.map(|status| &status.node), status, None)
}
