//! torch's TCPStore semantics: key prefixing, `init/` accounting, masters and multi-tenancy.

use std::time::{Duration, Instant};

use elastix_core::store::{StoreError, TcpStore, TcpStoreOptions};

fn master(world_size: Option<u32>) -> TcpStoreOptions {
    TcpStoreOptions {
        world_size,
        is_master: true,
        timeout: Some(Duration::from_secs(30)),
        ..TcpStoreOptions::new("127.0.0.1", 0)
    }
}

fn worker(port: u16, world_size: Option<u32>) -> TcpStoreOptions {
    TcpStoreOptions { world_size, timeout: Some(Duration::from_secs(30)), ..TcpStoreOptions::new("127.0.0.1", port) }
}

#[tokio::test]
async fn user_keys_are_prefixed_and_init_is_counted_but_hidden() {
    let mut store = TcpStore::open(master(Some(1))).await.unwrap();
    assert!(store.is_server());
    assert_ne!(store.port(), 0);
    store.set(b"key0", b"value0").await.unwrap();
    store.add(b"cnt", 3).await.unwrap();
    assert_eq!(store.num_keys().await.unwrap(), 3, "init/ counts");
    let mut keys = store.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, vec!["cnt", "key0"], "init/ is hidden");
    let mut raw = store.duplicate().await.unwrap();
    assert_eq!(raw.client().remote_addr().port(), store.port());
    assert_eq!(raw.get(b"key0").await.unwrap(), "value0");
    let err = store.multi_set(&[b"a", b"b"], &[b"1"]).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)), "{err}");
}

#[tokio::test]
async fn a_master_waits_for_its_workers() {
    // the master serves on a socket bound here, so that the workers know its port up front
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
    let port = socket.local_addr().unwrap().as_socket().unwrap().port();
    let listen_fd = Some(std::sync::Arc::new(std::os::fd::OwnedFd::from(socket)));
    let mut master = tokio::spawn(TcpStore::open(TcpStoreOptions { port, listen_fd, ..master(Some(3)) }));
    let _first = TcpStore::open(worker(port, Some(3))).await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(100), &mut master).await;
    assert!(early.is_err(), "the master must wait for the second worker");
    let _second = TcpStore::open(worker(port, Some(3))).await.unwrap();
    let mut master = tokio::time::timeout(Duration::from_secs(30), master).await.unwrap().unwrap().unwrap();
    assert_eq!(master.num_keys().await.unwrap(), 1, "only init/");
    assert_eq!(master.client().remote_addr().port(), port);
}

#[tokio::test]
async fn a_master_without_its_workers_times_out_with_a_count() {
    let options = TcpStoreOptions { timeout: Some(Duration::from_millis(300)), ..master(Some(2)) };
    let start = Instant::now();
    let err = TcpStore::open(options).await.err().unwrap();
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(err.is_timeout());
    assert!(err.to_string().contains("1/2 clients joined"), "{err}");
}

#[tokio::test]
async fn multi_tenant_masters_share_one_server() {
    let first = TcpStore::open(TcpStoreOptions { multi_tenant: true, ..master(None) }).await.unwrap();
    let port = first.port();
    let mut second = TcpStore::open(TcpStoreOptions { multi_tenant: true, port, ..master(None) }).await.unwrap();
    second.set(b"shared", b"yes").await.unwrap();
    let mut first = first;
    assert_eq!(first.get(b"shared").await.unwrap(), "yes");

    let err = TcpStore::open(TcpStoreOptions { port, ..master(None) }).await.err().unwrap();
    assert!(matches!(err, StoreError::Listen(_)), "{err}");
    assert!(err.to_string().contains(&port.to_string()), "{err}");

    let mut fallback =
        TcpStore::open(TcpStoreOptions { port, client_if_port_taken: true, ..master(None) }).await.unwrap();
    assert!(!fallback.is_server());
    assert_eq!(fallback.get(b"shared").await.unwrap(), "yes");
}

#[tokio::test]
async fn a_duplicate_keeps_the_in_process_server_alive() {
    let master = TcpStore::open(master(None)).await.unwrap();
    let mut copy = master.duplicate().await.unwrap();
    drop(master);
    copy.set(b"still", b"here").await.unwrap();
    assert_eq!(copy.get(b"still").await.unwrap(), "here");
}

#[tokio::test]
async fn barrier_timeout_names_the_users_key() {
    let mut store = TcpStore::open(master(None)).await.unwrap();
    let err = store.barrier(b"bar2", 2, Some(Duration::from_millis(50))).await.unwrap_err();
    assert_eq!(err.to_string(), "barrier timeout after 50ms, key: bar2");
    store.barrier(b"bar", 1, None).await.unwrap();
}
