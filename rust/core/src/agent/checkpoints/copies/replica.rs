//! Copies the holder makes itself. In data parallelism every rank saves the same bytes, so
//! the buddy's own rank often holds, for the same step, exactly what it is about to be sent.
//! The sender offers the slot's digest first; a holder whose own rank saved the same bytes for
//! that step copies them into its peer slot locally (one pass through memory: no network, no
//! sealing, no second agent busy), and the data is not sent. A state of its own per rank
//! (sharded) finds no replica and is sent as before.
//!
//! The digest is XXH3-128: it tells a replica from another state by accident only, which is
//! all it must do. Both ends are the round's own agents (the offer travels in their sealed
//! session) and the bytes are their own workers'.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::super::layout::{rank_dir, rank_of, read_slot, SlotManifest, SLOTS};
use super::super::persist::slot_generation;
use super::wire::{commit_peer_slot, prepare_peer_slot};

/// Bytes read per pass: small enough to stay in cache between the read and the hash.
const CHUNK: usize = 1 << 20;

/// The digest of the first `size` bytes of `data`.
pub fn digest(data: &Path, size: u64) -> io::Result<u128> {
    let file = File::open(data)?;
    let mut hasher = Xxh3::new();
    let mut buffer = vec![0u8; CHUNK];
    let mut done = 0u64;
    while done < size {
        let want = buffer.len().min((size - done) as usize);
        file.read_exact_at(&mut buffer[..want], done)?;
        hasher.update(&buffer[..want]);
        done += want as u64;
    }
    Ok(hasher.digest128())
}

/// Fills `manifest.rank`'s peer slot under `peers` from a slot of this agent's own ranks
/// (under `memory`) that holds `manifest`'s step with the same size and `digest`, if one does:
/// true when the copy is whole (its manifest written), false when no replica matched (or its
/// slot was saved into meanwhile).
pub fn fill_from_replica(memory: &Path, peers: &Path, manifest: &SlotManifest, digest: u128) -> io::Result<bool> {
    let Some((own_rank, own, source)) = replica_of(memory, manifest) else { return Ok(false) };
    let (data, json) = prepare_peer_slot(peers, manifest)?;
    let from = File::open(source)?;
    let to = OpenOptions::new().write(true).create(true).truncate(false).open(&data)?;
    let mut hasher = Xxh3::new();
    let mut buffer = vec![0u8; CHUNK];
    let mut done = 0u64;
    while done < manifest.size {
        let want = buffer.len().min((manifest.size - done) as usize);
        from.read_exact_at(&mut buffer[..want], done)?;
        hasher.update(&buffer[..want]);
        to.write_all_at(&buffer[..want], done)?;
        done += want as u64;
    }
    // a longer step held in the slot before is cut off
    to.set_len(manifest.size)?;
    // what was written is the sender's bytes, and the replica was one save throughout
    let same = hasher.digest128() == digest && slot_generation(memory, own_rank, &own) == Some(own.generation);
    if same {
        commit_peer_slot(&json, manifest)?;
    }
    Ok(same)
}

/// A slot of this agent's own ranks holding `manifest`'s step with its size: rank, manifest
/// and data file.
fn replica_of(memory: &Path, manifest: &SlotManifest) -> Option<(u32, SlotManifest, PathBuf)> {
    let entries = std::fs::read_dir(memory).ok()?;
    let mut ranks = entries.flatten().filter_map(|entry| entry.file_name().to_str().and_then(rank_of));
    ranks.find_map(|rank| {
        (0..SLOTS).find_map(|slot| {
            let (own, data) = read_slot(&rank_dir(memory, rank), rank, slot)?;
            (own.step == manifest.step && own.size == manifest.size).then_some((rank, own, data))
        })
    })
}

/// Offers a rank's copies while the buddy finds a replica of them; once it found none a few
/// times in a row (a sharded state: reading the slot for its digest would only add to each
/// copy), sends them outright and offers again now and then only (a job can change).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offering {
    missed: u32,
    since_offered: u32,
}

