//! `--rdzv-conf k1=v1,k2=v2`: torch's keys, checked strictly. Unknown keys are an error (torch
//! ignores them silently, so a typo like `heartbeat_timout=10` does nothing there); torch's keys
//! that have no effect here are taken with one INFO line ([`TORCH_INERT_KEYS`]); durations accept
//! units (`30`, `30s`, `1.5s`, `500ms`, `2m`, `1h`), booleans accept torch's spellings.
//!
//! The same keys arrive either as that text (the command line) or as a map of values (Python's
//! `rdzv_configs` and `RendezvousHandler(conf=...)`): [`ConfInput`], one schema for both.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use crate::rendezvous::error::{RendezvousError, Result};

/// The keys a backend accepts, with what each means (for the error message).
pub const DYNAMIC_KEYS: &[(&str, &str)] = &[
    ("join_timeout", "deadline for a whole rendezvous (default 600s)"),
    ("last_call_timeout", "extra wait for more nodes once min_nodes joined (default 30s)"),
    ("close_timeout", "deadline for closing the rendezvous (default 30s)"),
    ("heartbeat_timeout", "deadline for one heartbeat write (default 5s)"),
    ("keep_alive_interval", "time between heartbeats (default 5s)"),
    ("keep_alive_max_attempt", "missed heartbeats before a node counts as dead (default 3)"),
    ("read_timeout", "store operation timeout (default 60s)"),
    ("store_type", "tcp (default) or file"),
    ("is_host", "host the store in this agent (default: if the endpoint is this machine)"),
    ("node_order", "where this node ranks among the others (SLURM_NODEID under Slurm; default: by address)"),
    ("timeout", "accepted for torch compatibility; dynamic rendezvous uses join_timeout"),
    ("auth_token_file", "file holding the job secret, readable only by its owner (or ELASTIX_AUTH_TOKEN_FILE)"),
];

pub const ETCD_KEYS: &[(&str, &str)] = &[
    ("protocol", "http (default) or https"),
    ("cacert", "PEM file of the CA that signed the etcd servers (https)"),
    ("cert", "PEM file of this client's certificate (https, with key)"),
    ("key", "PEM file of this client's private key (https, with cert)"),
    ("timeout", "torch's name for join_timeout"),
    ("join_timeout", "deadline for a whole rendezvous (default 600s)"),
    ("last_call_timeout", "extra wait for more nodes once min_nodes joined (default 30s)"),
    ("close_timeout", "deadline for closing the rendezvous (default 30s)"),
    ("heartbeat_timeout", "how long one etcd request may keep failing before it is reported (default 5s)"),
    ("keep_alive_interval", "with keep_alive_max_attempt, the lease TTL: their product (default 5s)"),
    ("keep_alive_max_attempt", "with keep_alive_interval, the lease TTL: their product (default 3)"),
    ("lease_ttl", "a node counts as dead after this long without renewing its lease (sets keep_alive_*)"),
    ("key_prefix", "where the rendezvous keys live in etcd (default /elastix/rdzv/)"),
    ("auth_token_file", "file holding the job secret, readable only by its owner (or ELASTIX_AUTH_TOKEN_FILE)"),
];

pub const STATIC_KEYS: &[(&str, &str)] = &[
    ("rank", "this node's rank (set from --node-rank)"),
    ("timeout", "store timeout (default 600s)"),
    ("read_timeout", "store operation timeout (default 60s)"),
    ("auth_token_file", "file holding the job secret, readable only by its owner (or ELASTIX_AUTH_TOKEN_FILE)"),
];

