//! The entries of a store file and what each one means; pure, no I/O (the layout is described in
//! the [parent module](super)).

/// Bytes of a length field: a `u32`, little-endian.
const LEN_BYTES: usize = 4;

/// Before every key a user gives, so that torch's own counters cannot clash with one.
const USER: &[u8] = b"/";
/// Before a key that an entry removes.
const DELETE: &[u8] = b"-";
/// Before a user's key that an entry removes.
const DELETE_USER: &[u8] = b"-/";
/// elastix's queue entries: deletions of keys that nobody sets, so torch's reader passes over
/// them and they change nothing torch can see.
const QUEUE_PUSH: &[u8] = b"-elastix/queue-push/";
const QUEUE_POP: &[u8] = b"-elastix/queue-pop/";

/// torch's count of the handles open on the file: +1 by each opener, -1 by each closer.
pub(super) const REFCOUNT: &[u8] = b"refcount/";
/// torch's count of the handles closed so far, compared with `world_size`.
pub(super) const CLEANUP: &[u8] = b"cleanup/";

/// The longest first key that the start of a file is taken to be the beginning of, when that
/// key is not all there (its writer was cut short). Far above any real key, and far below the
/// length that four bytes of text or of a known binary format read as.
const LONGEST_TORN_FIRST_KEY: u32 = 64 * 1024;

/// One entry of the file, as found there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Splits the entry at the start of `bytes` off them; returns it with its length in bytes, or
/// `None` if it runs past the end (cut short, or `bytes` is empty).
pub(super) fn decode(bytes: &[u8]) -> Option<(Entry<'_>, usize)> {
    let (key, rest) = split_sized(bytes)?;
    let (value, rest) = split_sized(rest)?;
    Some((Entry { key, value }, bytes.len() - rest.len()))
}

/// Splits a length field and that many bytes off the front of `bytes`.
fn split_sized(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = read_len(bytes)?;
    rest.split_at_checked(usize::try_from(len).ok()?)
}

fn read_len(bytes: &[u8]) -> Option<(u32, &[u8])> {
    let (len, rest) = bytes.split_at_checked(LEN_BYTES)?;
    Some((u32::from_le_bytes(len.try_into().ok()?), rest))
}

/// A key or value too long for a length field.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} of {len} bytes does not fit the file format (at most {} bytes)", u32::MAX)]
pub(super) struct TooLong {
    pub what: &'static str,
    pub len: usize,
}

/// A change to the store, as one entry records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Change<'a> {
    /// A user's key takes a value: SET, and the outcome of ADD, COMPARE_SET and APPEND.
    Set { key: &'a [u8], value: &'a [u8] },
    /// A user's key is removed.
    Delete { key: &'a [u8] },
    /// A key outside the users' namespace takes a value: torch's [`REFCOUNT`] and [`CLEANUP`]
    /// counters, or whatever else a later torch may keep there.
    SetOther { key: &'a [u8], value: &'a [u8] },
    /// A key outside the users' namespace is removed (no one writes this; torch would apply it).
    DeleteOther { key: &'a [u8] },
    /// elastix's extension: an item joins the back of a queue.
    QueuePush { queue: &'a [u8], item: &'a [u8] },
    /// elastix's extension: the item at the front of a queue leaves it.
    QueuePop { queue: &'a [u8] },
}

impl<'a> Change<'a> {
    /// What an entry means.
    pub fn of(entry: Entry<'a>) -> Change<'a> {
        let Entry { key, value } = entry;
        if let Some(key) = key.strip_prefix(DELETE_USER) {
            Change::Delete { key }
        } else if let Some(queue) = key.strip_prefix(QUEUE_PUSH) {
            Change::QueuePush { queue, item: value }
        } else if let Some(queue) = key.strip_prefix(QUEUE_POP) {
            Change::QueuePop { queue }
        } else if let Some(key) = key.strip_prefix(DELETE) {
            Change::DeleteOther { key }
        } else if let Some(key) = key.strip_prefix(USER) {
            Change::Set { key, value }
        } else {
            Change::SetOther { key, value }
        }
    }

    /// Appends the entry that records this change to `out`; on error `out` is unchanged.
    pub fn encode(self, out: &mut Vec<u8>) -> Result<(), TooLong> {
        let (prefix, key, value): (&[u8], &[u8], &[u8]) = match self {
            Change::Set { key, value } => (USER, key, value),
            Change::Delete { key } => (DELETE_USER, key, b""),
            Change::SetOther { key, value } => (b"", key, value),
            Change::DeleteOther { key } => (DELETE, key, b""),
            Change::QueuePush { queue, item } => (QUEUE_PUSH, queue, item),
            Change::QueuePop { queue } => (QUEUE_POP, queue, b""),
        };
        let key_len = prefix.len() + key.len();
        let too_long = |what, len| move |_| TooLong { what, len };
        let key_field = u32::try_from(key_len).map_err(too_long("a key", key.len()))?;
        let value_field = u32::try_from(value.len()).map_err(too_long("a value", value.len()))?;
        out.reserve(2 * LEN_BYTES + key_len + value.len());
        out.extend_from_slice(&key_field.to_le_bytes());
        out.extend_from_slice(prefix);
        out.extend_from_slice(key);
        out.extend_from_slice(&value_field.to_le_bytes());
        out.extend_from_slice(value);
        Ok(())
    }
}

/// Why the start of a file shows that it is not a store file.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum NotAStore {
    #[error(
        "it is in the format of elastix releases before this one (it starts with ELXFSTOR); elastix now shares \
         torch's FileStore format: delete the file, or give a new path"
    )]
    OldElastix,
    #[error(
        "it is not a FileStore file (torch's format): its first entry {0}; give a path of the store's own, or \
         delete the file"
    )]
    Foreign(&'static str),
}

