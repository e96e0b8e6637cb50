//! `elastix-rdzv-bench --nodes N`: N rendezvous handlers (simulated nodes), each with its own
//! store connections, join one round against one store; prints how long until every node
//! has its rank, as JSON. The store is an elastix server in this process (own runtime) unless
//! `--endpoint host:port` names another one (a torch TCPStore, say), or `--etcd` an etcd
//! cluster.

use std::time::{Duration, Instant};

use clap::Parser;
use elastix_core::auth::{PlainClients, Secret};
use elastix_core::rendezvous::c10d::keys::run_prefix;
use elastix_core::rendezvous::etcd::EtcdRendezvous;
use elastix_core::rendezvous::store::{RendezvousStore, TcpRendezvousStore};
use elastix_core::rendezvous::{DynamicRendezvous, RendezvousError, RendezvousInfo, RendezvousSettings};
use elastix_core::store::{BackgroundServer, Client, ConnectOptions, ServerConfig};
use elastix_etcd::{EtcdClient, EtcdOptions};

#[derive(Parser)]
struct Args {
    /// Simulated nodes (min_nodes = max_nodes = N).
    #[arg(long)]
    nodes: u32,
    /// Use this store instead of an in-process elastix server.
    #[arg(long)]
    endpoint: Option<String>,
    /// Run on this etcd cluster (`host:port,...`) instead of a TCP store; each node has its
    /// own client, and the etcd requests per node are printed too.
    #[arg(long)]
    etcd: Option<String>,
    /// With --etcd: nodes share one client (one HTTP/2 connection per member) instead of one
    /// each, to tell the cost of the protocol from that of opening thousands of connections.
    #[arg(long)]
    shared_client: bool,
    /// Worker threads of the nodes' runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// With a job secret: the store requires it and every connection proves it.
    #[arg(long)]
    secret: bool,
    /// Instead of a round: time this many connections (connect, authenticate when --secret,
    /// VALIDATE, PING) to the in-process store, one after another; prints their median and
    /// 90th percentile in microseconds.
    #[arg(long)]
    connects: Option<u32>,
}

