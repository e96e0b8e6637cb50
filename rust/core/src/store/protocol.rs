//! Constants of torch's TCPStore wire protocol (torch 2.4 - 2.15).
//!
//! Every integer on the wire is little-endian; strings are a u64 length then raw bytes.

/// The u32 a client sends right after the VALIDATE opcode.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The key every torch TCPStore constructed with a `world_size` increments once. It is the
/// only key a torch client sends without its `/` prefix.
pub const INIT_KEY: &[u8] = b"init/";

/// Reply to CHECK.
pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;

/// Reply to WAIT and BARRIER (possibly much later), and to CANCEL_WAIT.
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// The request opcodes (`QueryType` in torch). The numbering is the only version marker of
/// the protocol: PING appeared in 2.5, the queues in 2.8, LIST_KEYS in 2.10, BARRIER in 2.12.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl Opcode {
    pub fn from_u8(byte: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match byte {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            _ => return None,
        })
    }

    /// The upper-case name torch uses, for logs and error messages.
    pub fn name(self) -> &'static str {
        use Opcode::*;
        match self {
            Validate => "VALIDATE",
            Set => "SET",
            CompareSet => "COMPARE_SET",
            Get => "GET",
            Add => "ADD",
            Check => "CHECK",
            Wait => "WAIT",
            GetNumKeys => "GETNUMKEYS",
            DeleteKey => "DELETE_KEY",
            Append => "APPEND",
            MultiGet => "MULTI_GET",
            MultiSet => "MULTI_SET",
            CancelWait => "CANCEL_WAIT",
            Ping => "PING",
            QueuePush => "QUEUE_PUSH",
            QueuePop => "QUEUE_POP",
            QueueLen => "QUEUE_LEN",
            ListKeys => "LIST_KEYS",
            Barrier => "BARRIER",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_opcode_round_trips_through_its_byte() {
        for byte in 0..=18u8 {
            let op = Opcode::from_u8(byte).expect("opcodes 0-18 are all defined");
            assert_eq!(op as u8, byte);
        }
        assert_eq!(Opcode::from_u8(19), None);
        assert_eq!(Opcode::from_u8(0x63), None);
    }

    #[test]
    fn magic_is_sent_little_endian() {
        assert_eq!(VALIDATION_MAGIC.to_le_bytes(), [0xce, 0xf7, 0x85, 0x3c]);
    }
}
