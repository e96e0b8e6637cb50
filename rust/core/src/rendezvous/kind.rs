//! The rendezvous backends, by the names `--rdzv-backend` takes: the one place a name becomes
//! a backend (the agent's configuration, the rendezvous, `elastix status` and `elastix dump`
//! all ask here).

use super::error::{RendezvousError, Result};

/// Which rendezvous a job uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Over a TCPStore: an agent's, a standalone one, or several sites.
    C10d,
    /// Over an etcd v3 cluster (also named `etcd-v3`).
    Etcd,
    /// torchrun's default: fixed node ranks, no shared state.
    Static,
}

impl BackendKind {
    /// Every name `--rdzv-backend` takes.
    pub const NAMES: &[&str] = &["c10d", "etcd", "etcd-v3", "static"];

    pub fn parse(name: &str) -> Result<BackendKind> {
        match name {
            "c10d" => Ok(BackendKind::C10d),
            "etcd" | "etcd-v3" => Ok(BackendKind::Etcd),
            "static" => Ok(BackendKind::Static),
            "etcd-v2" => Err(RendezvousError::Config(
                "--rdzv-backend etcd-v2: etcd's v2 API is off by default since etcd 3.4; use etcd (the v3 API)".into(),
            )),
            other => Err(RendezvousError::Config(format!(
                "--rdzv-backend: unknown backend {other:?} (choose from {})",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// Whether the job's state is shared where `elastix status` and `elastix dump` can read it.
    pub fn keeps_shared_state(self) -> bool {
        self != BackendKind::Static
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_and_retired_or_unknown_ones_say_why() {
        for name in BackendKind::NAMES {
            assert!(BackendKind::parse(name).is_ok(), "{name}");
        }
        assert_eq!(BackendKind::parse("etcd-v3").unwrap(), BackendKind::Etcd);
        assert!(BackendKind::parse("etcd-v2").unwrap_err().to_string().contains("v2 API is off by default"));
        let unknown = BackendKind::parse("zookeeper").unwrap_err().to_string();
        assert!(
            unknown.contains("unknown backend \"zookeeper\" (choose from c10d, etcd, etcd-v3, static)"),
            "{unknown}"
        );
    }
}
