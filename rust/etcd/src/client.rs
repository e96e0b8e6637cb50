//! Connecting to an etcd cluster and its unary requests.
//!
//! Requests go to one member at a time (each member's channel reconnects on its own); one that
//! fails for a reason that passes (no leader during an election, a member that went away)
//! moves the client to the next member and is retried with backoff until the client's patience
//! runs out, then reported with the endpoints it was sent to. (A balancing channel would keep
//! sending a share of the requests to a dead member, each one failing to connect.)

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::Status;

use crate::pb::etcdserverpb::kv_client::KvClient;
use crate::pb::etcdserverpb::{
    request_op, DeleteRangeRequest, PutRequest, PutResponse, RangeRequest, RangeResponse, RequestOp, TxnRequest,
    TxnResponse,
};
use crate::retry::{passing, Delays, Passing};

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered (or every answer was a passing failure) within the patience.
    #[error("etcd at {endpoints} did not answer within {patience:?}: {detail}")]
    Unavailable { endpoints: String, patience: Duration, detail: String },
    /// etcd refused the request.
    #[error("etcd at {endpoints} refused a request: {status}")]
    Refused { endpoints: String, status: String },
    /// The options are unusable (a bad endpoint, an unreadable TLS file).
    #[error("{0}")]
    Config(String),
}

impl EtcdError {
    /// etcd does not know the lease a request named (it expired, or was revoked).
    pub fn is_lease_not_found(&self) -> bool {
        matches!(self, EtcdError::Refused { status, .. } if status.contains("requested lease not found"))
    }
}

/// PEM contents for TLS: the CA that signed the servers, and this client's certificate and key.
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    pub ca: Option<Vec<u8>>,
    pub cert_and_key: Option<(Vec<u8>, Vec<u8>)>,
}

#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// `host:port` of each member.
    pub endpoints: Vec<String>,
    /// `Some` for https.
    pub tls: Option<TlsFiles>,
    /// How long one request may keep failing (retried) before it is reported.
    pub patience: Duration,
}

#[derive(Clone)]
pub struct EtcdClient {
    /// One channel per member, in the order given.
    members: Arc<[Channel]>,
    /// The member requests go to; moved on when it fails.
    current: Arc<AtomicUsize>,
    endpoints: Arc<str>,
    patience: Duration,
}

/// Requests sent by every client of this process (unary attempts, lease renewals and watches
/// opened), for benchmarks that report the cost of a rendezvous in etcd requests; and of
/// those, the attempts etcd shed ("too many requests") and the lease renewals.
static REQUESTS: AtomicU64 = AtomicU64::new(0);
static SHED: AtomicU64 = AtomicU64::new(0);
static RENEWALS: AtomicU64 = AtomicU64::new(0);

/// What every client of this process has sent so far (see [`requests_sent`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub sent: u64,
    /// Attempts etcd refused for being too busy (each retried).
    pub shed: u64,
    /// Lease renewals (a node's liveness, every third of its lease's TTL).
    pub renewals: u64,
}

impl std::ops::Sub for RequestCounts {
    type Output = RequestCounts;

    fn sub(self, earlier: RequestCounts) -> RequestCounts {
        RequestCounts {
            sent: self.sent - earlier.sent,
            shed: self.shed - earlier.shed,
            renewals: self.renewals - earlier.renewals,
        }
    }
}

pub fn requests_sent() -> RequestCounts {
    RequestCounts {
        sent: REQUESTS.load(Ordering::Relaxed),
        shed: SHED.load(Ordering::Relaxed),
        renewals: RENEWALS.load(Ordering::Relaxed),
    }
}

