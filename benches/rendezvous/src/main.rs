//! `elastix-rdzv-bench --nodes N`: N rendezvous handlers (simulated nodes), each with its own
//! store connections, join one round against one store; prints how long until every node
//! has its rank, as JSON. The store is an elastix server in this process (own runtime) unless
//! `--endpoint host:port` names another one (a torch TCPStore, say).

use std::time::{Duration, Instant};

use clap::Parser;
use elastix_core::rendezvous::keys::run_prefix;
use elastix_core::rendezvous::store::TcpRendezvousStore;
use elastix_core::rendezvous::{DynamicRendezvous, RendezvousSettings};
use elastix_core::store::{BackgroundServer, ConnectOptions, ServerConfig};

#[derive(Parser)]
struct Args {
    /// Simulated nodes (min_nodes = max_nodes = N).
    #[arg(long)]
    nodes: u32,
    /// Use this store instead of an in-process elastix server.
    #[arg(long)]
    endpoint: Option<String>,
    /// Worker threads of the nodes' runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn main() {
    let args = Args::parse();
    let server = match args.endpoint {
        None => Some(BackgroundServer::start(&ServerConfig::default(), 1).expect("start the store")),
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
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build().expect("runtime");
    let run_id = format!("bench-{}-{}", args.nodes, std::process::id());
    let seconds = runtime.block_on(async {
        let mut settings = RendezvousSettings::new(&run_id, args.nodes, args.nodes).expect("settings");
        settings.join_timeout = Duration::from_secs(300);
        settings.local_addr = Some("127.0.0.1".to_owned());
        let prefix = run_prefix(&run_id);
        let start = Instant::now();
        let tasks: Vec<_> = (0..args.nodes)
            .map(|_| {
                let options = ConnectOptions::new(host.clone(), port, Some(Duration::from_secs(60)));
                let store = TcpRendezvousStore::new(options, prefix.clone(), Duration::from_secs(60));
                let mut node = DynamicRendezvous::new(store, settings.clone(), prefix.clone()).expect("handler");
                tokio::spawn(async move {
                    let info = node.next_rendezvous().await.expect("rendezvous");
                    (node, info)
                })
            })
            .collect();
        let mut nodes = Vec::with_capacity(tasks.len());
        for task in tasks {
            nodes.push(task.await.expect("node task"));
        }
        let elapsed = start.elapsed().as_secs_f64();
        let mut ranks: Vec<u32> = nodes.iter().map(|(_, info)| info.rank).collect();
        ranks.sort();
        assert_eq!(ranks, (0..args.nodes).collect::<Vec<_>>(), "every node has a distinct rank");
        for (node, _) in &mut nodes {
            node.shutdown();
        }
        elapsed
    });
    println!(r#"{{"nodes": {}, "seconds": {seconds:.4}}}"#, args.nodes);
}
