use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;
use crate::interrupt::Interrupt;

/// A path in the temp directory, unique per process and test, removed when dropped (declare it
/// before the stores on it, so that it drops after them).
struct TempPath(PathBuf);

impl TempPath {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("elastix-filestore-{}-{n}-{name}", std::process::id());
        TempPath(std::env::temp_dir().join(name))
    }

    fn open(&self, world_size: Option<u32>) -> FileStore {
        FileStore::open(&self.0, world_size).unwrap()
    }

    fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.0).unwrap()
    }

    fn len(&self) -> u64 {
        std::fs::metadata(&self.0).unwrap().len()
    }

    fn append(&self, bytes: &[u8]) {
        OpenOptions::new().append(true).open(&self.0).unwrap().write_all(bytes).unwrap();
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn entry(key: &[u8], value: &[u8]) -> Vec<u8> {
    [&(key.len() as u32).to_le_bytes()[..], key, &(value.len() as u32).to_le_bytes(), value].concat()
}

fn keys(store: &FileStore) -> BTreeSet<Bytes> {
    store.list_keys().unwrap().into_iter().collect()
}

fn key_set(keys: &[&'static [u8]]) -> BTreeSet<Bytes> {
    keys.iter().map(|key| Bytes::from_static(key)).collect()
}

#[test]
fn operations_follow_the_shared_rules() {
    let path = TempPath::new("rules");
    let store = path.open(None);
    assert_eq!(store.num_keys().unwrap(), 1, "torch's refcount counter is a key");
    store.set(b"k", b"v").unwrap();
    assert_eq!(store.get(b"k", None, &Interrupt::never()).unwrap(), "v");
    assert_eq!(store.add(b"n", 2).unwrap(), 2);
    assert_eq!(store.compare_set(b"k", b"v", b"w").unwrap(), "w");
    assert_eq!(store.compare_set(b"k", b"v", b"x").unwrap(), "w");
    assert_eq!(store.compare_set(b"missing", b"e", b"x").unwrap(), "e");
    assert_eq!(store.num_keys().unwrap(), 3);
    assert!(store.delete_key(b"n").unwrap());
    assert!(!store.delete_key(b"n").unwrap());
    assert!(!store.check(&[b"n"]).unwrap());
    store.set(b"t", b"text").unwrap();
    assert!(matches!(store.add(b"t", 1), Err(StoreError::InvalidArgument(_))));
    store.set(b"empty", b"").unwrap();
    assert_eq!(store.add(b"empty", 5).unwrap(), 5, "an empty value counts as 0, as in torch's FileStore");
    store.append(b"t", b"!").unwrap();
    assert_eq!(store.get_now(b"t").unwrap().unwrap(), "text!");
    store.queue_push(b"q", b"1").unwrap();
    assert_eq!((store.num_keys().unwrap(), store.queue_len(b"q").unwrap()), (4, 1));
    assert!(store.check(&[b"q"]).unwrap(), "a non-empty queue counts as ready");
    assert_eq!(store.queue_pop_now(b"q").unwrap().unwrap(), "1");
    assert_eq!(store.queue_pop_now(b"q").unwrap(), None);
    assert_eq!(keys(&store), key_set(&[b"k", b"t", b"empty"]));
}

#[test]
fn the_file_holds_torchs_format() {
    let path = TempPath::new("format");
    let store = path.open(None);
    store.set(b"k", b"v").unwrap();
    assert_eq!(store.add(b"n", 7).unwrap(), 7);
    assert_eq!(store.compare_set(b"k", b"nope", b"x").unwrap(), "v");
    assert_eq!(store.compare_set(b"k", b"v", b"x").unwrap(), "x");
    store.append(b"a", b"po").unwrap();
    store.append(b"a", b"tato").unwrap();
    assert!(store.delete_key(b"k").unwrap());
    assert!(!store.delete_key(b"absent").unwrap());
    store.multi_set(&[(b"m1", b"1"), (b"m2", b"2")]).unwrap();
    store.queue_push(b"q", b"item").unwrap();
    store.queue_pop_now(b"q").unwrap();
    drop(store);
    let expected = [
        entry(b"refcount/", b"1"),
        entry(b"/k", b"v"),
        entry(b"/n", b"7"),
        // a COMPARE_SET that changes nothing writes nothing
        entry(b"/k", b"x"),
        entry(b"/a", b"po"),
        entry(b"/a", b"potato"),
        entry(b"-/k", b""),
        // a DELETE of a missing key writes nothing
        entry(b"/m1", b"1"),
        entry(b"/m2", b"2"),
        entry(b"-elastix/queue-push/q", b"item"),
        entry(b"-elastix/queue-pop/q", b""),
        entry(b"cleanup/", b"1"),
        entry(b"refcount/", b"0"),
    ]
    .concat();
    assert_eq!(path.bytes(), expected);
}

#[test]
fn an_empty_file_is_a_new_store() {
    // what `tempfile.NamedTemporaryFile` hands to torch's tests
    let path = TempPath::new("empty");
    std::fs::write(&path.0, b"").unwrap();
    let store = path.open(None);
    assert_eq!(store.num_keys().unwrap(), 1);
    assert_eq!(path.bytes(), entry(b"refcount/", b"1"));
}

#[test]
fn two_handles_see_each_others_writes() {
    let path = TempPath::new("handles");
    let (a, b) = (path.open(None), path.open(None));
    a.set(b"k", b"v").unwrap();
    assert_eq!(b.get_now(b"k").unwrap().unwrap(), "v");
    b.append(b"k", b"w").unwrap();
    assert_eq!(a.get_now(b"k").unwrap().unwrap(), "vw");
    assert_eq!(a.add(b"n", 5).unwrap(), 5);
    assert_eq!(b.add(b"n", 1).unwrap(), 6);
    assert_eq!(a.compare_set(b"n", b"6", b"seven").unwrap(), "seven");
    assert_eq!(b.get_now(b"n").unwrap().unwrap(), "seven");
    a.queue_push(b"q", b"1").unwrap();
    a.queue_push(b"q", b"2").unwrap();
    assert_eq!(b.queue_pop_now(b"q").unwrap().unwrap(), "1");
    assert_eq!(a.queue_len(b"q").unwrap(), 1);
    b.multi_set(&[(b"x", b"1"), (b"y", b"2")]).unwrap();
    assert_eq!(keys(&a), key_set(&[b"k", b"n", b"x", b"y"]));
    assert!(a.delete_key(b"x").unwrap());
    assert!(!b.check(&[b"x"]).unwrap());
    assert_eq!(b.num_keys().unwrap(), 4);
    // a handle opened later replays everything
    let c = path.open(None);
    assert_eq!(c.get_now(b"k").unwrap().unwrap(), "vw");
    assert_eq!(c.queue_pop_now(b"q").unwrap().unwrap(), "2");
    assert_eq!(a.queue_len(b"q").unwrap(), 0);
}

#[test]
fn torchs_counters_count_as_keys_but_are_not_users_keys() {
    let path = TempPath::new("counters");
    let (a, _b) = (path.open(None), path.open(None));
    assert_eq!(a.num_keys().unwrap(), 1);
    assert!(a.list_keys().unwrap().is_empty());
    assert!(!a.check(&[b"refcount/"]).unwrap() && !a.check(&[b""]).unwrap());
    assert_eq!(a.get_now(b"refcount/").unwrap(), None);
    assert_eq!(a.replica().other(REFCOUNT).unwrap(), "2");
    // a user's key of the same name is another key
    a.set(b"refcount/", b"mine").unwrap();
    assert_eq!(a.num_keys().unwrap(), 2);
    assert_eq!(a.replica().other(REFCOUNT).unwrap(), "2");
}

#[test]
fn a_waiter_is_woken_by_a_set_from_another_handle() {
    let path = TempPath::new("wake");
    let waiter = path.open(None);
    let setter = path.open(None);
    let thread = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        setter.set(b"late", b"here").unwrap();
    });
    assert_eq!(waiter.get(b"late", Some(Duration::from_secs(30)), &Interrupt::never()).unwrap(), "here");
    thread.join().unwrap();
}

