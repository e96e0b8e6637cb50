//! Watching a range of keys from a known revision: every write after that revision is seen, so
//! nothing can be missed between a read and the watch that follows it. A watch that breaks
//! (its member went away, an election) is opened again, on the next member, from the revision
//! after the last one delivered; one whose start was compacted away is reported, so that the
//! caller reads the state again and watches on from the new reading.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::client::{count_request, describe, EtcdClient, EtcdError};
use crate::pb::etcdserverpb::watch_client::WatchClient;
use crate::pb::etcdserverpb::watch_request::RequestUnion;
use crate::pb::etcdserverpb::{WatchCreateRequest, WatchRequest, WatchResponse};
use crate::pb::mvccpb::Event;
use crate::retry::passing;

/// Longest pause between attempts to open a watch again.
const MAX_REOPEN_DELAY: Duration = Duration::from_secs(1);

/// What a watch delivers.
#[derive(Debug)]
pub enum WatchItem {
    /// The writes of one or more revisions, in order (a revision's events are never split).
    Events(Vec<Event>),
    /// The revisions from the watch's start were compacted away (etcd keeps history only from
    /// `revision`): read the state again and [`Watcher::restart`] after the reading.
    Compacted { revision: i64 },
}

/// A watch on `[key, range_end)` (one key when `range_end` is empty).
pub struct Watcher {
    client: EtcdClient,
    key: Vec<u8>,
    range_end: Vec<u8>,
    /// The revision the next (re)opened watch starts from.
    next: i64,
    prev_kv: bool,
    open: Option<Open>,
}

struct Open {
    member: usize,
    /// Kept so that the stream stays open (dropping it would end the watch).
    _requests: mpsc::Sender<WatchRequest>,
    responses: Streaming<WatchResponse>,
}

impl EtcdClient {
    /// Watches the keys in `[key, range_end)` written from revision `from` on; `prev_kv` asks
    /// for each event's previous value (what a deleted key held). Opens on the first
    /// [`Watcher::next`].
    pub fn watch(&self, key: &[u8], range_end: &[u8], from: i64, prev_kv: bool) -> Watcher {
        Watcher {
            client: self.clone(),
            key: key.to_vec(),
            range_end: range_end.to_vec(),
            next: from,
            prev_kv,
            open: None,
        }
    }
}

impl Watcher {
    /// The next writes. Waits as long as it takes (callers bound it with a timeout); a broken
    /// watch is opened again with backoff. Errors only when etcd refuses the watch.
    pub async fn next(&mut self) -> Result<WatchItem, EtcdError> {
        let mut delay = Duration::from_millis(20);
        loop {
            if self.open.is_none() {
                let create = WatchCreateRequest {
                    key: self.key.clone(),
                    range_end: self.range_end.clone(),
                    start_revision: self.next,
                    prev_kv: self.prev_kv,
                    ..Default::default()
                };
                match open(&self.client, create).await? {
                    Ok(open) => self.open = Some(open),
                    Err(why) => {
                        tracing::debug!(endpoints = self.client.endpoints(), "etcd watch did not open: {why}");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(MAX_REOPEN_DELAY);
                        continue;
                    }
                }
            }
            let open = self.open.as_mut().expect("opened above");
            let response = match open.responses.message().await {
                Ok(Some(response)) => response,
                Ok(None) => {
                    self.broken(None, "the stream closed".into());
                    continue;
                }
                Err(status) => {
                    let member = open.member;
                    self.broken(Some(member), describe(&status));
                    continue;
                }
            };
            if response.canceled {
                self.open = None;
                if response.compact_revision > 0 {
                    return Ok(WatchItem::Compacted { revision: response.compact_revision });
                }
                return Err(EtcdError::Refused {
                    endpoints: self.client.endpoints().to_owned(),
                    status: format!("the watch was cancelled: {}", response.cancel_reason),
                });
            }
            if let Some(last) = response.events.last().and_then(|event| event.kv.as_ref()) {
                self.next = last.mod_revision + 1;
            }
            if !response.events.is_empty() {
                return Ok(WatchItem::Events(response.events));
            }
        }
    }

    /// Watches on from `revision` (after reading the state again at `revision - 1`).
    pub fn restart(&mut self, revision: i64) {
        self.open = None;
        self.next = revision;
    }

    fn broken(&mut self, member: Option<usize>, why: String) {
        if let Some(member) = member {
            self.client.failed(member);
        }
        tracing::debug!(endpoints = self.client.endpoints(), from = self.next, "etcd watch broke: {why}; reopening");
        self.open = None;
    }
}

/// Opens a watch on the client's current member: `Ok(Err(why))` for a failure that passes.
async fn open(client: &EtcdClient, create: WatchCreateRequest) -> Result<Result<Open, String>, EtcdError> {
    let (requests, receiver) = mpsc::channel(1);
    // the channel has room for it: it was just made
    let _ = requests.try_send(WatchRequest { request_union: Some(RequestUnion::CreateRequest(create)) });
    let (member, channel) = client.member();
    count_request();
    let mut request = tonic::Request::new(ReceiverStream::new(receiver));
    // a member cut off from the leader ends the watch instead of keeping it silent
    request.metadata_mut().insert("hasleader", tonic::metadata::MetadataValue::from_static("true"));
    let mut watch_client = WatchClient::new(channel);
    match tokio::time::timeout(client.patience(), watch_client.watch(request)).await {
        Ok(Ok(stream)) => Ok(Ok(Open { member, _requests: requests, responses: stream.into_inner() })),
        Ok(Err(status)) if passing(&status).is_some() => {
            client.failed(member);
            Ok(Err(describe(&status)))
        }
        Ok(Err(status)) => {
            Err(EtcdError::Refused { endpoints: client.endpoints().to_owned(), status: describe(&status) })
        }
        Err(_) => {
            client.failed(member);
            Ok(Err("the watch did not open in time".into()))
        }
    }
}
