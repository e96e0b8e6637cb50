//! The agent's copy server: it keeps the copies its peers send (put) and gives out what it
//! holds, its own ranks' slots or its peers' copies (get), to agents that prove the round's
//! key. A connection that does not prove it within the handshake deadline is closed; a few
//! connections are served at once, more are closed at once.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use super::super::layout::{peers_dir, SlotManifest};
use super::replica;
use super::wire::{self, Offer, Want, GET, OFFER, PURPOSE, PUT};
use crate::auth::pair;
use crate::auth::session::{Mode, SealedStream};
use crate::auth::{Key, HANDSHAKE_DEADLINE};
use crate::store::server::listener;

/// Connections served at once: a put from the buddy and a few gets after a re-form.
const AT_ONCE: usize = 8;
/// The longest a proven connection may take (a stalled peer frees its place after it).
pub const COPY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(600);

/// The round's key and this agent's group rank in it: what a connection must prove and name.
pub type RoundKey = Arc<Mutex<Option<(Key, u32)>>>;

/// The copy server; stops, with the connections it serves, when stopped or dropped.
pub struct Holder {
    port: u16,
    round: RoundKey,
    task: JoinHandle<()>,
}

impl Holder {
    /// Serves `memory` on a port the kernel picks: on `host` alone for a loopback name, else on
    /// every address. Must run inside a tokio runtime.
    pub fn start(memory: PathBuf, host: &str) -> io::Result<Holder> {
        let only = listener::is_loopback_name(host).then_some(host);
        let std = listener::bind(only, 0)?;
        std.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std)?;
        let port = listener.local_addr()?.port();
        let round = RoundKey::default();
        let task = tokio::spawn(serve(listener, memory, round.clone()));
        Ok(Holder { port, round, task })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, connections prove `key` and name `me` (this agent's group rank).
    pub fn enter_round(&self, key: Key, me: u32) {
        *self.round.lock().unwrap_or_else(PoisonError::into_inner) = Some((key, me));
    }

    /// Accepts no more connections and ends those in progress: a put still coming writes
    /// nothing more into the memory (which the agent is about to remove).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(listener: TcpListener, memory: PathBuf, round: RoundKey) {
    let at_once = Arc::new(Semaphore::new(AT_ONCE));
    // owned here: when the server is stopped (this future dropped), so are its connections
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::debug!("checkpoint copy server: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = at_once.clone().try_acquire_owned() else {
            tracing::debug!("checkpoint copy server: {AT_ONCE} connections already; closing {peer}'s");
            continue;
        };
        let Some((key, me)) = round.lock().unwrap_or_else(PoisonError::into_inner).clone() else { continue };
        let memory = memory.clone();
        connections.spawn(async move {
            match tokio::time::timeout(COPY_DEADLINE, connection(stream, &memory, &key, me)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::debug!("checkpoint copy connection from {peer}: {err}"),
                Err(_) => tracing::debug!("checkpoint copy connection from {peer}: closed after {COPY_DEADLINE:?}"),
            }
            drop(permit);
        });
    }
}

async fn connection(mut stream: TcpStream, memory: &Path, key: &Key, me: u32) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let check = |binding: &[u8]| match wire::acceptor_of(binding) {
        Some(acceptor) if acceptor == me => Ok(()),
        _ => Err("a copy meant for another member".to_owned()),
    };
    let accepted = pair::accept(&mut stream, key, &PURPOSE, Mode::wanted(), check);
    let (_, session) = tokio::time::timeout(HANDSHAKE_DEADLINE, accepted)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no handshake within the deadline"))?
        .map_err(io::Error::other)?;
    let mut stream = SealedStream::new(stream, session);
    match stream.read_u8().await? {
        PUT => {
            let Some(manifest) = wire::read_json::<_, SlotManifest>(&mut stream).await? else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "a put without a manifest"));
            };
            let stored = wire::receive_slot(&mut stream, &peers_dir(memory), &manifest).await?;
            stream.write_u8(u8::from(stored)).await?;
            stream.flush().await
        }
        OFFER => {
            let Some(offer) = wire::read_json::<_, Offer>(&mut stream).await? else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "an offer without a manifest"));
            };
            let filled = fill_from_replica(memory, &offer).await;
            stream.write_u8(u8::from(filled)).await?;
            stream.flush().await?;
            if !filled {
                let stored = wire::receive_slot(&mut stream, &peers_dir(memory), &offer.manifest).await?;
                stream.write_u8(u8::from(stored)).await?;
                stream.flush().await?;
            }
            Ok(())
        }
        GET => {
            let Some(want) = wire::read_json::<_, Want>(&mut stream).await? else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "a get that names nothing"));
            };
            give(&mut stream, memory, &want).await
        }
        op => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown request {op}"))),
    }
}