#[test]
fn a_blocking_pop_gets_an_item_pushed_by_another_handle() {
    let path = TempPath::new("pop");
    let popper = path.open(None);
    let pusher = path.open(None);
    let thread = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        pusher.queue_push(b"q", b"item").unwrap();
    });
    let item = popper.queue_pop(b"q", true, Some(Duration::from_secs(30)), &Interrupt::never()).unwrap();
    assert_eq!(item, "item");
    thread.join().unwrap();
}

#[test]
fn concurrent_adds_from_four_handles_sum_exactly() {
    let path = TempPath::new("adds");
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let store = path.open(None);
            std::thread::spawn(move || (0..200).map(|_| store.add(b"n", 1).unwrap()).collect::<Vec<_>>())
        })
        .collect();
    let totals: BTreeSet<i64> = threads.into_iter().flat_map(|thread| thread.join().unwrap()).collect();
    assert_eq!(totals, (1..=800).collect(), "every add saw a distinct total");
    assert_eq!(path.open(None).get_now(b"n").unwrap().unwrap(), "800");
}

#[test]
fn threads_sharing_handles_add_exactly() {
    let path = TempPath::new("shared");
    let handles = [Arc::new(path.open(None)), Arc::new(path.open(None))];
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let store = handles[i % 2].clone();
            std::thread::spawn(move || (0..100).for_each(|_| assert!(store.add(b"n", 1).unwrap() > 0)))
        })
        .collect();
    threads.into_iter().for_each(|thread| thread.join().unwrap());
    assert_eq!(handles[0].get_now(b"n").unwrap().unwrap(), "800");
}

