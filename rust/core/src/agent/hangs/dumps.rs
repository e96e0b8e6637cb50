//! Stack dumps on demand (`elastix dump`), through the job's rendezvous store: the command
//! counts a request up and writes it; every agent waits on the next request's key (a push
//! from the store, no polling), has its matching workers dump their stacks
//! ([`crate::agent::hangs::stacks`]), writes its node's reply and counts it. The workers go on running.
//!
//! Keys, under `elastix/dump/<run_id>/`: `requests` (the count), `<n>` (request `n`:
//! `{"rank": R}` or `{"rank": null}` for all), `<n>/node/<group rank>` (a node's reply:
//! `{"node": .., "host": .., "workers": [{"rank", "local_rank", "pid", "stacks" | "error"}]}`).
//!
//! The same requests carry hangs across nodes ([`FlightExchange`]): `{"flights": ROUND}` asks
//! every agent for its workers' flight records ([`RankFlights`]), which it writes to
//! `elastix/flights/<run_id>/<round>/<group rank>`; an agent that finds workers hung writes
//! its own there first, unasked.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::agent::hangs::flight::RankFlights;
use crate::auth::Secret;
use crate::rendezvous::config::conf::{RendezvousConf, DYNAMIC_KEYS, ETCD_KEYS};
use crate::rendezvous::endpoint::{parse_endpoint, DEFAULT_PORT};
use crate::rendezvous::job_secret;
use crate::rendezvous::job_status;
use crate::rendezvous::status::StatusQuery;
use crate::rendezvous::{BackendKind, RendezvousError, RendezvousInfo};
use crate::store::{TcpStore, TcpStoreOptions};

/// How long a node's workers may take to answer one request.
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// How often `elastix dump` looks for replies.
const REPLY_POLL: Duration = Duration::from_millis(50);
type RdzvResult<T> = std::result::Result<T, RendezvousError>;

/// Pause before connecting again after the store was lost.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);
/// How long each of its connects tries before the pause.
const RECONNECT_PATIENCE: Duration = Duration::from_secs(5);

pub fn request_count_key(run_id: &str) -> String {
    format!("elastix/dump/{run_id}/requests")
}

pub fn request_key(run_id: &str, n: i64) -> String {
    format!("elastix/dump/{run_id}/{n}")
}

pub fn reply_key(run_id: &str, n: i64, node: u32) -> String {
    format!("elastix/dump/{run_id}/{n}/node/{node}")
}

/// `elastix dump`: finds the job's members as `elastix status` does, then asks them for
/// their workers' stacks (of global rank `rank` only, if given). `Ok(None)`: no such job.
pub async fn job_dump(query: &StatusQuery, rank: Option<u32>) -> RdzvResult<Option<Value>> {
    let keys = match BackendKind::parse(&query.backend)? {
        BackendKind::C10d => DYNAMIC_KEYS,
        BackendKind::Etcd => ETCD_KEYS,
        BackendKind::Static => {
            return Err(RendezvousError::Config(
                "--rdzv-backend static: elastix dump asks c10d and etcd jobs (a static job has no shared state to \
                 find its agents by)"
                    .into(),
            ))
        }
    };
    let secret = job_secret(&RendezvousConf::from_input(&query.conf, keys)?)?;
    let Some(status) = job_status(query).await? else { return Ok(None) };
    if status.members.is_empty() {
        return Err(RendezvousError::Config(format!(
            "job {} has no running round to ask (state: {:?})",
            query.run_id, status.state
        )));
    }
    // a member publishes its ranks once its workers run: until then no rank can be refused
    let published = status.members.iter().all(|member| !member.ranks.is_empty());
    if let Some(rank) = rank.filter(|_| published) {
        let ranks: Vec<u32> = status.members.iter().flat_map(|m| m.ranks.iter().copied()).collect();
        if !ranks.contains(&rank) {
            let world = ranks.len();
            return Err(RendezvousError::Config(format!(
                "--rank {rank}: job {} has no such worker (its {world} workers have ranks 0 to {})",
                query.run_id,
                world.saturating_sub(1)
            )));
        }
    }
    // the agents watch the round's store: c10d's, or on etcd rank 0's workers' store
    let Some(store) = &status.round_store else {
        return Err(RendezvousError::Config(format!("job {} has no running round to ask", query.run_id)));
    };
    let (host, port) = parse_endpoint(store, DEFAULT_PORT)?;
    let options = TcpStoreOptions { timeout: Some(query.timeout), secret, ..TcpStoreOptions::new(host, port) };
    let mut store = TcpStore::open(options).await?;
    let nodes: Vec<u32> = status.members.iter().map(|member| member.group_rank).collect();
    let replies = request(&mut store, &query.run_id, rank, &nodes, query.timeout).await?;
    let nodes: Vec<Value> = replies
        .into_iter()
        .map(|(node, reply)| {
            reply
                .and_then(|text| serde_json::from_str(&text).ok())
                .unwrap_or_else(|| json!({"node": node, "missing": true}))
        })
        .collect();
    Ok(Some(json!({"run_id": query.run_id, "rank": rank, "nodes": nodes})))
}

