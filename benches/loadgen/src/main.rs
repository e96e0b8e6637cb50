//! `elastix-loadgen`: a closed-loop load generator for servers that speak torch's TCPStore
//! wire protocol. It encodes its few requests itself (no elastix crate), so it is the same
//! neutral peer for elastix-store and for torch's TCPStore servers.
//!
//! Each of N connections handshakes like torch's client (VALIDATE, then PING in a second
//! write, checking the echo) and then runs a closed loop: one transaction in flight, the next
//! one sent as soon as the previous reply is complete. Transactions cycle through
//! 1. SET(k, v) and GET(k) in one write: SET has no reply, so it travels with the GET that
//!    proves it was applied (v carries a fresh 8-byte stamp every time);
//! 2. ADD(counter, 1), whose reply must be the previous one plus 1;
//! 3. GET of another of the connection's keys, whose reply must be its last written value.
//!
//! Keys are `/bench/<run tag>/<connection>/<0..16>` with 16-64 byte values, so every reply is
//! predictable and checked byte for byte; a wrong or surplus byte aborts the run (exit 1).
//! `ops` counts requests (SET, GET and ADD each count one: 4 per 3 transactions); the
//! latency percentiles are per transaction, from the write to the last byte of its reply.
//!
//! It is built to cost the server's machine as little CPU as possible: each thread is one
//! level-triggered epoll loop over its connections, requests are encoded once at connect
//! time (only the stamp is patched in place), nothing is allocated per request, and
//! latencies go into a fixed-bucket histogram. It reports its own CPU time over the measured
//! window, so a run can show whether the generator or the server was the bottleneck.
//!
//! `--storm` instead starts `--connections` clients at once, as the ranks of a large job do
//! (see [`storm`]), and reports when the slowest one was connected, validated, added and
//! released.

mod conn;
mod histogram;
mod poller;
mod storm;
mod wire;

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;

use conn::Conn;
use histogram::Histogram;
use poller::{empty_events, thread_cpu_seconds, token, Poller};

/// Time for every connection's PING echo to arrive.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser, Debug)]
#[command(name = "elastix-loadgen", about = "Closed-loop SET/GET/ADD load on a TCPStore-protocol server.")]
struct Args {
    /// Server address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Server port.
    #[arg(long)]
    port: u16,
    /// Concurrent connections, each with one transaction in flight.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Seconds of load before measuring starts.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Threads, each an epoll loop over its share of the connections.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
    /// Also report this process's CPU use over the measured window (Linux /proc).
    #[arg(long)]
    server_pid: Option<u32>,
    /// A connect storm of --connections clients instead of a closed loop.
    #[arg(long)]
    storm: bool,
    /// After a storm, keep its connections open this many seconds (its report is out first).
    #[arg(long, default_value_t = 0.0)]
    hold: f64,
    /// Storm clients connect from this many loopback addresses (127.0.0.2 on), as from
    /// as many hosts.
    #[arg(long, default_value_t = 1)]
    sources: usize,
}

