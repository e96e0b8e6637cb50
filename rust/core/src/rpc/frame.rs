//! The wire format between two RPC endpoints. Every frame is a fixed 48-byte header, the
//! lengths of its out-of-band buffers, the payload, then the buffers:
//!
//! ```text
//! kind u8 | op u8 | status u8 | 0 u8 | buffers u32 | id u64
//! rref.worker u32 | fork.worker u32 | rref.local u64 | fork.local u64 | payload length u64
//! buffer lengths (u64 each) | payload | buffer 0 | buffer 1 | ...
//! ```
//!
//! All integers are little-endian. Buffers are pickle protocol 5's out-of-band buffers
//! (array data), kept apart from the payload so that neither side copies them into it.

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::ids::Gid;

pub const HEADER: usize = 48;
/// More buffers than this in one frame is garbage, not a message.
pub const MAX_BUFFERS: u32 = 1 << 16;
/// A payload or buffer over 64 GiB is garbage too.
pub const MAX_LEN: u64 = 1 << 36;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Kind {
    /// A user call; answered by a `Response` with the same id.
    Request = 1,
    Response = 2,
    /// A reference-counting message; answered by a `ControlAck` with the same id.
    Control = 3,
    ControlAck = 4,
}

/// What a request asks for (`Kind::Request`) or which reference message it is (`Kind::Control`).
pub mod op {
    /// Run a function, answer its result (rpc_sync / rpc_async).
    pub const CALL: u8 = 1;
    /// Run a function and keep its result in a new OwnerRRef (`rref` and `fork` name it).
    pub const REMOTE: u8 = 2;
    /// Answer the value of the OwnerRRef `rref`, once it has one.
    pub const TO_HERE: u8 = 3;

    /// Control: a worker got fork `fork` of `rref` from a user other than the owner.
    pub const FORK_REQUEST: u8 = 11;
    /// Control: the owner knows fork `fork`, so its parent may let go of its own.
    pub const CHILD_ACCEPT: u8 = 12;
    /// Control: fork `fork` of `rref` is gone.
    pub const USER_DELETE: u8 = 13;
}

/// `status` of a response.
pub mod status {
    pub const OK: u8 = 0;
    /// The payload is the pickled exception the function raised.
    pub const ERROR: u8 = 1;
    /// The callee could not take the request; the payload is a UTF-8 message.
    pub const REFUSED: u8 = 2;
}

#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    pub kind: Kind,
    pub op: u8,
    pub status: u8,
    pub id: u64,
    pub rref: Gid,
    pub fork: Gid,
    pub payload: Bytes,
    pub buffers: Vec<Bytes>,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not an elastix RPC frame: {0}")]
    Garbage(String),
}

impl Frame {
    pub fn control(op: u8, id: u64, rref: Gid, fork: Gid) -> Frame {
        Frame { kind: Kind::Control, op, status: 0, id, rref, fork, payload: Bytes::new(), buffers: Vec::new() }
    }

    pub fn ack(id: u64) -> Frame {
        Frame::control(0, id, Gid::default(), Gid::default()).with_kind(Kind::ControlAck)
    }

    fn with_kind(mut self, kind: Kind) -> Frame {
        self.kind = kind;
        self
    }

    /// Header and buffer lengths: what precedes the payload on the wire.
    pub fn head(&self) -> Vec<u8> {
        let mut head = Vec::with_capacity(HEADER + 8 * self.buffers.len());
        head.extend_from_slice(&[self.kind as u8, self.op, self.status, 0]);
        head.extend_from_slice(&(self.buffers.len() as u32).to_le_bytes());
        head.extend_from_slice(&self.id.to_le_bytes());
        head.extend_from_slice(&self.rref.worker.to_le_bytes());
        head.extend_from_slice(&self.fork.worker.to_le_bytes());
        head.extend_from_slice(&self.rref.local.to_le_bytes());
        head.extend_from_slice(&self.fork.local.to_le_bytes());
        head.extend_from_slice(&(self.payload.len() as u64).to_le_bytes());
        for buffer in &self.buffers {
            head.extend_from_slice(&(buffer.len() as u64).to_le_bytes());
        }
        head
    }

    pub async fn write_to<W: AsyncWrite + Unpin>(&self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(&self.head()).await?;
        writer.write_all(&self.payload).await?;
        for buffer in &self.buffers {
            writer.write_all(buffer).await?;
        }
        Ok(())
    }

    /// The next frame, or None at a clean end of stream (between frames).
    pub async fn read_from<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Option<Frame>, FrameError> {
        let mut head = [0u8; HEADER];
        match reader.read(&mut head[..1]).await? {
            0 => return Ok(None),
            _ => reader.read_exact(&mut head[1..]).await?,
        };
        let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
        let kind = match head[0] {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Control,
            4 => Kind::ControlAck,
            other => return Err(FrameError::Garbage(format!("unknown frame kind {other}"))),
        };
        let count = u32_at(4);
        if count > MAX_BUFFERS {
            return Err(FrameError::Garbage(format!("{count} buffers in one frame")));
        }
        let rref = Gid::new(u32_at(16), u64_at(24));
        let fork = Gid::new(u32_at(20), u64_at(32));
        let mut lens = vec![u64_at(40)];
        for _ in 0..count {
            lens.push(reader.read_u64_le().await?);
        }
        if let Some(len) = lens.iter().find(|&&len| len > MAX_LEN) {
            return Err(FrameError::Garbage(format!("a part of {len} bytes")));
        }
        let mut parts = Vec::with_capacity(lens.len());
        for len in lens {
            let mut part = BytesMut::zeroed(len as usize);
            reader.read_exact(&mut part).await?;
            parts.push(part.freeze());
        }
        let payload = parts.remove(0);
        Ok(Some(Frame { kind, op: head[1], status: head[2], id: u64_at(8), rref, fork, payload, buffers: parts }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Frame {
        Frame {
            kind: Kind::Request,
            op: op::REMOTE,
            status: status::OK,
            id: 0x0102_0304_0506_0708,
            rref: Gid::new(1, 7),
            fork: Gid::new(2, 9),
            payload: Bytes::from_static(b"pickle"),
            buffers: vec![Bytes::from_static(b"abc"), Bytes::new()],
        }
    }

    #[tokio::test]
    async fn a_frame_reads_back_as_written() {
        let mut wire = Vec::new();
        sample().write_to(&mut wire).await.unwrap();
        assert_eq!(wire.len(), HEADER + 16 + 6 + 3);
        assert_eq!(&wire[..4], &[1, op::REMOTE, 0, 0]);
        let mut reader = &wire[..];
        assert_eq!(Frame::read_from(&mut reader).await.unwrap(), Some(sample()));
        assert_eq!(Frame::read_from(&mut reader).await.unwrap(), None);
    }

    #[tokio::test]
    async fn garbage_is_an_error_not_an_allocation() {
        let mut wire = Vec::new();
        sample().write_to(&mut wire).await.unwrap();
        let mut bad_kind = wire.clone();
        bad_kind[0] = 9;
        assert!(matches!(Frame::read_from(&mut &bad_kind[..]).await, Err(FrameError::Garbage(_))));
        let mut huge = wire.clone();
        huge[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Frame::read_from(&mut &huge[..]).await, Err(FrameError::Garbage(_))));
        let cut = &wire[..wire.len() - 1];
        assert!(matches!(Frame::read_from(&mut &cut[..]).await, Err(FrameError::Io(_))));
    }
}
