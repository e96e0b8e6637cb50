//! One client connection: handshake, then a cycle of pre-encoded transactions, each one write
//! and one complete reply that is checked byte for byte.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::poller::wait_writable;
use crate::wire;

/// Keys each connection cycles through.
const KEYS: usize = 16;
/// Larger than any reply (u64 length + a 64-byte value), so a surplus byte is caught.
const READ_BUF: usize = 128;

struct Slot {
    key: String,
    /// SET(key, value) immediately followed by GET(key).
    request: Vec<u8>,
    value_at: usize,
    value_len: usize,
    /// Where GET(key) starts in `request`, to send it alone.
    get_at: usize,
    written: bool,
}

#[derive(Clone, Copy)]
enum Pending {
    Idle,
    /// A GET of this slot's value; `ops` counts the requests in the transaction.
    Value {
        slot: usize,
        ops: u32,
    },
    Add,
}

pub struct Conn {
    id: usize,
    stream: TcpStream,
    slots: Vec<Slot>,
    add_key: String,
    add_request: Vec<u8>,
    adds: i64,
    step: u64,
    pending: Pending,
    reply: [u8; READ_BUF],
    received: usize,
}

impl Conn {
    /// Connects and sends VALIDATE then PING, as torch's client does (two writes). The PING
    /// echo is read by [`Conn::finish_handshake`] once every connection has sent its own, so
    /// connection setup costs about one round trip rather than one per connection.
    pub fn open(addr: SocketAddr, tag: &str, id: usize) -> Result<Conn, String> {
        let fail = |what: &str, err: io::Error| format!("connection {id} to {addr}: {what}: {err}");
        let stream = TcpStream::connect(addr).map_err(|e| fail("connect", e))?;
        stream.set_nodelay(true).map_err(|e| fail("TCP_NODELAY", e))?;
        (&stream).write_all(&wire::VALIDATE).map_err(|e| fail("VALIDATE", e))?;
        (&stream).write_all(&wire::ping(ping_nonce(id))).map_err(|e| fail("PING", e))?;

        let slots = (0..KEYS)
            .map(|i| {
                let key = format!("/bench/{tag}/{id}/{i}");
                // 16..=64 bytes, varying by key and connection; the first 8 are a sequence stamp.
                let value_len = 16 + (i * 7 + id * 3) % 49;
                let value: Vec<u8> = (0..value_len).map(|b| b'a' + ((b + i) % 26) as u8).collect();
                let mut request = Vec::new();
                let value_at = wire::set(&mut request, key.as_bytes(), &value);
                let get_at = request.len();
                wire::get(&mut request, key.as_bytes());
                Slot { key, request, value_at, value_len, get_at, written: false }
            })
            .collect();
        let add_key = format!("/bench/{tag}/{id}/add");
        let mut add_request = Vec::new();
        wire::add(&mut add_request, add_key.as_bytes(), 1);
        Ok(Conn {
            id,
            stream,
            slots,
            add_key,
            add_request,
            adds: 0,
            step: 0,
            pending: Pending::Idle,
            reply: [0; READ_BUF],
            received: 0,
        })
    }