/// What one thread measured.
struct Outcome {
    histogram: Histogram,
    ops: u64,
    seconds: f64,
    cpu_seconds: f64,
    /// The server's CPU seconds over this thread's window, when asked for.
    server_cpu_seconds: Option<f64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("elastix-loadgen: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let finite = args.duration.is_finite() && args.warmup.is_finite();
    if args.connections == 0 || !finite || args.duration <= 0.0 || args.warmup < 0.0 {
        return Err("--connections and --duration must be positive, --warmup not negative".into());
    }
    let addr = resolve(&args.host, args.port)?;
    let threads = args.threads.clamp(1, args.connections);
    // A fresh key prefix per run: a server reused across runs still gives predictable replies.
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tag = format!("{:x}", (nanos as u64) ^ u64::from(std::process::id()) << 40);
    raise_open_file_limit();
    if args.storm {
        let (phases, held) = storm::run(addr, &tag, args.connections, threads, args.sources)?;
        report_storm(args, threads, &phases);
        std::thread::sleep(Duration::from_secs_f64(args.hold.max(0.0)));
        drop(held);
        return Ok(());
    }
    let warmup = Duration::from_secs_f64(args.warmup);
    let duration = Duration::from_secs_f64(args.duration);
    let ready = Arc::new(Barrier::new(threads));

    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let ids: Vec<usize> = (t..args.connections).step_by(threads).collect();
            let (tag, ready) = (tag.clone(), ready.clone());
            let server_pid = if t == 0 { args.server_pid } else { None };
            std::thread::spawn(move || {
                let result = drive(addr, &tag, &ids, &ready, warmup, duration, server_pid);
                if let Err(err) = &result {
                    // Abort at once rather than let the other threads run on.
                    eprintln!("elastix-loadgen: {err}");
                    std::process::exit(1);
                }
                result
            })
        })
        .collect();

    let mut total =
        Outcome { histogram: Histogram::new(), ops: 0, seconds: 0.0, cpu_seconds: 0.0, server_cpu_seconds: None };
    for worker in workers {
        let outcome = worker.join().map_err(|_| "a worker thread panicked".to_string())??;
        total.histogram.merge(&outcome.histogram);
        total.ops += outcome.ops;
        total.seconds = total.seconds.max(outcome.seconds);
        total.cpu_seconds += outcome.cpu_seconds;
        total.server_cpu_seconds = total.server_cpu_seconds.or(outcome.server_cpu_seconds);
    }
    report(args, threads, &total);
    Ok(())
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}:{port}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} has no address"))
}

/// One thread: connect its connections, load them through warm-up and the measured window,
/// then let every in-flight transaction finish (and be checked) before closing.
fn drive(
    addr: SocketAddr,
    tag: &str,
    ids: &[usize],
    ready: &Barrier,
    warmup: Duration,
    duration: Duration,
    server_pid: Option<u32>,
) -> Result<Outcome, String> {
    let mut conns = ids.iter().map(|&id| Conn::open(addr, tag, id)).collect::<Result<Vec<_>, _>>()?;
    let handshake_deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    for conn in &mut conns {
        let left = handshake_deadline.saturating_duration_since(Instant::now());
        conn.finish_handshake(left.max(Duration::from_millis(1)))?;
    }
    let poller = Poller::new().map_err(|e| format!("epoll: {e}"))?;
    for (index, conn) in conns.iter().enumerate() {
        poller.add(conn.fd(), index).map_err(|e| format!("epoll_ctl: {e}"))?;
    }
    let mut sent_at = vec![Instant::now(); conns.len()];
    let mut events = empty_events(conns.len().min(1024));
    let mut histogram = Histogram::new();
    let mut ops = 0u64;

    ready.wait(); // every thread connected: start the load together
    let measure_from = Instant::now() + warmup;
    let measure_until = measure_from + duration;
    let mut window: Option<(Instant, f64, Option<f64>)> = None;
    for (conn, sent) in conns.iter_mut().zip(&mut sent_at) {
        *sent = Instant::now();
        conn.send_next()?;
    }
    let ended = loop {
        let ready_count = poller.wait(&mut events, 50).map_err(|e| format!("epoll_wait: {e}"))?;
        let now = Instant::now();
        if window.is_none() && now >= measure_from {
            window = Some((now, thread_cpu_seconds(), server_pid.and_then(process_cpu_seconds)));
        }
        if now >= measure_until {
            break now;
        }
        for event in &events[..ready_count] {
            let index = token(event);
            let conn = &mut conns[index];
            if let Some(count) = conn.on_readable()? {
                let done = Instant::now(); // also the next transaction's start: one clock read
                if window.is_some() {
                    histogram.record((done - sent_at[index]).as_nanos() as u64);
                    ops += u64::from(count);
                }
                sent_at[index] = done;
                conn.send_next()?;
            }
        }
    };
    let server_cpu_end = server_pid.and_then(process_cpu_seconds);
    let (started, cpu_start, server_cpu_start) =
        window.unwrap_or((measure_until, thread_cpu_seconds(), server_cpu_end));
    let seconds = (ended - started).as_secs_f64();
    let cpu_seconds = thread_cpu_seconds() - cpu_start;
    let server_cpu_seconds = server_cpu_end.zip(server_cpu_start).map(|(end, start)| end - start);
    drain(&poller, &mut conns, &mut events)?;
    Ok(Outcome { histogram, ops, seconds, cpu_seconds, server_cpu_seconds })
}

