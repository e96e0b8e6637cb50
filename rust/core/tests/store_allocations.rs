//! The store's hot requests allocate nothing once their keys exist: decoding a SET, GET, ADD,
//! CHECK, WAIT or MULTI_GET (of up to eight keys) from the read buffer and executing it against the data into the reply buffer (what the
//! connection task does between a read and a write). Counted by this test binary's own global
//! allocator, on the test's thread only.

use bytes::BytesMut;
use elastix_core::store::execute::Db;
use elastix_core::store::limits::Limits;
use elastix_core::store::request::{Decoded, Keys, Request};
use elastix_core::store::waiters::Waker;

mod counting;
use counting::Counting;

#[global_allocator]
static GLOBAL: Counting = Counting;

fn wire(request: &Request<'_>) -> Vec<u8> {
    let mut out = BytesMut::new();
    request.encode(&mut out);
    out.to_vec()
}

/// Decodes `bytes` and executes it, its reply appended to `out`.
fn serve(db: &mut Db, waker: &Waker, bytes: &[u8], limits: &Limits, out: &mut BytesMut) {
    let Ok(Decoded::Request(request, used)) = Request::decode(bytes, limits) else { panic!("not a whole request") };
    assert_eq!(used, bytes.len());
    db.execute(1, waker, &request, out).unwrap();
}

#[test]
fn set_get_add_check_wait_and_multi_get_on_keys_that_exist_allocate_nothing() {
    let waker = Waker::default();
    let limits = Limits::default();
    let mut db = Db::new();
    let mut out = BytesMut::with_capacity(1 << 16);
    let set = wire(&Request::Set { key: b"rank/3/status", value: b"training step 000123" });
    let set_again = wire(&Request::Set { key: b"rank/3/status", value: b"training step 000124" });
    let get = wire(&Request::Get { key: b"rank/3/status" });
    let start = wire(&Request::Add { key: b"heartbeats", delta: 100 });
    let add = wire(&Request::Add { key: b"heartbeats", delta: 1 });
    let names = Keys::from_iter([&b"rank/3/status"[..], b"heartbeats"]);
    let check = wire(&Request::Check { keys: names.clone() });
    let wait = wire(&Request::Wait { keys: names.clone() });
    let multi_get = wire(&Request::MultiGet { keys: names });
    for bytes in [&set, &start] {
        serve(&mut db, &waker, bytes, &limits, &mut out); // the keys are made: that allocates
    }
    out.clear();

    let allocations = counting::on_this_thread(|| {
        for round in 0..800 {
            let value = if round % 2 == 0 { &set_again } else { &set };
            for bytes in [value, &get, &add, &check, &wait, &multi_get] {
                serve(&mut db, &waker, bytes, &limits, &mut out);
            }
            out.clear();
        }
    });

    assert_eq!(allocations, 0, "allocations in 4,800 requests");
    // and they did what they say: the last SET, and ADD from 100 by 800
    serve(&mut db, &waker, &get, &limits, &mut out);
    assert_eq!(&out[8..], b"training step 000123");
    out.clear();
    serve(&mut db, &waker, &wire(&Request::Add { key: b"heartbeats", delta: 0 }), &limits, &mut out);
    assert_eq!(i64::from_le_bytes(out[..8].try_into().unwrap()), 900);
}
