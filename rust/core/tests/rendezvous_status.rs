//! `elastix status`'s reader against a live store: two nodes form a round and publish what
//! their agents know; the reader sees both, their ranks and heartbeats, then the job's end.

use std::time::Duration;

use elastix_core::rendezvous::c10d::keys::run_prefix;
use elastix_core::rendezvous::job_status;
use elastix_core::rendezvous::records::{
    now_ms, AgentFacts, Doing, FailureRecord, HeldCheckpoint, RankPace, WorkerProgress, FORMAT_VERSION,
};
use elastix_core::rendezvous::status::{Health, State, StatusQuery};
use elastix_core::rendezvous::store::TcpRendezvousStore;
use elastix_core::rendezvous::{Backend, ConfInput, DynamicRendezvous, RendezvousError, RendezvousSettings};
use elastix_core::store::{ConnectOptions, ServerConfig, StoreServer};

const PATIENCE: Duration = Duration::from_secs(60);

fn node(server: &StoreServer, run_id: &str) -> DynamicRendezvous<TcpRendezvousStore> {
    let mut settings = RendezvousSettings::new(run_id, 2, 2).unwrap();
    settings.join_timeout = PATIENCE;
    settings.keep_alive_interval = Duration::from_millis(250);
    settings.keep_alive_max_attempt = 8;
    settings.local_addr = Some("127.0.0.1".into());
    let options = ConnectOptions::new("127.0.0.1", server.port(), Some(Duration::from_secs(10)));
    let store = TcpRendezvousStore::new(options, run_prefix(run_id), PATIENCE);
    DynamicRendezvous::new(store, settings, run_prefix(run_id)).unwrap()
}

fn query(port: u16, run_id: &str) -> StatusQuery {
    StatusQuery {
        backend: "c10d".into(),
        endpoint: format!("127.0.0.1:{port}"),
        run_id: run_id.into(),
        conf: ConfInput::default(),
        timeout: Duration::from_secs(5),
    }
}

