//! Leases: a client's liveness in etcd. Keys written under a lease vanish when it expires, and
//! every watcher of them sees that; a keep-alive renews the lease in the background and says
//! when it is gone, or when no member has renewed it for too long.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::client::{count_renewal, describe, EtcdClient, EtcdError};
use crate::pb::etcdserverpb::lease_client::LeaseClient;
use crate::pb::etcdserverpb::{LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest};

/// Bound on one renewal's answer.
const RENEW_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: i64,
    /// As granted (etcd may raise a short one to its minimum).
    pub ttl: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseState {
    Alive,
    /// Renewals fail (`detail`: the first failure): unless one gets through (or a new leader
    /// renews every lease), the lease lapses at `renewed_at` plus its TTL. Still retried.
    Failing {
        renewed_at: Instant,
        detail: String,
    },
    /// etcd answered that the lease is gone: the keys written under it were deleted.
    Expired,
    /// No member renewed it for `silent_for`; `detail` is the last failure.
    Unreachable {
        silent_for: Duration,
        detail: String,
    },
}

impl std::fmt::Display for LeaseState {
    /// For messages: what happened to the lease, in words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseState::Alive => write!(f, "alive"),
            LeaseState::Failing { renewed_at, detail } => {
                write!(f, "renewals failing for {:.1?}: {detail}", renewed_at.elapsed())
            }
            LeaseState::Expired => write!(f, "etcd says it expired"),
            LeaseState::Unreachable { silent_for, detail } => {
                write!(f, "not renewed for {silent_for:.1?}: {detail}")
            }
        }
    }
}

impl LeaseState {
    /// Whether the keep-alive has ended: the lease expired, or nobody renewed it for the
    /// outage limit.
    pub fn is_over(&self) -> bool {
        matches!(self, LeaseState::Expired | LeaseState::Unreachable { .. })
    }
}

/// Renews a lease until dropped.
pub struct KeepAlive {
    state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
}

impl KeepAlive {
    /// The lease's state: `Alive`, `Failing` while renewals fail (back to `Alive` when one
    /// gets through), then why it ended.
    pub fn state(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EtcdClient {
    /// A new lease of `ttl`, rounded up to whole seconds (etcd may grant more: its minimum).
    pub async fn grant_lease(&self, ttl: Duration) -> Result<Lease, EtcdError> {
        let request = LeaseGrantRequest { ttl: (ttl.as_secs_f64().ceil() as i64).max(1), id: 0 };
        let response =
            self.retry(|channel| async move { LeaseClient::new(channel).lease_grant(request).await }).await?;
        if !response.error.is_empty() {
            return Err(EtcdError::Refused { endpoints: self.endpoints().to_owned(), status: response.error });
        }
        Ok(Lease { id: response.id, ttl: Duration::from_secs(response.ttl.max(1) as u64) })
    }

    /// Ends `lease` now: the keys written under it are deleted.
    pub async fn revoke_lease(&self, lease: Lease) -> Result<(), EtcdError> {
        let request = LeaseRevokeRequest { id: lease.id };
        self.retry(|channel| async move { LeaseClient::new(channel).lease_revoke(request).await }).await?;
        Ok(())
    }

    /// Renews `lease` every third of its TTL, moving to the next member when one fails, until
    /// etcd says it expired or nobody renewed it for `outage_limit`.
    pub fn keep_alive(&self, lease: Lease, outage_limit: Duration) -> KeepAlive {
        let (sender, state) = watch::channel(LeaseState::Alive);
        let task = tokio::spawn(renew(self.clone(), lease, outage_limit, sender));
        KeepAlive { state, task }
    }
}

/// One keep-alive stream to one member.
struct Session {
    member: usize,
    requests: mpsc::Sender<LeaseKeepAliveRequest>,
    responses: Streaming<LeaseKeepAliveResponse>,
}

async fn renew(client: EtcdClient, lease: Lease, outage_limit: Duration, state: watch::Sender<LeaseState>) {
    let interval = lease.ttl / 3;
    let mut renewed = Instant::now();
    let mut session: Option<Session> = None;
    // the failure of the outage under way, said once
    let mut failing: Option<String> = None;
    loop {
        let wait = if failing.is_some() { interval.min(Duration::from_millis(500)) } else { interval };
        tokio::time::sleep(wait).await;
        let outcome = match session.as_mut() {
            Some(open) => renew_once(open, lease.id).await,
            None => match open(&client, lease.id).await {
                Ok(mut open) => {
                    let outcome = answer(&mut open).await;
                    session = Some(open);
                    outcome
                }
                Err(why) => Err(why),
            },
        };
        match outcome {
            Ok(true) => {
                renewed = Instant::now();
                if failing.take().is_some() {
                    tracing::info!(lease = lease.id, "etcd at {} renews this node's lease again", client.endpoints());
                    let _ = state.send(LeaseState::Alive);
                }
            }
            Ok(false) => {
                tracing::warn!(lease = lease.id, "etcd at {} says this node's lease expired", client.endpoints());
                let _ = state.send(LeaseState::Expired);
                return;
            }
            Err(why) => {
                if let Some(open) = session.take() {
                    client.failed(open.member);
                }
                let silent_for = renewed.elapsed();
                if failing.is_none() {
                    tracing::warn!(
                        lease = lease.id,
                        "etcd at {} did not renew this node's lease: {why}; retrying for up to {:.0?} more \
                         (the lease lasts {:?} without renewal)",
                        client.endpoints(),
                        outage_limit.saturating_sub(silent_for),
                        lease.ttl,
                    );
                }
                if silent_for >= outage_limit {
                    let _ = state.send(LeaseState::Unreachable { silent_for, detail: why });
                    return;
                }
                if failing.is_none() {
                    let _ = state.send(LeaseState::Failing { renewed_at: renewed, detail: why.clone() });
                }
                failing = Some(why);
            }
        }
    }
}

/// Opens a keep-alive stream with its first renewal already sent (etcd answers the opening
/// only with the first renewal's answer).
async fn open(client: &EtcdClient, id: i64) -> Result<Session, String> {
    let (member, channel) = client.member();
    let (requests, receiver) = mpsc::channel(1);
    count_renewal();
    // the channel has room for it: it was just made
    let _ = requests.try_send(LeaseKeepAliveRequest { id });
    let mut lease_client = LeaseClient::new(channel);
    let opening = lease_client.lease_keep_alive(ReceiverStream::new(receiver));
    match tokio::time::timeout(RENEW_TIMEOUT, opening).await {
        Ok(Ok(stream)) => Ok(Session { member, requests, responses: stream.into_inner() }),
        Ok(Err(status)) => {
            client.failed(member);
            Err(describe(&status))
        }
        Err(_) => {
            client.failed(member);
            Err(format!("no answer within {RENEW_TIMEOUT:?}"))
        }
    }
}

/// One renewal: whether the lease is still alive.
async fn renew_once(session: &mut Session, id: i64) -> Result<bool, String> {
    count_renewal();
    if session.requests.send(LeaseKeepAliveRequest { id }).await.is_err() {
        return Err("the keep-alive stream closed".into());
    }
    answer(session).await
}

/// The answer to the renewal just sent: whether the lease is still alive.
async fn answer(session: &mut Session) -> Result<bool, String> {
    match tokio::time::timeout(RENEW_TIMEOUT, session.responses.message()).await {
        Ok(Ok(Some(response))) => Ok(response.ttl > 0),
        Ok(Ok(None)) => Err("the keep-alive stream closed".into()),
        Ok(Err(status)) => Err(describe(&status)),
        Err(_) => Err(format!("no answer within {RENEW_TIMEOUT:?}")),
    }
}
