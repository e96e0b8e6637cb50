//! elastix's etcd v3 client: the gRPC API generated from etcd's definitions (KV, Watch,
//! Lease), and a small client over it that spreads requests over a cluster's endpoints,
//! retries through leader changes and lost members, watches ranges of keys from a revision
//! (never polling), and keeps leases alive.

mod client;
mod lease;
mod retry;
#[cfg(feature = "testing")]
pub mod testing;
mod watch;

pub use client::{
    put_op, range_op, requests_sent, EtcdClient, EtcdError, EtcdOptions, RequestCounts, TlsFiles, MAX_TXN_OPS,
};
pub use lease::{KeepAlive, Lease, LeaseState};
pub use watch::{WatchItem, Watcher};

/// The generated API. Only the client side is built.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod authpb {
        tonic::include_proto!("authpb");
    }
}
