//! The dynamic rendezvous on a real etcd: a round larger than etcd lets one transaction hold
//! (its `--max-txn-ops`, 128), which batch reads and writes must handle. Needs `etcd` on PATH
//! (Debian's etcd-server, which `.ci/run` installs); says so and passes trivially without it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use elastix_core::rendezvous::etcd_store::EtcdRendezvousStore;
use elastix_core::rendezvous::{DynamicRendezvous, RendezvousSettings};
use elastix_etcd::{EtcdClient, EtcdOptions};

/// One etcd member on free ports, with its data in a temporary directory; killed on drop.
struct Etcd {
    child: Child,
    data: std::path::PathBuf,
    endpoint: String,
}

impl Etcd {
    fn start() -> Option<Etcd> {
        let which = Command::new("sh").args(["-c", "command -v etcd"]).output().ok()?;
        if !which.status.success() {
            eprintln!("etcd is not installed (Debian: etcd-server): skipping");
            return None;
        }
        let port = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (client, peer) = (port(), port());
        let data = std::env::temp_dir().join(format!("elastix-etcd-test-{}-{client}", std::process::id()));
        let child = Command::new("etcd")
            .args(["--name", "solo", "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("solo=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        Some(Etcd { child, data, endpoint: format!("127.0.0.1:{client}") })
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_more_nodes_than_one_etcd_transaction_holds_forms() {
    let Some(etcd) = Etcd::start() else { return };
    const NODES: u32 = 200;
    let options = EtcdOptions { endpoints: vec![etcd.endpoint.clone()], tls: None, patience: Duration::from_secs(30) };
    let client = EtcdClient::new(&options).unwrap();
    let mut settings = RendezvousSettings::new("big", NODES, NODES).unwrap();
    settings.join_timeout = Duration::from_secs(120);
    settings.local_addr = Some("127.0.0.1".into());
    let prefix = "/elastix/rdzv/big/".to_owned();
    let (host, port) = etcd.endpoint.rsplit_once(':').unwrap();
    let sites = vec![(host.to_owned(), port.parse().unwrap())];
    let started = Instant::now();
    let tasks: Vec<_> = (0..NODES)
        .map(|_| {
            let store = EtcdRendezvousStore::new(client.clone(), sites.clone(), prefix.clone());
            let mut node = DynamicRendezvous::new(store, settings.clone(), prefix.clone()).unwrap();
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