/// Keys torch accepts that have no effect in elastix (torch ignores some of them too): taken
/// with one INFO line each, so that a torchrun command line works unchanged. A key of this list
/// that a backend does use (in its own list) is used.
pub const TORCH_INERT_KEYS: &[(&str, &str)] = &[
    ("heartbeat", "torch ignores it too (the key is heartbeat_timeout)"),
    ("use_libuv", "elastix's store has one server, for every client"),
    ("cas_backoff_max_seconds", "elastix forms rounds without compare-and-set retry loops"),
    ("keep_alive_interval", "the static backend has no heartbeats"),
    ("keep_alive_max_attempt", "the static backend has no heartbeats"),
    ("heartbeat_timeout", "the static backend has no heartbeats"),
    ("join_timeout", "the static backend waits up to its timeout"),
    ("last_call_timeout", "the static backend has a fixed size"),
    ("close_timeout", "the static backend has nothing to close"),
    ("read_timeout", "etcd requests are bounded by heartbeat_timeout and retried"),
    ("store_type", "etcd is the store"),
    ("is_host", "etcd is the store"),
];

/// torch's etcd-v2 backend's names for keys elastix's etcd backend has under other names.
const ETCD_V2_ALIASES: &[(&str, &str)] =
    &[("ssl_cert", "cert"), ("ssl_cert_key", "key"), ("ca_cert", "cacert"), ("etcd_prefix", "key_prefix")];

/// Rendezvous configuration as given: torch's `k=v,k=v` text, or a map of values (no quoting
/// needed: a value may contain `,` or `=`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum ConfInput {
    Text(String),
    Map(BTreeMap<String, ConfValue>),
}

/// One value of a configuration map. Durations are numbers of seconds or text with a unit.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum ConfValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

impl Default for ConfInput {
    fn default() -> Self {
        ConfInput::Text(String::new())
    }
}

impl From<&str> for ConfInput {
    fn from(text: &str) -> Self {
        ConfInput::Text(text.to_owned())
    }
}

impl From<String> for ConfInput {
    fn from(text: String) -> Self {
        ConfInput::Text(text)
    }
}

impl fmt::Display for ConfValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfValue::Bool(value) => write!(f, "{value}"),
            ConfValue::Int(value) => write!(f, "{value}"),
            ConfValue::Float(value) => write!(f, "{value}"),
            ConfValue::Text(value) => f.write_str(value),
        }
    }
}

/// Parsed `key=value` pairs, checked against the keys a backend accepts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RendezvousConf {
    values: BTreeMap<String, String>,
}

/// The shortest duration a setting may take: every one bounds or paces store requests, and a
/// round trip (a scheduler's hiccup included) takes longer than this can be counted on.
pub const MIN_DURATION: Duration = Duration::from_millis(10);

impl RendezvousConf {
    /// Checks either form of the configuration against the keys a backend accepts.
    pub fn from_input(input: &ConfInput, allowed: &[(&str, &str)]) -> Result<Self> {
        match input {
            ConfInput::Text(text) => Self::parse(text, allowed),
            ConfInput::Map(values) => {
                let mut conf = RendezvousConf::default();
                for (key, value) in values {
                    conf.insert(key.trim(), value.to_string().trim(), allowed)?;
                }
                Ok(conf)
            }
        }
    }

    /// Parses torch's format: pieces split on `,`, each split on its first `=`, both sides
    /// trimmed; an empty key or a missing `=` is an error, as is a key not in `allowed`.
    pub fn parse(text: &str, allowed: &[(&str, &str)]) -> Result<Self> {
        let mut conf = RendezvousConf::default();
        let text = text.trim();
        if text.is_empty() {
            return Ok(conf);
        }
        for piece in text.split(',') {
            let (key, value) = piece.split_once('=').ok_or_else(|| {
                RendezvousError::Config(format!("--rdzv-conf: {piece:?} is not of the form key=value"))
            })?;
            conf.insert(key.trim(), value.trim(), allowed)?;
        }
        Ok(conf)
    }

