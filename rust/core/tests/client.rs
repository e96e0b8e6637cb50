//! The client against the elastix server and against deliberately broken fake servers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastix_core::interrupt::Interrupt;
use elastix_core::store::{Client, ConnectOptions, ServerConfig, StoreError, StoreServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Bounds every wait: generous, so that only a broken client or server runs into it.
const PATIENCE: Duration = Duration::from_secs(30);

fn options(port: u16) -> ConnectOptions {
    ConnectOptions::new("127.0.0.1", port, Some(PATIENCE))
}

/// Waits until `n` clients are blocked in the server (a bounded poll of its own count).
async fn until_waiting(server: &StoreServer, n: usize) {
    let deadline = Instant::now() + PATIENCE;
    while server.waiting() != n {
        assert!(Instant::now() < deadline, "{} waiting clients, expected {n}", server.waiting());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn server_and_client() -> (StoreServer, Client) {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let client = Client::connect(&options(server.port())).await.unwrap();
    (server, client)
}

#[tokio::test]
async fn every_operation_round_trips() {
    let (_server, mut c) = server_and_client().await;
    c.set(b"k", b"v").await.unwrap();
    assert_eq!(c.get(b"k", None).await.unwrap(), "v");
    assert_eq!(c.get_now(b"missing").await.unwrap(), "");
    assert_eq!(c.add(b"n", 5).await.unwrap(), 5);
    assert_eq!(c.add(b"n", -7).await.unwrap(), -2);
    assert_eq!(c.compare_set(b"cs", b"", b"first").await.unwrap(), "first");
    assert_eq!(c.compare_set(b"cs", b"wrong", b"x").await.unwrap(), "first");
    assert_eq!(c.compare_set(b"cs", b"first", b"second").await.unwrap(), "second");
    assert!(c.check(&[b"k", b"n"]).await.unwrap());
    assert!(!c.check(&[b"k", b"nope"]).await.unwrap());
    c.wait(&[b"k", b"cs"], Some(Duration::from_secs(1))).await.unwrap();
    c.append(b"a", b"po").await.unwrap();
    c.append(b"a", b"tato").await.unwrap();
    c.multi_set(&[(b"m1", b"1"), (b"m2", b"22")]).await.unwrap();
    let values = c.multi_get(&[b"a", b"m1", b"m2"], None).await.unwrap();
    assert_eq!(values, vec!["potato", "1", "22"]);
    assert_eq!(c.num_keys().await.unwrap(), 6);
    assert!(c.delete_key(b"m1").await.unwrap());
    assert!(!c.delete_key(b"m1").await.unwrap());
    let mut keys = c.list_keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, vec!["a", "cs", "k", "m2", "n"]);
    c.queue_push(b"q", b"x1").await.unwrap();
    c.queue_push(b"q", b"x2").await.unwrap();
    assert_eq!(c.queue_len(b"q").await.unwrap(), 2);
    assert_eq!(c.queue_pop(b"q", true, None).await.unwrap(), "x1");
    assert_eq!(c.queue_pop(b"q", false, None).await.unwrap(), "x2");
    assert!(matches!(c.queue_pop(b"q", false, None).await, Err(StoreError::QueueEmpty)));
    c.barrier(b"bar", 1, None).await.unwrap();
    c.ping().await.unwrap();
}

#[tokio::test]
async fn a_timed_out_wait_names_its_keys_and_leaves_the_connection_usable() {
    let (_server, mut c) = server_and_client().await;
    let start = Instant::now();
    let err = c.wait(&[b"/nokey"], Some(Duration::from_millis(200))).await.unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(err.is_timeout());
    assert_eq!(err.to_string(), "wait timeout after 200ms, keys: /nokey");
    let err = c.get(b"/nokey2", Some(Duration::ZERO)).await.unwrap_err();
    assert_eq!(err.to_string(), "wait timeout after 0ms, keys: /nokey2");
    let err = c.barrier(b"b", 2, Some(Duration::from_millis(50))).await.unwrap_err();
    assert_eq!(err.to_string(), "barrier timeout after 50ms, key: b");
    c.set(b"/the_key", b"x").await.unwrap();
    assert_eq!(c.get(b"/the_key", None).await.unwrap(), "x");
}

#[tokio::test]
async fn a_wait_released_by_another_client() {
    let (server, mut waiter) = server_and_client().await;
    let mut setter = Client::connect(&options(server.port())).await.unwrap();
    let wait = tokio::spawn(async move { waiter.get(b"late", Some(PATIENCE)).await.unwrap() });
    until_waiting(&server, 1).await;
    setter.set(b"late", b"here").await.unwrap();
    assert_eq!(wait.await.unwrap(), "here");
}

#[tokio::test]
async fn a_wait_whose_keys_exist_succeeds_even_with_a_zero_timeout() {
    let (_server, mut c) = server_and_client().await;
    c.set(b"k", b"v").await.unwrap();
    // The STOP_WAITING may arrive after the zero timeout fired; the cancel then sees
    // `00 01` and the wait counts as released.
    for _ in 0..50 {
        c.wait(&[b"k"], Some(Duration::ZERO)).await.unwrap();
    }
}

#[tokio::test]
async fn an_interrupt_check_ends_a_wait_cleanly() {
    let (_server, mut c) = server_and_client().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    c.set_interrupt(Interrupt::new(move || counted.fetch_add(1, Ordering::SeqCst) >= 3));
    let err = c.wait(&[b"never"], None).await.unwrap_err();
    assert!(matches!(err, StoreError::Interrupted), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    c.set_interrupt(Interrupt::never());
    c.set(b"after", b"ok").await.unwrap();
    assert_eq!(c.get_now(b"after").await.unwrap(), "ok");
}

#[tokio::test]
async fn an_abandoned_operation_makes_the_connection_refuse_further_use() {
    let (_server, mut c) = server_and_client().await;
    // dropped before the reply: the stream position is unknown from now on
    let _ = tokio::time::timeout(Duration::from_millis(20), c.wait(&[b"never"], None)).await;
    let err = c.num_keys().await.unwrap_err();
    assert!(matches!(err, StoreError::ConnectionLost { .. }), "{err}");
    assert!(err.to_string().contains("abandoned"), "{err}");
}

#[tokio::test]
async fn connecting_to_a_closed_port_retries_then_names_what_it_tried() {
    // bound but not listening: connections are refused, and nobody else can take the port
    let closed = tokio::net::TcpSocket::new_v4().unwrap();
    closed.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = closed.local_addr().unwrap().port();
    let start = Instant::now();
    let timeout = Duration::from_secs(1);
    let err = Client::connect(&ConnectOptions::new("127.0.0.1", port, Some(timeout))).await.err().unwrap();
    assert!(start.elapsed() >= timeout);
    assert!(err.is_timeout());
    let message = err.to_string();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(message.contains("refused"), "{message}");
    let StoreError::ConnectTimeout { attempts, .. } = err else { panic!("{err:?}") };
    assert!(attempts >= 2, "a refused connection is retried, made {attempts} attempt(s)");
}

#[tokio::test]
async fn a_client_started_before_its_server_connects_once_it_is_up() {
    // the socket the server will serve on; until then nothing answers the client: its first
    // connection is accepted here and closed without a handshake
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = tokio::spawn(async move { Client::connect(&options(port)).await });
    let (first_attempt, _) = tokio::time::timeout(PATIENCE, listener.accept()).await.unwrap().unwrap();
    drop(first_attempt);
    let fd = std::sync::Arc::new(std::os::fd::OwnedFd::from(listener.into_std().unwrap()));
    let server = StoreServer::start(&ServerConfig { port, listen_fd: Some(fd), ..ServerConfig::default() }).unwrap();
    let mut client = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap().unwrap();
    client.ping().await.unwrap();
    drop(server);
}

#[tokio::test]
async fn an_unresolvable_host_is_reported() {
    let err = Client::connect(&ConnectOptions::new("no-such-host.invalid", 1, Some(Duration::from_millis(100))))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("cannot resolve"), "{err}");
}

/// A fake server that completes the handshake with a wrong nonce, or never answers.
async fn fake_server(answer_ping: Option<u32>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; 10];
            if socket.read_exact(&mut hello).await.is_ok() {
                if let Some(nonce) = answer_ping {
                    socket.write_all(&nonce.to_le_bytes()).await.unwrap();
                }
            }
            held.push(socket);
        }
    });
    port
}

