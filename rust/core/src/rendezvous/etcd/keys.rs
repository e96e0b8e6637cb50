//! Where the etcd rendezvous keeps its state, under the run's prefix `P`:
//!
//! * `P meta`, `P closed` (the reason), `P round` (the last sealed round);
//! * `P failures/<r>`: round r failed; the number of these keys is the job-wide restart count;
//! * `P j/<r>`: written by every arrival in round r, so its version counts them;
//! * `P r/<r>/m/<lease>`: a member of round r, written under the agent's lease (gone with it);
//! * `P r/<r>/q/<lease>`: an ask to that member (`?nonce`), and its answer (`!nonce`);
//! * `P r/<r>/s/{seal,size,master,closed}`: what became of round r;
//! * `P status/<r>/<rank>`, `P last_failure`: what the agents publish for `elastix status`.
//!
//! Round numbers are zero-padded so that key order is round order: one watch on
//! `[r/<r>/m/, r/<r+1>/m0)` sees round r's members leave and the next round's arrive, and
//! nothing of round r+1's outcome.

/// A key range `[key, end)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Range {
    pub key: Vec<u8>,
    pub end: Vec<u8>,
}

/// What a key written in a watched range is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum KeyKind {
    Member { round: u64, id: String },
    Ask { round: u64, id: String },
    Seal { round: u64 },
    Size { round: u64 },
    Master { round: u64 },
    Closed { round: u64 },
    Other,
}

#[derive(Clone, Debug)]
pub(super) struct EtcdKeys {
    prefix: String,
}

impl EtcdKeys {
    /// `prefix` ends with `/`.
    pub fn new(prefix: String) -> Self {
        EtcdKeys { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.prefix).into_bytes()
    }

    fn under(&self, rest: &str) -> Range {
        let key = self.key(rest);
        Range { end: prefix_end(&key), key }
    }

    /// Every key of the run.
    pub fn all(&self) -> Range {
        self.under("")
    }

    pub fn meta(&self) -> Vec<u8> {
        self.key("meta")
    }

    pub fn closed(&self) -> Vec<u8> {
        self.key("closed")
    }

    pub fn round(&self) -> Vec<u8> {
        self.key("round")
    }

    /// A restart counted: `name` is the failed round's number (or unique, for one counted by hand).
    pub fn failures(&self, name: &str) -> Vec<u8> {
        self.key(&format!("failures/{name}"))
    }

    pub fn all_failures(&self) -> Range {
        self.under("failures/")
    }

    /// A member's [`crate::rendezvous::records::NodeStatus`] in round r, for `elastix
    /// status`: outside the rounds' tree, so that no round's watch sees it.
    pub fn node_status(&self, r: u64, rank: u32) -> Vec<u8> {
        self.key(&format!("status/{r:012}/{rank}"))
    }

    pub fn node_statuses(&self, r: u64) -> Range {
        self.under(&format!("status/{r:012}/"))
    }

    /// The last failure's [`crate::rendezvous::records::FailureRecord`].
    pub fn last_failure(&self) -> Vec<u8> {
        self.key(crate::rendezvous::records::LAST_FAILURE_KEY)
    }

    pub fn joined(&self, r: u64) -> Vec<u8> {
        self.key(&format!("j/{r:012}"))
    }

    pub fn members(&self, r: u64) -> Range {
        self.under(&format!("r/{r:012}/m/"))
    }

    pub fn member(&self, r: u64, id: &str) -> Vec<u8> {
        self.key(&format!("r/{r:012}/m/{id}"))
    }

    /// Where another member asks member `id` of round `r` whether it is still there, and
    /// where it answers: in the round's watch, so the member sees the ask.
    pub fn ask(&self, r: u64, id: &str) -> Vec<u8> {
        self.key(&format!("r/{r:012}/q/{id}"))
    }

    pub fn outcome(&self, r: u64) -> Range {
        self.under(&format!("r/{r:012}/s/"))
    }

    pub fn seal(&self, r: u64) -> Vec<u8> {
        self.key(&format!("r/{r:012}/s/seal"))
    }

    pub fn size(&self, r: u64) -> Vec<u8> {
        self.key(&format!("r/{r:012}/s/size"))
    }

    pub fn master(&self, r: u64) -> Vec<u8> {
        self.key(&format!("r/{r:012}/s/master"))
    }

    pub fn closed_marker(&self, r: u64) -> Vec<u8> {
        self.key(&format!("r/{r:012}/s/closed"))
    }

    /// What a member of round `r` watches while the round runs: its members (their keys
    /// vanish when they leave), its outcome (the close), and round r+1's arrivals.
    pub fn round_watch(&self, r: u64) -> Range {
        Range { key: self.members(r).key, end: self.key(&format!("r/{:012}/m0", r + 1)) }
    }

    pub fn kind(&self, key: &[u8]) -> KeyKind {
        let Some(rest) = std::str::from_utf8(key).ok().and_then(|key| key.strip_prefix(&self.prefix)) else {
            return KeyKind::Other;
        };
        let mut parts = rest.splitn(4, '/');
        let (Some("r"), Some(round), Some(section), Some(name)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return KeyKind::Other;
        };
        let Ok(round) = round.parse() else { return KeyKind::Other };
        match (section, name) {
            ("m", id) => KeyKind::Member { round, id: id.to_owned() },
            ("q", id) => KeyKind::Ask { round, id: id.to_owned() },
            ("s", "seal") => KeyKind::Seal { round },
            ("s", "size") => KeyKind::Size { round },
            ("s", "master") => KeyKind::Master { round },
            ("s", "closed") => KeyKind::Closed { round },
            _ => KeyKind::Other,
        }
    }
}

/// The end of the range of keys starting with `prefix` (etcd's "prefix + 1").
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_end_after_the_last_key_with_the_prefix() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn a_rounds_watch_holds_its_members_its_outcome_and_the_next_rounds_arrivals_only() {
        let keys = EtcdKeys::new("/p/job/".into());
        let range = keys.round_watch(9);
        let inside = |key: &[u8]| range.key.as_slice() <= key && key < range.end.as_slice();
        assert!(inside(&keys.member(9, "a")));
        assert!(inside(&keys.closed_marker(9)));
        assert!(inside(&keys.member(10, "b")));
        assert!(!inside(&keys.seal(10)));
        assert!(!inside(&keys.member(8, "c")));
        assert!(!inside(&keys.joined(10)));
        assert!(!inside(&keys.closed()));
        assert!(!inside(&keys.node_status(9, 0)) && !inside(&keys.last_failure()));
        // zero padding: round 10 sorts after round 9
        assert!(keys.member(10, "a") > keys.member(9, "z"));
    }

    #[test]
    fn keys_are_told_apart() {
        let keys = EtcdKeys::new("/p/job/".into());
        assert_eq!(keys.kind(&keys.member(3, "00ff")), KeyKind::Member { round: 3, id: "00ff".into() });
        assert_eq!(keys.kind(&keys.seal(3)), KeyKind::Seal { round: 3 });
        assert_eq!(keys.kind(&keys.size(4)), KeyKind::Size { round: 4 });
        assert_eq!(keys.kind(&keys.master(4)), KeyKind::Master { round: 4 });
        assert_eq!(keys.kind(&keys.closed_marker(5)), KeyKind::Closed { round: 5 });
        assert_eq!(keys.kind(&keys.closed()), KeyKind::Other);
        assert_eq!(keys.kind(b"/q/job/r/000000000003/m/a"), KeyKind::Other);
    }
}
