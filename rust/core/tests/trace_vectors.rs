//! The codec and the server against exchanges recorded from real torch 2.13 servers
//! (`tests/vectors/tcpstore_traces.json`: 98 operations on the libuv and legacy servers).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::BytesMut;
use elastix_core::store::request::{Decoded, Request};
use elastix_core::store::{Limits, ServerConfig};

mod common;
use common::{on_both_servers, Engine, Server};
use serde::Deserialize;

#[derive(Deserialize)]
struct Trace {
    op: String,
    backend: String,
    notes: String,
    /// (connection, "open" | "c2s" | "s2c", time, hex bytes)
    tcp_chunks: Vec<(u32, String, f64, String)>,
}

fn traces() -> Vec<Trace> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/vectors/tcpstore_traces.json");
    let text = std::fs::read_to_string(path).expect("recorded vectors are checked in");
    serde_json::from_str(&text).expect("vectors parse")
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The legacy server rejects queue operations; elastix serves them like torch's libuv
/// server, so this one recorded exchange is a deliberate difference.
fn differs_by_design(trace: &Trace) -> bool {
    trace.op == "queue_push_to_legacy_server"
}

#[test]
fn every_recorded_request_decodes_and_re_encodes_to_the_same_bytes() {
    let mut decoded = 0;
    for trace in traces() {
        let mut per_connection: HashMap<u32, Vec<u8>> = HashMap::new();
        for (conn, direction, _, bytes) in &trace.tcp_chunks {
            if direction == "c2s" {
                per_connection.entry(*conn).or_default().extend(unhex(bytes));
            }
        }
        for (conn, stream) in per_connection {
            let mut rest = &stream[..];
            while !rest.is_empty() {
                let Decoded::Request(request, used) = Request::decode(rest, &Limits::default())
                    .unwrap_or_else(|e| panic!("{} conn {conn}: {e}", trace.op))
                else {
                    panic!("{} conn {conn}: recorded request is incomplete: {}", trace.op, hex(rest))
                };
                let mut encoded = BytesMut::new();
                request.encode(&mut encoded);
                assert_eq!(hex(&encoded), hex(&rest[..used]), "{}: {request:?}", trace.op);
                rest = &rest[used..];
                decoded += 1;
            }
        }
    }
    assert!(decoded >= 130, "only {decoded} requests decoded");
}

/// The trace's chunks with consecutive chunks of one connection and direction joined: TCP
/// segmentation carries no meaning, and a reply recorded in several segments is compared whole.
fn merged_chunks(trace: &Trace) -> Vec<(u32, String, Vec<u8>)> {
    let mut merged: Vec<(u32, String, Vec<u8>)> = Vec::new();
    for (conn, direction, _, bytes) in &trace.tcp_chunks {
        match merged.last_mut() {
            Some((c, d, joined)) if c == conn && d == direction => joined.extend(unhex(bytes)),
            _ => merged.push((*conn, direction.clone(), unhex(bytes))),
        }
    }
    merged
}

/// A LIST_KEYS reply (i64 count, then length-prefixed keys) as a sorted list.
fn key_set(reply: &[u8]) -> Vec<Vec<u8>> {
    let count = i64::from_le_bytes(reply[..8].try_into().unwrap());
    let mut rest = &reply[8..];
    let mut keys = Vec::new();
    for _ in 0..count {
        let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        keys.push(rest[8..8 + len].to_vec());
        rest = &rest[8 + len..];
    }
    assert!(rest.is_empty(), "trailing bytes after LIST_KEYS reply");
    keys.sort();
    keys
}

struct Replay {
    port: u16,
    connections: HashMap<u32, TcpStream>,
}

impl Replay {
    fn connection(&mut self, conn: u32) -> &mut TcpStream {
        let port = self.port;
        self.connections.entry(conn).or_insert_with(|| {
            let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            stream.set_nodelay(true).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            stream
        })
    }

    fn set_from_another_client(&mut self, key: &[u8]) {
        let helper = self.connection(u32::MAX);
        let mut bytes = BytesMut::new();
        Request::Validate { magic: 0x3C85_F7CE }.encode(&mut bytes);
        Request::Set { key, value: b"x" }.encode(&mut bytes);
        helper.write_all(&bytes).unwrap();
    }

    fn assert_nothing_more(&mut self, trace: &Trace) {
        for (conn, stream) in &mut self.connections {
            stream.set_nonblocking(true).unwrap();
            let mut byte = [0u8; 1];
            match stream.read(&mut byte) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                other => panic!("{}: unexpected extra reply on conn {conn}: {other:?}", trace.op),
            }
            stream.set_nonblocking(false).unwrap();
        }
    }
}

/// Waits until `n` clients are blocked in the server (a bounded poll of its own count).
fn until_waiting(server: &Server, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.waiting() != n {
        assert!(std::time::Instant::now() < deadline, "the WAIT never reached the server");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Replays one backend's recording, in order, on a fresh elastix server, and checks that
/// every reply is byte-for-byte the recorded one (the PING nonce is the recorded one too,
/// since the server echoes what the replay sends).
fn replay(engine: Engine, backend_prefix: &str) -> usize {
    let server = Server::start(engine, &ServerConfig::default());
    let mut replay = Replay { port: server.port(), connections: HashMap::new() };
    let mut replies_checked = 0;
    for trace in traces().iter().filter(|t| t.backend.starts_with(backend_prefix)) {
        if differs_by_design(trace) {
            continue;
        }
        for (conn, direction, bytes) in merged_chunks(trace) {
            let conn = &conn;
            match direction.as_str() {
                "open" => {
                    replay.connection(*conn);
                }
                "c2s" => {
                    replay.connection(*conn).write_all(&bytes).unwrap();
                    if trace.op == "wait_woken" {
                        // the recording's master set the key from its own connection, once
                        // the WAIT was registered
                        until_waiting(&server, 1);
                        replay.set_from_another_client(b"/late");
                    }
                }
                "s2c" => {
                    let mut reply = vec![0u8; bytes.len()];
                    replay
                        .connection(*conn)
                        .read_exact(&mut reply)
                        .unwrap_or_else(|e| panic!("{} ({}): no reply: {e}", trace.op, trace.notes));
                    if trace.op.ends_with("list_keys") {
                        // keys come in hash order: compare them as a set
                        assert_eq!(key_set(&reply), key_set(&bytes), "{}", trace.op);
                    } else {
                        assert_eq!(hex(&reply), hex(&bytes), "{} ({})", trace.op, trace.notes);
                    }
                    replies_checked += 1;
                }
                other => panic!("unknown chunk direction {other}"),
            }
        }
        replay.assert_nothing_more(trace);
    }
    replies_checked
}

fn server_replies_match_torch_libuv_recording(engine: Engine) {
    assert!(replay(engine, "libuv") > 50);
}

fn server_replies_match_torch_legacy_recording(engine: Engine) {
    assert!(replay(engine, "legacy") > 40);
}

on_both_servers!(server_replies_match_torch_libuv_recording, server_replies_match_torch_legacy_recording);
