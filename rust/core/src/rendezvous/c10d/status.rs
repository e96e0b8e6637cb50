//! Reading a c10d job's state for `elastix status`: only CHECK and GET (no ADD, not even of 0,
//! which would create a missing counter), O(members + [`EVENTS_SCANNED`]) requests, each
//! bounded by the query's timeout.

use std::time::Duration;

use super::keys::{run_prefix, Keys};
use super::locate::read_meta;
use crate::rendezvous::config::conf::{RendezvousConf, DYNAMIC_KEYS};
use crate::rendezvous::config::params::job_secret;
use crate::rendezvous::endpoint::{parse_endpoints, DEFAULT_PORT};
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::records::{
    decode, now_ms, seconds_between, Arrival, Event, FailureRecord, Meta, NodeStatus, Seal,
};
use crate::rendezvous::status::{judge, Evidence, Health, JobStatus, LastFailure, Lost, Member, Restarts, State};
use crate::rendezvous::status::{StatusQuery, EVENTS_SCANNED, STATUS_VERSION};
use crate::rendezvous::store::{RendezvousStore, StoreConn, TcpRendezvousStore, RUNS_KEY};
use crate::store::counter::parse_counter;

/// Arrivals named while a round forms.
const ARRIVALS_NAMED: u64 = 32;

/// The job's state at a c10d store (site list), or `None` when a site answers but holds no
/// run with that ID.
pub(crate) async fn c10d_status(query: &StatusQuery) -> Result<Option<JobStatus>> {
    let conf = RendezvousConf::from_input(&query.conf, DYNAMIC_KEYS)?;
    let secret = job_secret(&conf)?;
    let sites = parse_endpoints(&query.endpoint, DEFAULT_PORT)?;
    let prefix = run_prefix(&query.run_id);
    let store = TcpRendezvousStore::with_sites(sites, Some(query.timeout), prefix, query.timeout, secret);
    let Some((site, mut conn, meta)) = locate(&store, query.timeout).await? else { return Ok(None) };
    let mut status = read(&mut conn, &meta, &query.run_id).await?;
    status.endpoint = store.describe_site(site);
    status.round_store = Some(status.endpoint.clone());
    Ok(Some(status))
}

/// The runs the first answering site's list names ([`RUNS_KEY`]), each once, oldest first.
pub(crate) async fn c10d_runs(query: &StatusQuery) -> Result<Vec<String>> {
    let conf = RendezvousConf::from_input(&query.conf, DYNAMIC_KEYS)?;
    let secret = job_secret(&conf)?;
    let sites = parse_endpoints(&query.endpoint, DEFAULT_PORT)?;
    // no run prefix: the list lives outside every run's keys
    let store = TcpRendezvousStore::with_sites(sites, Some(query.timeout), "", query.timeout, secret);
    let mut conn = store.probe_site(store.active_site(), query.timeout).await?;
    let key = [RUNS_KEY.to_owned()];
    if !conn.check(&key).await? {
        return Ok(Vec::new());
    }
    let list = conn.multi_get(&key).await?.remove(0);
    let mut runs: Vec<String> = Vec::new();
    for run in String::from_utf8_lossy(&list).lines().filter(|run| !run.is_empty()) {
        if !runs.iter().any(|seen| seen == run) {
            runs.push(run.to_owned());
        }
    }
    Ok(runs)
}

/// The site holding the live copy of the state (the highest generation), with a connection
/// to it; `None` if a site answered and none holds the run; an error if none answered.
async fn locate(
    store: &TcpRendezvousStore,
    patience: Duration,
) -> Result<Option<(usize, <TcpRendezvousStore as RendezvousStore>::Conn, Meta)>> {
    let mut best: Option<(usize, _, Meta)> = None;
    let mut failures = Vec::new();
    for site in 0..store.sites() {
        let found = async {
            // a refusal is an answer (nothing listens there: the job ended, or never started)
            let mut conn = store.probe_site(site, patience).await?;
            let meta = read_meta(&mut conn).await?;
            Ok::<_, RendezvousError>(meta.map(|meta| (conn, meta)))
        };
        match found.await {
            Ok(Some((conn, meta))) => {
                if !best.as_ref().is_some_and(|(_, _, known)| known.generation >= meta.generation) {
                    best = Some((site, conn, meta));
                }
            }
            Ok(None) => {}
            Err(err) if err.is_store_unreachable() => failures.push(format!("{}: {err}", store.describe_site(site))),
            Err(err) => return Err(err),
        }
    }
    if best.is_none() && failures.len() == store.sites() {
        // a deadline that passed, not a bad setting: callers that tell the two apart (elastix
        // status answers a bad setting at once, an unreachable store from what it remembers)
        return Err(RendezvousError::Timeout(format!(
            "cannot reach the rendezvous store within {patience:?}: {}",
            failures.join("; ")
        )));
    }
    Ok(best)
}

async fn counter<C: StoreConn>(conn: &mut C, key: &str) -> Result<i64> {
    Ok(conn.try_get(key).await?.and_then(|value| parse_counter(&value).ok()).unwrap_or(0))
}

async fn record<C: StoreConn, T: serde::de::DeserializeOwned>(
    conn: &mut C,
    key: &str,
    what: &str,
) -> Result<Option<T>> {
    match conn.try_get(key).await? {
        Some(bytes) => Ok(Some(decode(&bytes, what)?)),
        None => Ok(None),
    }
}

