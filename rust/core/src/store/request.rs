//! Requests of the TCPStore protocol: encoding (client side) and incremental decoding (server
//! side). A request is an opcode byte followed by fields whose sizes follow from the opcode;
//! there is no length header, so the decoder must be able to stop at any byte.

use bytes::{BufMut, BytesMut};
use smallvec::SmallVec;

use super::limits::Limits;
use super::protocol::Opcode;

/// The keys of a WAIT, CHECK or MULTI_GET: the few a request names take no allocation.
pub type Keys<'a> = SmallVec<[&'a [u8]; 8]>;

/// One decoded request. Keys and values borrow from the buffer they were decoded from, so a
/// server only copies what it stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Validate { magic: u32 },
    Set { key: &'a [u8], value: &'a [u8] },
    CompareSet { key: &'a [u8], expected: &'a [u8], desired: &'a [u8] },
    Get { key: &'a [u8] },
    Add { key: &'a [u8], delta: i64 },
    Check { keys: Keys<'a> },
    Wait { keys: Keys<'a> },
    GetNumKeys,
    DeleteKey { key: &'a [u8] },
    Append { key: &'a [u8], value: &'a [u8] },
    MultiGet { keys: Keys<'a> },
    MultiSet { pairs: Vec<(&'a [u8], &'a [u8])> },
    CancelWait,
    Ping { nonce: u32 },
    QueuePush { key: &'a [u8], value: &'a [u8] },
    QueuePop { key: &'a [u8] },
    QueueLen { key: &'a [u8] },
    ListKeys,
    Barrier { key: &'a [u8], world_size: i64 },
}

/// Why a byte stream is not a valid request. The connection that sent it is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLong { len: u64, max: usize },
    #[error("value of {len} bytes exceeds the limit of {max} bytes")]
    ValueTooLong { len: u64, max: usize },
    #[error("{count} keys in one request exceed the limit of {max}")]
    TooManyKeys { count: u64, max: usize },
}

/// Result of a decode attempt on the bytes received so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A whole request, and how many bytes of the buffer it used.
    Request(Request<'a>, usize),
    /// The buffer holds only the start of a request that is at least `needed` bytes long
    /// (a lower bound that grows as more of the request is seen). Decoding again before that
    /// many bytes are buffered is wasted work.
    Incomplete { needed: usize },
}

impl<'a> Request<'a> {
    pub fn opcode(&self) -> Opcode {
        use Request::*;
        match self {
            Validate { .. } => Opcode::Validate,
            Set { .. } => Opcode::Set,
            CompareSet { .. } => Opcode::CompareSet,
            Get { .. } => Opcode::Get,
            Add { .. } => Opcode::Add,
            Check { .. } => Opcode::Check,
            Wait { .. } => Opcode::Wait,
            GetNumKeys => Opcode::GetNumKeys,
            DeleteKey { .. } => Opcode::DeleteKey,
            Append { .. } => Opcode::Append,
            MultiGet { .. } => Opcode::MultiGet,
            MultiSet { .. } => Opcode::MultiSet,
            CancelWait => Opcode::CancelWait,
            Ping { .. } => Opcode::Ping,
            QueuePush { .. } => Opcode::QueuePush,
            QueuePop { .. } => Opcode::QueuePop,
            QueueLen { .. } => Opcode::QueueLen,
            ListKeys => Opcode::ListKeys,
            Barrier { .. } => Opcode::Barrier,
        }
    }

    /// Appends the wire form of this request to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        use Request::*;
        out.put_u8(self.opcode() as u8);
        match self {
            Validate { magic } => out.put_u32_le(*magic),
            Ping { nonce } => out.put_u32_le(*nonce),
            GetNumKeys | CancelWait | ListKeys => {}
            Get { key } | DeleteKey { key } | QueuePop { key } | QueueLen { key } => put_bytes(out, key),
            Set { key, value } | Append { key, value } | QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Add { key, delta } => {
                put_bytes(out, key);
                out.put_i64_le(*delta);
            }
            Barrier { key, world_size } => {
                put_bytes(out, key);
                out.put_i64_le(*world_size);
            }
            Check { keys } | Wait { keys } | MultiGet { keys } => {
                out.put_u64_le(keys.len() as u64);
                for key in keys {
                    put_bytes(out, key);
                }
            }
            MultiSet { pairs } => {
                out.put_i64_le(pairs.len() as i64);
                for (key, value) in pairs {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
        }
    }

    /// Decodes the request at the start of `buf`, checking every length against `limits`
    /// before waiting for the bytes it announces.
    pub fn decode(buf: &'a [u8], limits: &Limits) -> Result<Decoded<'a>, FrameError> {
        let mut reader = Reader { buf, pos: 0, limits };
        match reader.request() {
            Ok(request) => Ok(Decoded::Request(request, reader.pos)),
            Err(Stop::Incomplete(needed)) => Ok(Decoded::Incomplete { needed }),
            Err(Stop::Invalid(error)) => Err(error),
        }
    }
}

/// Appends a length-prefixed byte string (u64 little-endian length, then the bytes).
pub fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u64_le(bytes.len() as u64);
    out.put_slice(bytes);
}

enum Stop {
    /// At least this many bytes are needed in total.
    Incomplete(usize),
    Invalid(FrameError),
}

impl From<FrameError> for Stop {
    fn from(error: FrameError) -> Self {
        Stop::Invalid(error)
    }
}

struct Reader<'a, 'l> {
    buf: &'a [u8],
    pos: usize,
    limits: &'l Limits,
}

impl<'a> Reader<'a, '_> {
    fn request(&mut self) -> Result<Request<'a>, Stop> {
        use Opcode as Op;
        let byte = self.take(1)?[0];
        let opcode = Opcode::from_u8(byte).ok_or(FrameError::UnknownOpcode(byte))?;
        Ok(match opcode {
            Op::Validate => Request::Validate { magic: self.u32()? },
            Op::Ping => Request::Ping { nonce: self.u32()? },
            Op::GetNumKeys => Request::GetNumKeys,
            Op::CancelWait => Request::CancelWait,
            Op::ListKeys => Request::ListKeys,
            Op::Get => Request::Get { key: self.key()? },
            Op::DeleteKey => Request::DeleteKey { key: self.key()? },
            Op::QueuePop => Request::QueuePop { key: self.key()? },
            Op::QueueLen => Request::QueueLen { key: self.key()? },
            Op::Set => Request::Set { key: self.key()?, value: self.value()? },
            Op::Append => Request::Append { key: self.key()?, value: self.value()? },
            Op::QueuePush => Request::QueuePush { key: self.key()?, value: self.value()? },
            Op::CompareSet => Request::CompareSet { key: self.key()?, expected: self.value()?, desired: self.value()? },
            Op::Add => Request::Add { key: self.key()?, delta: self.i64()? },
            Op::Barrier => Request::Barrier { key: self.key()?, world_size: self.i64()? },
            Op::Check => Request::Check { keys: self.keys()? },
            Op::Wait => Request::Wait { keys: self.keys()? },
            Op::MultiGet => Request::MultiGet { keys: self.keys()? },
            Op::MultiSet => {
                let count = self.count()?;
                let mut pairs = Vec::with_capacity(count.min(1024));
                for _ in 0..count {
                    pairs.push((self.key()?, self.value()?));
                }
                Request::MultiSet { pairs }
            }
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Stop> {
        let end = self.pos.checked_add(n).ok_or(Stop::Incomplete(usize::MAX))?;
        if end > self.buf.len() {
            return Err(Stop::Incomplete(end));
        }
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn u32(&mut self) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("took 4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("took 8 bytes")))
    }

    fn i64(&mut self) -> Result<i64, Stop> {
        Ok(self.u64()? as i64)
    }

    fn key(&mut self) -> Result<&'a [u8], Stop> {
        let len = self.u64()?;
        let max = self.limits.max_key_len;
        if len > max as u64 {
            return Err(FrameError::KeyTooLong { len, max }.into());
        }
        self.take(len as usize)
    }

    fn value(&mut self) -> Result<&'a [u8], Stop> {
        let len = self.u64()?;
        let max = self.limits.max_value_len;
        if len > max as u64 {
            return Err(FrameError::ValueTooLong { len, max }.into());
        }
        self.take(len as usize)
    }

    /// A list length. MULTI_SET writes it as i64, the others as u64: same 8 bytes, and a
    /// negative i64 reads as a huge u64 that the limit rejects.
    fn count(&mut self) -> Result<usize, Stop> {
        let count = self.u64()?;
        let max = self.limits.max_keys_per_request;
        if count > max as u64 {
            return Err(FrameError::TooManyKeys { count, max }.into());
        }
        Ok(count as usize)
    }

    fn keys(&mut self) -> Result<Keys<'a>, Stop> {
        let count = self.count()?;
        let mut keys = Keys::with_capacity(count.min(1024));
        for _ in 0..count {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(request: &Request) -> Vec<u8> {
        let mut out = BytesMut::new();
        request.encode(&mut out);
        out.to_vec()
    }

    fn decode_all(bytes: &[u8]) -> Request<'_> {
        match Request::decode(bytes, &Limits::default()).unwrap() {
            Decoded::Request(request, used) => {
                assert_eq!(used, bytes.len());
                request
            }
            other => panic!("expected a whole request, got {other:?}"),
        }
    }

    #[test]
    fn set_matches_the_recorded_bytes() {
        let request = Request::Set { key: b"/key0", value: b"value0" };
        let wire = encoded(&request);
        assert_eq!(wire, [&[1u8][..], &5u64.to_le_bytes(), b"/key0", &6u64.to_le_bytes(), b"value0"].concat());
        assert_eq!(format!("{:?}", decode_all(&wire)), format!("{request:?}"));
    }

    #[test]
    fn every_prefix_of_a_request_is_incomplete_with_a_growing_lower_bound() {
        let request = Request::MultiSet { pairs: vec![(b"/a", b"xyz"), (b"/bb", b"")] };
        let wire = encoded(&request);
        let mut last_needed = 0;
        for cut in 0..wire.len() {
            match Request::decode(&wire[..cut], &Limits::default()).unwrap() {
                Decoded::Incomplete { needed } => {
                    assert!(needed > cut, "needed {needed} must exceed the {cut} bytes held");
                    assert!(needed <= wire.len());
                    assert!(needed >= last_needed);
                    last_needed = needed;
                }
                other => panic!("prefix of {cut} bytes decoded as {other:?}"),
            }
        }
        assert_eq!(format!("{:?}", decode_all(&wire)), format!("{request:?}"));
    }

    #[test]
    fn pipelined_requests_decode_one_at_a_time() {
        let mut wire = encoded(&Request::Ping { nonce: 7 });
        wire.extend(encoded(&Request::GetNumKeys));
        let Decoded::Request(first, used) = Request::decode(&wire, &Limits::default()).unwrap() else {
            panic!("first request incomplete")
        };
        assert_eq!(first, Request::Ping { nonce: 7 });
        assert_eq!(decode_all(&wire[used..]), Request::GetNumKeys);
    }

    #[test]
    fn limits_reject_at_the_length_field_before_the_payload_arrives() {
        let limits = Limits { max_key_len: 4, max_value_len: 8, max_keys_per_request: 2 };
        let mut wire = vec![Opcode::Set as u8];
        wire.extend(5u64.to_le_bytes());
        assert_eq!(Request::decode(&wire, &limits), Err(FrameError::KeyTooLong { len: 5, max: 4 }));

        let mut wire = vec![Opcode::Set as u8];
        wire.extend(1u64.to_le_bytes());
        wire.push(b'k');
        wire.extend(u64::MAX.to_le_bytes());
        assert_eq!(Request::decode(&wire, &limits), Err(FrameError::ValueTooLong { len: u64::MAX, max: 8 }));

        let mut wire = vec![Opcode::Wait as u8];
        wire.extend(3u64.to_le_bytes());
        assert_eq!(Request::decode(&wire, &limits), Err(FrameError::TooManyKeys { count: 3, max: 2 }));

        let mut wire = vec![Opcode::MultiSet as u8];
        wire.extend((-1i64).to_le_bytes());
        assert!(matches!(Request::decode(&wire, &limits), Err(FrameError::TooManyKeys { .. })));
    }

    #[test]
    fn unknown_opcodes_are_rejected() {
        assert_eq!(Request::decode(&[0x63, 0, 0], &Limits::default()), Err(FrameError::UnknownOpcode(0x63)));
        assert_eq!(Request::decode(b"GET / HTTP/1.1\r\n", &Limits::default()), Err(FrameError::UnknownOpcode(b'G')));
    }

    #[test]
    fn random_bytes_never_panic_the_decoder() {
        let limits = Limits { max_key_len: 64, max_value_len: 64, max_keys_per_request: 8 };
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        for _ in 0..20_000 {
            let len = rng.usize(0..48);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            if let Some(first) = bytes.first_mut() {
                *first %= 20; // mostly valid opcodes, so the field parsers get exercised
            }
            match Request::decode(&bytes, &limits) {
                Ok(Decoded::Request(request, used)) => {
                    assert!(used <= bytes.len());
                    assert_eq!(encoded(&request), bytes[..used].to_vec());
                }
                Ok(Decoded::Incomplete { needed }) => assert!(needed > bytes.len()),
                Err(_) => {}
            };
        }
    }
}
