//! The etcd rendezvous on a real etcd: a large round, late nodes and spares, a lost member
//! (its lease expires), the restart count and the close. Needs `etcd` on PATH (Debian's
//! etcd-server, which `.ci/run` installs); says so and passes trivially without it.

use std::time::{Duration, Instant};

use elastix_core::rendezvous::etcd::EtcdRendezvous;
use elastix_core::rendezvous::{Backend, MembershipChange, RendezvousError, RendezvousInfo, RendezvousSettings};
use elastix_etcd::pb::etcdserverpb::RangeRequest;
use elastix_etcd::testing::LocalEtcd;
use elastix_etcd::EtcdClient;
use tokio::task::JoinHandle;

/// The local etcd, and nodes of runs on it.
struct Etcd(LocalEtcd);

impl Etcd {
    fn start() -> Option<Etcd> {
        LocalEtcd::start().map(Etcd)
    }

    fn client(&self) -> EtcdClient {
        self.0.client()
    }

    /// A node of run `run_id` with `min..max` nodes, lost 2 s (etcd's shortest lease) after
    /// its agent stops, with a short last call.
    fn node(&self, run_id: &str, min: u32, max: u32) -> EtcdRendezvous {
        let mut settings = RendezvousSettings::new(run_id, min, max).unwrap();
        settings.join_timeout = Duration::from_secs(30);
        settings.last_call_timeout = Duration::from_millis(300);
        settings.keep_alive_interval = Duration::from_millis(500);
        settings.keep_alive_max_attempt = 4;
        settings.local_addr = Some("127.0.0.1".into());
        EtcdRendezvous::new(self.client(), settings, format!("/elastix/rdzv/{run_id}/")).unwrap()
    }
}

type Joining = JoinHandle<(EtcdRendezvous, Result<RendezvousInfo, RendezvousError>)>;

fn join(mut node: EtcdRendezvous) -> Joining {
    tokio::spawn(async move {
        let info = node.next_rendezvous().await;
        (node, info)
    })
}

async fn formed(task: Joining) -> (EtcdRendezvous, RendezvousInfo) {
    let (node, info) = tokio::time::timeout(Duration::from_secs(30), task).await.expect("in time").unwrap();
    (node, info.expect("rendezvous"))
}