/// Whether this agent filled the offered copy from its own rank's identical save of the step
/// (on a blocking thread: a pass through memory); a failure to is said, and the data is sent.
async fn fill_from_replica(memory: &Path, offer: &Offer) -> bool {
    let Some(digest) = replica::from_hex(&offer.digest) else { return false };
    let (memory, manifest) = (memory.to_path_buf(), offer.manifest.clone());
    let filling = tokio::task::spawn_blocking(move || {
        replica::fill_from_replica(&memory, &peers_dir(&memory), &manifest, digest)
    });
    match filling.await.map_err(io::Error::other) {
        Ok(Ok(filled)) => filled,
        Ok(Err(err)) | Err(err) => {
            tracing::debug!(
                "cannot copy rank {}'s step {} from a replica here: {err}",
                offer.manifest.rank,
                offer.manifest.step
            );
            false
        }
    }
}

/// Sends the slot of `want`, from this agent's own ranks or its peers' copies.
async fn give(stream: &mut SealedStream<TcpStream>, memory: &Path, want: &Want) -> io::Result<()> {
    let peers = peers_dir(memory);
    let found = [memory, peers.as_path()]
        .into_iter()
        .find_map(|root| Some((root, wire::find_slot(root, want.rank, want.step)?)));
    let Some((root, (manifest, data))) = found else {
        stream.write_u32_le(0).await?;
        return stream.flush().await;
    };
    wire::write_json(stream, &manifest).await?;
    wire::send_slot(stream, root, &manifest, &data, 0, None).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::peer::{Peer, Put};
    use super::*;
    use crate::agent::checkpoints::layout::fixtures::{manifest, scratch, write_slot};
    use crate::agent::checkpoints::quiet::Quiet;

    /// A holder serving `memory` as member 1 of a round, and member 0 as its buddy sees it.
    fn serving(memory: &Path) -> (Holder, Peer) {
        let holder = Holder::start(memory.to_path_buf(), "127.0.0.1").unwrap();
        let key = Key::from_bytes(b"the round's key, thirty-two bytes");
        holder.enter_round(key.clone(), 1);
        let buddy = Peer { addr: format!("127.0.0.1:{}", holder.port()), key, me: 0, them: 1 };
        (holder, buddy)
    }

    fn saved(root: &Path, rank: u32, step: u64, data: &[u8]) -> (SlotManifest, PathBuf) {
        let manifest = manifest(rank, step, data.len() as u64);
        let data_path = write_slot(root, 0, &manifest, data);
        (manifest, data_path)
    }

    #[tokio::test]
    async fn a_copy_put_by_the_buddy_is_given_back_to_a_member_that_proves_the_key() {
        let (sender, holder_memory, taker) = (scratch("sender"), scratch("holder"), scratch("taker"));
        let holder = Holder::start(holder_memory.clone(), "127.0.0.1").unwrap();
        let key = Key::from_bytes(b"the round's key, thirty-two bytes");
        holder.enter_round(key.clone(), 1);
        let addr = format!("127.0.0.1:{}", holder.port());
        let buddy = Peer { addr: addr.clone(), key: key.clone(), me: 0, them: 1 };
        let (manifest, data) = saved(&sender, 0, 9, b"weights of step 9");
        let put = buddy.put(&sender, &manifest, &data, 1_000_000, &Quiet::new(sender.clone()), true).await.unwrap();
        assert_eq!(put, Put::Sent, "the holder has no replica of its own: the data was sent");
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 9).is_some());

        let taker_peer = Peer { addr: addr.clone(), key, me: 2, them: 1 };
        let got = taker_peer.get(&Want { rank: 0, step: 9 }, &peers_dir(&taker)).await.unwrap();
        assert_eq!(got.as_ref(), Some(&manifest));
        let (_, path) = wire::find_slot(&peers_dir(&taker), 0, 9).unwrap();
        assert_eq!(std::fs::read(path).unwrap(), b"weights of step 9");
        // a step it does not hold: none
        assert_eq!(taker_peer.get(&Want { rank: 0, step: 8 }, &peers_dir(&taker)).await.unwrap(), None);
        for dir in [sender, holder_memory, taker] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[tokio::test]
    async fn a_stranger_or_a_copy_meant_for_another_member_is_refused() {
        let (sender, holder_memory) = (scratch("stranger"), scratch("stranger-holder"));
        let holder = Holder::start(holder_memory.clone(), "127.0.0.1").unwrap();
        holder.enter_round(Key::from_bytes(b"the round's key, thirty-two bytes"), 1);
        let addr = format!("127.0.0.1:{}", holder.port());
        let (manifest, data) = saved(&sender, 0, 1, b"x");
        let stranger =
            Peer { addr: addr.clone(), key: Key::from_bytes(b"a guess at the key, 32 bytes long"), me: 0, them: 1 };
        assert!(stranger.put(&sender, &manifest, &data, 0, &Quiet::new(sender.clone()), true).await.is_err());
        let misdirected = Peer { addr, key: Key::from_bytes(b"the round's key, thirty-two bytes"), me: 0, them: 2 };
        assert!(misdirected.put(&sender, &manifest, &data, 0, &Quiet::new(sender.clone()), true).await.is_err());
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 1).is_none());
        for dir in [sender, holder_memory] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[tokio::test]
    async fn a_hushed_sender_holds_its_copy_back_until_its_workers_save_a_newer_step() {
        let (sender, holder_memory) = (scratch("hushed"), scratch("hushed-holder"));
        let (_holder, buddy) = serving(&holder_memory);
        let (nine, data) = saved(&sender, 0, 9, b"weights of step 9");
        let quiet = Quiet::new(sender.clone());
        quiet.hush(); // a round starts: step 9 is the newest held
        let put = buddy.put(&sender, &nine, &data, 0, &quiet, true);
        tokio::pin!(put);
        let waited = tokio::time::timeout(std::time::Duration::from_millis(300), &mut put).await;
        assert!(waited.is_err(), "held back while the round restores");
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 9).is_none());
        // the workers train again: step 10 saved into another slot
        write_slot(&sender, 1, &manifest(0, 10, 1), b"x");
        assert_eq!(put.await.unwrap(), Put::Sent);
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 9).is_some());
        for dir in [&sender, &holder_memory] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[tokio::test]
    async fn a_stopped_holder_ends_the_puts_in_progress_and_keeps_nothing_of_them() {
        let (sender, holder_memory) = (scratch("stopped"), scratch("stopped-holder"));
        let (holder, buddy) = serving(&holder_memory);
        // 5 MiB at 4 MB/s: the first 4 MiB go at once, the rest a second later
        let (nine, data) = saved(&sender, 0, 9, &vec![9u8; 5 << 20]);
        let quiet = Quiet::new(sender.clone());
        let put = buddy.put(&sender, &nine, &data, 4_000_000, &quiet, true);
        tokio::pin!(put);
        assert!(tokio::time::timeout(std::time::Duration::from_millis(500), &mut put).await.is_err());
        holder.stop(); // the agent's run is over, the put half done
        assert!(put.await.is_err(), "the holder closed the connection");
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 9).is_none());
        assert!(buddy.put(&sender, &nine, &data, 0, &quiet, true).await.is_err(), "nor is a new one served");
        for dir in [&sender, &holder_memory] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[tokio::test]
    async fn a_holder_whose_own_rank_saved_the_same_bytes_copies_them_itself_and_nothing_is_sent() {
        let (sender, holder_memory) = (scratch("replica-sender"), scratch("replica-holder"));
        let (_holder, buddy) = serving(&holder_memory);
        // data parallelism: the holder's rank 1 saved step 9 as the sender's rank 0 did
        saved(&holder_memory, 1, 9, b"replicated weights");
        let (nine, data) = saved(&sender, 0, 9, b"replicated weights");
        let quiet = Quiet::new(sender.clone());
        assert_eq!(buddy.put(&sender, &nine, &data, 0, &quiet, true).await.unwrap(), Put::Replica);
        let (held, path) = wire::find_slot(&peers_dir(&holder_memory), 0, 9).unwrap();
        assert_eq!(held, nine);
        assert_eq!(std::fs::read(path).unwrap(), b"replicated weights");
        // a state of its own per rank: sent, and held as the sender's bytes
        saved(&holder_memory, 1, 10, b"rank 1's own state");
        let (ten, data) = saved(&sender, 0, 10, b"rank 0's own state");
        assert_eq!(buddy.put(&sender, &ten, &data, 0, &quiet, true).await.unwrap(), Put::Sent);
        let (_, path) = wire::find_slot(&peers_dir(&holder_memory), 0, 10).unwrap();
        assert_eq!(std::fs::read(path).unwrap(), b"rank 0's own state");
        // not offered (a rank whose copies found no replica lately): sent, replica or not
        let (eleven, data) = saved(&sender, 0, 11, b"replicated weights");
        saved(&holder_memory, 1, 11, b"replicated weights");
        assert_eq!(buddy.put(&sender, &eleven, &data, 0, &quiet, false).await.unwrap(), Put::Sent);
        assert!(wire::find_slot(&peers_dir(&holder_memory), 0, 11).is_some());
        for dir in [&sender, &holder_memory] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
