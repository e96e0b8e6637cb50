//! Size limits a server enforces on requests.

/// Per-request limits. A request that breaks one is rejected as soon as the offending length
/// field has been read (nothing is buffered for it) and only that connection is closed.
///
/// The defaults equal torch's libuv server (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`,
/// `MAX_KEY_COUNT`), so every request a torch client can get accepted by torch is accepted here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest key (also queue names and every key inside a list), in bytes.
    pub max_key_len: usize,
    /// Longest value, in bytes.
    pub max_value_len: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys_per_request: usize,
}

impl Limits {
    pub const DEFAULT_MAX_KEY_LEN: usize = 8 * 1024;
    pub const DEFAULT_MAX_VALUE_LEN: usize = 8 * 1024 * 1024;
    pub const DEFAULT_MAX_KEYS_PER_REQUEST: usize = 128 * 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: Self::DEFAULT_MAX_KEY_LEN,
            max_value_len: Self::DEFAULT_MAX_VALUE_LEN,
            max_keys_per_request: Self::DEFAULT_MAX_KEYS_PER_REQUEST,
        }
    }
}
