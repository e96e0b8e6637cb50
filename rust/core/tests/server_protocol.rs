//! The server seen through raw sockets: framing, waits and wake-ups, and bad input, checked
//! against the behaviour recorded from torch's servers (`tests/vectors/tcpstore_raw_experiments.json`,
//! experiment names in the comments) and where elastix deliberately does better.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use elastix_core::store::request::{Keys, Request};
use elastix_core::store::{Limits, ServerConfig};

mod common;
use common::{on_both_servers, Engine, Server};

const MAGIC: u32 = 0x3C85_F7CE;

fn server(engine: Engine) -> Server {
    Server::start(engine, &ServerConfig::default())
}

/// Waits until `n` clients are blocked in the server (a bounded poll of its own count), so
/// that what follows happens after their waits were registered.
fn until_waiting(server: &Server, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.waiting() != n {
        assert!(Instant::now() < deadline, "{} waiting clients, expected {n}", server.waiting());
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn bytes_of(requests: &[Request]) -> Vec<u8> {
    let mut out = BytesMut::new();
    for request in requests {
        request.encode(&mut out);
    }
    out.to_vec()
}

fn str_reply(value: &[u8]) -> Vec<u8> {
    [&(value.len() as u64).to_le_bytes()[..], value].concat()
}

struct Raw(TcpStream);

impl Raw {
    fn open(server: &Server) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        stream.set_nodelay(true).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Raw(stream)
    }

    fn validated(server: &Server) -> Raw {
        let mut raw = Raw::open(server);
        raw.send(&[Request::Validate { magic: MAGIC }]);
        raw
    }

    fn send(&mut self, requests: &[Request]) {
        self.0.write_all(&bytes_of(requests)).unwrap();
    }

    fn read(&mut self, n: usize) -> Vec<u8> {
        let mut reply = vec![0u8; n];
        self.0.read_exact(&mut reply).unwrap();
        reply
    }

    /// Nothing arrives within a short while.
    fn silent(&mut self) -> bool {
        self.0.set_read_timeout(Some(Duration::from_millis(150))).unwrap();
        let mut byte = [0u8; 1];
        let silent =
            matches!(self.0.read(&mut byte), Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut));
        self.0.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        silent
    }

    /// The server closed the connection (EOF or reset), possibly after a short delay.
    fn closed_by_server(&mut self) -> bool {
        let mut buf = [0u8; 64];
        loop {
            match self.0.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    fn ping(&mut self, nonce: u32) -> bool {
        if self.0.write_all(&bytes_of(&[Request::Ping { nonce }])).is_err() {
            return false;
        }
        let mut reply = [0u8; 4];
        self.0.read_exact(&mut reply).is_ok() && u32::from_le_bytes(reply) == nonce
    }
}

fn get(server: &Server, key: &[u8]) -> Vec<u8> {
    let mut raw = Raw::validated(server);
    raw.send(&[Request::Get { key }]);
    let len = u64::from_le_bytes(raw.read(8).try_into().unwrap()) as usize;
    raw.read(len)
}

fn pipelined_requests_in_one_segment_are_answered_in_order(engine: Engine) {
    // E7
    let server = server(engine);
    let mut raw = Raw::open(&server);
    raw.send(&[
        Request::Validate { magic: MAGIC },
        Request::Ping { nonce: 42 },
        Request::Set { key: b"/p", value: b"pv" },
        Request::Get { key: b"/p" },
        Request::GetNumKeys,
    ]);
    let expected = [&42u32.to_le_bytes()[..], &str_reply(b"pv"), &1i64.to_le_bytes()].concat();
    assert_eq!(raw.read(expected.len()), expected);
}

fn bursts_and_large_values_through_buffers_that_start_small_and_adapt(engine: Engine) {
    // a connection's buffers start at hundreds of bytes: thousands of pipelined requests, a
    // 4 MiB value each way, then small requests again, all on one connection
    let server = server(engine);
    let mut raw = Raw::validated(&server);
    let burst: Vec<Request> = (0..5_000u32).map(|nonce| Request::Ping { nonce }).collect();
    raw.send(&burst);
    let echoed = raw.read(4 * burst.len());
    assert!(echoed.chunks(4).enumerate().all(|(i, reply)| reply == (i as u32).to_le_bytes()));
    let large: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
    let writer = raw.0.try_clone().unwrap();
    let sent = large.clone();
    let sending = std::thread::spawn(move || {
        let mut writer = writer;
        writer.write_all(&bytes_of(&[Request::Set { key: b"/large", value: &sent }, Request::Get { key: b"/large" }]))
    });
    assert_eq!(raw.read(8 + large.len()), str_reply(&large));
    sending.join().unwrap().unwrap();
    for nonce in 0..100 {
        assert!(raw.ping(nonce), "ping {nonce} after the large value");
    }
}

fn many_clients_sending_large_values_at_once_are_all_served(engine: Engine) {
    // 32 clients write 2 MiB each at the same moment, 16 times what io_uring's shared receive
    // pool holds (rust/store/tests/cli.rs empties it for sure, with the server stopped)
    let server = server(engine);
    let writers: Vec<_> = (0..32u8)
        .map(|i| {
            let mut raw = Raw::validated(&server);
            std::thread::spawn(move || {
                let key = format!("/large/{i}").into_bytes();
                let value = vec![i; 2 << 20];
                raw.send(&[Request::Set { key: &key, value: &value }, Request::Get { key: &key }]);
                assert_eq!(u64::from_le_bytes(raw.read(8).try_into().unwrap()), value.len() as u64);
                assert!(raw.read(value.len()) == value, "client {i} read back another value");
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    assert!(Raw::validated(&server).ping(3));
}

fn requests_arriving_byte_by_byte_are_reassembled(engine: Engine) {
    // E8, and E22: torch's libuv server closes a connection whose VALIDATE is split.
    let server = server(engine);
    let mut raw = Raw::open(&server);
    let wire = bytes_of(&[
        Request::Validate { magic: MAGIC },
        Request::Set { key: b"/slow", value: b"slow" },
        Request::Get { key: b"/slow" },
    ]);
    for byte in wire {
        raw.0.write_all(&[byte]).unwrap();
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(raw.read(12), str_reply(b"slow"));
}

fn a_partial_request_does_not_stall_other_clients(engine: Engine) {
    // E23: torch's legacy server stalls everyone until the partial request completes.
    let server = server(engine);
    let mut stalled = Raw::validated(&server);
    let wire = bytes_of(&[Request::Set { key: b"/half", value: b"0123456789" }]);
    stalled.0.write_all(&wire[..wire.len() - 3]).unwrap();
    let mut other = Raw::validated(&server);
    assert!(other.ping(11));
    stalled.0.write_all(&wire[wire.len() - 3..]).unwrap();
    assert!(stalled.ping(12));
    assert_eq!(get(&server, b"/half"), b"0123456789");
}

fn a_connection_must_start_with_a_valid_validate(engine: Engine) {
    let server = server(engine);
    // E1: a SET first is refused and not applied (libuv would apply it later)
    let mut raw = Raw::open(&server);
    raw.send(&[Request::Set { key: b"/e1", value: b"v" }, Request::Ping { nonce: 7 }]);
    assert!(raw.closed_by_server());
    // E2: wrong magic
    let mut raw = Raw::open(&server);
    raw.send(&[Request::Validate { magic: 0xdead_beef }]);
    assert!(raw.closed_by_server());
    // E2b: HTTP instead of the protocol
    let mut raw = Raw::open(&server);
    raw.0.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(raw.closed_by_server());
    // E3: VALIDATE twice
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Validate { magic: MAGIC }]);
    assert!(raw.closed_by_server());
    // E4: unknown opcode after validation
    let mut raw = Raw::validated(&server);
    raw.0.write_all(&[0x63]).unwrap();
    assert!(raw.closed_by_server());
    // nothing leaked into the data, and the server still serves
    assert_eq!(get(&server, b"/e1"), b"");
    assert!(Raw::validated(&server).ping(1));
}

fn size_limits_close_only_the_offending_connection(engine: Engine) {
    // E9: keys up to 8192 bytes and values up to 8 MiB are accepted, one more byte is not.
    let server = server(engine);
    let limits = Limits::default();
    let mut bystander = Raw::validated(&server);
    let key = vec![b'k'; limits.max_key_len];
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Set { key: &key, value: b"v" }]);
    assert!(raw.ping(77));
    let long_key = vec![b'k'; limits.max_key_len + 1];
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Set { key: &long_key, value: b"v" }]);
    assert!(raw.closed_by_server());

    let value = vec![b'v'; limits.max_value_len];
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Set { key: b"/big", value: &value }]);
    assert!(raw.ping(78));
    // too long: rejected from the header alone, before the 8 MiB arrive
    let mut raw = Raw::validated(&server);
    let mut header = vec![1u8];
    header.extend(4u64.to_le_bytes());
    header.extend(b"/big");
    header.extend((limits.max_value_len as u64 + 1).to_le_bytes());
    raw.0.write_all(&header).unwrap();
    assert!(raw.closed_by_server());

    // a count of 131073 keys, header only
    let mut raw = Raw::validated(&server);
    let mut header = vec![6u8];
    header.extend((limits.max_keys_per_request as u64 + 1).to_le_bytes());
    raw.0.write_all(&header).unwrap();
    assert!(raw.closed_by_server());
    // a huge announced length does not make the server allocate it
    let mut raw = Raw::validated(&server);
    let mut header = vec![1u8];
    header.extend(u64::MAX.to_le_bytes());
    raw.0.write_all(&header).unwrap();
    assert!(raw.closed_by_server());

    assert!(bystander.ping(79));
    assert_eq!(get(&server, b"/big").len(), limits.max_value_len);
}