    /// Adds one pair (also used for values coming from elsewhere, like `--node-rank`).
    pub fn insert(&mut self, key: &str, value: &str, allowed: &[(&str, &str)]) -> Result<()> {
        if key.is_empty() {
            return Err(RendezvousError::Config("--rdzv-conf: empty key".into()));
        }
        if value.is_empty() {
            return Err(RendezvousError::Config(format!("--rdzv-conf: key {key:?} has no value")));
        }
        let key = match ETCD_V2_ALIASES.iter().find(|(torch, _)| *torch == key) {
            Some((_, ours)) if allowed.iter().any(|(known, _)| known == ours) => *ours,
            _ => key,
        };
        if !allowed.iter().any(|(known, _)| *known == key) {
            if let Some((_, why)) = TORCH_INERT_KEYS.iter().find(|(inert, _)| *inert == key) {
                tracing::info!("--rdzv-conf {key}={value}: accepted for torch compatibility; no effect here ({why})");
                return Ok(());
            }
            let known: Vec<String> = allowed.iter().map(|(k, meaning)| format!("  {k}: {meaning}")).collect();
            return Err(RendezvousError::Config(format!(
                "--rdzv-conf: unknown key {key:?}; this backend accepts:\n{}",
                known.join("\n")
            )));
        }
        self.values.insert(key.to_owned(), value.to_owned());
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    pub fn duration(&self, key: &str, default: Duration) -> Result<Duration> {
        match self.get(key) {
            None => Ok(default),
            Some(text) => {
                let duration = parse_duration(text)
                    .map_err(|why| RendezvousError::Config(format!("--rdzv-conf {key}={text}: {why}")))?;
                if duration.is_zero() {
                    return Err(RendezvousError::Config(format!("--rdzv-conf {key}={text}: must be positive")));
                }
                if duration < MIN_DURATION {
                    return Err(RendezvousError::Config(format!(
                        "--rdzv-conf {key}={text}: shorter than a store round trip can be counted on to take; use \
                         {MIN_DURATION:?} or more"
                    )));
                }
                Ok(duration)
            }
        }
    }

    pub fn positive_int(&self, key: &str, default: u32) -> Result<u32> {
        match self.get(key) {
            None => Ok(default),
            Some(text) => text.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                RendezvousError::Config(format!("--rdzv-conf {key}={text}: expected a positive integer"))
            }),
        }
    }

    pub fn int(&self, key: &str) -> Result<Option<i64>> {
        self.get(key)
            .map(|text| {
                text.parse::<i64>()
                    .map_err(|_| RendezvousError::Config(format!("--rdzv-conf {key}={text}: expected an integer")))
            })
            .transpose()
    }

    pub fn boolean(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|text| {
                parse_bool(text).ok_or_else(|| {
                    RendezvousError::Config(format!("--rdzv-conf {key}={text}: expected true/false (or 1/0, yes/no)"))
                })
            })
            .transpose()
    }
}

/// `30` (seconds), `30s`, `1.5s`, `500ms`, `250us`, `2m`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a duration (e.g. 30, 30s, 500ms, 2m)"))?;
    let seconds = match unit.trim() {
        "" | "s" | "sec" | "secs" => value,
        "ms" => value / 1e3,
        "us" => value / 1e6,
        "m" | "min" | "mins" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown unit {other:?} (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|err| format!("{text:?}: {err}"))
}

