//! Store requests, counted where they are served (every store server of the process: the
//! standalone one, or those an agent hosts) and where an agent sends them (its rendezvous
//! traffic). Counted only while a metrics endpoint runs ([`super::enabled`]): the server's
//! request path is the hottest code in elastix.
//!
//! A WAIT is counted but not timed: it blocks for as long as its keys take by design.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::REQUEST_BUCKETS;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    pub op: &'static str,
}

/// Operations a server may count with a resolved slot each (the store's opcodes are 0-18).
pub const OP_SLOTS: usize = 32;

fn latency_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// One series per operation, made on its first use.
struct PerOp {
    requests: Family<Op, Counter>,
    durations: Family<Op, Histogram, fn() -> Histogram>,
}

impl PerOp {
    fn new() -> PerOp {
        PerOp { requests: Family::default(), durations: Family::new_with_constructor(latency_histogram) }
    }

    fn record(&self, op: &'static str, took: Option<Duration>) {
        let label = Op { op };
        self.requests.get_or_create(&label).inc();
        if let Some(took) = took {
            self.durations.get_or_create(&label).observe(took.as_secs_f64());
        }
    }
}

pub struct ServerMetrics {
    /// Handles per operation slot, resolved once so that a request costs no map lookup.
    by_slot: [OnceLock<(Counter, Histogram)>; OP_SLOTS],
    per_op: PerOp,
    connections: Gauge,
    accepted: Counter,
}

pub fn server() -> &'static ServerMetrics {
    static METRICS: OnceLock<ServerMetrics> = OnceLock::new();
    METRICS.get_or_init(|| ServerMetrics {
        by_slot: std::array::from_fn(|_| OnceLock::new()),
        per_op: PerOp::new(),
        connections: Gauge::default(),
        accepted: Counter::default(),
    })
}

impl ServerMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        let store = registry.sub_registry_with_prefix("store");
        store.register("requests", "Requests served, by operation", self.per_op.requests.clone());
        store.register_with_unit(
            "request_duration",
            "Time to execute a request on the server (WAIT: not timed)",
            Unit::Seconds,
            self.per_op.durations.clone(),
        );
        store.register("connections", "Client connections open now", self.connections.clone());
        store.register("accepted_connections", "Client connections accepted", self.accepted.clone());
    }

    /// A request for operation `op` (counted in `slot`, below [`OP_SLOTS`]: one slot per
    /// operation, always the same), executed in `took` (`None`: not timed, as a WAIT).
    pub fn request(&self, slot: usize, op: &'static str, took: Option<Duration>) {
        let Some(handles) = self.by_slot.get(slot) else { return self.per_op.record(op, took) };
        let (requests, durations) = handles.get_or_init(|| {
            let label = Op { op };
            (self.per_op.requests.get_or_create_owned(&label), self.per_op.durations.get_or_create_owned(&label))
        });
        requests.inc();
        if let Some(took) = took {
            durations.observe(took.as_secs_f64());
        }
    }

    pub fn connection_opened(&self) {
        self.accepted.inc();
        self.connections.inc();
    }

    pub fn connection_closed(&self) {
        self.connections.dec();
    }
}

/// What an agent's own store requests cost (its rendezvous: rounds, heartbeats, events).
pub struct ClientMetrics {
    per_op: PerOp,
    errors: Family<Op, Counter>,
}

pub fn client() -> &'static ClientMetrics {
    static METRICS: OnceLock<ClientMetrics> = OnceLock::new();
    METRICS.get_or_init(|| ClientMetrics { per_op: PerOp::new(), errors: Family::default() })
}

impl ClientMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        let agent = registry.sub_registry_with_prefix("agent");
        agent.register(
            "store_requests",
            "Requests this agent sent to the rendezvous store, by operation",
            self.per_op.requests.clone(),
        );
        agent.register_with_unit(
            "store_request_duration",
            "Round-trip time of this agent's rendezvous store requests (WAIT: not timed)",
            Unit::Seconds,
            self.per_op.durations.clone(),
        );
        agent.register(
            "store_request_errors",
            "This agent's rendezvous store requests that failed, by operation",
            self.errors.clone(),
        );
    }

    /// Runs `request` (operation `op`), counting and timing it while metrics are on; errors
    /// `failed` accepts are counted as failures (a wait that timed out is an answer).
    pub async fn timed<T, E>(
        &self,
        op: &'static str,
        request: impl std::future::Future<Output = Result<T, E>>,
        failed: impl FnOnce(&E) -> bool,
    ) -> Result<T, E> {
        if !super::enabled() {
            return request.await;
        }
        let started = Instant::now();
        let result = request.await;
        self.per_op.record(op, (op != "wait").then(|| started.elapsed()));
        if result.as_ref().err().is_some_and(failed) {
            self.errors.get_or_create(&Op { op }).inc();
        }
        result
    }
}