fn configured_limits_are_enforced(engine: Engine) {
    let config = ServerConfig {
        limits: Limits { max_key_len: 16, max_value_len: 32, max_keys_per_request: 2 },
        ..ServerConfig::default()
    };
    let server = Server::start(engine, &config);
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Set { key: b"/ok", value: &[0u8; 32] }]);
    assert!(raw.ping(1));
    raw.send(&[Request::Set { key: b"/ok", value: &[0u8; 33] }]);
    assert!(raw.closed_by_server());
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Check { keys: Keys::from_iter([&b"/a"[..], b"/b", b"/c"]) }]);
    assert!(raw.closed_by_server());
}

fn add_on_a_non_integer_closes_that_connection_only(engine: Engine) {
    // E6
    let server = server(engine);
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Set { key: b"/t", value: b"12abc" }, Request::Add { key: b"/t", delta: 1 }]);
    assert_eq!(raw.read(8), 13i64.to_le_bytes());
    raw.send(&[Request::Set { key: b"/t", value: b"abc" }, Request::Add { key: b"/t", delta: 1 }]);
    assert!(raw.closed_by_server());
    assert_eq!(get(&server, b"/t"), b"abc");
    // E19c: same for BARRIER
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::Barrier { key: b"/t", world_size: 2 }]);
    assert!(raw.closed_by_server());
}