/// The exit code of a forked child, waited for at most 30 s: a child stuck on a lock inherited
/// from another test thread must fail its test, not hang the suite.
fn exit_status(child: nix::unistd::Pid) -> i32 {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match waitpid(child, Some(WaitPidFlag::WNOHANG)).unwrap() {
            WaitStatus::StillAlive if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            WaitStatus::StillAlive => {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                panic!("the forked child did not finish within 30 s");
            }
            WaitStatus::Exited(_, code) => return code,
            status => panic!("the forked child ended so: {status:?}"),
        }
    }
}

#[test]
fn a_forked_child_and_its_parent_exclude_each_other_on_one_handle() {
    use nix::unistd::{fork, ForkResult};

    let path = TempPath::new("fork");
    let store = path.open(Some(1));
    // SAFETY: the child touches only `store` (no other thread uses it) and leaves through
    // `exit`, running no destructors and no test-harness code.
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let added = std::panic::catch_unwind(|| (0..300).all(|_| store.add(b"n", 1).is_ok()));
            std::process::exit(if matches!(added, Ok(true)) { 0 } else { 1 });
        }
        ForkResult::Parent { child } => {
            (0..300).for_each(|_| assert!(store.add(b"n", 1).unwrap() > 0));
            assert_eq!(exit_status(child), 0);
        }
    }
    assert_eq!(store.get_now(b"n").unwrap().unwrap(), "600");
    assert_eq!(store.replica().other(REFCOUNT).unwrap(), "1", "the child neither opened nor closed");
}

#[test]
fn a_forked_childs_exit_does_not_close_its_parents_handle() {
    use nix::unistd::{fork, ForkResult};

    let path = TempPath::new("fork-drop");
    let store = path.open(Some(1));
    // SAFETY: the child only drops `store` (no other thread uses it) and leaves through `exit`.
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            drop(store);
            std::process::exit(0);
        }
        ForkResult::Parent { child } => assert_eq!(exit_status(child), 0),
    }
    assert_eq!(store.replica().other(CLEANUP), None);
    drop(store);
    assert!(!path.0.exists());
}

