//! Building etcd transactions and reading their answers, and etcd's errors as rendezvous
//! errors.

use elastix_etcd::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use elastix_etcd::pb::etcdserverpb::range_request::{SortOrder, SortTarget};
use elastix_etcd::pb::etcdserverpb::request_op::Request;
use elastix_etcd::pb::etcdserverpb::response_op::Response;
use elastix_etcd::pb::etcdserverpb::{
    Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, ResponseOp, TxnRequest, TxnResponse,
};
use elastix_etcd::pb::mvccpb::KeyValue;
use elastix_etcd::{EtcdClient, EtcdError};

use super::keys::Range;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::store::StoreError;

/// `key` does not exist.
pub(super) fn absent(key: &[u8]) -> Compare {
    Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Create as i32,
        key: key.to_vec(),
        target_union: Some(TargetUnion::CreateRevision(0)),
        ..Default::default()
    }
}

/// No key in `range` exists (etcd compares every key of the range; none is true).
pub(super) fn empty(range: &Range) -> Compare {
    Compare { range_end: range.end.clone(), ..absent(&range.key) }
}

pub(super) fn put(key: &[u8], value: &[u8], lease: i64) -> RequestOp {
    let put = PutRequest { key: key.to_vec(), value: value.to_vec(), lease, ..Default::default() };
    RequestOp { request: Some(Request::RequestPut(put)) }
}

/// A write whose answer carries the previous version (to count the writes).
pub(super) fn put_counted(key: &[u8]) -> RequestOp {
    let put = PutRequest { key: key.to_vec(), prev_kv: true, ..Default::default() };
    RequestOp { request: Some(Request::RequestPut(put)) }
}

pub(super) fn delete(key: &[u8]) -> RequestOp {
    RequestOp {
        request: Some(Request::RequestDeleteRange(DeleteRangeRequest { key: key.to_vec(), ..Default::default() })),
    }
}

pub(super) fn get(key: &[u8]) -> RequestOp {
    RequestOp { request: Some(Request::RequestRange(RangeRequest { key: key.to_vec(), ..Default::default() })) }
}

/// How many keys `range` holds at `revision` (0: now).
pub(super) fn count(range: &Range, revision: i64) -> RequestOp {
    let request = RangeRequest {
        key: range.key.clone(),
        range_end: range.end.clone(),
        count_only: true,
        revision,
        ..Default::default()
    };
    RequestOp { request: Some(Request::RequestRange(request)) }
}

/// `key` has been written at least `times` times (its version).
pub(super) fn written_at_least(key: &[u8], times: u64) -> Compare {
    Compare {
        result: CompareResult::Greater as i32,
        target: CompareTarget::Version as i32,
        key: key.to_vec(),
        target_union: Some(TargetUnion::Version(times as i64 - 1)),
        ..Default::default()
    }
}

/// `op`, nested in the transaction, run only if `compare` holds (etcd evaluates a nested
/// comparison before any of the transaction's writes, as the outer ones).
pub(super) fn only_if(compare: Compare, op: RequestOp) -> RequestOp {
    let nested = TxnRequest { compare: vec![compare], success: vec![op], failure: vec![] };
    RequestOp { request: Some(Request::RequestTxn(nested)) }
}

/// The keys (no values) of `range` at `revision` created before `before`.
pub(super) fn keys_created_before(range: &Range, revision: i64, before: i64) -> RangeRequest {
    RangeRequest {
        key: range.key.clone(),
        range_end: range.end.clone(),
        keys_only: true,
        revision,
        max_create_revision: before - 1,
        ..Default::default()
    }
}

/// The keys (no values) of `range` at `revision`, the `limit` first created.
pub(super) fn first_created(range: &Range, revision: i64, limit: u32) -> RangeRequest {
    RangeRequest {
        key: range.key.clone(),
        range_end: range.end.clone(),
        keys_only: true,
        revision,
        limit: i64::from(limit),
        sort_order: SortOrder::Ascend as i32,
        sort_target: SortTarget::Create as i32,
        ..Default::default()
    }
}

/// The members of a round as sealed (`range` at `revision`, created up to `last_member`),
/// with their values and leases, in the order they entered: their group ranks.
pub(super) fn members_as_sealed(range: &Range, revision: i64, last_member: i64) -> RangeRequest {
    RangeRequest {
        key: range.key.clone(),
        range_end: range.end.clone(),
        revision,
        max_create_revision: last_member,
        sort_order: SortOrder::Ascend as i32,
        sort_target: SortTarget::Create as i32,
        ..Default::default()
    }
}

/// The revision a transaction was applied at.
pub(super) fn revision(response: &TxnResponse) -> i64 {
    response.header.as_ref().map_or(0, |header| header.revision)
}

fn range_of(op: Option<&ResponseOp>) -> Option<&elastix_etcd::pb::etcdserverpb::RangeResponse> {
    match op.and_then(|op| op.response.as_ref()) {
        Some(Response::ResponseRange(range)) => Some(range),
        _ => None,
    }
}

/// The key a range operation (answer `index`) read, if it exists.
pub(super) fn found(response: &TxnResponse, index: usize) -> Option<&KeyValue> {
    range_of(response.responses.get(index)).and_then(|range| range.kvs.first())
}

/// The value a range operation (answer `index`) read.
pub(super) fn value(response: &TxnResponse, index: usize) -> Option<Vec<u8>> {
    found(response, index).map(|kv| kv.value.clone())
}

/// The count a counting range operation (answer `index`) gave.
pub(super) fn counted(response: &TxnResponse, index: usize) -> u64 {
    range_of(response.responses.get(index)).map_or(0, |range| range.count.max(0) as u64)
}

/// The count of an [`only_if`] counting operation (answer `index`); `None` if it did not run.
pub(super) fn counted_if(response: &TxnResponse, index: usize) -> Option<u64> {
    match response.responses.get(index).and_then(|op| op.response.as_ref()) {
        Some(Response::ResponseTxn(nested)) if nested.succeeded => Some(counted(nested, 0)),
        _ => None,
    }
}

/// The version a key reached with a [`put_counted`] (answer `index`).
pub(super) fn written_times(response: &TxnResponse, index: usize) -> u64 {
    match response.responses.get(index).and_then(|op| op.response.as_ref()) {
        Some(Response::ResponsePut(put)) => {
            put.prev_kv.as_ref().map_or(0, |previous| previous.version.max(0) as u64) + 1
        }
        _ => 0,
    }
}

/// A decimal number stored in etcd.
pub(super) fn number(bytes: &[u8], what: &str) -> Result<i64> {
    std::str::from_utf8(bytes).ok().and_then(|text| text.trim().parse().ok()).ok_or_else(|| {
        RendezvousError::State(format!(
            "the rendezvous {what} holds {:?}, not a number",
            String::from_utf8_lossy(bytes)
        ))
    })
}

pub(super) fn etcd_error(err: EtcdError, client: &EtcdClient) -> RendezvousError {
    match err {
        // it may come back: the callers that retry on a lost store do
        EtcdError::Unavailable { .. } => RendezvousError::Store(StoreError::ConnectionLost {
            peer: client.endpoints().to_owned(),
            reason: err.to_string(),
        }),
        EtcdError::Refused { .. } if err.is_lease_not_found() => RendezvousError::LeaseGone(err.to_string()),
        EtcdError::Refused { .. } => RendezvousError::State(err.to_string()),
        EtcdError::Config(message) => RendezvousError::Config(message),
    }
}