fn wait_is_answered_when_the_last_missing_key_is_written(engine: Engine) {
    // E11, E12
    let server = server(engine);
    let mut waiter = Raw::validated(&server);
    let mut writer = Raw::validated(&server);
    waiter.send(&[Request::Wait { keys: Keys::from_iter([&b"/k1"[..], b"/k2", b"/k2"]) }]);
    until_waiting(&server, 1);
    writer.send(&[Request::Set { key: b"/k1", value: b"1" }]);
    assert!(writer.ping(1));
    assert_eq!(server.waiting(), 1, "one key is still missing");
    assert!(waiter.silent());
    writer.send(&[Request::Set { key: b"/k2", value: b"2" }]);
    assert_eq!(waiter.read(1), [0]);
    // keys present now: answered at once
    waiter.send(&[Request::Wait { keys: Keys::from_iter([&b"/k1"[..], b"/k2"]) }]);
    assert_eq!(waiter.read(1), [0]);
}

fn every_kind_of_write_wakes_waiters_but_delete_does_not(engine: Engine) {
    // E16, E16b, E17, E17b, E17c, E19b
    let server = server(engine);
    let writes: Vec<(&str, Vec<Request>)> = vec![
        ("set", vec![Request::Set { key: b"/w", value: b"v" }]),
        ("add", vec![Request::Add { key: b"/w", delta: 1 }]),
        ("append", vec![Request::Append { key: b"/w", value: b"v" }]),
        ("multi_set", vec![Request::MultiSet { pairs: vec![(b"/x", b"1"), (b"/w", b"2")] }]),
        ("failed compare_set", vec![Request::CompareSet { key: b"/w", expected: b"e", desired: b"d" }]),
        ("queue push", vec![Request::QueuePush { key: b"/w", value: b"q" }]),
    ];
    for (name, write) in writes {
        let mut waiter = Raw::validated(&server);
        let mut writer = Raw::validated(&server);
        writer.send(&[Request::DeleteKey { key: b"/w" }, Request::QueuePop { key: b"/w" }]);
        writer.read(8);
        let popped = i64::from_le_bytes(writer.read(8).try_into().unwrap());
        if popped > 0 {
            writer.read(8 + 1);
        }
        waiter.send(&[Request::Wait { keys: Keys::from_iter([&b"/w"[..]]) }]);
        until_waiting(&server, 1);
        writer.send(&[Request::DeleteKey { key: b"/w" }]);
        writer.read(8);
        assert_eq!(server.waiting(), 1, "{name}: delete must not wake");
        assert!(waiter.silent(), "{name}: delete must not wake");
        writer.send(&write);
        if name == "failed compare_set" {
            writer.read(9);
        }
        assert_eq!(waiter.read(1), [0], "{name} must wake the waiter");
    }
}