#[tokio::test]
async fn a_wrong_ping_echo_is_refused() {
    let port = fake_server(Some(0xbad)).await;
    let err =
        Client::connect(&ConnectOptions::new("127.0.0.1", port, Some(Duration::from_millis(200)))).await.err().unwrap();
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
    assert!(err.to_string().contains("answered 0x00000bad to the opening PING, which must echo"), "{err}");
}

#[tokio::test]
async fn a_silent_server_cannot_hang_the_handshake() {
    let port = fake_server(None).await;
    let options = ConnectOptions::new("127.0.0.1", port, Some(Duration::from_millis(300)));
    let err =
        tokio::time::timeout(PATIENCE, Client::connect(&options)).await.expect("the handshake hung").err().unwrap();
    assert!(err.to_string().contains("no PING reply"), "{err}");
}

#[tokio::test]
async fn a_server_that_stops_replying_is_a_reply_timeout() {
    // handshake answered with the right nonce, then silence
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; 10];
        socket.read_exact(&mut hello).await.unwrap();
        socket.write_all(&hello[6..10]).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let mut c = Client::connect(&options(port)).await.unwrap();
    c.set_reply_timeout(Some(Duration::from_millis(100)));
    let err = c.num_keys().await.unwrap_err();
    assert!(matches!(err, StoreError::ReplyTimeout { .. }), "{err}");
    assert!(err.is_timeout());
}

