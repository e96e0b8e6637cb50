//! Where checkpoints live, in memory and on disk, and what their manifests say. The Python
//! side (`python/elastix/checkpoint/`) writes and reads the same layout:
//!
//! ```text
//! <memory>/rank-<r>/slot-<k>.data   a saved state's bytes (k < 4: the worker writes into a
//! <memory>/rank-<r>/slot-<k>.json   slot holding neither its newest step nor a pinned one);
//!                                   the manifest is written last and removed first, so a slot
//!                                   with one is whole
//! <memory>/pinned.json              the steps the agent is copying to a peer, kept meanwhile
//! <memory>/peers/rank-<r>/slot-<k>.*   copies of other nodes' slots, sent by their agents
//! <memory>/rank-<r>/restored.json       the step rank r's worker restored last, and from where
//! <dir>/<run_id>/step-<n>/rank-<r>.data   persisted by the agent, the manifest last, with the
//! <dir>/<run_id>/step-<n>/rank-<r>.json   data's CRC-32
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::rendezvous::records::Restored;

/// The format both sides write.
pub const FORMAT_VERSION: u32 = 1;
/// Slots per rank in memory: the newest whole step, the one being written, and the (at most
/// two) steps the agent pins while it copies them to a peer ([`PINNED`]).
pub const SLOTS: u32 = 4;
/// Slots per rank of a peer's copies: the newest whole copy and the one being received.
pub const PEER_SLOTS: u32 = 2;
/// `<memory>/pinned.json`: `{"v": 1, "steps": [...]}`, the steps a worker must not save over.
pub const PINNED: &str = "pinned.json";

/// A slot's manifest, as the worker wrote it (the structure is the worker's business).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotManifest {
    pub v: u32,
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Bytes of the data file that belong to the state.
    pub size: u64,
    /// Changes with every save into the slot: a copy made while it changed is not kept.
    pub generation: u64,
    /// When the worker saved it (seconds since the epoch).
    pub saved: f64,
    /// How long the worker's save took, in seconds (the copy into memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub took: Option<f64>,
    pub structure: Value,
}

/// A persisted rank's manifest: the slot's, with the data's checksum and when it was written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskManifest {
    #[serde(flatten)]
    pub slot: SlotManifest,
    pub crc32: u32,
    pub persisted: f64,
}

pub fn rank_dir(memory: &Path, rank: u32) -> PathBuf {
    memory.join(format!("rank-{rank}"))
}

pub fn slot_paths(rank_dir: &Path, slot: u32) -> (PathBuf, PathBuf) {
    (rank_dir.join(format!("slot-{slot}.data")), rank_dir.join(format!("slot-{slot}.json")))
}

pub fn step_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join(format!("step-{step:012}"))
}

/// Slot `slot` of `rank` (in its directory `rank_dir`), when it is whole: its manifest (of
/// this format and rank) and its data file.
pub fn read_slot(rank_dir: &Path, rank: u32, slot: u32) -> Option<(SlotManifest, PathBuf)> {
    let (data, json) = slot_paths(rank_dir, slot);
    let manifest: SlotManifest = serde_json::from_slice(&std::fs::read(json).ok()?).ok()?;
    (manifest.v == FORMAT_VERSION && manifest.rank == rank).then_some((manifest, data))
}

/// What a rank's worker says it restored last (`<rank dir>/restored.json`), if it did.
pub fn read_restored(rank_dir: &Path) -> Option<Restored> {
    serde_json::from_slice(&std::fs::read(rank_dir.join("restored.json")).ok()?).ok()
}

/// Where the copies other agents sent are kept, inside an agent's memory: the same layout.
pub fn peers_dir(memory: &Path) -> PathBuf {
    memory.join("peers")
}

/// The step a `step-<n>` directory holds.
pub fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The rank a `rank-<r>` directory belongs to.
pub fn rank_of(name: &str) -> Option<u32> {
    name.strip_prefix("rank-")?.parse().ok()
}

/// What the checkpoint modules' tests write: a slot's manifest and files.
#[cfg(test)]
pub mod fixtures {
    use std::path::{Path, PathBuf};

    use serde_json::json;

    use super::{rank_dir, slot_paths, SlotManifest, FORMAT_VERSION};

    /// The manifest of rank `rank`'s step `step` (its generation too), of `size` bytes.
    pub fn manifest(rank: u32, step: u64, size: u64) -> SlotManifest {
        SlotManifest {
            v: FORMAT_VERSION,
            step,
            rank,
            world_size: 2,
            size,
            generation: step,
            saved: 0.0,
            took: None,
            structure: json!({"w": "leaf"}),
        }
    }

    /// Writes `data` and `manifest` as slot `slot` under `root`; returns the data file.
    pub fn write_slot(root: &Path, slot: u32, manifest: &SlotManifest, data: &[u8]) -> PathBuf {
        let dir = rank_dir(root, manifest.rank);
        std::fs::create_dir_all(&dir).unwrap();
        let (data_path, json) = slot_paths(&dir, slot);
        std::fs::write(&data_path, data).unwrap();
        std::fs::write(json, serde_json::to_vec(manifest).unwrap()).unwrap();
        data_path
    }

    /// An empty directory of the test's own under the temporary directory.
    pub fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("elastix-ckpt-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back() {
        let dir = step_dir(Path::new("/x"), 42);
        assert_eq!(step_of(dir.file_name().unwrap().to_str().unwrap()), Some(42));
        assert_eq!(rank_of("rank-3"), Some(3));
        assert_eq!(rank_of("rank-x"), None);
        assert_eq!(step_of("steps"), None);
    }
}
