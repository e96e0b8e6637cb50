//! The other end: another agent's copy server, reached for one put or get per connection.

use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::super::layout::SlotManifest;
use super::super::persist::slot_generation;
use super::super::quiet::Quiet;
use super::holder::COPY_DEADLINE;
use super::replica;
use super::wire::{self, Offer, Want, GET, OFFER, PURPOSE, PUT};
use crate::auth::pair;
use crate::auth::session::{Mode, SealedStream};
use crate::auth::{Key, HANDSHAKE_DEADLINE};

/// How long reaching a peer's copy server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What became of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The peer copied its own rank's identical save of the step: no data was sent.
    Replica,
    /// The data was sent, and the peer keeps it.
    Sent,
    /// The slot was saved into meanwhile: the peer keeps nothing.
    Changed,
}

/// Another member's copy server, as seen from this one.
#[derive(Clone, Debug)]
pub struct Peer {
    /// `host:port`.
    pub addr: String,
    pub key: Key,
    /// This member's group rank, and the peer's.
    pub me: u32,
    pub them: u32,
}

impl Peer {
    /// Gives the peer `manifest`'s slot (its data in `data`, under `root`), waiting while
    /// `quiet` holds it back: with `offer`, by its digest first, which a peer holding the same
    /// bytes for the step (a replica) copies itself; else (or then) sent at most `rate` bytes
    /// a second.
    pub async fn put(
        &self,
        root: &Path,
        manifest: &SlotManifest,
        data: &Path,
        rate: u64,
        quiet: &Quiet,
        offer: bool,
    ) -> io::Result<Put> {
        let mut digest = None;
        if offer {
            quiet.wait().await;
            let (path, size) = (data.to_path_buf(), manifest.size);
            let read = tokio::task::spawn_blocking(move || replica::digest(&path, size));
            digest = Some(read.await.map_err(io::Error::other)??);
            if slot_generation(root, manifest.rank, manifest) != Some(manifest.generation) {
                return Ok(Put::Changed); // saved into while it was read: the digest is of no one step
            }
        }
        self.within(async {
            let mut stream = self.open().await?;
            match digest {
                Some(digest) => {
                    stream.write_u8(OFFER).await?;
                    let offer = Offer { manifest: manifest.clone(), digest: replica::to_hex(digest) };
                    wire::write_json(&mut stream, &offer).await?;
                    stream.flush().await?;
                    if stream.read_u8().await? == 1 {
                        return Ok(Put::Replica);
                    }
                }
                None => {
                    stream.write_u8(PUT).await?;
                    wire::write_json(&mut stream, manifest).await?;
                }
            }
            let whole = wire::send_slot(&mut stream, root, manifest, data, rate, Some(quiet)).await?;
            Ok(if stream.read_u8().await? == 1 && whole { Put::Sent } else { Put::Changed })
        })
        .await
    }

    /// Takes the peer's copy of `want` into `root` (this agent's peers' directory): its
    /// manifest, or `None` when the peer does not hold it whole.
    pub async fn get(&self, want: &Want, root: &Path) -> io::Result<Option<SlotManifest>> {
        self.within(async {
            let mut stream = self.open().await?;
            stream.write_u8(GET).await?;
            wire::write_json(&mut stream, want).await?;
            let Some(manifest) = wire::read_json::<_, SlotManifest>(&mut stream).await? else { return Ok(None) };
            if manifest.rank != want.rank || manifest.step != want.step {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer sent another step than asked"));
            }
            let whole = wire::receive_slot(&mut stream, root, &manifest).await?;
            Ok(whole.then_some(manifest))
        })
        .await
    }

    async fn open(&self) -> io::Result<SealedStream<TcpStream>> {
        let connecting = TcpStream::connect(&self.addr);
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, connecting).await.map_err(|_| {
            io::Error::new(io::ErrorKind::TimedOut, format!("no connection within {CONNECT_TIMEOUT:?}"))
        })??;
        stream.set_nodelay(true)?;
        let binding = wire::binding(self.me, self.them);
        let proving = pair::connect(&mut stream, &self.key, &PURPOSE, &binding, Mode::wanted());
        let session = tokio::time::timeout(HANDSHAKE_DEADLINE, proving)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no handshake within the deadline"))?
            .map_err(io::Error::other)?;
        Ok(SealedStream::new(stream, session))
    }

    async fn within<T>(&self, work: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
        tokio::time::timeout(COPY_DEADLINE, work)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("not done within {COPY_DEADLINE:?}")))?
    }
}