#[tokio::test]
async fn a_server_shutdown_ends_a_blocked_wait_with_a_clear_error() {
    let (server, mut c) = server_and_client().await;
    let wait = tokio::spawn(async move { c.wait(&[b"never"], None).await });
    until_waiting(&server, 1).await;
    server.shutdown().await;
    let err = tokio::time::timeout(PATIENCE, wait).await.unwrap().unwrap().unwrap_err();
    assert!(matches!(err, StoreError::ConnectionLost { .. }), "{err}");
    assert!(err.to_string().contains("closed the connection"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_clients() {
    let server = StoreServer::start(&ServerConfig::default()).unwrap();
    let port = server.port();
    let mut tasks = Vec::new();
    for i in 0..1200u32 {
        tasks.push(tokio::spawn(async move {
            let mut c =
                Client::connect(&ConnectOptions::new("127.0.0.1", port, Some(Duration::from_secs(30)))).await.unwrap();
            c.add(b"count", 1).await.unwrap();
            c.set(format!("k{i}").as_bytes(), b"v").await.unwrap();
            // everyone waits until the last one has arrived: all 1200 are connected at once
            c.wait(&[b"go"], Some(Duration::from_secs(30))).await.unwrap();
            c
        }));
    }
    let mut master = Client::connect(&options(port)).await.unwrap();
    let arrived = server.wait_for_counter(b"count", 1200, Some(Duration::from_secs(60))).await;
    assert_eq!(arrived, Ok(1200), "clients did not all arrive");
    assert_eq!(server.connections(), 1201);
    master.set(b"go", b"").await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(master.num_keys().await.unwrap(), 1202);
}

#[tokio::test]
async fn something_that_is_not_a_store_is_an_error_at_once_not_a_retry_until_the_deadline() {
    // a web server: whatever it is sent, it answers with an HTTP status line and closes
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let serving = tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut request = [0u8; 64];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").await;
            });
        }
    });
    let err = Client::connect(&options(port)).await.err().expect("an HTTP server is no store");
    // final: not a connect timeout after retrying until the deadline
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
    let said = err.to_string();
    assert!(said.contains(&format!("127.0.0.1:{port} is not a TCPStore server")) && said.contains("HTTP"), "{said}");
    serving.abort();
}