#[test]
fn concurrent_pops_take_each_item_once() {
    let path = TempPath::new("pops");
    let pusher = path.open(None);
    (0..200).for_each(|i| pusher.queue_push(b"q", i.to_string().as_bytes()).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let store = path.open(None);
            std::thread::spawn(move || std::iter::from_fn(|| store.queue_pop_now(b"q").unwrap()).collect::<Vec<_>>())
        })
        .collect();
    let mut items: Vec<Bytes> = threads.into_iter().flat_map(|thread| thread.join().unwrap()).collect();
    assert_eq!(items.len(), 200);
    items.sort();
    items.dedup();
    assert_eq!(items.len(), 200);
}

#[test]
fn a_torn_tail_is_ignored_by_readers_and_cut_off_by_the_next_writer() {
    let path = TempPath::new("torn");
    let store = path.open(None);
    store.set(b"kept", b"v").unwrap();
    let good_len = path.len();
    // a writer killed mid-write: a set of "abc" promising 10 value bytes, with 4 of them
    let torn = [&4u32.to_le_bytes()[..], b"/abc", &10u32.to_le_bytes(), b"half"].concat();
    path.append(&torn);

    assert_eq!(store.get_now(b"kept").unwrap().unwrap(), "v");
    assert!(!store.check(&[b"abc"]).unwrap());
    assert_eq!(store.num_keys().unwrap(), 2);
    assert_eq!(path.len(), good_len + torn.len() as u64, "readers leave the tail alone");

    store.set(b"after", b"x").unwrap();
    assert_eq!(path.len(), good_len + entry(b"/after", b"x").len() as u64);
    let other = path.open(None);
    assert_eq!(keys(&other), key_set(&[b"after", b"kept"]));
}

#[test]
fn a_torn_first_entry_is_started_over() {
    let path = TempPath::new("torn-start");
    std::fs::write(&path.0, &entry(b"refcount/", b"1")[..7]).unwrap();
    let store = path.open(None);
    store.set(b"k", b"v").unwrap();
    assert_eq!(path.open(None).get_now(b"k").unwrap().unwrap(), "v");
    assert!(path.bytes().starts_with(&entry(b"refcount/", b"1")));
}

#[test]
fn a_file_that_is_not_a_store_is_refused_and_left_alone() {
    let path = TempPath::new("foreign");
    std::fs::write(&path.0, b"just some text, not a store").unwrap();
    let err = FileStore::open(&path.0, None).err().unwrap();
    let message = err.to_string();
    assert!(matches!(err, StoreError::File { .. }), "{err}");
    assert!(message.contains("not a FileStore file") && message.contains(&*path.0.to_string_lossy()), "{message}");
    assert_eq!(path.bytes(), b"just some text, not a store");

    let old = b"ELXFSTOR\x01\x00\x00\x00\x06\x00\x00\x00\x00\x00\x00\x00\x00";
    std::fs::write(&path.0, old).unwrap();
    let message = FileStore::open(&path.0, None).err().unwrap().to_string();
    assert!(message.contains("ELXFSTOR") && message.contains("torch's FileStore format"), "{message}");
    assert_eq!(path.bytes(), old);
}

#[test]
fn a_corrupt_counter_is_reported() {
    let path = TempPath::new("corrupt");
    std::fs::write(&path.0, entry(b"refcount/", b"many")).unwrap();
    let message = FileStore::open(&path.0, None).err().unwrap().to_string();
    assert!(message.contains("\"refcount/\" is corrupt"), "{message}");
}

#[test]
fn a_missing_directory_is_named_in_the_error() {
    let dir = std::env::temp_dir().join(format!("elastix-no-such-dir-{}", std::process::id()));
    let err = FileStore::open(dir.join("store"), None).err().unwrap();
    let message = err.to_string();
    assert!(matches!(err, StoreError::File { .. }));
    assert!(message.contains(&format!("directory {} does not exist", dir.display())), "{message}");
}

