//! The connection cap: clients past `max_connections` are refused at once (EOF, not a hang in
//! the backlog) while the served ones go on, and a closed connection frees its place.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use elastix_core::store::ServerConfig;

mod common;
use common::{on_both_servers, Engine, Server};

/// VALIDATE then PING 7: true when the echo comes back, false on EOF or reset.
fn ping(stream: &mut TcpStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    if stream.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 7, 0, 0, 0]).is_err() {
        return false;
    }
    let mut echo = [0u8; 4];
    stream.read_exact(&mut echo).is_ok() && echo == [7, 0, 0, 0]
}

/// PING 9 on an already validated connection.
fn ping_again(stream: &mut TcpStream) -> bool {
    stream.write_all(&[0x0d, 9, 0, 0, 0]).unwrap();
    let mut echo = [0u8; 4];
    stream.read_exact(&mut echo).is_ok() && echo == [9, 0, 0, 0]
}

/// True when the server closes the connection (EOF or reset) instead of serving it; a client
/// left waiting (the read times out) is not refused.
fn refused(stream: &mut TcpStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = stream.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 7, 0, 0, 0]);
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(err) => matches!(err.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe),
    }
}

fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(("127.0.0.1", server.port())).unwrap()
}

fn clients_past_the_cap_are_refused_at_once_and_the_served_ones_go_on(engine: Engine) {
    let config = ServerConfig { max_connections: 3, ..ServerConfig::default() };
    let server = Server::start(engine, &config);
    let mut served: Vec<TcpStream> = (0..3).map(|_| connect(&server)).collect();
    for stream in &mut served {
        assert!(ping(stream));
    }
    for _ in 0..5 {
        let mut extra = connect(&server);
        assert!(refused(&mut extra), "a client past the cap must be closed at once, not served or left waiting");
    }
    assert_eq!(server.refused(), 5);
    for stream in &mut served {
        assert!(ping_again(stream), "served clients go on");
    }
    // a closed connection frees its place
    drop(served.pop());
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.connections() != 2 {
        assert!(Instant::now() < deadline, "the closed connection was never counted out");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut next = connect(&server);
    assert!(ping(&mut next));
}

#[test]
fn the_default_cap_fits_the_open_file_limit() {
    let limit = elastix_core::store::server::listener::open_file_limit().unwrap();
    let cap = ServerConfig::default_max_connections() as u64;
    assert!(cap >= 1 && cap < limit.max(2) && cap <= ServerConfig::MOST_CONNECTIONS as u64, "{cap} of {limit}");
}

#[test]
fn both_ends_of_a_store_connection_keep_alive() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let server = elastix_core::store::StoreServer::start(&ServerConfig::default()).unwrap();
        let options =
            elastix_core::store::ConnectOptions::new("127.0.0.1", server.port(), Some(Duration::from_secs(30)));
        let client = elastix_core::store::Client::connect(&options).await.unwrap();
        assert!(client.keepalive().unwrap(), "the client's socket has SO_KEEPALIVE");
    });
}

fn send(stream: &mut TcpStream, requests: &[elastix_core::store::request::Request]) {
    let mut out = bytes::BytesMut::new();
    for request in requests {
        request.encode(&mut out);
    }
    stream.write_all(&out).unwrap();
}

fn an_idle_timeout_closes_silent_clients_but_not_waiting_or_talking_ones(engine: Engine) {
    use elastix_core::store::request::{Keys, Request};
    let idle = Duration::from_millis(300);
    let config = ServerConfig { idle_timeout: Some(idle), ..ServerConfig::default() };
    let server = Server::start(engine, &config);
    let mut silent = connect(&server);
    let mut waiting = connect(&server);
    let mut talking = connect(&server);
    for stream in [&mut silent, &mut waiting, &mut talking] {
        assert!(ping(stream));
    }
    send(&mut waiting, &[Request::Wait { keys: Keys::from_iter([&b"/later"[..]]) }]);
    // the talking client keeps sending for several idle timeouts
    let until = Instant::now() + idle * 4;
    while Instant::now() < until {
        assert!(ping_again(&mut talking), "a client that talks is never idle");
        std::thread::sleep(idle / 4);
    }
    let mut byte = [0u8; 1];
    assert_eq!(silent.read(&mut byte).unwrap(), 0, "the silent client was closed (EOF)");
    let mut writer = connect(&server);
    assert!(ping(&mut writer));
    send(&mut writer, &[Request::Set { key: b"/later", value: b"v" }]);
    waiting.read_exact(&mut byte).unwrap();
    assert_eq!(byte, [0], "the waiting client got its STOP_WAITING, not EOF");
}

on_both_servers!(
    clients_past_the_cap_are_refused_at_once_and_the_served_ones_go_on,
    an_idle_timeout_closes_silent_clients_but_not_waiting_or_talking_ones,
);
