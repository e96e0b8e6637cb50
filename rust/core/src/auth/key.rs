//! The keys connections prove: the job's (the store's connections) and a group's (one round's
//! RPC or collectives connections), both derived from the job secret so that a key learnt from
//! one use opens nothing else.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::secret::Secret;

/// A key two peers prove they hold. Never shown: its `Debug` names only its kind.
#[derive(Clone)]
pub struct Key {
    bytes: Arc<[u8]>,
    kind: &'static str,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({})", self.kind)
    }
}

/// HMAC-SHA256 under `key` of `parts`, one after another.
fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

impl Key {
    /// The key of the job's store connections.
    pub fn job(secret: &Secret) -> Key {
        Key { bytes: Arc::from(hmac(secret.key(), &[b"elastix job key v2"])), kind: "job" }
    }

    /// A group's key for one round: `nonce` is drawn by the group's rank 0 and published in the
    /// group's store; `label` keeps the keys of different uses of one nonce apart. Without a job
    /// secret the nonce itself is the key, as private as the store it came from.
    pub fn group(secret: Option<&Secret>, label: &[u8], nonce: &[u8]) -> Key {
        match secret {
            Some(secret) => Key { bytes: Arc::from(hmac(secret.key(), &[label, nonce])), kind: "group" },
            None => Key { bytes: Arc::from(nonce), kind: "group, without a job secret" },
        }
    }

    /// A key given as bytes (tests; peers that agreed on one some other way).
    pub fn from_bytes(bytes: &[u8]) -> Key {
        Key { bytes: Arc::from(bytes), kind: "given" }
    }

    pub(super) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        hmac(&self.bytes, parts)
    }

    /// The key itself, for the session keys derived from it ([`super::session`]).
    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_use_and_never_show() {
        let secret = Secret::from_bytes("a-long-enough-job-secret-0123456789").unwrap();
        let job = Key::job(&secret);
        let rpc = Key::group(Some(&secret), b"rpc", &[1; 32]);
        let collectives = Key::group(Some(&secret), b"collectives", &[1; 32]);
        assert_ne!(job.bytes, rpc.bytes);
        assert_ne!(rpc.bytes, collectives.bytes);
        assert_ne!(&*job.bytes, secret.key(), "the secret itself is never a key");
        assert_eq!(&*Key::group(None, b"rpc", &[1; 32]).bytes, &[1; 32]);
        assert_eq!(format!("{rpc:?}"), "Key(group)");
    }
}