fn main() {
    let args = Args::parse();
    // handed to the store and to every client
    let secret = args.secret.then(|| Secret::from_bytes("elastix-rdzv-bench's job secret").expect("a secret"));
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build().expect("runtime");
    if let Some(endpoints) = &args.etcd {
        let (seconds, requests) = runtime.block_on(etcd_round(args.nodes, endpoints, args.shared_client));
        let per_node = requests as f64 / f64::from(args.nodes);
        println!(r#"{{"nodes": {}, "seconds": {seconds:.4}, "requests_per_node": {per_node:.2}}}"#, args.nodes);
        return;
    }
    let server = match args.endpoint {
        None => {
            let config = ServerConfig::default().requiring(secret.as_ref(), PlainClients::LoopbackAndAuthenticated);
            Some(BackgroundServer::start(&config, 1).expect("start the store"))
        }
        Some(_) => None,
    };
    let (host, port) = match (&args.endpoint, &server) {
        (Some(endpoint), _) => {
            let (host, port) = endpoint.rsplit_once(':').expect("--endpoint host:port");
            (host.to_owned(), port.parse().expect("a port number"))
        }
        (None, Some(server)) => ("127.0.0.1".to_owned(), server.port()),
        (None, None) => unreachable!(),
    };
    if let Some(count) = args.connects {
        let (median, p90) = runtime.block_on(connects(&host, port, count, secret));
        println!(r#"{{"connects": {count}, "median_us": {median:.1}, "p90_us": {p90:.1}}}"#);
        return;
    }
    let run_id = format!("bench-{}-{}", args.nodes, std::process::id());
    let seconds = runtime.block_on(async {
        let prefix = run_prefix(&run_id);
        let settings = settings(&run_id, args.nodes);
        let nodes = (0..args.nodes).map(|_| {
            let options = ConnectOptions {
                secret: secret.clone(),
                ..ConnectOptions::new(host.clone(), port, Some(Duration::from_secs(60)))
            };
            let store = TcpRendezvousStore::new(options, prefix.clone(), Duration::from_secs(60));
            DynamicRendezvous::new(store, settings.clone(), prefix.clone()).expect("handler")
        });
        one_round(args.nodes, nodes.collect()).await
    });
    println!(r#"{{"nodes": {}, "seconds": {seconds:.4}}}"#, args.nodes);
}

fn settings(run_id: &str, nodes: u32) -> RendezvousSettings {
    let mut settings = RendezvousSettings::new(run_id, nodes, nodes).expect("settings");
    settings.join_timeout = Duration::from_secs(300);
    settings.local_addr = Some("127.0.0.1".to_owned());
    settings
}

/// A simulated node: a rendezvous handler of either backend.
trait Node: Send + 'static {
    fn join(&mut self) -> impl std::future::Future<Output = Result<RendezvousInfo, RendezvousError>> + Send;
    fn stop(&mut self);
}

impl<S: RendezvousStore> Node for DynamicRendezvous<S> {
    async fn join(&mut self) -> Result<RendezvousInfo, RendezvousError> {
        self.next_rendezvous().await
    }
    fn stop(&mut self) {
        self.shutdown();
    }
}

impl Node for EtcdRendezvous {
    async fn join(&mut self) -> Result<RendezvousInfo, RendezvousError> {
        self.next_rendezvous().await
    }
    fn stop(&mut self) {
        self.shutdown();
    }
}

/// Every node joins one round at once; seconds until the last has its rank.
async fn one_round<N: Node>(nodes: u32, handlers: Vec<N>) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = handlers
        .into_iter()
        .map(|mut node| {
            tokio::spawn(async move {
                let info = node.join().await.expect("rendezvous");
                (node, info)
            })
        })
        .collect();
    let mut joined = Vec::with_capacity(tasks.len());
    for task in tasks {
        joined.push(task.await.expect("node task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut ranks: Vec<u32> = joined.iter().map(|(_, info)| info.rank).collect();
    ranks.sort();
    assert_eq!(ranks, (0..nodes).collect::<Vec<_>>(), "every node has a distinct rank");
    for (node, _) in &mut joined {
        node.stop();
    }
    elapsed
}

/// `count` connections one after another: the median and 90th percentile, in microseconds.
async fn connects(host: &str, port: u16, count: u32, secret: Option<Secret>) -> (f64, f64) {
    let options = ConnectOptions { secret, ..ConnectOptions::new(host, port, Some(Duration::from_secs(10))) };
    let mut times = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let start = Instant::now();
        let client = Client::connect(&options).await;
        times.push(start.elapsed().as_secs_f64() * 1e6);
        drop(client.expect("connect"));
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[times.len() * 9 / 10])
}

/// One round on etcd, and the etcd requests it took.
async fn etcd_round(nodes: u32, endpoints: &str, shared_client: bool) -> (f64, u64) {
    let run_id = format!("bench-{nodes}-{}", std::process::id());
    let prefix = format!("/elastix/rdzv/{run_id}/");
    let options = EtcdOptions {
        endpoints: endpoints.split(',').map(str::to_owned).collect(),
        tls: None,
        patience: Duration::from_secs(30),
    };
    let shared = EtcdClient::new(&options).expect("etcd client");
    let settings = settings(&run_id, nodes);
    let handlers = (0..nodes)
        .map(|_| {
            let client = if shared_client { shared.clone() } else { EtcdClient::new(&options).expect("etcd client") };
            EtcdRendezvous::new(client, settings.clone(), prefix.clone()).expect("handler")
        })
        .collect();
    let before = elastix_etcd::requests_sent();
    let seconds = one_round(nodes, handlers).await;
    (seconds, elastix_etcd::requests_sent() - before)
}
