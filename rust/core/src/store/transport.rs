//! What a store connection's bytes travel over: the TCP stream itself (torch's clients, and
//! elastix's without a job secret), or, after the handshake that proved the secret, a session
//! that seals every byte both ways ([`crate::auth::session`]).

use std::io;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::auth::session::{Mode, SealedStream, Session};

pub enum Transport {
    Plain(TcpStream),
    Sealed(Box<SealedStream<TcpStream>>),
}

impl Transport {
    pub fn sealed(stream: TcpStream, session: Session) -> Transport {
        Transport::Sealed(Box::new(SealedStream::new(stream, session)))
    }

    /// The TCP stream underneath (its addresses, its socket options).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Transport::Plain(stream) => stream,
            Transport::Sealed(sealed) => sealed.get_ref(),
        }
    }

    /// The session's mode, for a sealed one.
    pub fn mode(&self) -> Option<Mode> {
        match self {
            Transport::Plain(_) => None,
            Transport::Sealed(sealed) => Some(sealed.mode()),
        }
    }

    /// Reads what has arrived into `buf` (0: the peer closed between messages). Cancel-safe.
    pub async fn read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            Transport::Plain(stream) => stream.read_buf(buf).await,
            Transport::Sealed(sealed) => sealed.read_buf(buf).await,
        }
    }

    /// Writes what fits the socket now, without waiting: plain streams only (a sealed one
    /// writes whole records, through [`Self::write_all`]).
    pub fn try_write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(stream) => stream.try_write(data),
            Transport::Sealed(_) => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    /// Writes `data`, all of it out before it returns.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            Transport::Plain(stream) => stream.write_all(data).await,
            Transport::Sealed(sealed) => {
                sealed.write_all(data).await?;
                sealed.flush().await
            }
        }
    }
}
