//! The dynamic rendezvous end to end: several handlers (nodes) against one store server.

use std::time::{Duration, Instant};

use elastix_core::rendezvous::keys::run_prefix;
use elastix_core::rendezvous::store::TcpRendezvousStore;
use elastix_core::rendezvous::{
    DynamicRendezvous, MembershipChange, Rendezvous, RendezvousError, RendezvousInfo, RendezvousParams,
    RendezvousSettings,
};
use elastix_core::store::{ConnectOptions, ServerConfig, StoreServer};
use tokio::task::JoinHandle;

type Node = DynamicRendezvous<TcpRendezvousStore>;

fn settings(run_id: &str, min: u32, max: u32) -> RendezvousSettings {
    let mut settings = RendezvousSettings::new(run_id, min, max).unwrap();
    settings.join_timeout = Duration::from_secs(20);
    settings.last_call_timeout = Duration::from_millis(300);
    settings.keep_alive_interval = Duration::from_millis(100);
    settings.keep_alive_max_attempt = 3;
    settings.local_addr = Some("127.0.0.1".into());
    settings
}

fn node(server: &StoreServer, settings: &RendezvousSettings) -> Node {
    let options = ConnectOptions::new("127.0.0.1", server.port(), Some(Duration::from_secs(10)));
    let prefix = run_prefix(&settings.run_id);
    let store = TcpRendezvousStore::new(options, prefix.clone(), Duration::from_secs(10));
    DynamicRendezvous::new(store, settings.clone(), ("127.0.0.1".into(), server.port()), prefix).unwrap()
}

fn join(mut node: Node) -> JoinHandle<(Node, Result<RendezvousInfo, RendezvousError>)> {
    tokio::spawn(async move {
        let info = node.next_rendezvous().await;
        (node, info)
    })
}