/// The command's side of a request: asks the job's agents for their workers' stacks (of global rank
/// `rank` only, if given) and returns the replies of the nodes of group ranks `nodes` that
/// came within `timeout`, each as its JSON text (`None`: no reply in time).
pub async fn request(
    store: &mut TcpStore,
    run_id: &str,
    rank: Option<u32>,
    nodes: &[u32],
    timeout: Duration,
) -> Result<Vec<(u32, Option<String>)>, crate::store::StoreError> {
    let n = store.add(request_count_key(run_id).as_bytes(), 1).await?;
    let request = serde_json::to_vec(&DumpRequest { rank, flights: None }).expect("a plain struct serializes");
    store.set(request_key(run_id, n).as_bytes(), &request).await?;
    let keys: Vec<String> = nodes.iter().map(|node| reply_key(run_id, n, *node)).collect();
    // checks, not a WAIT: a WAIT that times out leaves its connection unusable, and the
    // replies that did come are still to be read
    let deadline = tokio::time::Instant::now() + timeout;
    let mut present = vec![false; keys.len()];
    while present.iter().any(|seen| !seen) && tokio::time::Instant::now() < deadline {
        for (key, seen) in keys.iter().zip(present.iter_mut()).filter(|(_, seen)| !**seen) {
            *seen = store.check(&[key.as_bytes()]).await?;
        }
        if present.iter().any(|seen| !seen) {
            tokio::time::sleep(REPLY_POLL).await;
        }
    }
    let mut replies = Vec::with_capacity(nodes.len());
    for ((node, key), seen) in nodes.iter().zip(&keys).zip(present) {
        let reply =
            if seen { Some(String::from_utf8_lossy(&store.get(key.as_bytes()).await?).into_owned()) } else { None };
        replies.push((*node, reply));
    }
    Ok(replies)
}

/// What `elastix dump` (or an agent, for a hang) asks for.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct DumpRequest {
    /// One global rank, or every worker.
    pub rank: Option<u32>,
    /// Instead of stacks: the flight records of round `flights`' workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flights: Option<u64>,
}

pub fn flights_key(run_id: &str, round: u64, node: u32) -> String {
    format!("elastix/flights/{run_id}/{round}/{node}")
}

/// One worker's answer.
#[derive(Debug, Serialize)]
pub struct WorkerStacks {
    pub rank: u32,
    pub local_rank: u32,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stacks: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A request for the worker group, and where its answer goes.
pub enum Asked {
    Stacks { rank: Option<u32>, answer: oneshot::Sender<Vec<WorkerStacks>> },
    Flights { answer: oneshot::Sender<Vec<RankFlights>> },
}

/// The requests of one attempt; dropping it stops watching.
pub struct DumpRequests {
    asked: mpsc::Receiver<Asked>,
    watcher: JoinHandle<()>,
    exchange: Option<FlightExchange>,
}

impl DumpRequests {
    /// Watches the round's rendezvous store for requests.
    pub fn watch(info: &RendezvousInfo, host: &str, secret: Option<&Secret>) -> DumpRequests {
        let (sender, asked) = mpsc::channel(1);
        let node = Node {
            run_id: info.run_id.clone(),
            round: info.round,
            rank: info.rank,
            host: host.to_owned(),
            store: (info.store_host.clone(), info.store_port),
            secret: secret.cloned(),
        };
        let exchange = (info.world_size > 1).then(|| FlightExchange { node: node.clone(), nodes: info.world_size });
        DumpRequests { asked, watcher: tokio::spawn(node.serve(sender)), exchange }
    }

    /// Where this node shares flight records with the others (`None`: a one-node round).
    pub fn exchange(&self) -> Option<&FlightExchange> {
        self.exchange.as_ref()
    }