async fn read<C: StoreConn>(conn: &mut C, meta: &Meta, run_id: &str) -> Result<JobStatus> {
    let round = counter(conn, Keys::ROUND).await?.max(0) as u64;
    let closed_reason = conn.try_get(Keys::CLOSED).await?.map(|reason| String::from_utf8_lossy(&reason).into_owned());
    let seal: Option<Seal> = record(conn, &Keys::sealed(round), "seal").await?;
    let formed = seal.as_ref().is_some_and(|seal| !seal.aborted);
    let mut members = Vec::new();
    let mut arrived = Vec::new();
    match &seal {
        Some(seal) if formed => {
            for rank in 0..seal.world_size {
                members.push(member(conn, round, rank, seal.world_size).await?);
            }
        }
        _ => arrived = arrivals(conn, round).await?,
    }
    let lost = lost_nodes(conn).await?;
    let size_before_loss = match lost.last() {
        Some(last) if last.round < round => {
            record::<_, Seal>(conn, &Keys::sealed(last.round), "seal").await?.map(|seal| seal.world_size)
        }
        _ => None,
    };
    let last_failure: Option<FailureRecord> = record(conn, Keys::LAST_FAILURE, "failure record").await?;
    let allowed = last_failure.as_ref().map(|failure| failure.max_restarts);
    let now = now_ms();
    let mut status = JobStatus {
        v: STATUS_VERSION,
        run_id: run_id.to_owned(),
        backend: "c10d",
        endpoint: String::new(),
        round_store: None,
        health: Health::Healthy,
        state: State::Running,
        problems: Vec::new(),
        min_nodes: meta.min_nodes,
        max_nodes: meta.max_nodes,
        round,
        waiting: counter(conn, &Keys::waiting(round)).await?.max(0) as u64,
        spares: counter(conn, &Keys::spares(round)).await?.max(0) as u64,
        restarts: Restarts {
            used: counter(conn, Keys::RESTARTS).await?,
            allowed: members.iter().find_map(|m| m.max_restarts).or(allowed),
        },
        members: members.into_iter().map(|m| m.member).collect(),
        arrived,
        last_failure: last_failure.map(|failure| LastFailure::from_record(failure, now)),
        lost,
        closed_reason,
    };
    judge(&mut status, &Evidence { formed, size_before_loss });
    Ok(status)
}

/// A member, and the restart budget its agent published.
struct Read {
    member: Member,
    max_restarts: Option<u32>,
}

async fn member<C: StoreConn>(conn: &mut C, round: u64, rank: u32, world_size: u32) -> Result<Read> {
    let arrival: Option<Arrival> = record(conn, &Keys::member(round, rank), "member").await?;
    let status: Option<NodeStatus> = record(conn, &Keys::node_status(round, rank), "node status").await?;
    let node = arrival.and_then(|arrival| arrival.node).or_else(|| status.as_ref().map(|s| s.node.clone()));
    let heartbeat_age_s = if world_size > 1 { heartbeat_age(conn, round, rank).await? } else { None };
    let member = Member::new(rank, node.as_ref(), status.as_ref(), heartbeat_age_s);
    Ok(Read { member, max_restarts: status.map(|status| status.facts.max_restarts) })
}

/// Seconds since the member's last beat, from the clock value the beat carries (the newest
/// beat may be counted and not written yet: then the one before it).
async fn heartbeat_age<C: StoreConn>(conn: &mut C, round: u64, rank: u32) -> Result<Option<f64>> {
    let latest = counter(conn, &Keys::beats(round, rank)).await?.max(0) as u64;
    for seq in [latest, latest.saturating_sub(1)] {
        if seq == 0 {
            break;
        }
        if let Some(value) = conn.try_get(&Keys::heartbeat(round, rank, seq)).await? {
            let Ok(sent) = String::from_utf8_lossy(&value).parse::<u64>() else { return Ok(None) };
            return Ok(Some(seconds_between(sent, now_ms())));
        }
    }
    Ok(None)
}

/// The nodes that arrived in a forming round (the first [`ARRIVALS_NAMED`]).
async fn arrivals<C: StoreConn>(conn: &mut C, round: u64) -> Result<Vec<String>> {
    let arrived = counter(conn, &Keys::joined(round)).await?.max(0) as u64;
    let mut names = Vec::new();
    for i in 0..arrived.min(ARRIVALS_NAMED) {
        if let Some(Arrival { node: Some(node), .. }) = record(conn, &Keys::arrival(round, i), "arrival").await? {
            names.push(node.to_string());
        }
    }
    Ok(names)
}

/// Lost-node reports among the last [`EVENTS_SCANNED`] events, oldest first.
async fn lost_nodes<C: StoreConn>(conn: &mut C) -> Result<Vec<Lost>> {
    let count = counter(conn, Keys::EVENTS).await?;
    let mut lost = Vec::new();
    for n in (count - EVENTS_SCANNED + 1).max(1)..=count {
        if let Some(Event::Lost { round, rank, node, .. }) = record(conn, &Keys::event(n), "event").await? {
            lost.push(Lost { round, group_rank: rank, node: node.map(|node| node.to_string()) });
        }
    }
    Ok(lost)
}