/// Waits for the replies still in flight (checking them) so no connection closes mid-request.
fn drain(poller: &Poller, conns: &mut [Conn], events: &mut [poller::Event]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut busy = conns.iter().filter(|c| !c.is_idle()).count();
    while busy > 0 {
        if Instant::now() >= deadline {
            return Err(format!("{busy} replies still missing 10 s after the run ended"));
        }
        let ready_count = poller.wait(events, 100).map_err(|e| format!("epoll_wait: {e}"))?;
        for event in &events[..ready_count] {
            if conns[token(event)].on_readable()?.is_some() {
                busy -= 1;
            }
        }
    }
    Ok(())
}

fn report(args: &Args, threads: usize, total: &Outcome) {
    let h = &total.histogram;
    let us = |q: f64| h.quantile(q) as f64 / 1000.0;
    let ops_per_s = total.ops as f64 / total.seconds;
    let cpu_pct = 100.0 * total.cpu_seconds / total.seconds;
    let server_pct = total.server_cpu_seconds.map(|s| 100.0 * s / total.seconds);
    if args.json {
        let server = server_pct.map_or(String::new(), |p| format!(", \"server_cpu_pct\": {p:.1}"));
        println!(
            "{{\"connections\": {}, \"threads\": {threads}, \"ops\": {}, \"transactions\": {}, \
             \"seconds\": {:.3}, \"ops_per_s\": {:.1}, \"p50_us\": {:.1}, \"p99_us\": {:.1}, \
             \"p999_us\": {:.1}, \"loadgen_cpu_pct\": {:.1}{server}}}",
            args.connections,
            total.ops,
            h.count(),
            total.seconds,
            ops_per_s,
            us(0.5),
            us(0.99),
            us(0.999),
            cpu_pct
        );
    } else {
        let server = server_pct.map_or(String::new(), |p| format!(", server {p:.0}%"));
        println!(
            "{} connections: {} ops in {:.2} s = {:.0} ops/s; per transaction p50 {:.1} us, \
             p99 {:.1} us, p99.9 {:.1} us; CPU (% of one core): loadgen {:.0}%{server}",
            args.connections,
            total.ops,
            total.seconds,
            ops_per_s,
            us(0.5),
            us(0.99),
            us(0.999),
            cpu_pct
        );
    }
}

fn report_storm(args: &Args, threads: usize, phases: &storm::Phases) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let (c, v, a, r) = (ms(phases.connected), ms(phases.validated), ms(phases.added), ms(phases.released));
    if args.json {
        println!(
            "{{\"clients\": {}, \"threads\": {threads}, \"connected_ms\": {c:.1}, \"validated_ms\": {v:.1}, \
             \"added_ms\": {a:.1}, \"released_ms\": {r:.1}}}",
            args.connections
        );
    } else {
        println!(
            "{} clients: all connected at {c:.1} ms, validated at {v:.1} ms, added at {a:.1} ms, released at {r:.1} ms",
            args.connections
        );
    }
}

/// Raises the soft open-file limit to the hard one: a storm holds one descriptor per client.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct passed, valid for the calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// User + system CPU seconds of process `pid` so far (fields 14-15 of /proc/PID/stat).
fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces; the fixed fields start after its closing ')'.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let ticks: u64 = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks as f64 / per_second as f64)
}
