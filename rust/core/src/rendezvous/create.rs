//! The rendezvous backend the launcher's parameters name ([`Rendezvous`]), its configuration
//! (conf values, secret, endpoint list) parsed once, up front, and checkable before anything
//! starts.

use std::ops::{Deref, DerefMut};

use super::backend::Backend;
use super::c10d::{C10dOptions, C10dRendezvous};
use super::error::{RendezvousError, Result};
use super::etcd::{EtcdRdzvOptions, EtcdRendezvous};
use super::params::RendezvousParams;
use super::static_rdzv::{StaticOptions, StaticRendezvous};

/// The rendezvous backend `--rdzv-backend` names.
pub struct Rendezvous(Box<dyn Backend>);

impl Rendezvous {
    /// Builds the backend `params.backend` names. Must run inside a tokio runtime (a hosted
    /// store is served on it).
    pub async fn create(params: RendezvousParams) -> Result<Rendezvous> {
        let backend: Box<dyn Backend> = match params.backend.as_str() {
            "c10d" => Box::new(C10dRendezvous::create(&params, C10dOptions::parse(&params)?).await?),
            "static" => Box::new(StaticRendezvous::create(&params, StaticOptions::parse(&params)?)?),
            "etcd" | "etcd-v3" => Box::new(EtcdRendezvous::create(EtcdRdzvOptions::parse(&params)?)?),
            other => return Err(unknown_backend(other)),
        };
        Ok(Rendezvous(backend))
    }

    /// Checks everything `create` would build from `params` (every `--rdzv-conf` value, the
    /// secret's file, the endpoint list) without building anything, binding anything or
    /// installing the secret: a bad value is a configuration error before the agent starts.
    pub fn check(params: &RendezvousParams) -> Result<()> {
        match params.backend.as_str() {
            "c10d" => C10dOptions::parse(params).map(drop),
            "static" => StaticOptions::parse(params).map(drop),
            "etcd" | "etcd-v3" => EtcdRdzvOptions::parse(params).map(drop),
            other => Err(unknown_backend(other)),
        }
    }
}

impl Deref for Rendezvous {
    type Target = dyn Backend;

    fn deref(&self) -> &(dyn Backend + 'static) {
        &*self.0
    }
}

impl DerefMut for Rendezvous {
    fn deref_mut(&mut self) -> &mut (dyn Backend + 'static) {
        &mut *self.0
    }
}

fn unknown_backend(name: &str) -> RendezvousError {
    if name == "etcd-v2" {
        return RendezvousError::Config(
            "--rdzv-backend etcd-v2: etcd's v2 API is off by default since etcd 3.4; use etcd (the v3 API)".into(),
        );
    }
    RendezvousError::Config(format!(
        "--rdzv-backend {name:?} is unknown; use c10d (elastic), etcd (elastic, on an etcd v3 cluster) or static"
    ))
}
