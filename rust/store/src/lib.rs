//! `elastix-store`: a standalone store server that torch's TCPStore clients, elastix clients
//! and elastix agents can share. The command line lives in the library so that the Python
//! package can install the same program as a console script.

use std::ffi::OsString;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Parser;
use elastix_core::auth::{PlainClients, Secret, SecretError};
use elastix_core::metrics::{Exposes, MetricsServer};
use elastix_core::store::server::Io;
use elastix_core::store::{AnyServer, Limits, ServerConfig};

/// How long connections get to close after a stop signal before the process exits anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

#[derive(Parser, Debug)]
#[command(
    name = "elastix-store",
    version,
    about = "Serve a key-value store that speaks torch's TCPStore protocol.",
    long_about = "Serve a key-value store that speaks torch's TCPStore wire protocol, for \
                  `elastix run --rdzv-endpoint HOST:PORT` and torch.distributed.TCPStore clients. \
                  Prints the bound address on its first line of output; stops cleanly on \
                  SIGTERM or SIGINT."
)]
pub struct Args {
    /// Address to listen on (default: every IPv6 and IPv4 address).
    #[arg(long, env = "ELASTIX_STORE_HOST")]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free port (printed on start).
    #[arg(long, default_value_t = 29400, env = "ELASTIX_STORE_PORT")]
    pub port: u16,
    /// Log level: error, warn, info, debug, trace, or a tracing directive (RUST_LOG, when set,
    /// takes precedence).
    #[arg(long, default_value = "info", env = "ELASTIX_STORE_LOG_LEVEL")]
    pub log_level: String,
    /// Connections served at once; more clients are refused (closed at once, with a warning
    /// at most every 10 s). Default: what the open-file limit allows (raised to its hard
    /// limit at start), less 64, at most 65536.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Close a connection that sent nothing for this long while holding no wait (e.g. 10m;
    /// off by default: torch's clients stay connected and idle for hours).
    #[arg(long, value_parser = parse_duration)]
    pub idle_timeout: Option<std::time::Duration>,
    /// Longest key accepted, in bytes.
    #[arg(long, default_value_t = Limits::DEFAULT_MAX_KEY_LEN)]
    pub max_key_bytes: usize,
    /// Longest value accepted, in bytes.
    #[arg(long, default_value_t = Limits::DEFAULT_MAX_VALUE_LEN)]
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET request.
    #[arg(long, default_value_t = Limits::DEFAULT_MAX_KEYS_PER_REQUEST)]
    pub max_keys_per_request: usize,
    /// Threads serving connections. One is fastest on small machines (all data sits behind
    /// one lock, and the work is mostly the kernel's TCP); more help where many cores serve
    /// thousands of clients.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// How the server waits for its clients: io_uring (one thread; every client's receives
    /// and sends handed to the kernel together, one system call per turn), epoll (tokio), or
    /// auto: io_uring where the kernel lets this process use it (Linux 6.0 or later, not
    /// disabled by kernel.io_uring_disabled or a seccomp filter) and the job has no secret and
    /// one thread, epoll otherwise (said at start).
    #[arg(
        long,
        default_value_t = Io::Auto,
        env = Io::ENV,
        value_parser = PossibleValuesParser::new(Io::NAMES).try_map(|name| name.parse::<Io>())
    )]
    pub io: Io,
    /// A file holding the job secret (only its owner may read it): every client must prove
    /// it before any request. torch's clients cannot, so they are refused. Default: the file
    /// ELASTIX_AUTH_TOKEN_FILE names, if set.
    #[arg(long)]
    pub auth_token_file: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics (request counts and latencies by operation, connections) over
    /// HTTP on this port, at /metrics, on --host's address (default: every IPv4 address; 0
    /// picks a free port, printed on start). Off by default.
    #[arg(long, env = "ELASTIX_STORE_METRICS_PORT")]
    pub metrics_port: Option<u16>,
}

impl Args {
    /// The server `--io` asks for, given the threads (io_uring's is one) and what
    /// [`Io::why_not_uring`] weighs (the job secret, the kernel). An error (a usage error)
    /// where the arguments rule `--io uring` out; a kernel without io_uring fails it as it
    /// starts.
    fn io(&self, config: &ServerConfig) -> Result<Io, String> {
        let (many_threads, secret) = (self.threads > 1, config.auth.is_some());
        let epoll_because = match many_threads {
            true => Some("--threads asks for more than one thread".to_owned()),
            false => Io::why_not_uring(config),
        };
        match (self.io, epoll_because) {
            (Io::Uring, Some(reason)) if many_threads || secret => Err(format!("--io uring: {reason}")),
            (Io::Auto, Some(reason)) => {
                tracing::info!("serving on epoll: {reason}");
                Ok(Io::Epoll)
            }
            (Io::Auto, None) => Ok(Io::Uring),
            (io, _) => Ok(io),
        }
    }