#[test]
fn the_file_is_deleted_once_world_size_handles_have_closed_and_none_is_open() {
    let path = TempPath::new("cleanup");
    let (a, b) = (path.open(Some(2)), path.open(Some(2)));
    a.set(b"k", b"v").unwrap();
    drop(a);
    assert!(path.0.exists(), "one handle is still open");
    drop(b);
    assert!(!path.0.exists());

    // a late opener starts a new, empty store
    let c = path.open(Some(2));
    assert_eq!(c.num_keys().unwrap(), 1);
    drop(c);
    assert!(path.0.exists(), "only one of two handles has closed");
    drop(path.open(Some(2)));
    assert!(!path.0.exists(), "two handles have closed in all, one after the other");
}

#[test]
fn an_open_handle_keeps_the_file_even_past_world_size() {
    // torch's test_refcount: two handles with world_size 1
    let path = TempPath::new("refcount");
    let (a, b) = (path.open(Some(1)), path.open(Some(1)));
    drop(a);
    assert!(path.0.exists());
    drop(b);
    assert!(!path.0.exists());
    // world_size 0, as torch allows it: deleted as soon as no handle is open
    drop(path.open(Some(0)));
    assert!(!path.0.exists());
}

#[test]
fn the_file_is_kept_without_a_world_size() {
    let path = TempPath::new("kept");
    let stores: Vec<_> = (0..3).map(|_| path.open(None)).collect();
    stores[0].set(b"k", b"v").unwrap();
    drop(stores);
    assert!(path.0.exists());
    let store = path.open(None);
    assert_eq!(store.get_now(b"k").unwrap().unwrap(), "v");
    assert_eq!(store.num_keys().unwrap(), 3, "k, and torch's refcount and cleanup counters");
}

#[test]
fn a_file_deleted_under_a_handle_reads_empty_and_is_made_anew_by_a_write() {
    let path = TempPath::new("deleted");
    let store = path.open(None);
    store.set(b"k", b"v").unwrap();
    std::fs::remove_file(&path.0).unwrap();
    assert!(!store.check(&[b"k"]).unwrap());
    assert_eq!(store.num_keys().unwrap(), 0);
    assert!(!path.0.exists(), "reading makes no file");
    store.set(b"new", b"w").unwrap();
    assert_eq!(path.bytes(), entry(b"/new", b"w"));
    assert_eq!(keys(&store), key_set(&[b"new"]));
    // replaced by another store's file: replayed from its start
    let other = TempPath::new("deleted-other");
    std::fs::write(&other.0, entry(b"/other", b"x")).unwrap();
    std::fs::rename(&other.0, &path.0).unwrap();
    assert_eq!(keys(&store), key_set(&[b"other"]));
}

#[test]
fn timeouts_and_interrupts_end_waits() {
    let path = TempPath::new("timeouts");
    let store = path.open(None);
    let start = Instant::now();
    let err = store.wait(&[b"nokey"], Some(Duration::from_millis(50)), &Interrupt::never()).unwrap_err();
    assert_eq!(err.to_string(), "wait timeout after 50ms, keys: nokey");
    assert!(start.elapsed() >= Duration::from_millis(50));
    let asked = std::sync::atomic::AtomicU32::new(0);
    let second_ask = Interrupt::new(move || asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1);
    let err = store.wait(&[b"nokey"], None, &second_ask).unwrap_err();
    assert!(matches!(err, StoreError::Interrupted));
    let err = store.queue_pop(b"q", false, None, &Interrupt::never()).unwrap_err();
    assert!(matches!(err, StoreError::QueueEmpty));
    let err = store.queue_pop(b"q", true, Some(Duration::from_millis(20)), &Interrupt::never()).unwrap_err();
    assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
}

#[test]
fn a_wait_polls_without_writing() {
    let path = TempPath::new("poll");
    let store = path.open(None);
    let before = path.bytes();
    let start = Instant::now();
    store.wait_for_change(&[b"nokey"], Duration::from_millis(100)).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert_eq!(path.bytes(), before, "polling writes nothing");
}