fn cancel_wait_is_always_acknowledged_and_a_lost_race_answers_00_01(engine: Engine) {
    // E14, E15
    let server = server(engine);
    let mut raw = Raw::validated(&server);
    raw.send(&[Request::CancelWait]);
    assert_eq!(raw.read(1), [1]);
    raw.send(&[Request::Wait { keys: Keys::from_iter([&b"/race"[..]]) }]);
    until_waiting(&server, 1);
    let mut setter = Raw::validated(&server);
    setter.send(&[Request::Set { key: b"/race", value: b"v" }]);
    assert!(setter.ping(2), "the SET was handled");
    until_waiting(&server, 0);
    raw.send(&[Request::CancelWait]);
    assert_eq!(raw.read(2), [0, 1]);
    assert!(raw.silent());
}

fn a_client_that_disconnects_mid_wait_leaves_no_waiter_behind(engine: Engine) {
    // E10
    let server = server(engine);
    for _ in 0..20 {
        let mut raw = Raw::validated(&server);
        raw.send(&[Request::Wait { keys: Keys::from_iter([&b"/never"[..], b"/nope"]) }]);
        raw.send(&[Request::GetNumKeys]);
        raw.read(8);
        drop(raw);
    }
    until_waiting(&server, 0);
    assert!(Raw::validated(&server).ping(5));
}

fn barrier_releases_all_arrivals_together(engine: Engine) {
    // E19, E19b, E19d
    let server = server(engine);
    let mut first = Raw::validated(&server);
    let mut second = Raw::validated(&server);
    first.send(&[Request::Barrier { key: b"/bar", world_size: 2 }]);
    until_waiting(&server, 1);
    assert!(first.silent());
    second.send(&[Request::Barrier { key: b"/bar", world_size: 2 }]);
    assert_eq!(second.read(1), [0]);
    assert_eq!(first.read(1), [0]);
    assert_eq!(get(&server, b"/bar"), b"2");
    first.send(&[Request::Barrier { key: b"/zero", world_size: 0 }]);
    assert_eq!(first.read(1), [0]);
    // a barrier waiter is also released by a SET of its key
    first.send(&[Request::Barrier { key: b"/b2", world_size: 5 }]);
    until_waiting(&server, 1);
    assert!(first.silent());
    second.send(&[Request::Set { key: b"/b2", value: b"x" }]);
    assert_eq!(first.read(1), [0]);
}

fn queues_wake_one_waiter_per_push(engine: Engine) {
    // E18, E18b, E18c, E18d, E20
    let server = server(engine);
    let mut w1 = Raw::validated(&server);
    let mut w2 = Raw::validated(&server);
    let mut pusher = Raw::validated(&server);
    pusher.send(&[Request::QueuePop { key: b"/none" }, Request::QueueLen { key: b"/none" }]);
    assert_eq!(pusher.read(16), [0u8; 16]);
    w1.send(&[Request::Wait { keys: Keys::from_iter([&b"/q"[..]]) }]);
    until_waiting(&server, 1);
    w2.send(&[Request::Wait { keys: Keys::from_iter([&b"/q"[..]]) }]);
    until_waiting(&server, 2);
    pusher.send(&[Request::QueuePush { key: b"/q", value: b"a" }]);
    assert_eq!(w1.read(1), [0]);
    assert_eq!(server.waiting(), 1, "one push wakes one waiter");
    assert!(w2.silent());
    pusher.send(&[Request::QueuePush { key: b"/q", value: b"b" }]);
    assert_eq!(w2.read(1), [0]);
    // a non-empty queue satisfies WAIT and CHECK, is invisible to GET and GETNUMKEYS
    pusher.send(&[
        Request::Wait { keys: Keys::from_iter([&b"/q"[..]]) },
        Request::Check { keys: Keys::from_iter([&b"/q"[..]]) },
        Request::Get { key: b"/q" },
        Request::GetNumKeys,
    ]);
    assert_eq!(pusher.read(1 + 1 + 8 + 8), [&[0u8, 0][..], &[0u8; 8], &0i64.to_le_bytes()].concat());
}

