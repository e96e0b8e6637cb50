//! Step 2 of joining a round: the seal, and the round's size published at it.

use elastix_etcd::pb::etcdserverpb::request_op::Request;
use elastix_etcd::pb::etcdserverpb::TxnRequest;

use super::{Ctx, SealAttempt, SealMark, Size};
use crate::rendezvous::error::Result;
use crate::rendezvous::etcd::ops;
use crate::rendezvous::records::{decode, encode, Master, FORMAT_VERSION};

/// Round r's outcome as read at once (after its watch was compacted away).
pub(super) struct OutcomeRead {
    pub cutoff: Option<(i64, u32)>,
    pub size: Option<Size>,
    pub master: Option<Master>,
    pub closed: Option<String>,
}

impl Ctx<'_> {
    /// Seals round `r` with the first `cutoff` members, if it is not sealed and round r-1 has
    /// no members left.
    pub(super) async fn try_seal(&self, r: u64, cutoff: u32) -> Result<SealAttempt> {
        let keys = self.keys;
        let mut compare = vec![ops::absent(&keys.seal(r))];
        if r > 0 {
            compare.push(ops::empty(&keys.members(r - 1)));
        }
        let mark = encode(&SealMark { v: FORMAT_VERSION, cutoff });
        let request = TxnRequest {
            compare,
            success: vec![
                ops::put(&keys.seal(r), &mark, 0),
                ops::put(&keys.round(), r.to_string().as_bytes(), 0),
                ops::count(&keys.members(r), 0),
                ops::get(&keys.joined(r)),
            ],
            failure: vec![ops::get(&keys.seal(r)), ops::count(&keys.members(r.saturating_sub(1)), 0)],
        };
        let response = self.txn(request).await?;
        if !response.succeeded {
            if ops::found(&response, 0).is_some() || r == 0 {
                return Ok(SealAttempt::Taken);
            }
            return Ok(SealAttempt::PreviousBusy {
                count: ops::counted(&response, 1),
                revision: ops::revision(&response),
            });
        }
        let revision = ops::revision(&response);
        let live = ops::counted(&response, 2);
        let joins = ops::found(&response, 3).map_or(0, |kv| kv.version.max(0) as u64);
        tracing::debug!(round = r, live, "sealed the round");
        Ok(SealAttempt::Sealed(self.publish_size(r, revision, cutoff, Some((live, joins))).await?))
    }

    /// Publishes the size of round `r` at its seal (`sealed_at`): as the sealer counted it,
    /// or read at the seal (the sealer died before it published it).
    pub(super) async fn publish_size(
        &self,
        r: u64,
        sealed_at: i64,
        cutoff: u32,
        counted: Option<(u64, u64)>,
    ) -> Result<Size> {
        let keys = self.keys;
        let (live, joins) = match counted {
            Some(counted) => counted,
            None => {
                let mut joined = ops::get(&keys.joined(r));
                if let Some(Request::RequestRange(range)) = joined.request.as_mut() {
                    range.revision = sealed_at;
                }
                let success = vec![ops::count(&keys.members(r), sealed_at), joined];
                let response = self.txn(TxnRequest { success, ..Default::default() }).await?;
                (ops::counted(&response, 0), ops::found(&response, 1).map_or(0, |kv| kv.version.max(0) as u64))
            }
        };
        let last_member = if live > u64::from(cutoff) {
            let request = ops::first_created(&keys.members(r), sealed_at, cutoff);
            let response = self.client.range(request).await.map_err(|err| self.error(err))?;
            response.kvs.last().map_or(i64::MAX, |kv| kv.create_revision)
        } else {
            i64::MAX // every key is a member's
        };
        let size = Size { v: FORMAT_VERSION, revision: sealed_at, cutoff, live, joins, last_member };
        self.client.put(&keys.size(r), &encode(&size)).await.map_err(|err| self.error(err))?;
        Ok(size)
    }

    /// Round r's outcome read afresh (after its watch was compacted away), and the revision.
    pub(super) async fn read_outcome(&self, r: u64) -> Result<(OutcomeRead, i64)> {
        let keys = self.keys;
        let request = TxnRequest {
            success: vec![
                ops::get(&keys.seal(r)),
                ops::get(&keys.size(r)),
                ops::get(&keys.master(r)),
                ops::get(&keys.closed_marker(r)),
            ],
            ..Default::default()
        };
        let response = self.txn(request).await?;
        let cutoff = match ops::found(&response, 0) {
            Some(kv) => Some((kv.mod_revision, decode::<SealMark>(&kv.value, "seal")?.cutoff)),
            None => None,
        };
        let read = OutcomeRead {
            cutoff,
            size: ops::value(&response, 1).map(|bytes| decode(&bytes, "round size")).transpose()?,
            master: ops::value(&response, 2).map(|bytes| decode(&bytes, "master address")).transpose()?,
            closed: ops::value(&response, 3).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
        };
        Ok((read, ops::revision(&response)))
    }
}