impl Offering {
    /// Misses in a row before copies are sent without an offer.
    const MISSES: u32 = 3;
    /// While so: one copy in this many is offered again.
    const AGAIN_EVERY: u32 = 16;

    /// Whether the next copy is offered.
    pub fn offer(&mut self) -> bool {
        if self.missed < Self::MISSES {
            return true;
        }
        self.since_offered += 1;
        if self.since_offered >= Self::AGAIN_EVERY {
            self.since_offered = 0;
            return true;
        }
        false
    }

    /// What an offered copy came to: made from the buddy's replica (true) or sent.
    pub fn offered(&mut self, replica: bool) {
        self.missed = if replica { 0 } else { self.missed.saturating_add(1) };
    }
}

/// A digest as the offer carries it: 32 hex digits.
pub fn to_hex(digest: u128) -> String {
    format!("{digest:032x}")
}

pub fn from_hex(text: &str) -> Option<u128> {
    (text.len() == 32).then(|| u128::from_str_radix(text, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::checkpoints::copies::wire::find_slot;
    use crate::agent::checkpoints::layout::fixtures::{manifest, scratch, write_slot};
    use crate::agent::checkpoints::layout::peers_dir;

    #[test]
    fn a_replica_of_the_step_fills_the_peer_slot_and_another_state_does_not() {
        let memory = scratch("replica");
        // this agent's rank 1 saved step 7; the buddy offers rank 0's step 7
        let own = write_slot(&memory, 2, &manifest(1, 7, 10), b"same bytes");
        let offered = manifest(0, 7, 10);
        let same = digest(&own, 10).unwrap();
        assert!(fill_from_replica(&memory, &peers_dir(&memory), &offered, same).unwrap());
        let (held, path) = find_slot(&peers_dir(&memory), 0, 7).unwrap();
        assert_eq!(held, offered, "held as rank 0's, with rank 0's manifest");
        assert_eq!(std::fs::read(path).unwrap(), b"same bytes");

        // other bytes (a state of its own per rank), another step, another size: no replica
        let other = manifest(0, 8, 10);
        write_slot(&memory, 3, &manifest(1, 8, 10), b"rank 1's 8");
        let theirs = u128::from_le_bytes(*b"rank 0's bytes!!");
        assert!(!fill_from_replica(&memory, &peers_dir(&memory), &other, theirs).unwrap());
        assert!(find_slot(&peers_dir(&memory), 0, 8).is_none(), "nothing kept of a mismatch");
        assert!(!fill_from_replica(&memory, &peers_dir(&memory), &manifest(0, 9, 10), same).unwrap());
        assert!(!fill_from_replica(&memory, &peers_dir(&memory), &manifest(0, 7, 11), same).unwrap());
        assert!(find_slot(&peers_dir(&memory), 0, 7).is_some(), "the whole copy of step 7 stays");
        let _ = std::fs::remove_dir_all(memory);
    }

    #[test]
    fn a_rank_whose_copies_find_no_replica_is_offered_again_only_now_and_then() {
        let mut offering = Offering::default();
        for _ in 0..3 {
            assert!(offering.offer());
            offering.offered(false);
        }
        let offers: Vec<bool> = (0..32).map(|_| offering.offer()).collect();
        assert_eq!(offers.iter().filter(|offered| **offered).count(), 2, "{offers:?}");
        // a replica found again: every copy is offered
        offering.offered(true);
        assert!((0..5).all(|_| offering.offer()));
    }

    #[test]
    fn digests_travel_as_hex() {
        let value = 0x0123_4567_89ab_cdef_0011_2233_4455_6677u128;
        assert_eq!(from_hex(&to_hex(value)), Some(value));
        assert_eq!(from_hex("12"), None);
        assert_eq!(from_hex(&"g".repeat(32)), None);
    }
}