    /// Reads and checks the PING echo, then switches to non-blocking for the load.
    pub fn finish_handshake(&mut self, timeout: Duration) -> Result<(), String> {
        let id = self.id;
        let fail = |what: &str, err: io::Error| format!("connection {id}: {what}: {err}");
        self.stream.set_read_timeout(Some(timeout)).map_err(|e| fail("timeout", e))?;
        let mut echo = [0u8; 4];
        (&self.stream).read_exact(&mut echo).map_err(|e| fail("PING reply", e))?;
        let nonce = ping_nonce(id);
        if echo != nonce.to_le_bytes() {
            return Err(format!("connection {id}: PING echoed {echo:02x?}, sent {nonce:#010x}"));
        }
        self.stream.set_nonblocking(true).map_err(|e| fail("non-blocking", e))
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sends the next transaction of the cycle: SET+GET of key i, ADD, GET of another key.
    pub fn send_next(&mut self) -> Result<(), String> {
        let i = (self.step / 3) as usize % KEYS;
        let (bytes, pending) = match self.step % 3 {
            0 => {
                let slot = &mut self.slots[i];
                // A fresh stamp per SET, so the GET proves this very write was applied.
                slot.request[slot.value_at..slot.value_at + 8].copy_from_slice(&self.step.to_le_bytes());
                slot.written = true;
                (&slot.request[..], Pending::Value { slot: i, ops: 2 })
            }
            1 => (&self.add_request[..], Pending::Add),
            _ => {
                let other = (i + KEYS / 2) % KEYS;
                let j = if self.slots[other].written { other } else { i };
                let slot = &self.slots[j];
                (&slot.request[slot.get_at..], Pending::Value { slot: j, ops: 1 })
            }
        };
        write_fully(&self.stream, bytes).map_err(|e| format!("connection {}: write: {e}", self.id))?;
        self.step += 1;
        self.pending = pending;
        self.received = 0;
        Ok(())
    }

    /// Reads what is available. Returns the number of requests the transaction carried once
    /// its whole reply has arrived and matched, `None` while more bytes are due.
    pub fn on_readable(&mut self) -> Result<Option<u32>, String> {
        let expected = self.expected_len();
        while self.received < expected.max(1) {
            match (&self.stream).read(&mut self.reply[self.received..]) {
                Ok(0) => {
                    return Err(format!(
                        "connection {}: server closed the connection ({} of {expected} reply bytes in)",
                        self.id, self.received
                    ))
                }
                Ok(n) => {
                    self.received += n;
                    self.check_length_prefix()?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("connection {}: read: {e}", self.id)),
            }
        }
        if self.received > expected {
            return Err(format!(
                "connection {}: {} unexpected reply bytes after a {expected}-byte reply: {:02x?}",
                self.id,
                self.received - expected,
                &self.reply[expected..self.received]
            ));
        }
        let ops = self.check_reply()?;
        self.pending = Pending::Idle;
        self.received = 0;
        Ok(Some(ops))
    }

    pub fn is_idle(&self) -> bool {
        matches!(self.pending, Pending::Idle)
    }

    fn expected_len(&self) -> usize {
        match self.pending {
            Pending::Idle => 0,
            Pending::Value { slot, .. } => 8 + self.slots[slot].value_len,
            Pending::Add => 8,
        }
    }

    /// Fails as soon as a value's length prefix is wrong, instead of waiting for bytes that
    /// will never come.
    fn check_length_prefix(&self) -> Result<(), String> {
        if let Pending::Value { slot, .. } = self.pending {
            let slot = &self.slots[slot];
            if self.received >= 8 && self.reply[..8] != (slot.value_len as u64).to_le_bytes() {
                return Err(format!(
                    "connection {}: GET {:?} reply announces {} bytes, expected {}",
                    self.id,
                    slot.key,
                    u64::from_le_bytes(self.reply[..8].try_into().expect("8 bytes")),
                    slot.value_len
                ));
            }
        }
        Ok(())
    }

    fn check_reply(&mut self) -> Result<u32, String> {
        let reply = &self.reply[..self.received];
        match self.pending {
            Pending::Idle => unreachable!("no reply is expected while idle"),
            Pending::Value { slot, ops } => {
                let slot = &self.slots[slot];
                let want = &slot.request[slot.value_at..slot.value_at + slot.value_len];
                if reply[..8] != (slot.value_len as u64).to_le_bytes() || &reply[8..] != want {
                    return Err(format!(
                        "connection {}: GET {:?} returned {:02x?}, expected length {} and value {:02x?}",
                        self.id, slot.key, reply, slot.value_len, want
                    ));
                }
                Ok(ops)
            }
            Pending::Add => {
                let got = i64::from_le_bytes(reply.try_into().expect("8 bytes"));
                if got != self.adds + 1 {
                    return Err(format!(
                        "connection {}: ADD {:?} returned {got}, expected {}",
                        self.id,
                        self.add_key,
                        self.adds + 1
                    ));
                }
                self.adds = got;
                Ok(1)
            }
        }
    }
}

fn ping_nonce(id: usize) -> u32 {
    std::process::id() ^ (id as u32).rotate_left(16)
}

fn write_fully(stream: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match (&*stream).write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_writable(stream.as_raw_fd())?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
