//! What an idle client costs the server: the heap each connection holds once it has
//! validated, pinged, and blocked in a WAIT (a storm's clients, and a torch job's, sit like
//! that for the whole rendezvous), counted by this test binary's own global allocator as
//! live bytes (allocated, not yet freed). RSS adds the allocator's own overhead on top;
//! `benches/storm_bench.py` measures that.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use elastix_core::store::request::{Keys, Request};
use elastix_core::store::{BackgroundServer, ServerConfig};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed on unchanged to the system allocator, which upholds
// GlobalAlloc's contract; counting touches only an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires of it
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from System through this allocator, with this layout
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as for dealloc, and `new_size` as the caller gave it
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const CLIENTS: usize = 400;

/// What a torch client sends to start and then block: VALIDATE, PING, an ADD to the
/// storm's counter, and a WAIT for a key nobody sets.
fn blocking_requests() -> Vec<u8> {
    let mut out = BytesMut::new();
    Request::Validate { magic: 0x3c85f7ce }.encode(&mut out);
    Request::Ping { nonce: 7 }.encode(&mut out);
    Request::Add { key: b"storm/count", delta: 1 }.encode(&mut out);
    Request::Wait { keys: Keys::from_slice(&[b"storm/released".as_slice()]) }.encode(&mut out);
    out.to_vec()
}

/// Live heap bytes once they have not moved for 200 ms (the server has settled), within 20 s.
fn settled() -> isize {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = LIVE.load(Ordering::Relaxed);
    let mut since = Instant::now();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let now = LIVE.load(Ordering::Relaxed);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= Duration::from_millis(200) {
            break;
        }
    }
    last
}

#[test]
fn a_client_blocked_in_wait_holds_at_most_1450_bytes_of_the_servers_heap() {
    let server = BackgroundServer::start(&ServerConfig::for_address("127.0.0.1"), 2).unwrap();
    let requests = blocking_requests();
    let mut clients: Vec<TcpStream> = Vec::with_capacity(CLIENTS);
    // one client first: the server's one-time allocations (the keys, tables' first growth)
    // are not any connection's
    let connect = |clients: &mut Vec<TcpStream>| {
        let mut stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        stream.write_all(&requests).unwrap();
        let mut replies = [0u8; 4 + 8]; // the PING's echo and the ADD's count (the WAIT blocks)
        stream.read_exact(&mut replies).unwrap();
        clients.push(stream);
    };
    connect(&mut clients);
    let before = settled();
    for _ in 1..CLIENTS {
        connect(&mut clients);
    }
    let after = settled();
    let per_client = (after - before) / (CLIENTS as isize - 1);
    eprintln!("live heap per client blocked in WAIT: {per_client} B");
    // 1320 B when written: the task (a 768-byte cell: tokio aligns tasks to 128 bytes), the
    // socket's registration (297), a 64-byte read buffer, the waker (48) and the wait's entry.
    // A channel per waker (+496), a 512-byte read buffer kept while waiting (+448) or a task
    // that holds its connection twice (+256) fails this.
    assert!(per_client <= 1450, "{per_client} B of heap per client blocked in WAIT");
    drop(clients);
}