/// Checks that a file starting with `bytes` can be a store file: empty, or starting with an
/// entry a store's first writer makes, whole or cut short: torch's and elastix's openers count
/// themselves in [`REFCOUNT`] first, and a file deleted under a handle is made again by
/// whatever that handle writes next.
pub(super) fn check_start(bytes: &[u8]) -> Result<(), NotAStore> {
    if bytes.starts_with(b"ELXFSTOR") {
        return Err(NotAStore::OldElastix);
    }
    let Some((key_len, rest)) = read_len(bytes) else {
        // too short to tell anything: the first writer was cut short (or nothing is there yet)
        return Ok(());
    };
    if key_len == 0 {
        return Err(NotAStore::Foreign("has an empty key"));
    }
    let whole = rest.len() >= key_len as usize;
    let present = &rest[..rest.len().min(key_len as usize)];
    let counter = |name: &[u8]| name.len() == key_len as usize && name.starts_with(present);
    let prefixed = [USER, DELETE].iter().any(|prefix| present.starts_with(prefix));
    let change = (present.is_empty() || prefixed) && (whole || key_len <= LONGEST_TORN_FIRST_KEY);
    if counter(REFCOUNT) || counter(CLEANUP) || change {
        Ok(())
    } else {
        Err(NotAStore::Foreign("is neither one of torch's counters nor a change to a key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(change: Change<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        change.encode(&mut out).unwrap();
        out
    }

    #[test]
    fn entries_are_little_endian_u32_lengths_then_bytes() {
        let set = encoded(Change::Set { key: b"k", value: b"value" });
        assert_eq!(set, b"\x02\x00\x00\x00/k\x05\x00\x00\x00value");
        assert_eq!(encoded(Change::Delete { key: b"k" }), b"\x03\x00\x00\x00-/k\x00\x00\x00\x00");
        let refcount = encoded(Change::SetOther { key: REFCOUNT, value: b"1" });
        assert_eq!(refcount, b"\x09\x00\x00\x00refcount/\x01\x00\x00\x001");
        let long_key = vec![b'k'; 300];
        let entry = encoded(Change::Set { key: &long_key, value: b"" });
        assert_eq!(entry[..4], [0x2d, 0x01, 0, 0], "301 = 0x12d");
        assert_eq!(entry.len(), 4 + 301 + 4);
    }

    #[test]
    fn every_change_survives_a_round_trip() {
        let changes = [
            Change::Set { key: b"k", value: b"v" },
            Change::Set { key: b"", value: b"" },
            Change::Set { key: b"-k", value: b"starts like a delete" },
            Change::Delete { key: b"k" },
            Change::Delete { key: b"" },
            Change::SetOther { key: REFCOUNT, value: b"2" },
            Change::SetOther { key: CLEANUP, value: b"1" },
            Change::DeleteOther { key: b"refcount/" },
            Change::QueuePush { queue: b"q", item: b"item" },
            Change::QueuePush { queue: b"", item: b"" },
            Change::QueuePop { queue: b"q" },
        ];
        let mut file = Vec::new();
        changes.iter().for_each(|change| change.encode(&mut file).unwrap());
        let mut rest = &file[..];
        for expected in changes {
            let (entry, used) = decode(rest).unwrap();
            assert_eq!(Change::of(entry), expected);
            rest = &rest[used..];
        }
        assert!(rest.is_empty());
    }

    #[test]
    fn torch_keys_mean_what_torch_reads_them_as() {
        let of = |key: &'static [u8]| Change::of(Entry { key, value: b"x" });
        assert_eq!(of(b"/a"), Change::Set { key: b"a", value: b"x" });
        assert_eq!(of(b"/-a"), Change::Set { key: b"-a", value: b"x" });
        assert_eq!(of(b"-/a"), Change::Delete { key: b"a" });
        assert_eq!(of(b"-/-a"), Change::Delete { key: b"-a" });
        assert_eq!(of(b"refcount/"), Change::SetOther { key: REFCOUNT, value: b"x" });
        assert_eq!(of(b"something/new"), Change::SetOther { key: b"something/new", value: b"x" });
        assert_eq!(of(b"-cleanup/"), Change::DeleteOther { key: CLEANUP });
        // torch reads elastix's queue entries as the deletion of keys that never exist
        assert_eq!(of(b"-elastix/queue-push/q"), Change::QueuePush { queue: b"q", item: b"x" });
        assert_eq!(of(b"-elastix/queue-pop/q"), Change::QueuePop { queue: b"q" });
    }

    #[test]
    fn an_entry_cut_short_anywhere_does_not_decode() {
        let entry = encoded(Change::Set { key: b"key", value: b"value" });
        for cut in 0..entry.len() {
            assert_eq!(decode(&entry[..cut]), None, "cut at {cut}");
        }
        let (whole, used) = decode(&entry).unwrap();
        assert_eq!((whole.key, whole.value, used), (&b"/key"[..], &b"value"[..], entry.len()));
    }

    #[test]
    fn a_length_beyond_u32_is_refused_without_writing() {
        // a slice that long cannot be allocated here; the check is on the length alone
        let err = TooLong { what: "a value", len: 1 << 32 };
        assert!(err.to_string().contains("4294967296 bytes does not fit"), "{err}");
    }

    #[test]
    fn a_store_file_starts_with_a_counter_or_a_user_key() {
        let refcount = encoded(Change::SetOther { key: REFCOUNT, value: b"1" });
        let cleanup = encoded(Change::SetOther { key: CLEANUP, value: b"1" });
        let user = encoded(Change::Set { key: b"k", value: b"v" });
        let push = encoded(Change::QueuePush { queue: b"q", item: b"v" });
        for start in [&refcount, &cleanup, &user, &push] {
            // whole, or cut anywhere (its first writer died mid-write)
            for cut in 0..=start.len() {
                assert_eq!(check_start(&start[..cut]), Ok(()), "{:?}", &start[..cut]);
            }
        }
        assert_eq!(check_start(b""), Ok(()));
    }

    #[test]
    fn other_files_are_not_taken_for_a_store() {
        assert_eq!(check_start(b"ELXFSTOR\x01\x00\x00\x00\x06"), Err(NotAStore::OldElastix));
        for foreign in [
            &b"just some text, not a store"[..],
            b"/usr/bin/env python",
            b"\x7fELF\x02\x01\x01",
            b"\x1f\x8b\x08\x00",
            b"\x00\x00\x00\x00\x00\x00\x00\x00",
            b"\x05\x00\x00\x00hello\x00\x00\x00\x00",
            b"\x09\x00\x00\x00refcounts\x01\x00\x00\x001",
        ] {
            assert!(matches!(check_start(foreign), Err(NotAStore::Foreign(_))), "{foreign:?}");
        }
    }
}
