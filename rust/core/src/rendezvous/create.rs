//! The rendezvous backend the launcher's parameters name ([`Rendezvous`]), its configuration
//! (conf values, secret, endpoint list) parsed once, up front, and checkable before anything
//! starts.

use std::ops::{Deref, DerefMut};

use super::backend::Backend;
use super::c10d::{C10dOptions, C10dRendezvous};
use super::error::Result;
use super::etcd::{EtcdRdzvOptions, EtcdRendezvous};
use super::kind::BackendKind;
use super::static_rdzv::{StaticOptions, StaticRendezvous};
use crate::rendezvous::config::params::RendezvousParams;

/// The rendezvous backend `--rdzv-backend` names.
pub struct Rendezvous(Box<dyn Backend>);

impl Rendezvous {
    /// Builds the backend `params.backend` names. Must run inside a tokio runtime (a hosted
    /// store is served on it).
    pub async fn create(params: RendezvousParams) -> Result<Rendezvous> {
        let backend: Box<dyn Backend> = match BackendKind::parse(&params.backend)? {
            BackendKind::C10d => Box::new(C10dRendezvous::create(&params, C10dOptions::parse(&params)?).await?),
            BackendKind::Static => Box::new(StaticRendezvous::create(&params, StaticOptions::parse(&params)?)?),
            BackendKind::Etcd => Box::new(EtcdRendezvous::create(EtcdRdzvOptions::parse(&params)?)?),
        };
        Ok(Rendezvous(backend))
    }

    /// Checks everything `create` would build from `params` (every `--rdzv-conf` value, the
    /// secret's file, the endpoint list) without building anything, binding anything or
    /// installing the secret: a bad value is a configuration error before the agent starts.
    pub fn check(params: &RendezvousParams) -> Result<()> {
        match BackendKind::parse(&params.backend)? {
            BackendKind::C10d => C10dOptions::parse(params).map(drop),
            BackendKind::Static => StaticOptions::parse(params).map(drop),
            BackendKind::Etcd => EtcdRdzvOptions::parse(params).map(drop),
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