    /// The next request (cancel safe).
    pub async fn next(&mut self) -> Option<Asked> {
        self.asked.recv().await
    }
}

impl Drop for DumpRequests {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

#[derive(Clone)]
struct Node {
    run_id: String,
    round: u64,
    rank: u32,
    host: String,
    store: (String, u16),
    secret: Option<Secret>,
}

impl Node {
    /// Serves requests until aborted, connecting again whenever the store is lost.
    async fn serve(self, asked: mpsc::Sender<Asked>) {
        let mut next = None;
        loop {
            if let Err(err) = self.serve_connected(&asked, &mut next).await {
                tracing::debug!("stack dump requests: {err}; watching again in {RECONNECT_PAUSE:?}");
            }
            if asked.is_closed() {
                return;
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }

    async fn serve_connected(
        &self,
        asked: &mpsc::Sender<Asked>,
        next: &mut Option<i64>,
    ) -> Result<(), crate::store::StoreError> {
        // in the background, for the round's life: the agent reports a lost store itself
        let options = TcpStoreOptions {
            secret: self.secret.clone(),
            timeout: Some(RECONNECT_PATIENCE),
            quiet: true,
            ..TcpStoreOptions::new(self.store.0.clone(), self.store.1)
        };
        let mut store = TcpStore::open(options).await?;
        // requests made before this round are not for it
        let mut n = match *next {
            Some(n) => n,
            None => store.add(request_count_key(&self.run_id).as_bytes(), 0).await? + 1,
        };
        *next = Some(n);
        loop {
            let key = request_key(&self.run_id, n);
            store.wait(&[key.as_bytes()], None).await?;
            let request: DumpRequest = serde_json::from_slice(&store.get(key.as_bytes()).await?).unwrap_or_default();
            if let Some(round) = request.flights {
                if round != self.round {
                    n += 1; // asked about another round (a late request): its workers are gone
                    *next = Some(n);
                    continue;
                }
                let (answer, answered) = oneshot::channel();
                if asked.send(Asked::Flights { answer }).await.is_ok() {
                    if let Ok(Ok(records)) = tokio::time::timeout(ANSWER_WAIT, answered).await {
                        let records = serde_json::to_vec(&records).expect("flight records serialize");
                        store.set(flights_key(&self.run_id, round, self.rank).as_bytes(), &records).await?;
                    }
                }
            } else {
                tracing::info!(
                    "stack dump request {n} for {}: asking the workers",
                    request.rank.map_or_else(|| "every rank".to_owned(), |rank| format!("rank {rank}"))
                );
                let (answer, answered) = oneshot::channel();
                let workers = match asked.send(Asked::Stacks { rank: request.rank, answer }).await {
                    Ok(()) => tokio::time::timeout(ANSWER_WAIT, answered).await.ok().and_then(Result::ok),
                    Err(_) => None,
                };
                let reply = serde_json::json!({
                    "node": self.rank,
                    "host": self.host,
                    "workers": workers.unwrap_or_default(),
                });
                store.set(reply_key(&self.run_id, n, self.rank).as_bytes(), reply.to_string().as_bytes()).await?;
            }
            n += 1;
            *next = Some(n);
        }
    }
}

/// A hang across nodes: ranks of one node wait in a collective for ranks of another. The
/// node that finds them shares its workers' flight records through the round's store, asks
/// the other agents for theirs, and reads what arrives within [`GATHER_WAIT`]; an agent busy
/// with a hang of its own shares its records unasked.
pub struct FlightExchange {
    node: Node,
    nodes: u32,
}

/// How long a node with hung workers waits for the others' flight records.
const GATHER_WAIT: Duration = Duration::from_secs(2);

impl FlightExchange {
    /// Writes this node's records (best effort, bounded).
    pub async fn share(&self, records: &[RankFlights]) {
        let key = flights_key(&self.node.run_id, self.node.round, self.node.rank);
        let value = serde_json::to_vec(records).expect("flight records serialize");
        let write = async { self.connect().await?.set(key.as_bytes(), &value).await };
        match tokio::time::timeout(GATHER_WAIT, write).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not share this node's flight records: {err}"),
            Err(_) => tracing::debug!("sharing this node's flight records took over {GATHER_WAIT:?}"),
        }
    }

    /// Asks the other agents for their records and returns those that came in time.
    pub async fn gather(&self) -> Vec<RankFlights> {
        let others: Vec<u32> = (0..self.nodes).filter(|node| *node != self.node.rank).collect();
        tracing::info!("asking the other {} node(s) where their ranks are, for up to {GATHER_WAIT:?}", others.len());
        let mut found = Vec::new();
        let mut heard = vec![false; others.len()];
        let ask = async {
            let mut store = self.connect().await?;
            let n = store.add(request_count_key(&self.node.run_id).as_bytes(), 1).await?;
            let request = DumpRequest { rank: None, flights: Some(self.node.round) };
            store
                .set(request_key(&self.node.run_id, n).as_bytes(), &serde_json::to_vec(&request).expect("serializes"))
                .await?;
            while heard.iter().any(|heard| !heard) {
                for (node, heard) in others.iter().zip(heard.iter_mut()).filter(|(_, heard)| !**heard) {
                    let key = flights_key(&self.node.run_id, self.node.round, *node);
                    if store.check(&[key.as_bytes()]).await? {
                        *heard = true;
                        let records: Vec<RankFlights> =
                            serde_json::from_slice(&store.get(key.as_bytes()).await?).unwrap_or_default();
                        found.extend(records);
                    }
                }
                if heard.iter().any(|heard| !heard) {
                    tokio::time::sleep(REPLY_POLL).await;
                }
            }
            Ok::<(), crate::store::StoreError>(())
        };
        match tokio::time::timeout(GATHER_WAIT, ask).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not ask the other nodes for their flight records: {err}"),
            Err(_) => {
                let silent: Vec<String> =
                    others.iter().zip(&heard).filter(|(_, h)| !**h).map(|(n, _)| n.to_string()).collect();
                tracing::info!("no flight records from node(s) {} within {GATHER_WAIT:?}", silent.join(","));
            }
        }
        found
    }

    async fn connect(&self) -> Result<TcpStore, crate::store::StoreError> {
        let (host, port) = self.node.store.clone();
        let options = TcpStoreOptions {
            timeout: Some(GATHER_WAIT),
            secret: self.node.secret.clone(),
            ..TcpStoreOptions::new(host, port)
        };
        TcpStore::open(options).await
    }
}
