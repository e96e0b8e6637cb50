//! How two agents exchange checkpoint copies, after the handshake that proves the round's key
//! ([`PURPOSE`]) and inside its sealed session:
//!
//! ```text
//! request  = op (1: put, 2: get, 3: offer) | length (u32 LE)
//!            | JSON (put: the slot's manifest; get: {"rank", "step"};
//!                    offer: {"manifest", "digest": 32 hex digits})
//! put      = request | data (manifest.size bytes) | commit (1: whole, 0: changed meanwhile)
//!            -> stored (1) or not (0)
//! get      -> length (u32 LE) | JSON manifest, or length 0 when not held
//!             | data | commit
//! offer    -> 1: the holder copied the same bytes from its own rank's save of the step
//!                (kept; [`super::replica`]), or 0: then data | commit -> stored, as a put's
//! ```
//!
//! The side that sends data checks after sending that the slot was not saved into meanwhile
//! (its generation) and says so in the commit byte; the receiver writes the manifest, which
//! makes its copy whole, only on a commit.

use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::super::layout::{rank_dir, read_slot, slot_paths, SlotManifest, PEER_SLOTS, SLOTS};
use super::super::persist::slot_generation;
use super::super::quiet::Quiet;
use crate::auth::pair::Purpose;

/// Agent-to-agent checkpoint copies: bound to (connector, acceptor) group ranks, two u32 LE.
pub const PURPOSE: Purpose = Purpose { magic: *b"ELXCKP01", label: b"elastix checkpoints", binding_len: 8 };
/// The round's key is derived from the job secret with this label.
pub const KEY_LABEL: &[u8] = b"checkpoints";
pub const PUT: u8 = 1;
pub const GET: u8 = 2;
pub const OFFER: u8 = 3;
/// The largest request JSON (a manifest's structure included).
const MAX_HEADER: usize = 16 << 20;
/// Bytes moved per read and write.
const CHUNK: usize = 4 << 20;

/// What a get asks for.
#[derive(Debug, Serialize, Deserialize)]
pub struct Want {
    pub rank: u32,
    pub step: u64,
}

/// What an offer names: the slot, and the digest of its data ([`super::replica::digest`]).
#[derive(Debug, Serialize, Deserialize)]
pub struct Offer {
    pub manifest: SlotManifest,
    pub digest: String,
}

pub fn binding(connector: u32, acceptor: u32) -> [u8; 8] {
    let mut bytes = [0u8; 8];
    bytes[..4].copy_from_slice(&connector.to_le_bytes());
    bytes[4..].copy_from_slice(&acceptor.to_le_bytes());
    bytes
}

/// The acceptor's group rank a binding names.
pub fn acceptor_of(binding: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(binding.get(4..8)?.try_into().ok()?))
}

pub async fn write_json<W: AsyncWrite + Unpin>(stream: &mut W, value: &impl Serialize) -> io::Result<()> {
    let json = serde_json::to_vec(value).map_err(io::Error::other)?;
    stream.write_u32_le(json.len() as u32).await?;
    stream.write_all(&json).await
}

/// A JSON value, or `None` for a length of 0.
pub async fn read_json<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(stream: &mut R) -> io::Result<Option<T>> {
    let len = stream.read_u32_le().await? as usize;
    if len == 0 {
        return Ok(None);
    }
    if len > MAX_HEADER {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {len}-byte header is too long")));
    }
    let mut json = vec![0u8; len];
    stream.read_exact(&mut json).await?;
    serde_json::from_slice(&json).map(Some).map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))
}

/// Where `rank`'s whole slot of `step` is under `root` (a memory directory or its peers'), if
/// one holds it.
pub fn find_slot(root: &Path, rank: u32, step: u64) -> Option<(SlotManifest, PathBuf)> {
    (0..SLOTS)
        .filter_map(|slot| read_slot(&rank_dir(root, rank), rank, slot))
        .find(|(manifest, _)| manifest.step == step)
}