    fn server_config(&self, secret: Option<Secret>) -> ServerConfig {
        ServerConfig {
            host: self.host.clone(),
            port: self.port,
            listen_fd: None,
            limits: Limits {
                max_key_len: self.max_key_bytes,
                max_value_len: self.max_value_bytes,
                max_keys_per_request: self.max_keys_per_request,
            },
            max_connections: self.max_connections.unwrap_or_else(ServerConfig::default_max_connections),
            idle_timeout: self.idle_timeout,
            auth: secret.map(|secret| (secret, PlainClients::Refuse)),
        }
    }

    /// The job secret: `--auth-token-file`, else the environment's.
    fn secret(&self) -> Result<Option<Secret>, SecretError> {
        match &self.auth_token_file {
            Some(path) => Secret::from_file(path).map(Some),
            None => Secret::from_env(),
        }
    }
}

/// Parses `args` (program name first) and serves until SIGTERM or SIGINT. Returns the exit
/// code: 0 after a clean stop (or `--help`), 1 if serving failed, 2 for a usage error.
pub fn main_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = match Args::try_parse_from(args) {
        Ok(args) => args,
        Err(err) => {
            let _ = err.print();
            return if err.use_stderr() { 2 } else { 0 };
        }
    };
    // Fails only for a bad level; an embedding process's own subscriber is kept.
    if let Err(err) = elastix_core::logging::init_stderr(&args.log_level) {
        eprintln!("elastix-store: --log-level: {err}");
        return 2;
    }
    // every client is a descriptor: take all the kernel allows before sizing the cap on it
    if let Err(err) = elastix_core::store::server::listener::raise_open_file_limit() {
        tracing::warn!("cannot raise the open-file limit: {err}; serving within the current one");
    }
    let secret = match args.secret() {
        Ok(secret) => secret,
        Err(err) => {
            eprintln!("elastix-store: {err}");
            return 2;
        }
    };
    let config = args.server_config(secret);
    let io = match args.io(&config) {
        Ok(io) => io,
        Err(err) => {
            eprintln!("elastix-store: {err}");
            return 2;
        }
    };
    match serve(&args, io, &config) {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("elastix-store: {err}");
            1
        }
    }
}

fn serve(args: &Args, io: Io, config: &ServerConfig) -> std::io::Result<()> {
    let mut runtime = match args.threads {
        0 | 1 => tokio::runtime::Builder::new_current_thread(),
        threads => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
    };
    let runtime = runtime.thread_name("elastix-store").enable_all().build()?;
    runtime.block_on(async {
        // Handlers first: a signal right after the address is printed must not kill us.
        let stop = StopSignals::install()?;
        let server = AnyServer::start_on(io, config)?;
        // after the store, so that its first line of output stays the store's address
        let metrics = match args.metrics_port {
            Some(port) => Some(MetricsServer::start(args.host.as_deref(), port, Exposes::Store)?),
            None => None,
        };
        println!("elastix-store listening on {}", server.local_addr());
        if let Some(metrics) = &metrics {
            println!("elastix-store metrics on http://{}/metrics", metrics.local_addr());
        }
        if config.auth.is_none() && !server.local_addr().ip().is_loopback() {
            tracing::warn!(
                "no job secret: anyone who can reach port {} of this host can read and change the jobs' \
                 rendezvous; give --auth-token-file (a file only you can read; the agents take the same file \
                 as ELASTIX_AUTH_TOKEN_FILE)",
                server.local_addr().port()
            );
        }
        use std::io::Write;
        std::io::stdout().flush()?;
        let signal = stop.recv().await;
        tracing::info!("received {signal}, shutting down");
        if tokio::time::timeout(SHUTDOWN_GRACE, server.shutdown()).await.is_err() {
            tracing::warn!("connections still open after {SHUTDOWN_GRACE:?}; exiting anyway");
        }
        elastix_core::logging::flush(SHUTDOWN_GRACE).await;
        Ok(())
    })
}

struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> std::io::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals { terminate: signal(SignalKind::terminate())?, interrupt: signal(SignalKind::interrupt())? })
    }

    async fn recv(mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// A positive duration with a unit, as the rendezvous takes them (`90`, `30s`, `10m`).
fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    match elastix_core::rendezvous::config::conf::parse_duration(text)? {
        duration if duration.is_zero() => Err("must be positive".into()),
        duration => Ok(duration),
    }
}
