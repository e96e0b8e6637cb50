//! The dynamic rendezvous end to end: several handlers (nodes) against one store server.
//!
//! Orderings come from waiting for the store keys the nodes write (an arrival, a spare's
//! registration), never from sleeping. Deadlines only keep a broken test from hanging: they
//! are long enough for a loaded machine, and a round that needs a last call is shown by a
//! last call that never ends, not by measuring how long a join took.

use std::time::{Duration, Instant};

use elastix_core::rendezvous::c10d::keys::{run_prefix, Keys};
use elastix_core::rendezvous::store::{RendezvousStore, StoreConn, TcpRendezvousStore};
use elastix_core::rendezvous::{
    Backend, DynamicRendezvous, MembershipChange, Rendezvous, RendezvousError, RendezvousInfo, RendezvousParams,
    RendezvousSettings,
};
use elastix_core::store::{ConnectOptions, ServerConfig, StoreServer};
use tokio::task::JoinHandle;

type Node = DynamicRendezvous<TcpRendezvousStore>;

/// Bounds every wait: generous, so that only a broken rendezvous runs into it.
const PATIENCE: Duration = Duration::from_secs(60);
/// A last call that outlasts any test: a round that forms all the same did not wait for it.
const ENDLESS: Duration = Duration::from_secs(3600);

fn settings(run_id: &str, min: u32, max: u32) -> RendezvousSettings {
    let mut settings = RendezvousSettings::new(run_id, min, max).unwrap();
    settings.join_timeout = PATIENCE;
    settings.last_call_timeout = Duration::from_millis(300);
    // a live node is lost only after 2 s without a beat, which a loaded machine does not reach
    settings.keep_alive_interval = Duration::from_millis(250);
    settings.keep_alive_max_attempt = 8;
    settings.local_addr = Some("127.0.0.1".into());
    settings
}

fn endless_last_call(run_id: &str, min: u32, max: u32) -> RendezvousSettings {
    RendezvousSettings { last_call_timeout: ENDLESS, ..settings(run_id, min, max) }
}

fn node(server: &StoreServer, settings: &RendezvousSettings) -> Node {
    let prefix = run_prefix(&settings.run_id);
    DynamicRendezvous::new(store(server, &settings.run_id), settings.clone(), prefix).unwrap()
}

fn store(server: &StoreServer, run_id: &str) -> TcpRendezvousStore {
    let options = ConnectOptions::new("127.0.0.1", server.port(), Some(Duration::from_secs(10)));
    TcpRendezvousStore::new(options, run_prefix(run_id), PATIENCE)
}

/// Waits until the rendezvous key `key` of `run_id` exists (a node has reached that step).
async fn wait_for_key(server: &StoreServer, run_id: &str, key: String) {
    let mut conn = store(server, run_id).connect().await.unwrap();
    assert!(conn.wait(std::slice::from_ref(&key), Some(PATIENCE)).await.unwrap(), "{key} never appeared");
}

async fn key_exists(server: &StoreServer, run_id: &str, key: String) -> bool {
    store(server, run_id).connect().await.unwrap().check(&[key]).await.unwrap()
}

fn join(mut node: Node) -> JoinHandle<(Node, Result<RendezvousInfo, RendezvousError>)> {
    tokio::spawn(async move {
        let info = node.next_rendezvous().await;
        (node, info)
    })
}

async fn formed(task: JoinHandle<(Node, Result<RendezvousInfo, RendezvousError>)>) -> (Node, RendezvousInfo) {
    let (node, info) = tokio::time::timeout(PATIENCE, task).await.expect("the join never ended").unwrap();
    (node, info.unwrap())
}

async fn join_all(nodes: Vec<Node>) -> Vec<(Node, RendezvousInfo)> {
    let tasks: Vec<_> = nodes.into_iter().map(join).collect();
    let mut all = Vec::new();
    for task in tasks {
        all.push(formed(task).await);
    }
    all
}

/// Ranks are 0..n, world sizes and master agree across the nodes.
fn assert_consistent(infos: &[&RendezvousInfo], world_size: u32) {
    let mut ranks: Vec<u32> = infos.iter().map(|info| info.rank).collect();
    ranks.sort();
    assert_eq!(ranks, (0..world_size).collect::<Vec<_>>());
    for info in infos {
        assert_eq!(info.world_size, world_size);
        assert_eq!((&info.master_addr, info.master_port), (&infos[0].master_addr, infos[0].master_port));
        assert_eq!(info.round, infos[0].round);
    }
}