pub(crate) fn count_request() {
    REQUESTS.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn count_renewal() {
    RENEWALS.fetch_add(1, Ordering::Relaxed);
    count_request();
}

/// etcd refuses transactions of more operations than this (its `--max-txn-ops` default):
/// batches of reads or writes are split.
pub const MAX_TXN_OPS: usize = 128;

/// Bound on one attempt of a unary request.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl EtcdClient {
    /// A client for the cluster; connections open on first use.
    pub fn new(options: &EtcdOptions) -> Result<EtcdClient, EtcdError> {
        if options.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoint given".into()));
        }
        let scheme = if options.tls.is_some() { "https" } else { "http" };
        let tls = options.tls.as_ref().map(tls_config);
        let mut endpoints = Vec::new();
        for endpoint in &options.endpoints {
            let uri = format!("{scheme}://{endpoint}");
            let mut built = Endpoint::from_shared(uri.clone())
                .map_err(|err| EtcdError::Config(format!("etcd endpoint {endpoint:?}: {err}")))?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_keepalive(Some(Duration::from_secs(10)))
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5));
            if let Some(tls) = &tls {
                built = built
                    .tls_config(tls.clone())
                    .map_err(|err| EtcdError::Config(format!("etcd endpoint {endpoint:?}: TLS: {err}")))?;
            }
            endpoints.push(built);
        }
        // a client started at once by every node should not all pick the same member first
        let first = std::process::id() as usize % endpoints.len();
        Ok(EtcdClient {
            members: endpoints.into_iter().map(|endpoint| endpoint.connect_lazy()).collect(),
            current: Arc::new(AtomicUsize::new(first)),
            endpoints: options.endpoints.join(",").into(),
            patience: options.patience,
        })
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// Member `index` failed a request: the next one gets the following requests (unless
    /// another request moved on already).
    pub(crate) fn failed(&self, index: usize) {
        let next = (index + 1) % self.members.len();
        let _ = self.current.compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub(crate) fn patience(&self) -> Duration {
        self.patience
    }

    /// The member to ask now, and its number (for [`Self::failed`]).
    pub(crate) fn member(&self) -> (usize, Channel) {
        let index = self.current.load(Ordering::Relaxed) % self.members.len();
        (index, self.members[index].clone())
    }

    /// The value of `key` (if any) and the store's revision at the time of reading.
    pub async fn get(&self, key: &[u8]) -> Result<(Option<Vec<u8>>, i64), EtcdError> {
        let response = self.range(RangeRequest { key: key.to_vec(), ..Default::default() }).await?;
        let revision = response.header.map_or(0, |header| header.revision);
        Ok((response.kvs.into_iter().next().map(|kv| kv.value), revision))
    }

    /// Writes `key` once more and returns how many times it has been written since it was
    /// created (its version): a counter that needs no read-modify-write.
    pub async fn put_counted(&self, key: &[u8]) -> Result<i64, EtcdError> {
        let response = self.put_request(PutRequest { key: key.to_vec(), prev_kv: true, ..Default::default() }).await?;
        Ok(response.prev_kv.map_or(0, |previous| previous.version) + 1)
    }

    /// How many times `key` has been written since it was created (0 if it does not exist).
    pub async fn version(&self, key: &[u8]) -> Result<i64, EtcdError> {
        let response = self.range(RangeRequest { key: key.to_vec(), keys_only: true, ..Default::default() }).await?;
        Ok(response.kvs.first().map_or(0, |kv| kv.version))
    }

    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), EtcdError> {
        self.put_request(PutRequest { key: key.to_vec(), value: value.to_vec(), ..Default::default() }).await?;
        Ok(())
    }

    /// Deletes `key`; whether it existed.
    pub async fn delete(&self, key: &[u8]) -> Result<bool, EtcdError> {
        let request = DeleteRangeRequest { key: key.to_vec(), ..Default::default() };
        let response = self
            .retry(|channel| {
                let request = request.clone();
                async move { KvClient::new(channel).delete_range(request).await }
            })
            .await?;
        Ok(response.deleted > 0)
    }

    pub async fn txn(&self, request: TxnRequest) -> Result<TxnResponse, EtcdError> {
        self.retry(|channel| {
            let request = request.clone();
            async move { KvClient::new(channel).txn(request).await }
        })
        .await
    }

    pub async fn range(&self, request: RangeRequest) -> Result<RangeResponse, EtcdError> {
        self.retry(|channel| {
            let request = request.clone();
            async move { KvClient::new(channel).range(request).await }
        })
        .await
    }

    async fn put_request(&self, request: PutRequest) -> Result<PutResponse, EtcdError> {
        self.retry(|channel| {
            let request = request.clone();
            async move { KvClient::new(channel).put(request).await }
        })
        .await
    }

    /// Runs one request, retrying passing failures with backoff until the patience runs out.
    pub(crate) async fn retry<T, F, Fut>(&self, mut request: F) -> Result<T, EtcdError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.patience;
        let mut delays = Delays::new();
        loop {
            // a cluster with no member up leaves a request pending, not failed: bound each try
            let bound = ATTEMPT_TIMEOUT.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            count_request();
            let (member, channel) = self.member();
            let outcome = tokio::time::timeout(bound.max(Duration::from_millis(50)), request(channel)).await;
            let (why, status) = match outcome {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => match passing(&status) {
                    Some(why) => {
                        if why == Passing::Shedding {
                            SHED.fetch_add(1, Ordering::Relaxed);
                        }
                        (why, describe(&status))
                    }
                    None => {
                        let status = describe(&status);
                        return Err(EtcdError::Refused { endpoints: self.endpoints.to_string(), status });
                    }
                },
                Err(_) => (Passing::Outage, format!("no answer within {bound:?}")),
            };
            self.failed(member);
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(EtcdError::Unavailable {
                    endpoints: self.endpoints.to_string(),
                    patience: self.patience,
                    detail: status,
                });
            }
            tracing::debug!(endpoints = %self.endpoints, "etcd request failed, retrying: {status}");
            tokio::time::sleep(delays.next(why).min(deadline - now)).await;
        }
    }
}