fn stopping_the_server_releases_blocked_clients_at_once(engine: Engine) {
    // E21
    let server = server(engine);
    let mut waiter = Raw::validated(&server);
    waiter.send(&[Request::Wait { keys: Keys::from_iter([&b"/forever"[..]]) }]);
    until_waiting(&server, 1);
    drop(server);
    // released, not left waiting (the read gives up after 30 s)
    assert!(waiter.closed_by_server());
}

fn random_garbage_from_many_clients_leaves_the_server_serving(engine: Engine) {
    let server = server(engine);
    let mut honest = Raw::validated(&server);
    honest.send(&[Request::Set { key: b"/keep", value: b"safe" }]);
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..200 {
        let mut raw = Raw::open(&server);
        let mut junk: Vec<u8> = (0..rng.usize(1..256)).map(|_| rng.u8(..)).collect();
        if round % 2 == 0 {
            // validated first, so the garbage reaches the request decoder
            junk.splice(0..0, bytes_of(&[Request::Validate { magic: MAGIC }]));
        }
        let _ = raw.0.write_all(&junk);
        drop(raw);
        if round % 20 == 0 {
            assert!(honest.ping(round));
        }
    }
    // truncated frames: every prefix of a valid request, then hang up
    let wire = bytes_of(&[Request::MultiSet { pairs: vec![(b"/t1", b"v1"), (b"/t2", b"v2")] }]);
    for cut in 1..wire.len() {
        let mut raw = Raw::validated(&server);
        raw.0.write_all(&wire[..cut]).unwrap();
    }
    assert!(honest.ping(999));
    assert_eq!(get(&server, b"/keep"), b"safe");
    assert_eq!(get(&server, b"/t1"), b"");
}

fn a_client_that_leaves_between_requests_is_no_error_however_it_leaves(engine: Engine) {
    let server = server(engine);
    let mut left = 0;
    for reset in [false, true] {
        let mut stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        stream.write_all(&bytes_of(&[Request::Validate { magic: MAGIC }, Request::Ping { nonce: 7 }])).unwrap();
        let mut echo = [0u8; 4];
        stream.read_exact(&mut echo).unwrap();
        if reset {
            // a process that exits with bytes unread (or sets a zero linger) resets its
            // connections: the server sees "connection reset by peer"
            socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO)).unwrap();
        }
        drop(stream);
        left += 1;
        let deadline = Instant::now() + Duration::from_secs(30);
        while server.connections() > 0 {
            assert!(Instant::now() < deadline, "the server kept the connection");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!((left, server.closed_on_errors()), (2, 0), "neither is an error to warn about");
    // one cut off in the middle of a request is
    let mut stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    stream.write_all(&bytes_of(&[Request::Validate { magic: MAGIC }])).unwrap();
    stream.write_all(&[0x01, 9, 0]).unwrap();
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.closed_on_errors() == 0 {
        assert!(Instant::now() < deadline, "a truncated request was not counted");
        std::thread::sleep(Duration::from_millis(1));
    }
}

on_both_servers!(
    many_clients_sending_large_values_at_once_are_all_served,
    pipelined_requests_in_one_segment_are_answered_in_order,
    bursts_and_large_values_through_buffers_that_start_small_and_adapt,
    requests_arriving_byte_by_byte_are_reassembled,
    a_partial_request_does_not_stall_other_clients,
    a_connection_must_start_with_a_valid_validate,
    size_limits_close_only_the_offending_connection,
    configured_limits_are_enforced,
    add_on_a_non_integer_closes_that_connection_only,
    wait_is_answered_when_the_last_missing_key_is_written,
    every_kind_of_write_wakes_waiters_but_delete_does_not,
    cancel_wait_is_always_acknowledged_and_a_lost_race_answers_00_01,
    a_client_that_disconnects_mid_wait_leaves_no_waiter_behind,
    barrier_releases_all_arrivals_together,
    queues_wake_one_waiter_per_push,
    stopping_the_server_releases_blocked_clients_at_once,
    random_garbage_from_many_clients_leaves_the_server_serving,
    a_client_that_leaves_between_requests_is_no_error_however_it_leaves,
);