async fn next_change(node: &Node, within: Duration) -> Option<MembershipChange> {
    let mut changes = node.changes().expect("a member");
    tokio::time::timeout(within, async {
        loop {
            if let Some(change) = changes.borrow_and_update().clone() {
                return change;
            }
            changes.changed().await.unwrap();
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_equals_max_forms_as_soon_as_everyone_is_there() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    // no last call when min == max: with one that never ends, the round forms all the same
    let settings = endless_last_call("exact", 3, 3);
    let joined = join_all((0..3).map(|_| node(&server, &settings)).collect()).await;
    let infos: Vec<&RendezvousInfo> = joined.iter().map(|(_, info)| info).collect();
    assert_consistent(&infos, 3);
    // ranks follow (address, pid, local id): here the local id, i.e. creation order
    let by_rank = |rank| joined.iter().find(|(_, info)| info.rank == rank).unwrap().0.node().clone();
    assert!(by_rank(0) < by_rank(1) && by_rank(1) < by_rank(2));
    // the workers' store at master_port is a live server
    let mut client = elastix_core::store::Client::connect(&ConnectOptions::new(
        "127.0.0.1",
        infos[0].master_port,
        Some(Duration::from_secs(10)),
    ))
    .await
    .unwrap();
    client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_below_max_waits_for_the_last_call() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let run = "last-call";
    // two nodes reach min_nodes, but their last call never ends: the round stays open
    let first = join(node(&server, &endless_last_call(run, 2, 4)));
    wait_for_key(&server, run, Keys::arrival(0, 0)).await;
    let second = join(node(&server, &endless_last_call(run, 2, 4)));
    wait_for_key(&server, run, Keys::arrival(0, 1)).await;
    assert!(!key_exists(&server, run, Keys::claim(0)).await, "min_nodes alone must not fix the round");
    // a third node's last call ends it, with everyone who arrived meanwhile
    let start = Instant::now();
    let third = formed(join(node(&server, &settings(run, 2, 4)))).await;
    assert!(start.elapsed() >= settings(run, 2, 4).last_call_timeout, "the third node ran its last call");
    let (first, second) = (formed(first).await, formed(second).await);
    assert_consistent(&[&first.1, &second.1, &third.1], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_join_deadline_a_round_with_min_nodes_starts_whatever_is_left_of_its_last_call() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let run = "deadline";
    // the last call would outlast the join timeout: with min_nodes there, the deadline starts it
    let short = RendezvousSettings { join_timeout: Duration::from_secs(1), ..endless_last_call(run, 2, 4) };
    let first = join(node(&server, &short));
    let second = join(node(&server, &short));
    let (first, second) = (formed(first).await, formed(second).await);
    assert_consistent(&[&first.1, &second.1], 2);
    // alone below min_nodes, the deadline is still an error
    let alone = RendezvousSettings { join_timeout: Duration::from_millis(500), ..endless_last_call("alone", 2, 4) };
    let outcome = tokio::time::timeout(PATIENCE, join(node(&server, &alone))).await.unwrap().unwrap().1;
    assert!(matches!(outcome, Err(RendezvousError::Timeout(_))), "{outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_node_waits_and_the_members_re_form_with_it() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let run = "late";
    // round 0 forms when the second node's last call ends: nobody else is there yet
    let first = join(node(&server, &endless_last_call(run, 1, 3)));
    wait_for_key(&server, run, Keys::arrival(0, 0)).await;
    let second = join(node(&server, &settings(run, 1, 3)));
    let (first, second) = (formed(first).await, formed(second).await);
    assert_consistent(&[&first.1, &second.1], 2);
    let round = first.1.round;
    let late = join(node(&server, &endless_last_call(run, 1, 3)));
    for member in [&first.0, &second.0] {
        assert_eq!(next_change(member, PATIENCE).await, Some(MembershipChange::NodesWaiting));
    }
    let (mut first, second) = (first.0, second.0);
    assert_eq!(first.num_nodes_waiting().await.unwrap(), 1);
    // the members come back: the first and the late node wait without a last call of their
    // own, and the second member's arrival completes the round of three at once
    let first = join(first);
    wait_for_key(&server, run, Keys::arrival(round + 1, 1)).await;
    let second = formed(join(second)).await;
    let (first, late) = (formed(first).await, formed(late).await);
    assert_consistent(&[&first.1, &second.1, &late.1], 3);
    assert_eq!(late.1.round, round + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_heartbeats_stop_is_dropped_and_the_rest_re_form() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("lost", 2, 3);
    let mut joined = join_all((0..3).map(|_| node(&server, &settings)).collect()).await;
    let (dead, dead_info) = joined.pop().unwrap();
    drop(dead); // its heartbeats stop
    for (survivor, _) in &joined {
        match next_change(survivor, PATIENCE).await {
            Some(MembershipChange::NodeLost { rank, node }) => {
                assert_eq!(rank, Some(dead_info.rank));
                assert!(node.is_some(), "the lost node is named");
            }
            other => panic!("expected NodeLost, got {other:?}"),
        }
    }
    let rejoined = join_all(joined.into_iter().map(|(node, _)| node).collect()).await;
    assert_consistent(&rejoined.iter().map(|(_, i)| i).collect::<Vec<_>>(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spares_wait_quietly_and_fill_a_freed_place() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("spares", 2, 2);
    let mut joined = join_all((0..2).map(|_| node(&server, &settings)).collect()).await;
    let round = joined[0].1.round;
    let spare = join(node(&server, &settings));
    wait_for_key(&server, "spares", Keys::spares(round)).await;
    // a registered spare does not disturb a full round
    assert_eq!(*joined[0].0.changes().unwrap().borrow(), None);
    assert_eq!(joined[0].0.num_nodes_waiting().await.unwrap(), 0);
    let (dead, _) = joined.pop().unwrap();
    drop(dead);
    let (survivor, _) = joined.pop().unwrap();
    assert!(matches!(next_change(&survivor, PATIENCE).await, Some(MembershipChange::NodeLost { .. })));
    let rejoined = join_all(vec![survivor]).await;
    let (_, spare_info) = formed(spare).await;
    assert_consistent(&[&rejoined[0].1, &spare_info], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_rendezvous_refuses_joins_and_tells_everyone() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("closing", 1, 1);
    let mut joined = join_all(vec![node(&server, &settings)]).await;
    let spare = join(node(&server, &settings));
    wait_for_key(&server, "closing", Keys::spares(joined[0].1.round)).await;
    let (member, _) = &mut joined[0];
    member.set_closed().await.unwrap();
    assert!(member.is_closed().await.unwrap());
    assert_eq!(next_change(member, PATIENCE).await, Some(MembershipChange::Closed));
    let (_, spare_result) = tokio::time::timeout(PATIENCE, spare).await.expect("the spare never ended").unwrap();
    assert!(matches!(spare_result, Err(RendezvousError::GracefulExit { .. })), "{spare_result:?}");
    let err = node(&server, &settings).next_rendezvous().await.unwrap_err();
    assert!(matches!(err, RendezvousError::Closed { .. }));
    assert!(err.to_string().contains("closed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_names_who_joined_and_how_many_are_missing() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let patient = node(&server, &settings("short", 3, 3));
    let patient_name = patient.node().to_string();
    let patient = join(patient);
    wait_for_key(&server, "short", Keys::arrival(0, 0)).await;
    // the second node arrives after the first, so its timeout sees both
    let hasty = node(&server, &RendezvousSettings { join_timeout: Duration::from_secs(1), ..settings("short", 3, 3) });
    let (hasty, result) = tokio::time::timeout(PATIENCE, join(hasty)).await.expect("no timeout").unwrap();
    let err = result.unwrap_err().to_string();
    assert!(err.contains("timed out"), "{err}");
    assert!(err.contains("2 node(s) joined"), "{err}");
    assert!(err.contains(&hasty.node().to_string()) && err.contains(&patient_name), "{err}");
    assert!(err.contains("1 more node(s) missing"), "{err}");
    patient.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_different_bounds_are_refused() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let _first = join_all(vec![node(&server, &settings("bounds", 1, 1))]).await;
    let err = node(&server, &settings("bounds", 1, 2)).next_rendezvous().await.unwrap_err();
    assert!(err.to_string().contains("--nnodes 1:2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_nodes_get_distinct_ranks() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("many", 64, 64);
    let joined = join_all((0..64).map(|_| node(&server, &settings)).collect()).await;
    assert_consistent(&joined.iter().map(|(_, i)| i).collect::<Vec<_>>(), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_comes_back_opens_a_new_round_for_everyone() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("restart", 2, 2);
    let mut joined = join_all((0..2).map(|_| node(&server, &settings)).collect()).await;
    let (mut restarting, info) = joined.pop().unwrap();
    assert_eq!(restarting.record_restart().await.unwrap(), 1);
    let again = join(restarting);
    let (other, _) = joined.pop().unwrap();
    assert_eq!(next_change(&other, PATIENCE).await, Some(MembershipChange::RoundSuperseded { round: info.round + 1 }));
    let rejoined = join_all(vec![other]).await;
    let (mut restarted, again) = formed(again).await;
    assert_consistent(&[&rejoined[0].1, &again], 2);
    assert_eq!(restarted.restart_count().await.unwrap(), 1, "the restart count is job-wide");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c10d_params_host_the_store_when_the_endpoint_is_this_machine() {
    let params = |conf: &str| RendezvousParams {
        backend: "c10d".into(),
        endpoint: "127.0.0.1:0".into(),
        run_id: "params".into(),
        min_nodes: 1,
        max_nodes: 1,
        local_addr: Some("127.0.0.1".into()),
        conf: conf.into(),
        node_rank: None,
    };
    let mut host = Rendezvous::create(params("join_timeout=10s")).await.unwrap();
    let port = host.hosted_port().expect("this agent hosts the store");
    let info = host.next_rendezvous().await.unwrap();
    assert_eq!((info.rank, info.world_size, info.store_port), (0, 1, port));
    let err = Rendezvous::create(params("heartbeat_timout=5")).await.err().unwrap();
    assert!(err.to_string().contains("unknown key"), "{err}");
    let err = Rendezvous::create(RendezvousParams { backend: "zookeeper".into(), ..params("") }).await.err().unwrap();
    assert!(err.to_string().contains("zookeeper"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_rendezvous_uses_fixed_ranks_and_names_missing_ones() {
    let params = |rank: u32, conf: &str, port: u16| RendezvousParams {
        backend: "static".into(),
        endpoint: format!("127.0.0.1:{port}"),
        run_id: "fixed".into(),
        min_nodes: 2,
        max_nodes: 2,
        local_addr: None,
        conf: conf.into(),
        node_rank: Some(rank),
    };
    // rank 0 given port 0 serves the store at once, on a port the kernel picked
    let first = Rendezvous::create(params(0, "timeout=60s", 0)).await.unwrap();
    let port = first.hosted_port().expect("rank 0 serves the store");
    let second = Rendezvous::create(params(1, "timeout=60s", port)).await.unwrap();
    let nodes: Vec<_> = [first, second]
        .into_iter()
        .map(|mut rdzv| {
            tokio::spawn(async move {
                let info = rdzv.next_rendezvous().await.unwrap();
                (rdzv, info)
            })
        })
        .collect();
    let mut held = Vec::new();
    for (rank, task) in nodes.into_iter().enumerate() {
        let (rdzv, info) = tokio::time::timeout(PATIENCE, task).await.expect("static rendezvous never ended").unwrap();
        assert_eq!((info.rank, info.world_size, info.master_port), (rank as u32, 2, port));
        held.push(rdzv);
    }
    drop(held);
    let mut lonely = Rendezvous::create(params(0, "timeout=300ms", 0)).await.unwrap();
    let err = lonely.next_rendezvous().await.unwrap_err().to_string();
    assert!(err.contains("node rank(s) [1] of 2"), "{err}");
    assert!(Rendezvous::create(params(2, "", port)).await.is_err(), "rank 2 of 2 is out of range");
    let err = Rendezvous::create(params(1, "", 0)).await.err().expect("only rank 0 can let the kernel pick");
    assert!(err.to_string().contains("master port"), "{err}");
}
