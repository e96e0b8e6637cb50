//! The few TCPStore requests the generator sends, encoded by hand: opcode byte, then
//! u64-LE-length-prefixed strings and LE integers (wire protocol §2-3).

pub const VALIDATE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const WAIT: u8 = 6;
const PING: u8 = 13;

pub fn ping(nonce: u32) -> [u8; 5] {
    let n = nonce.to_le_bytes();
    [PING, n[0], n[1], n[2], n[3]]
}

fn put_str(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Appends SET(key, value); returns where the value's bytes start in `buf`.
pub fn set(buf: &mut Vec<u8>, key: &[u8], value: &[u8]) -> usize {
    buf.push(SET);
    put_str(buf, key);
    buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
    let at = buf.len();
    buf.extend_from_slice(value);
    at
}

pub fn get(buf: &mut Vec<u8>, key: &[u8]) {
    buf.push(GET);
    put_str(buf, key);
}

pub fn add(buf: &mut Vec<u8>, key: &[u8], delta: i64) {
    buf.push(ADD);
    put_str(buf, key);
    buf.extend_from_slice(&delta.to_le_bytes());
}

/// WAIT for one key.
pub fn wait(buf: &mut Vec<u8>, key: &[u8]) {
    buf.push(WAIT);
    buf.extend_from_slice(&1u64.to_le_bytes());
    put_str(buf, key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_matches_the_documented_bytes() {
        let mut buf = Vec::new();
        let at = set(&mut buf, b"/key0", b"value0");
        let mut want = vec![1u8, 5, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"/key0");
        want.extend_from_slice(&[6, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(b"value0");
        assert_eq!(buf, want);
        assert_eq!(&buf[at..], b"value0");
    }

    #[test]
    fn add_and_ping_layouts() {
        let mut buf = Vec::new();
        add(&mut buf, b"/cnt", -2);
        let mut want = vec![4u8, 4, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"/cnt");
        want.extend_from_slice(&[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(buf, want);
        assert_eq!(ping(0x191a), [0x0d, 0x1a, 0x19, 0, 0]);
        let mut buf = Vec::new();
        wait(&mut buf, b"/go");
        let mut want = vec![6u8, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"/go");
        assert_eq!(buf, want);
    }
}
