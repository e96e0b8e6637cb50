//! The rendezvous on an etcd v3 cluster (`--rdzv-backend etcd`): the store operations of
//! [`super::store`] as etcd requests, so the dynamic rendezvous runs unchanged on a store that
//! survives the loss of any minority of its members, and no agent is special.
//!
//! * `compare_set` and `add` are transactions guarded by the key's value (or its absence);
//!   tallies (arrivals, events, heartbeats) are the key's version, one write each, so a
//!   thousand nodes arriving at once do not race on a value;
//! * `wait` is a read, then a watch from the revision after it (nothing written in between is
//!   missed), never polling;
//! * reads of several keys are one transaction.
//!
//! Every key lives under the run's prefix; nothing is written outside it.

use std::time::Duration;

use bytes::Bytes;
use elastix_etcd::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use elastix_etcd::pb::etcdserverpb::response_op::Response;
use elastix_etcd::pb::etcdserverpb::{request_op, Compare, RangeRequest, RequestOp, TxnRequest};
use elastix_etcd::{put_op, range_op, EtcdClient, EtcdError, MAX_TXN_OPS};

use super::error::{RendezvousError, Result};
use super::store::{RendezvousStore, StoreConn};
use crate::store::StoreError;

/// How often `add` retries a transaction that lost a race before giving up.
const ADD_ATTEMPTS: usize = 100;

#[derive(Clone)]
pub struct EtcdRendezvousStore {
    client: EtcdClient,
    endpoints: Vec<(String, u16)>,
    prefix: String,
}

impl EtcdRendezvousStore {
    pub fn new(client: EtcdClient, endpoints: Vec<(String, u16)>, prefix: impl Into<String>) -> Self {
        EtcdRendezvousStore { client, endpoints, prefix: prefix.into() }
    }

    /// Refuses a prefix that holds keys of something else (keys, but no rendezvous record):
    /// the rendezvous would write among them.
    pub async fn check_prefix(&self, meta_key: &str) -> Result<()> {
        let start = self.prefix.as_bytes().to_vec();
        let request = TxnRequest {
            success: vec![
                range_op(format!("{}{meta_key}", self.prefix).as_bytes()),
                RequestOp {
                    request: Some(request_op::Request::RequestRange(RangeRequest {
                        range_end: prefix_end(&start),
                        key: start,
                        count_only: true,
                        ..Default::default()
                    })),
                },
            ],
            ..Default::default()
        };
        let response = self.client.txn(request).await.map_err(|err| etcd_error(err, &self.client))?;
        let counts: Vec<i64> = response
            .responses
            .into_iter()
            .map(|op| match op.response {
                Some(Response::ResponseRange(range)) => range.count.max(range.kvs.len() as i64),
                _ => 0,
            })
            .collect();
        if counts.first() == Some(&0) && counts.get(1).is_some_and(|count| *count > 0) {
            return Err(RendezvousError::Config(format!(
                "etcd at {} holds {} key(s) under {:?} that are not an elastix rendezvous; choose another \
                 --rdzv-id or --rdzv-conf key_prefix",
                self.client.endpoints(),
                counts[1],
                self.prefix
            )));
        }
        Ok(())
    }
}

/// The end of the range of keys starting with `prefix` (etcd's "prefix + 1").
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

fn etcd_error(err: EtcdError, client: &EtcdClient) -> RendezvousError {
    match err {
        // it may come back: the callers that retry on a lost store do
        EtcdError::Unavailable { .. } => RendezvousError::Store(StoreError::ConnectionLost {
            peer: client.endpoints().to_owned(),
            reason: err.to_string(),
        }),
        EtcdError::Refused { .. } => RendezvousError::State(err.to_string()),
        EtcdError::Config(message) => RendezvousError::Config(message),
    }
}

impl RendezvousStore for EtcdRendezvousStore {
    type Conn = EtcdConn;

    async fn connect(&self) -> Result<EtcdConn> {
        Ok(EtcdConn { client: self.client.clone(), prefix: self.prefix.clone() })
    }

    async fn connect_site(&self, _site: usize, _patience: Duration) -> Result<EtcdConn> {
        self.connect().await
    }

    fn address(&self, _site: usize) -> (String, u16) {
        self.endpoints[0].clone()
    }

    fn describe_site(&self, _site: usize) -> String {
        format!("etcd at {}", self.client.endpoints())
    }

    fn serves_rounds(&self) -> bool {
        false
    }
}

/// Requests need no connection of their own: the client multiplexes them.
pub struct EtcdConn {
    client: EtcdClient,
    prefix: String,
}