/// torch's boolean spellings, case-insensitive.
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" => Some(true),
        "0" | "false" | "f" | "no" | "n" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_torch_style_pairs() {
        let conf =
            RendezvousConf::parse(" join_timeout = 60 , is_host=yes,last_call_timeout=500ms", DYNAMIC_KEYS).unwrap();
        assert_eq!(conf.duration("join_timeout", Duration::ZERO).unwrap(), Duration::from_secs(60));
        assert_eq!(conf.duration("last_call_timeout", Duration::ZERO).unwrap(), Duration::from_millis(500));
        assert_eq!(conf.boolean("is_host").unwrap(), Some(true));
        assert_eq!(conf.duration("close_timeout", Duration::from_secs(30)).unwrap(), Duration::from_secs(30));
        assert_eq!(RendezvousConf::parse("", DYNAMIC_KEYS).unwrap(), RendezvousConf::default());
    }

    #[test]
    fn rejects_unknown_keys_naming_the_known_ones() {
        let err = RendezvousConf::parse("heartbeat_timout=10", DYNAMIC_KEYS).unwrap_err().to_string();
        assert!(err.contains("unknown key \"heartbeat_timout\""), "{err}");
        assert!(err.contains("heartbeat_timeout"), "{err}");
        assert!(RendezvousConf::parse("rank=1", DYNAMIC_KEYS).is_err());
        assert!(RendezvousConf::parse("rank=1", STATIC_KEYS).is_ok());
    }

    #[test]
    fn torchs_keys_without_effect_are_taken_and_its_etcd_v2_names_are_aliases() {
        let inert = RendezvousConf::parse("heartbeat=10,use_libuv=1,cas_backoff_max_seconds=2", DYNAMIC_KEYS).unwrap();
        assert_eq!(inert, RendezvousConf::default());
        let static_conf = RendezvousConf::parse("rank=1,keep_alive_interval=5,join_timeout=30", STATIC_KEYS).unwrap();
        assert_eq!(static_conf.get("rank"), Some("1"));
        let etcd = RendezvousConf::parse("ca_cert=/ca.pem,etcd_prefix=/p/,read_timeout=60", ETCD_KEYS).unwrap();
        assert_eq!((etcd.get("cacert"), etcd.get("key_prefix")), (Some("/ca.pem"), Some("/p/")));
        assert!(RendezvousConf::parse("bogus=1", ETCD_KEYS).is_err(), "unknown keys stay errors");
    }

    #[test]
    fn rejects_malformed_pieces_and_values() {
        assert!(RendezvousConf::parse("join_timeout", DYNAMIC_KEYS).is_err());
        assert!(RendezvousConf::parse("=5", DYNAMIC_KEYS).is_err());
        assert!(RendezvousConf::parse("join_timeout=", DYNAMIC_KEYS).is_err());
        let conf =
            RendezvousConf::parse("join_timeout=soon,keep_alive_max_attempt=0,is_host=maybe", DYNAMIC_KEYS).unwrap();
        assert!(conf.duration("join_timeout", Duration::ZERO).is_err());
        assert!(conf.positive_int("keep_alive_max_attempt", 3).is_err());
        assert!(conf.boolean("is_host").is_err());
        let zero = RendezvousConf::parse("join_timeout=0", DYNAMIC_KEYS).unwrap();
        assert!(zero.duration("join_timeout", Duration::ZERO).is_err());
    }

    #[test]
    fn a_map_means_the_same_as_the_text() {
        let map: ConfInput = serde_json::from_str(
            r#"{"join_timeout": "30s", "last_call_timeout": 0.5, "keep_alive_max_attempt": 4, "is_host": false}"#,
        )
        .unwrap();
        let text = ConfInput::from("join_timeout=30s,last_call_timeout=0.5,keep_alive_max_attempt=4,is_host=false");
        let (map, text) = (
            RendezvousConf::from_input(&map, DYNAMIC_KEYS).unwrap(),
            RendezvousConf::from_input(&text, DYNAMIC_KEYS).unwrap(),
        );
        assert_eq!(map, text);
        assert_eq!(map.duration("last_call_timeout", Duration::ZERO).unwrap(), Duration::from_millis(500));
        assert_eq!(map.boolean("is_host").unwrap(), Some(false));
        let unknown: ConfInput = serde_json::from_str(r#"{"heartbeat_timout": 10}"#).unwrap();
        assert!(RendezvousConf::from_input(&unknown, DYNAMIC_KEYS).unwrap_err().to_string().contains("heartbeat"));
        let comma: ConfInput = serde_json::from_str(r#"{"store_type": "a,b=c"}"#).unwrap();
        assert_eq!(RendezvousConf::from_input(&comma, DYNAMIC_KEYS).unwrap().get("store_type"), Some("a,b=c"));
    }

    #[test]
    fn a_duration_no_round_trip_fits_in_is_refused() {
        let conf = RendezvousConf::parse("read_timeout=0.001ms,join_timeout=10ms", DYNAMIC_KEYS).unwrap();
        let err = conf.duration("read_timeout", Duration::from_secs(60)).unwrap_err().to_string();
        assert!(err.contains("read_timeout=0.001ms: shorter than a store round trip") && err.contains("10ms"), "{err}");
        assert_eq!(conf.duration("join_timeout", Duration::ZERO).unwrap(), MIN_DURATION, "the floor itself is fine");
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-1").is_err());
    }
}