async fn join_all(nodes: Vec<Node>) -> Vec<(Node, RendezvousInfo)> {
    let tasks: Vec<_> = nodes.into_iter().map(join).collect();
    let mut joined = Vec::new();
    for task in tasks {
        let (node, info) = task.await.unwrap();
        joined.push((node, info.unwrap()));
    }
    joined
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
    let settings = settings("exact", 3, 3);
    let start = Instant::now();
    let joined = join_all((0..3).map(|_| node(&server, &settings)).collect()).await;
    assert!(start.elapsed() < settings.last_call_timeout, "no last call when min == max");
    let infos: Vec<&RendezvousInfo> = joined.iter().map(|(_, info)| info).collect();
    assert_consistent(&infos, 3);
    // ranks follow (address, pid, local id): here the local id, i.e. creation order
    let by_rank = |rank| joined.iter().find(|(_, info)| info.rank == rank).unwrap().0.node().clone();
    assert!(by_rank(0) < by_rank(1) && by_rank(1) < by_rank(2));
    // the workers' store at master_port is a live server
    let mut client = elastix_core::store::Client::connect(&ConnectOptions::new(
        "127.0.0.1",
        infos[0].master_port,
        Some(Duration::from_secs(2)),
    ))
    .await
    .unwrap();
    client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_below_max_waits_for_the_last_call() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("last-call", 2, 4);
    let start = Instant::now();
    let joined = join_all((0..2).map(|_| node(&server, &settings)).collect()).await;
    assert!(start.elapsed() >= settings.last_call_timeout);
    assert_consistent(&joined.iter().map(|(_, i)| i).collect::<Vec<_>>(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_node_waits_and_the_members_re_form_with_it() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("late", 1, 3);
    let joined = join_all((0..2).map(|_| node(&server, &settings)).collect()).await;
    let first_round = joined[0].1.round;
    let late = join(node(&server, &settings));
    for (member, _) in &joined {
        assert_eq!(next_change(member, Duration::from_secs(5)).await, Some(MembershipChange::NodesWaiting));
    }
    let mut members: Vec<Node> = joined.into_iter().map(|(node, _)| node).collect();
    assert_eq!(members[0].num_nodes_waiting().await.unwrap(), 1);
    // the members come back: the round re-forms with three at once (no last call needed)
    let start = Instant::now();
    let rejoined = join_all(members).await;
    let (_, late_info) = late.await.unwrap();
    let late_info = late_info.unwrap();
    assert!(start.elapsed() < settings.last_call_timeout);
    let mut infos: Vec<&RendezvousInfo> = rejoined.iter().map(|(_, i)| i).collect();
    infos.push(&late_info);
    assert_consistent(&infos, 3);
    assert!(late_info.round > first_round);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_heartbeats_stop_is_dropped_and_the_rest_re_form() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("lost", 2, 3);
    let mut joined = join_all((0..3).map(|_| node(&server, &settings)).collect()).await;
    let (dead, dead_info) = joined.pop().unwrap();
    drop(dead); // its heartbeats stop
    for (survivor, _) in &joined {
        match next_change(survivor, Duration::from_secs(5)).await {
            Some(MembershipChange::NodeLost { rank, node }) => {
                assert_eq!(rank, dead_info.rank);
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
    let spare = join(node(&server, &settings));
    // a spare does not disturb a full round
    assert_eq!(next_change(&joined[0].0, Duration::from_millis(400)).await, None);
    assert_eq!(joined[0].0.num_nodes_waiting().await.unwrap(), 0);
    let (dead, _) = joined.pop().unwrap();
    drop(dead);
    let (survivor, _) = joined.pop().unwrap();
    assert!(matches!(next_change(&survivor, Duration::from_secs(5)).await, Some(MembershipChange::NodeLost { .. })));
    let rejoined = join_all(vec![survivor]).await;
    let (_, spare_info) = spare.await.unwrap();
    assert_consistent(&[&rejoined[0].1, &spare_info.unwrap()], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_rendezvous_refuses_joins_and_tells_everyone() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let settings = settings("closing", 1, 1);
    let mut joined = join_all(vec![node(&server, &settings)]).await;
    let spare = join(node(&server, &settings));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (member, _) = &mut joined[0];
    member.set_closed().await.unwrap();
    assert!(member.is_closed().await.unwrap());
    assert_eq!(next_change(member, Duration::from_secs(5)).await, Some(MembershipChange::Closed));
    let (_, spare_result) = spare.await.unwrap();
    assert!(matches!(spare_result, Err(RendezvousError::GracefulExit { .. })), "{spare_result:?}");
    let err = node(&server, &settings).next_rendezvous().await.unwrap_err();
    assert!(matches!(err, RendezvousError::Closed { .. }));
    assert!(err.to_string().contains("closed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_names_who_joined_and_how_many_are_missing() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let mut settings = settings("short", 3, 3);
    settings.join_timeout = Duration::from_millis(400);
    let tasks: Vec<_> = (0..2).map(|_| join(node(&server, &settings))).collect();
    for task in tasks {
        let (node, result) = task.await.unwrap();
        let err = result.unwrap_err().to_string();
        assert!(err.contains("timed out"), "{err}");
        assert!(err.contains("2 node(s) joined"), "{err}");
        assert!(err.contains(&node.node().to_string()), "{err}");
        assert!(err.contains("1 more node(s) missing"), "{err}");
    }
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
    assert_eq!(
        next_change(&other, Duration::from_secs(5)).await,
        Some(MembershipChange::RoundSuperseded { round: info.round + 1 })
    );
    let rejoined = join_all(vec![other]).await;
    let (mut restarted, again) = again.await.unwrap();
    assert_consistent(&[&rejoined[0].1, &again.unwrap()], 2);
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
    let err = Rendezvous::create(params("heartbeat=5")).await.err().unwrap();
    assert!(err.to_string().contains("unknown key"), "{err}");
    let err = Rendezvous::create(RendezvousParams { backend: "zookeeper".into(), ..params("") }).await.err().unwrap();
    assert!(err.to_string().contains("zookeeper"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_rendezvous_uses_fixed_ranks_and_names_missing_ones() {
    let free_port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port = free_port();
    let params = move |rank: u32, conf: &str, port: u16| RendezvousParams {
        backend: "static".into(),
        endpoint: format!("127.0.0.1:{port}"),
        run_id: "fixed".into(),
        min_nodes: 2,
        max_nodes: 2,
        local_addr: None,
        conf: conf.into(),
        node_rank: Some(rank),
    };
    let mut nodes = Vec::new();
    for rank in 0..2 {
        nodes.push(tokio::spawn(async move {
            let mut rdzv = Rendezvous::create(params(rank, "timeout=10s", port)).await.unwrap();
            let info = rdzv.next_rendezvous().await.unwrap();
            (rdzv, info)
        }));
    }
    let mut held = Vec::new();
    for (rank, task) in nodes.into_iter().enumerate() {
        let (rdzv, info) = task.await.unwrap();
        assert_eq!((info.rank, info.world_size, info.master_port), (rank as u32, 2, port));
        held.push(rdzv);
    }
    drop(held);
    let lonely = params(0, "timeout=300ms", free_port());
    let err = Rendezvous::create(lonely).await.unwrap().next_rendezvous().await.unwrap_err().to_string();
    assert!(err.contains("node rank(s) [1] of 2"), "{err}");
    assert!(Rendezvous::create(params(2, "", port)).await.is_err(), "rank 2 of 2 is out of range");
}