impl EtcdConn {
    fn key(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.prefix).into_bytes()
    }

    fn error(&self, err: EtcdError) -> RendezvousError {
        etcd_error(err, &self.client)
    }

    /// Reads `keys`, a transaction per [`MAX_TXN_OPS`]: `None` for a missing one.
    async fn read(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        let mut values = Vec::with_capacity(keys.len());
        for batch in keys.chunks(MAX_TXN_OPS) {
            let success = batch.iter().map(|key| range_op(&self.key(key))).collect();
            let response = self.client.txn(TxnRequest { success, ..Default::default() }).await;
            values.extend(response.map_err(|err| self.error(err))?.responses.into_iter().map(|op| match op.response {
                Some(Response::ResponseRange(range)) => range.kvs.into_iter().next().map(|kv| kv.value),
                _ => None,
            }));
        }
        Ok(values)
    }

    /// Writes `desired` if `key` holds `current` (`None`: if it is missing); whether it did,
    /// and the value found otherwise.
    async fn swap(&self, key: &[u8], current: Option<&[u8]>, desired: &[u8]) -> Result<(bool, Option<Vec<u8>>)> {
        let compare = match current {
            None => Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Create as i32,
                key: key.to_vec(),
                target_union: Some(TargetUnion::CreateRevision(0)),
                ..Default::default()
            },
            Some(value) => Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Value as i32,
                key: key.to_vec(),
                target_union: Some(TargetUnion::Value(value.to_vec())),
                ..Default::default()
            },
        };
        let request =
            TxnRequest { compare: vec![compare], success: vec![put_op(key, desired)], failure: vec![range_op(key)] };
        let response = self.client.txn(request).await.map_err(|err| self.error(err))?;
        if response.succeeded {
            return Ok((true, None));
        }
        let found = response.responses.into_iter().find_map(|op| match op.response {
            Some(Response::ResponseRange(range)) => range.kvs.into_iter().next().map(|kv| kv.value),
            _ => None,
        });
        Ok((false, found))
    }
}

fn counter(value: &[u8]) -> Result<i64> {
    std::str::from_utf8(value).ok().and_then(|text| text.trim().parse().ok()).ok_or_else(|| {
        RendezvousError::State(format!("a rendezvous counter holds {:?}, not a number", String::from_utf8_lossy(value)))
    })
}

impl StoreConn for EtcdConn {
    async fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let key = self.key(key);
        let (mut current, _) = self.client.get(&key).await.map_err(|err| self.error(err))?;
        for _ in 0..ADD_ATTEMPTS {
            let value = current.as_deref().map(counter).transpose()?.unwrap_or(0);
            if delta == 0 && current.is_some() {
                return Ok(value);
            }
            let total = value + delta;
            match self.swap(&key, current.as_deref(), total.to_string().as_bytes()).await? {
                (true, _) => return Ok(total),
                (false, found) => current = found,
            }
        }
        Err(RendezvousError::State(format!(
            "etcd at {}: adding to {} lost the race {ADD_ATTEMPTS} times in a row",
            self.client.endpoints(),
            String::from_utf8_lossy(&key)
        )))
    }

    /// One write, no race: the count is the key's version (writes since it was created),
    /// which etcd assigns in order.
    async fn count_up(&mut self, key: &str) -> Result<i64> {
        let key = self.key(key);
        self.client.put_counted(&key).await.map_err(|err| self.error(err))
    }

    async fn tally(&mut self, key: &str) -> Result<i64> {
        let key = self.key(key);
        self.client.version(&key).await.map_err(|err| self.error(err))
    }

    async fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        self.client.put(&key, value).await.map_err(|err| self.error(err))
    }

    /// A transaction per [`MAX_TXN_OPS`] pairs: callers publish what the writes mean (a seal)
    /// with a write of their own afterwards, so the batches need not be one.
    async fn multi_set(&mut self, pairs: &[(String, Vec<u8>)]) -> Result<()> {
        for batch in pairs.chunks(MAX_TXN_OPS) {
            let success = batch.iter().map(|(key, value)| put_op(&self.key(key), value)).collect();
            self.client.txn(TxnRequest { success, ..Default::default() }).await.map_err(|err| self.error(err))?;
        }
        Ok(())
    }

    async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        let key = self.key(key);
        let current = (!expected.is_empty()).then_some(expected);
        match self.swap(&key, current, desired).await? {
            (true, _) => Ok(Bytes::copy_from_slice(desired)),
            (false, Some(found)) => Ok(Bytes::from(found)),
            // TCPStore's answer for a missing key and a non-empty expectation
            (false, None) => Ok(Bytes::copy_from_slice(expected)),
        }
    }

    /// One read.
    async fn try_get(&mut self, key: &str) -> Result<Option<Bytes>> {
        let key = self.key(key);
        Ok(self.client.get(&key).await.map_err(|err| self.error(err))?.0.map(Bytes::from))
    }

    /// A read, and if the key is missing a watch whose event carries the value.
    async fn wait_get(&mut self, key: &str, timeout: Option<Duration>) -> Result<Option<Bytes>> {
        let key = self.key(key);
        Ok(self.client.wait_for_value(&key, timeout).await.map_err(|err| self.error(err))?.map(Bytes::from))
    }

    async fn wait(&mut self, keys: &[String], timeout: Option<Duration>) -> Result<bool> {
        let keys: Vec<Vec<u8>> = keys.iter().map(|key| self.key(key)).collect();
        self.client.wait_for_keys(&keys, timeout).await.map_err(|err| self.error(err))
    }

    async fn check(&mut self, keys: &[String]) -> Result<bool> {
        Ok(self.read(keys).await?.iter().all(Option::is_some))
    }

    async fn multi_get(&mut self, keys: &[String]) -> Result<Vec<Bytes>> {
        Ok(self.read(keys).await?.into_iter().map(|value| Bytes::from(value.unwrap_or_default())).collect())
    }

    async fn delete(&mut self, key: &str) -> Result<bool> {
        let key = self.key(key);
        self.client.delete(&key).await.map_err(|err| self.error(err))
    }

    fn is_usable(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_end_after_the_last_key_with_the_prefix() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
