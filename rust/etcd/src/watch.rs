//! Waiting for keys to be created, with a watch from a known revision: every write after that
//! revision is seen, so nothing can be missed between the read that found a key missing and
//! the watch. A watch that breaks (its member went away) is opened again from the last
//! revision seen; one whose start was compacted away is answered by reading the keys again.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::client::{count_request, describe, passes, range_op, EtcdClient, EtcdError, MAX_TXN_OPS};
use crate::pb::etcdserverpb::response_op::Response;
use crate::pb::etcdserverpb::watch_request::RequestUnion;
use crate::pb::etcdserverpb::{TxnRequest, WatchCreateRequest, WatchRequest};
use crate::pb::mvccpb::event::EventType;

impl EtcdClient {
    /// Which of `keys` exist, and the revision of the reading (one request per
    /// [`MAX_TXN_OPS`] keys; the first revision, so that a watch from it misses nothing).
    pub async fn existing(&self, keys: &[Vec<u8>]) -> Result<(Vec<bool>, i64), EtcdError> {
        let mut found = Vec::with_capacity(keys.len());
        let mut revision = None;
        for batch in keys.chunks(MAX_TXN_OPS) {
            let request = TxnRequest { success: batch.iter().map(|key| range_op(key)).collect(), ..Default::default() };
            let response = self.txn(request).await?;
            revision.get_or_insert(response.header.map_or(0, |header| header.revision));
            found.extend(
                response
                    .responses
                    .into_iter()
                    .map(|op| matches!(op.response, Some(Response::ResponseRange(range)) if !range.kvs.is_empty())),
            );
        }
        Ok((found, revision.unwrap_or(0)))
    }

    /// The value of `key`, waiting up to `timeout` for it to be written (`None`: it was not).
    pub async fn wait_for_value(&self, key: &[u8], timeout: Option<Duration>) -> Result<Option<Vec<u8>>, EtcdError> {
        let waiting = async {
            loop {
                let (value, revision) = self.get(key).await?;
                if value.is_some() {
                    return Ok(value);
                }
                match self.watch_until_created(HashSet::from([key.to_vec()]), revision + 1).await? {
                    WatchEnd::AllCreated(mut values) => return Ok(values.remove(key)),
                    WatchEnd::Broken(why) => tracing::debug!(endpoints = self.endpoints(), "etcd watch ended: {why}"),
                }
            }
        };
        match timeout {
            None => waiting.await,
            Some(timeout) => tokio::time::timeout(timeout, waiting).await.unwrap_or(Ok(None)),
        }
    }

    /// Blocks until every key exists (`true`) or `timeout` passes (`false`).
    pub async fn wait_for_keys(&self, keys: &[Vec<u8>], timeout: Option<Duration>) -> Result<bool, EtcdError> {
        let waiting = async {
            loop {
                let (found, revision) = self.existing(keys).await?;
                let missing: HashSet<Vec<u8>> =
                    keys.iter().zip(found).filter(|(_, found)| !found).map(|(key, _)| key.clone()).collect();
                if missing.is_empty() {
                    return Ok(true);
                }
                match self.watch_until_created(missing, revision + 1).await? {
                    WatchEnd::AllCreated(_) => return Ok(true),
                    // read again, then watch from the new reading
                    WatchEnd::Broken(why) => tracing::debug!(endpoints = self.endpoints(), "etcd watch ended: {why}"),
                }
            }
        };
        match timeout {
            None => waiting.await,
            Some(timeout) => tokio::time::timeout(timeout, waiting).await.unwrap_or(Ok(false)),
        }
    }

    async fn watch_until_created(&self, mut missing: HashSet<Vec<u8>>, from: i64) -> Result<WatchEnd, EtcdError> {
        let (requests, receiver) = mpsc::channel(missing.len().max(1));
        for key in &missing {
            let create = WatchCreateRequest { key: key.clone(), start_revision: from, ..Default::default() };
            let request = WatchRequest { request_union: Some(RequestUnion::CreateRequest(create)) };
            // the channel holds them all: it was made that large
            let _ = requests.try_send(request);
        }
        let (member, mut client) = self.watch_client();
        count_request();
        let mut request = tonic::Request::new(ReceiverStream::new(receiver));
        // a member cut off from the leader ends the watch instead of keeping it silent
        request.metadata_mut().insert("hasleader", tonic::metadata::MetadataValue::from_static("true"));
        let mut stream = match tokio::time::timeout(self.patience(), client.watch(request)).await {
            Ok(Ok(stream)) => stream.into_inner(),
            Ok(Err(status)) if passes(&status) => {
                self.failed(member);
                return Ok(WatchEnd::Broken(describe(&status)));
            }
            Ok(Err(status)) => {
                return Err(EtcdError::Refused { endpoints: self.endpoints().to_owned(), status: describe(&status) })
            }
            Err(_) => {
                self.failed(member);
                return Ok(WatchEnd::Broken("the watch did not open in time".into()));
            }
        };
        let mut created = HashMap::new();
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return Ok(WatchEnd::Broken("the stream closed".into())),
                Err(status) => {
                    self.failed(member);
                    return Ok(WatchEnd::Broken(describe(&status)));
                }
            };
            if response.canceled {
                let why = if response.compact_revision > 0 {
                    format!("revision {from} was compacted (now {})", response.compact_revision)
                } else {
                    format!("cancelled: {}", response.cancel_reason)
                };
                return Ok(WatchEnd::Broken(why));
            }
            for event in response.events {
                if event.r#type == EventType::Put as i32 {
                    if let Some(kv) = event.kv {
                        if missing.remove(&kv.key) {
                            created.insert(kv.key, kv.value);
                        }
                    }
                }
            }
            if missing.is_empty() {
                drop(requests);
                return Ok(WatchEnd::AllCreated(created));
            }
        }
    }
}

enum WatchEnd {
    /// Every key was written; the values they were written with.
    AllCreated(HashMap<Vec<u8>, Vec<u8>>),
    Broken(String),
}