/// Sends the data of the slot `manifest` describes (`data`, under `root`), at most `rate` bytes
/// a second (0: as fast as it goes) and waiting before each chunk while `quiet` holds it back,
/// then the commit byte; true when it was whole throughout.
pub async fn send_slot<W: AsyncWrite + Unpin>(
    stream: &mut W,
    root: &Path,
    manifest: &SlotManifest,
    data: &Path,
    rate: u64,
    quiet: Option<&Quiet>,
) -> io::Result<bool> {
    // read with plain positioned reads on a blocking thread: one copy per byte (tokio's file
    // reads go through a buffer of their own, a second copy)
    let file = Arc::new(std::fs::File::open(data)?);
    let started = Instant::now();
    let mut buffer = vec![0u8; CHUNK.min(manifest.size as usize).max(1)];
    let mut sent = 0u64;
    while sent < manifest.size {
        if let Some(quiet) = quiet {
            quiet.wait().await;
        }
        let want = buffer.len().min((manifest.size - sent) as usize);
        let reading = file.clone();
        let (read, back) = tokio::task::spawn_blocking(move || {
            let read = reading.read_at(&mut buffer[..want], sent);
            (read, buffer)
        })
        .await
        .map_err(io::Error::other)?;
        buffer = back;
        let n = read?;
        if n == 0 {
            break;
        }
        stream.write_all(&buffer[..n]).await?;
        sent += n as u64;
        if rate > 0 {
            // ahead of the allowed rate: wait until it catches up
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    if sent < manifest.size {
        // the file shrank: a new save into the slot; keep the stream's framing, refuse the copy
        let zeros = vec![0u8; CHUNK];
        while sent < manifest.size {
            let n = zeros.len().min((manifest.size - sent) as usize);
            stream.write_all(&zeros[..n]).await?;
            sent += n as u64;
        }
    }
    let whole = sent == manifest.size
        && slot_generation(root, manifest.rank, manifest) == Some(manifest.generation)
        && file.metadata()?.len() >= manifest.size;
    stream.write_u8(u8::from(whole)).await?;
    stream.flush().await?;
    Ok(whole)
}

/// Receives a slot's data (`manifest.size` bytes) and commit byte into `rank`'s two slots
/// under `root`, into the one not holding its newest step; its manifest is written, making it
/// whole, on a commit only. True when the copy is whole.
pub async fn receive_slot<R: AsyncRead + Unpin>(
    stream: &mut R,
    root: &Path,
    manifest: &SlotManifest,
) -> io::Result<bool> {
    let (root_owned, wanted) = (root.to_path_buf(), manifest.clone());
    let (data, json) = tokio::task::spawn_blocking(move || prepare_peer_slot(&root_owned, &wanted))
        .await
        .map_err(io::Error::other)??;
    // written over, not truncated (freeing and allocating again hundreds of MB of pages), with
    // plain positioned writes on a blocking thread: tokio's file writes copy into a buffer of
    // their own first
    let file = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(&data)?;
    let file = Arc::new(file);
    let mut written = 0u64;
    let mut buffer = vec![0u8; CHUNK.min(manifest.size as usize).max(1)];
    while written < manifest.size {
        let want = buffer.len().min((manifest.size - written) as usize);
        stream.read_exact(&mut buffer[..want]).await?;
        let writing = file.clone();
        let (wrote, back) = tokio::task::spawn_blocking(move || {
            let wrote = writing.write_all_at(&buffer[..want], written);
            (wrote, buffer)
        })
        .await
        .map_err(io::Error::other)?;
        buffer = back;
        wrote?;
        written += want as u64;
    }
    file.set_len(manifest.size)?; // a longer step held in the slot before
    if stream.read_u8().await? != 1 {
        return Ok(false);
    }
    let wanted = manifest.clone();
    tokio::task::spawn_blocking(move || commit_peer_slot(&json, &wanted)).await.map_err(io::Error::other)??;
    Ok(true)
}

/// The slot `manifest`'s copy goes into among its rank's peer slots under `root`: the one not
/// holding the newest step, its manifest removed (not whole until [`commit_peer_slot`]).
/// Returns its data file and manifest path.
pub fn prepare_peer_slot(root: &Path, manifest: &SlotManifest) -> io::Result<(PathBuf, PathBuf)> {
    let dir = rank_dir(root, manifest.rank);
    std::fs::create_dir_all(&dir)?;
    let held: Vec<_> =
        (0..PEER_SLOTS).filter_map(|slot| Some((slot, read_slot(&dir, manifest.rank, slot)?.0.step))).collect();
    let newest = held.iter().max_by_key(|(_, step)| *step).map(|(slot, _)| *slot);
    let slot = (0..PEER_SLOTS).find(|slot| Some(*slot) != newest).unwrap_or(0);
    let (data, json) = slot_paths(&dir, slot);
    match std::fs::remove_file(&json) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    Ok((data, json))
}

/// Makes a peer slot's copy whole: its manifest, written through a temporary name.
pub fn commit_peer_slot(json: &Path, manifest: &SlotManifest) -> io::Result<()> {
    let temporary = json.with_extension("json.tmp");
    std::fs::write(&temporary, serde_json::to_vec(manifest).map_err(io::Error::other)?)?;
    std::fs::rename(&temporary, json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::checkpoints::layout::fixtures::{manifest, scratch, write_slot};

    #[tokio::test]
    async fn a_slot_sent_arrives_whole_in_the_slot_not_holding_the_newest_step() {
        let (from, to) = (scratch("from"), scratch("to"));
        let sent = manifest(1, 5, 10);
        write_slot(&from, 0, &sent, b"0123456789");
        write_slot(&to, 0, &manifest(1, 4, 3), b"old");
        // an older, longer step in the slot it goes to: written over, and no byte of it left
        write_slot(&to, 1, &manifest(1, 3, 20), b"an older longer step");
        let (mut a, mut b) = tokio::io::duplex(64);
        let data = slot_paths(&rank_dir(&from, 1), 0).0;
        let (whole, received) =
            tokio::join!(send_slot(&mut a, &from, &sent, &data, 0, None), receive_slot(&mut b, &to, &sent));
        assert!(whole.unwrap() && received.unwrap());
        let (got, path) = find_slot(&to, 1, 5).unwrap();
        assert_eq!(got, sent);
        assert_eq!(std::fs::read(path).unwrap(), b"0123456789");
        assert!(find_slot(&to, 1, 4).is_some(), "the older step stays in the other slot");
        let _ = (std::fs::remove_dir_all(from), std::fs::remove_dir_all(to));
    }

    #[tokio::test]
    async fn a_slot_saved_into_while_it_was_sent_is_not_kept() {
        let (from, to) = (scratch("torn-from"), scratch("torn-to"));
        let sent = manifest(0, 5, 4);
        write_slot(&from, 0, &sent, b"abcd");
        // the worker saved step 6 into the slot meanwhile: another generation
        write_slot(&from, 0, &manifest(0, 6, 4), b"efgh");
        let (mut a, mut b) = tokio::io::duplex(64);
        let data = slot_paths(&rank_dir(&from, 0), 0).0;
        let (whole, received) =
            tokio::join!(send_slot(&mut a, &from, &sent, &data, 0, None), receive_slot(&mut b, &to, &sent));
        assert!(!whole.unwrap() && !received.unwrap());
        assert!(find_slot(&to, 0, 5).is_none());
        let _ = (std::fs::remove_dir_all(from), std::fs::remove_dir_all(to));
    }

    #[test]
    fn bindings_name_both_ends() {
        assert_eq!(acceptor_of(&binding(3, 7)), Some(7));
        assert_eq!(acceptor_of(&[1, 2]), None);
    }
}
