//! `elastix-rdzv-bench --nodes N`: N rendezvous handlers (simulated nodes), each with its own
//! store connections, join one round against one store; prints how long until every node
//! has its rank, as JSON. The store is an elastix server in this process (own runtime) unless
//! `--endpoint host:port` names another one (an elastix-store process, a torch TCPStore), or
//! `--etcd` an etcd cluster.
//!
//! `--leave-after-rank` makes each node a round and no more: it disconnects as soon as it has
//! its rank, before a member's heartbeat and watcher connections are opened (with one thread,
//! its background tasks are stopped before they first run). 10,000 members would hold
//! 30,000 connections to one store: more than this machine's 20,000 open files.

use std::time::{Duration, Instant};

use clap::Parser;
use elastix_core::auth::{PlainClients, Secret};
use elastix_core::rendezvous::c10d::keys::run_prefix;
use elastix_core::rendezvous::etcd::EtcdRendezvous;
use elastix_core::rendezvous::records::now_ms;
use elastix_core::rendezvous::store::TcpRendezvousStore;
use elastix_core::rendezvous::{Backend, DynamicRendezvous, RendezvousSettings};
use elastix_core::store::{BackgroundServer, Client, ConnectOptions, ServerConfig};
use elastix_etcd::{EtcdClient, EtcdOptions, RequestCounts};

#[derive(Parser)]
struct Args {
    /// Simulated nodes (min_nodes = max_nodes = N).
    #[arg(long)]
    nodes: u32,
    /// How many of them this process runs (default: all). Each node has a listener of its
    /// own besides its connection, so 10,000 take several processes here: each is given the
    /// same --run-id and --start-at, and prints when its last node had its rank.
    #[arg(long)]
    here: Option<u32>,
    /// The rendezvous run ID (default: one of this process's own).
    #[arg(long)]
    run_id: Option<String>,
    /// When the nodes join, in seconds since the Unix epoch (default: once they are made).
    #[arg(long)]
    start_at: Option<f64>,
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
    /// Worker threads of the nodes' runtime (1: a current-thread runtime).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Each node disconnects as soon as it has its rank (see above).
    #[arg(long)]
    leave_after_rank: bool,
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
    if let Ok(level) = std::env::var("RUST_LOG") {
        elastix_core::logging::init_stderr(&level).expect("RUST_LOG");
    }
    // handed to the store and to every client
    let secret = args.secret.then(|| Secret::from_bytes("elastix-rdzv-bench's job secret").expect("a secret"));
    let mut builder = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        threads => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
    };
    let runtime = builder.enable_all().build().expect("runtime");
    let round = Round {
        nodes: args.nodes,
        here: args.here.unwrap_or(args.nodes),
        run_id: args.run_id.clone().unwrap_or_else(|| format!("bench-{}-{}", args.nodes, std::process::id())),
        start_at: args.start_at,
        leave_after_rank: args.leave_after_rank,
    };
    if let Some(endpoints) = &args.etcd {
        let (timing, requests) = runtime.block_on(etcd_round(&round, endpoints, args.shared_client));
        let per_node = |count: u64| count as f64 / f64::from(round.here);
        println!(
            r#"{{"nodes": {}, {timing}, "requests_per_node": {:.2}, "shed_per_node": {:.2}, "renewals_per_node": {:.2}}}"#,
            args.nodes,
            per_node(requests.sent),
            per_node(requests.shed),
            per_node(requests.renewals)
        );
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
    let timing = runtime.block_on(async {
        let prefix = run_prefix(&round.run_id);
        let settings = settings(&round.run_id, args.nodes);
        let nodes = (0..round.here).map(|_| {
            let options = ConnectOptions {
                secret: secret.clone(),
                ..ConnectOptions::new(host.clone(), port, Some(Duration::from_secs(60)))
            };
            let store = TcpRendezvousStore::new(options, prefix.clone(), Duration::from_secs(60));
            DynamicRendezvous::new(store, settings.clone(), prefix.clone()).expect("handler")
        });
        round.run(nodes.collect()).await
    });
    println!(r#"{{"nodes": {}, {timing}}}"#, args.nodes);
}

/// One round, as this process takes part in it.
struct Round {
    nodes: u32,
    here: u32,
    run_id: String,
    start_at: Option<f64>,
    leave_after_rank: bool,
}

impl Round {
    /// Every node here joins at the start; the figures, as JSON fields: seconds from the
    /// start until the last of them had its rank, and that moment in Unix seconds.
    async fn run<N: Backend + 'static>(&self, handlers: Vec<N>) -> String {
        if let Some(start_at) = self.start_at {
            let until = Duration::from_secs_f64((start_at - unix_now()).max(0.0));
            tokio::time::sleep(until).await;
        }
        let seconds = one_round(self.nodes, handlers, self.leave_after_rank).await;
        format!(r#""seconds": {seconds:.4}, "finished_at": {:.4}"#, unix_now())
    }
}

fn unix_now() -> f64 {
    now_ms() as f64 / 1000.0
}

fn settings(run_id: &str, nodes: u32) -> RendezvousSettings {
    let mut settings = RendezvousSettings::new(run_id, nodes, nodes).expect("settings");
    settings.join_timeout = Duration::from_secs(300);
    settings.local_addr = Some("127.0.0.1".to_owned());
    settings
}

/// Every node joins one round at once; seconds until the last has its rank.
async fn one_round<N: Backend + 'static>(nodes: u32, handlers: Vec<N>, leave_after_rank: bool) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = handlers
        .into_iter()
        .map(|mut node| {
            tokio::spawn(async move {
                let info = node.next_rendezvous().await.expect("rendezvous");
                if leave_after_rank {
                    node.linger(Duration::ZERO).await; // stops, and closes every connection
                }
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
    ranks.dedup();
    assert!(ranks.len() == joined.len() && ranks.iter().all(|rank| *rank < nodes), "every node has a distinct rank");
    for (node, _) in &mut joined {
        node.shutdown();
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
async fn etcd_round(round: &Round, endpoints: &str, shared_client: bool) -> (String, RequestCounts) {
    let prefix = format!("/elastix/rdzv/{}/", round.run_id);
    let options = EtcdOptions {
        endpoints: endpoints.split(',').map(str::to_owned).collect(),
        tls: None,
        patience: Duration::from_secs(30),
    };
    let shared = EtcdClient::new(&options).expect("etcd client");
    let settings = settings(&round.run_id, round.nodes);
    let handlers = (0..round.here)
        .map(|_| {
            let client = if shared_client { shared.clone() } else { EtcdClient::new(&options).expect("etcd client") };
            EtcdRendezvous::new(client, settings.clone(), prefix.clone()).expect("handler")
        })
        .collect();
    let before = elastix_etcd::requests_sent();
    let timing = round.run(handlers).await;
    (timing, elastix_etcd::requests_sent() - before)
}