/// The first change of `node`'s round, up to `within`.
async fn change(node: &EtcdRendezvous, within: Duration) -> Option<MembershipChange> {
    let mut changes = node.changes().expect("a member");
    let waiting = async {
        loop {
            if let Some(change) = changes.borrow_and_update().clone() {
                return change;
            }
            changes.changed().await.expect("the round's watch runs");
        }
    };
    tokio::time::timeout(within, waiting).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_more_nodes_than_one_etcd_transaction_holds_forms() {
    let Some(etcd) = Etcd::start() else { return };
    const NODES: u32 = 200;
    let client = etcd.client();
    let mut settings = RendezvousSettings::new("big", NODES, NODES).unwrap();
    settings.join_timeout = Duration::from_secs(120);
    settings.local_addr = Some("127.0.0.1".into());
    let prefix = "/elastix/rdzv/big/".to_owned();
    let started = Instant::now();
    let tasks: Vec<_> = (0..NODES)
        .map(|_| {
            let mut node = EtcdRendezvous::new(client.clone(), settings.clone(), prefix.clone()).unwrap();
            tokio::spawn(async move {
                let info = node.next_rendezvous().await;
                node.shutdown();
                info
            })
        })
        .collect();
    let mut ranks = Vec::new();
    for task in tasks {
        let info = tokio::time::timeout(Duration::from_secs(120), task).await.expect("the round formed").unwrap();
        let info = info.expect("rendezvous");
        assert_eq!(info.world_size, NODES);
        ranks.push(info.rank);
    }
    ranks.sort_unstable();
    assert_eq!(ranks, (0..NODES).collect::<Vec<_>>(), "every node has its own rank");
    eprintln!("{NODES} nodes formed a round on etcd in {:.2?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_waits_quietly_and_takes_the_place_of_a_lost_member() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b) = (join(etcd.node("spare", 1, 2)), join(etcd.node("spare", 1, 2)));
    let ((a, a_info), (mut b, b_info)) = (formed(a).await, formed(b).await);
    assert_eq!((a_info.round, a_info.world_size, b_info.world_size), (0, 2, 2));
    let spare = join(etcd.node("spare", 1, 2));
    assert_eq!(change(&a, Duration::from_secs(1)).await, None, "a spare does not disturb a full round");

    b.shutdown(); // its lease is no longer renewed: it expires, and its key with it
    match change(&a, Duration::from_secs(10)).await {
        Some(MembershipChange::NodeLost { rank, node }) => {
            assert_eq!(rank, Some(b_info.rank));
            assert_eq!(node.as_ref(), Some(b.node()));
        }
        other => panic!("expected the loss of the stopped node, got {other:?}"),
    }
    let (mut a, a_info) = formed(join(a)).await;
    let (spare, spare_info) = formed(spare).await;
    assert_eq!((a_info.round, spare_info.round), (1, 1));
    assert_eq!((a_info.world_size, spare_info.world_size), (2, 2));
    assert_ne!(a_info.rank, spare_info.rank);

    a.set_closed_with("succeeded").await.unwrap();
    assert_eq!(change(&spare, Duration::from_secs(5)).await, Some(MembershipChange::Closed));
    let mut spare = spare;
    assert_eq!(spare.closed_reason().await.unwrap().as_deref(), Some("succeeded"));
    let late = formed_or_error(join(etcd.node("spare", 1, 2))).await;
    assert!(matches!(late, Err(RendezvousError::Closed { .. })), "{late:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_node_makes_the_round_re_form_with_it_and_failures_count_once_per_round() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b) = (join(etcd.node("late", 1, 3)), join(etcd.node("late", 1, 3)));
    let ((mut a, a_info), (b, _)) = (formed(a).await, formed(b).await);
    assert_eq!(a_info.world_size, 2, "the last call ended with two");
    let late = join(etcd.node("late", 1, 3));
    assert_eq!(change(&a, Duration::from_secs(5)).await, Some(MembershipChange::NodesWaiting));
    assert_eq!(change(&b, Duration::from_secs(5)).await, Some(MembershipChange::NodesWaiting));

    // two nodes report the same round's failure: one restart
    assert_eq!(a.report_failure().await.unwrap(), 1);
    let mut b = b;
    assert_eq!(b.report_failure().await.unwrap(), 1);
    assert_eq!(a.restart_count().await.unwrap(), 1);

    let (a, b) = (join(a), join(b));
    let infos = [formed(a).await.1, formed(b).await.1, formed(late).await.1];
    assert!(infos.iter().all(|info| info.round == 1 && info.world_size == 3), "{infos:?}");
    let mut ranks: Vec<u32> = infos.iter().map(|info| info.rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![0, 1, 2]);
}

async fn formed_or_error(task: Joining) -> Result<RendezvousInfo, RendezvousError> {
    tokio::time::timeout(Duration::from_secs(30), task).await.expect("in time").unwrap().1
}

/// Round 0's member keys of run `run_id`, up to `within` until there are `count` of them.
async fn wait_members(etcd: &Etcd, run_id: &str, count: i64, within: Duration) {
    let key = format!("/elastix/rdzv/{run_id}/r/{:012}/m/", 0).into_bytes();
    let mut range_end = key.clone();
    *range_end.last_mut().unwrap() += 1;
    let request = RangeRequest { key, range_end, count_only: true, ..Default::default() };
    let deadline = Instant::now() + within;
    loop {
        let found = etcd.client().range(request.clone()).await.unwrap().count;
        if found == count {
            return;
        }
        assert!(Instant::now() < deadline, "{found} member key(s) of round 0, not {count}, after {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_that_left_do_not_count_toward_min_nodes() {
    // arrivals before the min_nodes-th are not counted live; from it on they are, so a node
    // that left meanwhile does not start a last call for a round that cannot form
    let Some(etcd) = Etcd::start() else { return };
    let (a, b) = (join(etcd.node("left", 3, 4)), join(etcd.node("left", 3, 4)));
    wait_members(&etcd, "left", 2, Duration::from_secs(10)).await;
    b.abort(); // its agent is gone: its lease expires, and its key with it
    wait_members(&etcd, "left", 1, Duration::from_secs(10)).await;
    let c = join(etcd.node("left", 3, 4));
    wait_members(&etcd, "left", 2, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(1)).await; // three last calls' worth
    assert!(!a.is_finished() && !c.is_finished(), "a round of 2 live nodes (3 arrivals) does not form");
    let d = join(etcd.node("left", 3, 4));
    let infos = [formed(a).await.1, formed(c).await.1, formed(d).await.1];
    assert!(infos.iter().all(|info| info.round == 0 && info.world_size == 3), "{infos:?}");
}