pub(crate) fn describe(status: &Status) -> String {
    let message = status.message();
    if message.is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {message}", status.code())
    }
}

fn tls_config(files: &TlsFiles) -> ClientTlsConfig {
    let mut config = ClientTlsConfig::new();
    if let Some(ca) = &files.ca {
        config = config.ca_certificate(Certificate::from_pem(ca));
    }
    if let Some((cert, key)) = &files.cert_and_key {
        config = config.identity(Identity::from_pem(cert, key));
    }
    config
}

/// A read of `key` inside a transaction.
pub fn range_op(key: &[u8]) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(RangeRequest { key: key.to_vec(), ..Default::default() })),
    }
}

/// A write of `key` inside a transaction.
pub fn put_op(key: &[u8], value: &[u8]) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            ..Default::default()
        })),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;

    /// A client of a cluster that is never reached: the requests below answer for themselves.
    fn client(patience: Duration) -> EtcdClient {
        let endpoints = vec!["127.0.0.1:1".to_owned()];
        EtcdClient::new(&EtcdOptions { endpoints, tls: None, patience }).expect("a client")
    }

    /// Runs `retry` over a request that fails with `status` `failures` times, then succeeds;
    /// returns the outcome and the tries made.
    async fn tries(patience: Duration, status: fn() -> Status, failures: u32) -> (Result<(), EtcdError>, u32) {
        let made = AtomicU32::new(0);
        let outcome = client(patience)
            .retry(|_channel| {
                let try_number = made.fetch_add(1, Ordering::Relaxed);
                async move {
                    if try_number < failures {
                        Err(status())
                    } else {
                        Ok(tonic::Response::new(()))
                    }
                }
            })
            .await;
        (outcome, made.load(Ordering::Relaxed))
    }

    // on a paused clock, which moves only when every task waits: each wait is exact
    #[tokio::test(start_paused = true)]
    async fn a_member_shedding_load_is_retried_and_left_alone_longer_than_one_down() {
        let shedding = || Status::unknown("etcdserver: too many requests");
        let down = || Status::unavailable("connection refused");
        let before = requests_sent();
        let (outcome, made) = tries(Duration::from_secs(5), shedding, 2).await;
        assert!(outcome.is_ok() && made == 3, "{outcome:?} after {made} tries");
        // counted for the benchmarks (other tests of this process may add to the counts)
        let counted = requests_sent() - before;
        assert!(counted.sent >= 3 && counted.shed >= 2, "{counted:?}");
        // within 3 s, and one last try at the end: while down, tries at 0, 20, 60, 140, 300,
        // 620, 1120, 1620, 2120 and 2620 ms; while shedding at most at 0, 50, 150, 350, 750,
        // 1550 and 2550 ms (each wait at least half its span of 100 ms doubling to 2 s)
        let patience = Duration::from_secs(3);
        let (outcome, shed) = tries(patience, shedding, u32::MAX).await;
        assert!(matches!(outcome, Err(EtcdError::Unavailable { .. })), "{outcome:?}");
        let (_, outage) = tries(patience, down, u32::MAX).await;
        assert!(shed <= 8 && outage == 11, "{shed} tries while shedding, {outage} while down");
    }

    #[tokio::test]
    async fn a_connection_closed_under_load_is_retried_and_a_refusal_is_not() {
        let calm = || Status::resource_exhausted("h2 protocol error: http2 error");
        let (outcome, made) = tries(Duration::from_secs(5), calm, 1).await;
        assert!(outcome.is_ok() && made == 2, "{outcome:?} after {made} tries");
        let too_large = || Status::resource_exhausted("grpc: received message larger than max");
        let (outcome, made) = tries(Duration::from_secs(5), too_large, 1).await;
        assert!(matches!(outcome, Err(EtcdError::Refused { .. })) && made == 1, "{outcome:?} after {made} tries");
    }

    #[test]
    fn a_lease_etcd_has_forgotten_is_told_from_other_refusals() {
        let refused = |status: Status| EtcdError::Refused { endpoints: "e".into(), status: describe(&status) };
        assert!(refused(Status::not_found("etcdserver: requested lease not found")).is_lease_not_found());
        assert!(!refused(Status::not_found("etcdserver: key not found")).is_lease_not_found());
        assert!(
            !refused(Status::invalid_argument("etcdserver: too many operations in txn request")).is_lease_not_found()
        );
    }
}
