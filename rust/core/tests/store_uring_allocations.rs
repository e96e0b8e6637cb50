//! The io_uring server allocates nothing per request once its keys exist and a connection's
//! buffers have grown to its replies: received bytes are executed from the shared pool's
//! buffer, replies go out of the connection's two reply buffers in turn. Counted by this test
//! binary's own global allocator over the whole process, with a client that itself allocates
//! nothing (fixed buffers, plain socket calls); so this file holds this one test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::BytesMut;
use elastix_core::store::request::{Keys, Request};
use elastix_core::store::server::uring::UringServer;
use elastix_core::store::ServerConfig;

mod counting;
use counting::Counting;

#[global_allocator]
static GLOBAL: Counting = Counting;

/// SET, GET, ADD, CHECK, WAIT and MULTI_GET on two keys, in one write; `value` is SET's.
fn round(value: &[u8]) -> Vec<u8> {
    let names = Keys::from_iter([&b"rank/3/status"[..], b"heartbeats"]);
    let mut out = BytesMut::new();
    for request in [
        Request::Set { key: b"rank/3/status", value },
        Request::Get { key: b"rank/3/status" },
        Request::Add { key: b"heartbeats", delta: 1 },
        Request::Check { keys: names.clone() },
        Request::Wait { keys: names.clone() },
        Request::MultiGet { keys: names },
    ] {
        request.encode(&mut out);
    }
    out.to_vec()
}

/// GET's value (8 + 20), ADD's count (8), CHECK's and WAIT's byte, MULTI_GET's two values
/// (8 + 20, 8 + 3: the counter stays at three digits).
const REPLIES: usize = 28 + 8 + 1 + 1 + 28 + 11;

#[test]
fn requests_on_the_io_uring_server_allocate_nothing_once_its_buffers_have_grown() {
    let server = UringServer::start(&ServerConfig::for_address("127.0.0.1")).expect("the io_uring server");
    let mut client = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    client.set_nodelay(true).unwrap();
    client.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut start = BytesMut::new();
    Request::Validate { magic: 0x3C85_F7CE }.encode(&mut start);
    Request::Add { key: b"heartbeats", delta: 100 }.encode(&mut start);
    client.write_all(&start).unwrap();
    let mut replies = [0u8; REPLIES];
    client.read_exact(&mut replies[..8]).unwrap();
    let rounds = [round(b"training step 000123"), round(b"training step 000124")];
    let mut exchange = |round: usize| {
        client.write_all(&rounds[round % 2]).unwrap();
        client.read_exact(&mut replies).unwrap();
    };
    for round in 0..50 {
        exchange(round); // the keys are made and the buffers grow: that allocates
    }

    let allocations = counting::in_process(|| {
        for round in 0..800 {
            exchange(round);
        }
    });

    assert_eq!(allocations, 0, "allocations in 4,800 requests");
    // and they did what they say: the last SET, and ADD from 100 by 850
    assert_eq!(&replies[8..28], b"training step 000124");
    assert_eq!(i64::from_le_bytes(replies[28..36].try_into().unwrap()), 950);
}