fn facts(first_rank: u32) -> AgentFacts {
    AgentFacts {
        host: "h".into(),
        role: "trainer".into(),
        local_world_size: 2,
        first_rank,
        max_restarts: 3,
        metrics_port: Some(9100),
        workers_started_ms: 0,
        workers: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_members_their_ranks_and_the_end() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let run_id = "status-job";
    assert_eq!(job_status(&query(server.port(), run_id)).await.unwrap(), None, "no such job yet");

    let (mut a, mut b) = (node(&server, run_id), node(&server, run_id));
    let joining = tokio::spawn(async move { (b.next_rendezvous().await.unwrap(), b) });
    let info_a = tokio::time::timeout(PATIENCE, a.next_rendezvous()).await.unwrap().unwrap();
    let (info_b, b) = tokio::time::timeout(PATIENCE, joining).await.unwrap().unwrap();
    let (mut first, mut second) = if info_a.rank == 0 { (a, b) } else { (b, a) };
    assert_eq!(info_a.world_size + info_b.world_size, 4);
    first.publish_node_status(facts(0)).await.unwrap();
    second.publish_node_status(facts(2)).await.unwrap();

    // heartbeats start with the round; wait (bounded) until both have reached the store
    let mut status = None;
    for _ in 0..200 {
        let now = job_status(&query(server.port(), run_id)).await.unwrap().unwrap();
        if now.members.iter().all(|m| m.heartbeat_age_s.is_some()) {
            status = Some(now);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = status.expect("both members' heartbeats reach the store");
    assert_eq!((status.health, status.state), (Health::Healthy, State::Running), "{status:?}");
    assert_eq!(status.members.len(), 2);
    assert_eq!(status.members[1].ranks, [2, 3]);
    assert_eq!(status.members[0].role.as_deref(), Some("trainer"));
    assert_eq!(status.members[0].metrics_port, Some(9100));
    assert_eq!(status.restarts.allowed, Some(3));
    assert!(status.members.iter().all(|m| m.lost_after_s == Some(2.0)), "{status:?}");

    // the agent's own task republishes a member's status with its workers' progress
    let writer = second.status_writer().expect("a member of a round has one");
    let held = HeldCheckpoint {
        step: 4,
        bytes: 4096,
        saved_ms: now_ms(),
        persisted_step: Some(3),
        persisted_ms: None,
        save_ms: Some(3),
        persist_ms: Some(12),
        copied_step: Some(4),
        restored: None,
    };
    let workers = vec![
        WorkerProgress {
            rank: 2,
            beats: 5,
            step: Some(4),
            seen_ms: Some(now_ms()),
            doing: Some(Doing::BlockedBusy),
            checkpoint: Some(held),
            pace: Some(RankPace { score: 0.5, compute_ms: 200.0, others_ms: 100.0, straggler: true }),
        },
        WorkerProgress { rank: 3, beats: 0, step: None, seen_ms: None, doing: None, checkpoint: None, pace: None },
    ];
    writer(AgentFacts { workers, ..facts(2) }).await.unwrap();
    let status = job_status(&query(server.port(), run_id)).await.unwrap().unwrap();
    let shown = &status.members[1].workers;
    assert_eq!(shown.iter().map(|w| (w.rank, w.beats, w.step)).collect::<Vec<_>>(), [(2, 5, Some(4)), (3, 0, None)]);
    assert!(shown[0].seen_age_s.is_some_and(|age| age < 5.0) && shown[1].seen_age_s.is_none(), "{shown:?}");
    assert_eq!((shown[0].doing, shown[1].doing), (Some(Doing::BlockedBusy), None));
    let checkpoint = shown[0].checkpoint.as_ref().expect("rank 2 saved one");
    assert_eq!((checkpoint.step, checkpoint.bytes, checkpoint.persisted_step), (4, 4096, Some(3)));
    assert!(checkpoint.saved_age_s < 5.0 && shown[1].checkpoint.is_none(), "{shown:?}");
    assert!(status.members[0].workers.is_empty(), "the other member published none");
    // a rank named a straggler is a problem of the job's
    assert_eq!(shown[0].pace.as_ref().map(|pace| (pace.score, pace.straggler)), Some((0.5, true)));
    assert!(shown[1].pace.is_none());
    let named = status.problems.iter().find(|problem| problem.contains("rank 2 on node")).expect("named");
    assert!(named.contains("straggler") && named.contains("2.0x") && named.contains("200 ms"), "{named}");
    assert_eq!(status.health, Health::Degraded);

    let failure = FailureRecord {
        v: FORMAT_VERSION,
        round: status.round,
        host: "h".into(),
        at_ms: now_ms(),
        rank: 3,
        local_rank: 1,
        exitcode: -9,
        signal: Some("SIGKILL".into()),
        hung: Some("no heartbeat for 2.00s".into()),
        message: "killed".into(),
        restarts_used: 1,
        max_restarts: 3,
    };
    second.publish_failure(&failure).await.unwrap();
    first.set_closed_with("failed: rank 3 was killed").await.unwrap();
    let status = job_status(&query(server.port(), run_id)).await.unwrap().unwrap();
    assert_eq!((status.health, status.state), (Health::Failed, State::Failed));
    let last = status.last_failure.expect("the failure is published");
    assert_eq!((last.rank, last.signal.as_deref()), (3, Some("SIGKILL")));
    assert_eq!(last.hung.as_deref(), Some("no heartbeat for 2.00s"));
    let json = serde_json::to_value(job_status(&query(server.port(), run_id)).await.unwrap()).unwrap();
    assert_eq!(json["v"], 1);
    assert_eq!(json["health"], "failed");
    first.shutdown();
    second.shutdown();
}

#[tokio::test]
async fn an_unreachable_store_and_an_unknown_backend_are_clear_errors() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut unreachable = query(port, "job");
    unreachable.timeout = Duration::from_millis(300);
    let err = job_status(&unreachable).await.unwrap_err();
    assert!(matches!(err, RendezvousError::Timeout(_)), "a deadline, not a bad setting: {err:?}");
    let err = err.to_string();
    assert!(err.contains("cannot reach the rendezvous store") && err.contains(&port.to_string()), "{err}");

    let unknown = StatusQuery { backend: "zookeeper".into(), ..query(port, "job") };
    let err = job_status(&unknown).await.unwrap_err().to_string();
    assert!(err.contains("unknown backend \"zookeeper\" (choose from c10d, etcd, etcd-v3, static)"), "{err}");
}
