//! Prometheus metrics of this process, served over HTTP on request (`--metrics-port`; off by
//! default).
//!
//! * [`agent`]: what an agent counts (rounds, re-forms, restarts, worker exits, heartbeats).
//! * [`store`]: store requests, on the server side and on the agent's client side.
//! * [`http`]: the tiny responder for `GET /metrics`.
//!
//! The metrics are process-wide statics, always there: rare events (a round, a restart) are
//! counted whether or not anyone scrapes. Per-request counting on the store's hot path is done
//! only once a metrics endpoint was started ([`enabled`]), so a store without one pays nothing.
//! Labels are low-cardinality by construction: an opcode, a reason, an exit code or signal,
//! a local rank; never a key, a host or a run ID.

pub mod agent;
mod http;
pub mod store;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;

pub use http::MetricsServer;

/// The text format served (Prometheus 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Latency buckets of store requests, in seconds: 50 us to 5 s.
const REQUEST_BUCKETS: [f64; 14] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0];

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether a metrics endpoint runs in this process: hot paths measure only then.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// What a process exposes: an agent shows its own families and those of the stores it
/// hosts; a standalone store only the store's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposes {
    Agent,
    Store,
}

fn registry(exposes: Exposes) -> &'static Registry {
    static AGENT: OnceLock<Registry> = OnceLock::new();
    static STORE: OnceLock<Registry> = OnceLock::new();
    let build = || {
        let mut registry = Registry::with_prefix("elastix");
        if exposes == Exposes::Agent {
            agent::get().register(&mut registry);
            store::client().register(&mut registry);
        }
        store::server().register(&mut registry);
        registry
    };
    match exposes {
        Exposes::Agent => AGENT.get_or_init(build),
        Exposes::Store => STORE.get_or_init(build),
    }
}

/// The text exposition of every metric `exposes` names, values as of now.
pub fn render(exposes: Exposes) -> String {
    if exposes == Exposes::Agent {
        agent::get().refresh();
    }
    let mut text = String::with_capacity(16 * 1024);
    // writing to a String cannot fail
    let _ = prometheus_text::encode(&mut text, registry(exposes));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_exposition_names_only_store_families() {
        let text = render(Exposes::Store);
        assert!(text.contains("# TYPE elastix_store_connections gauge"), "{text}");
        assert!(!text.contains("elastix_agent_"), "{text}");
        let text = render(Exposes::Agent);
        // families with labels appear with their first series, except re-form reasons (all known)
        for family in
            ["elastix_agent_rounds_total", "elastix_agent_reforms_total", "elastix_store_accepted_connections_total"]
        {
            assert!(text.contains(&format!("# TYPE {family} counter")), "{family}: {text}");
        }
    }
}
