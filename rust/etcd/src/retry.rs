//! Which failed requests are worth retrying, and how long to wait before each retry.

use std::time::Duration;

use tonic::{Code, Status};

/// A failure that passes, by what it will take to pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Passing {
    /// A member down or unreachable, an election under way, a timeout: over within a few
    /// hundred milliseconds, or another member answers.
    Outage,
    /// A member shedding load ("too many requests"): its applying lags its commits by
    /// thousands of entries, as when 10,000 nodes join one round at once, and it refuses
    /// every write until it has caught up, which takes seconds.
    Shedding,
}

/// Whether `status` passes, and how; `None` for a refusal that retrying would not change.
pub(crate) fn passing(status: &Status) -> Option<Passing> {
    let message = status.message();
    let shedding = message.contains("too many requests");
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Cancelled => Some(Passing::Outage),
        // etcd reports its load with either code
        Code::ResourceExhausted | Code::Unknown if shedding => Some(Passing::Shedding),
        // the connection was closed under load ("enhance your calm": HTTP/2's own limits, as
        // on thousands of requests multiplexed on one connection); the next try opens another
        Code::ResourceExhausted if message.contains("h2 protocol error") => Some(Passing::Outage),
        // and a lost leader or a slow commit this way
        Code::Unknown if ["leader", "timed out", "transport"].iter().any(|word| message.contains(word)) => {
            Some(Passing::Outage)
        }
        _ => None,
    }
}

/// The waits between the tries of one request.
///
/// After an outage the request is retried soon, then every half second. A member shedding
/// load is left alone longer (from 100 ms up to 2 s), and each wait is drawn from the upper
/// half of its span: the nodes it refused together come back spread out rather than
/// together, and do not add to the load it sheds (10,000 nodes joining one round each sent
/// 8.2 to 11.2 requests when they retried it as an outage, 7.5 to 7.7 now; 5 unrefused).
pub(crate) struct Delays {
    outage: Duration,
    shedding: Duration,
    rng: fastrand::Rng,
}

const OUTAGE_FIRST: Duration = Duration::from_millis(20);
const OUTAGE_MOST: Duration = Duration::from_millis(500);
const SHEDDING_FIRST: Duration = Duration::from_millis(100);
const SHEDDING_MOST: Duration = Duration::from_secs(2);

impl Delays {
    pub(crate) fn new() -> Delays {
        Delays { outage: OUTAGE_FIRST, shedding: SHEDDING_FIRST, rng: fastrand::Rng::new() }
    }

    /// The wait before the next try, after a failure of kind `why`.
    pub(crate) fn next(&mut self, why: Passing) -> Duration {
        match why {
            Passing::Outage => {
                let delay = self.outage;
                self.outage = (delay * 2).min(OUTAGE_MOST);
                delay
            }
            Passing::Shedding => {
                let span = self.shedding;
                self.shedding = (span * 2).min(SHEDDING_MOST);
                span.mul_f64(0.5 + 0.5 * self.rng.f64())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overloaded_member_is_retried_but_a_request_too_large_is_not() {
        assert_eq!(passing(&Status::unknown("etcdserver: too many requests")), Some(Passing::Shedding));
        assert_eq!(passing(&Status::resource_exhausted("etcdserver: too many requests")), Some(Passing::Shedding));
        assert_eq!(passing(&Status::resource_exhausted("grpc: received message larger than max")), None);
        assert_eq!(passing(&Status::invalid_argument("etcdserver: too many operations in txn request")), None);
    }

    #[test]
    fn a_lost_leader_or_member_is_an_outage() {
        assert_eq!(passing(&Status::unavailable("connection refused")), Some(Passing::Outage));
        assert_eq!(passing(&Status::unknown("etcdserver: leader changed")), Some(Passing::Outage));
        assert_eq!(passing(&Status::unknown("etcdserver: request timed out")), Some(Passing::Outage));
        assert_eq!(passing(&Status::unknown("something else")), None);
        // tonic's words for a connection that HTTP/2 closed with ENHANCE_YOUR_CALM
        assert_eq!(passing(&Status::resource_exhausted("h2 protocol error: http2 error")), Some(Passing::Outage));
    }

    #[test]
    fn outages_are_retried_soon_then_every_half_second() {
        let mut delays = Delays::new();
        let waits: Vec<u64> = (0..7).map(|_| delays.next(Passing::Outage).as_millis() as u64).collect();
        assert_eq!(waits, [20, 40, 80, 160, 320, 500, 500]);
    }

    #[test]
    fn shedding_waits_grow_to_two_seconds_in_the_upper_half_of_each_span() {
        let mut delays = Delays::new();
        for span in [100, 200, 400, 800, 1600, 2000, 2000] {
            let wait = delays.next(Passing::Shedding).as_secs_f64() * 1000.0;
            assert!(wait >= span as f64 / 2.0 - 1e-6 && wait <= span as f64 + 1e-6, "{wait} ms for a span of {span}");
        }
    }

    #[test]
    fn nodes_refused_together_come_back_apart() {
        let waits: std::collections::HashSet<Duration> =
            (0..16).map(|_| Delays::new().next(Passing::Shedding)).collect();
        assert!(waits.len() > 8, "{waits:?}");
    }
}
