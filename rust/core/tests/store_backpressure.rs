//! A client that asks for far more than it reads holds a bounded share of the server: its
//! requests wait while a mebibyte of its replies is queued. Measured as the growth of this
//! test process's resident memory (the server runs in it), so this file holds this one test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::BytesMut;
use elastix_core::store::request::Request;
use elastix_core::store::ServerConfig;

mod common;
use common::{Engine, Server};

const VALUE: usize = 1 << 20;
const GETS: usize = 256;

fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 1024
}

/// How much the server grew while a client that had asked for 256 MiB read nothing.
fn growth_while_unread(engine: Engine) -> usize {
    let server = Server::start(engine, &ServerConfig::for_address("127.0.0.1"));
    let mut client = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    client.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let value: Vec<u8> = (0..VALUE).map(|i| (i % 251) as u8).collect();
    let mut wire = BytesMut::new();
    Request::Validate { magic: 0x3C85_F7CE }.encode(&mut wire);
    Request::Set { key: b"/big", value: &value }.encode(&mut wire);
    Request::Ping { nonce: 1 }.encode(&mut wire);
    client.write_all(&wire).unwrap();
    let mut echo = [0u8; 4];
    client.read_exact(&mut echo).unwrap();
    let before = resident_bytes();
    let mut gets = BytesMut::new();
    for _ in 0..GETS {
        Request::Get { key: b"/big" }.encode(&mut gets);
    }
    client.write_all(&gets).unwrap();
    std::thread::sleep(Duration::from_millis(500)); // the server does what it will meanwhile
    let grown = resident_bytes().saturating_sub(before);
    // then every reply arrives, whole and in order
    let mut reply = vec![0u8; 8 + VALUE];
    for i in 0..GETS {
        client.read_exact(&mut reply).unwrap_or_else(|err| panic!("reply {i} on {engine:?}: {err}"));
        assert_eq!(u64::from_le_bytes(reply[..8].try_into().unwrap()), VALUE as u64);
        assert!(reply[8..] == value[..], "reply {i} on {engine:?} is not the value");
    }
    grown
}

#[test]
fn a_client_that_reads_nothing_of_256_mib_it_asked_for_costs_the_server_a_few_mib() {
    for engine in [Engine::Epoll, Engine::Uring] {
        let grown = growth_while_unread(engine);
        eprintln!("{engine:?}: grew by {} KiB while its client read nothing", grown / 1024);
        assert!(grown < 16 << 20, "{engine:?} grew by {} MiB", grown >> 20);
    }
}
