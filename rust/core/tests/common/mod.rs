//! The store's two servers (tokio's epoll and io_uring), for tests that hold both to the same
//! behaviour: each such test is a function of an [`Engine`], run on both by
//! [`on_both_servers`].
#![allow(dead_code, unused_macros, unused_imports)] // each test file uses what it needs

use elastix_core::store::server::uring::UringServer;
use elastix_core::store::{BackgroundServer, ServerConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Epoll,
    Uring,
}

pub enum Server {
    Epoll(BackgroundServer),
    Uring(UringServer),
}

impl Server {
    /// Starts `engine`'s server; io_uring's must start here (the test fails, not skips, where
    /// the kernel does not let it).
    pub fn start(engine: Engine, config: &ServerConfig) -> Server {
        match engine {
            Engine::Epoll => Server::Epoll(BackgroundServer::start(config, 2).unwrap()),
            Engine::Uring => {
                Server::Uring(UringServer::start(config).unwrap_or_else(|err| panic!("the io_uring server: {err}")))
            }
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            Server::Epoll(server) => server.port(),
            Server::Uring(server) => server.port(),
        }
    }

    pub fn waiting(&self) -> usize {
        match self {
            Server::Epoll(server) => server.server().waiting(),
            Server::Uring(server) => server.waiting(),
        }
    }

    pub fn connections(&self) -> usize {
        match self {
            Server::Epoll(server) => server.server().connections(),
            Server::Uring(server) => server.connections(),
        }
    }

    pub fn refused(&self) -> u64 {
        match self {
            Server::Epoll(server) => server.server().refused(),
            Server::Uring(server) => server.refused(),
        }
    }

    pub fn closed_on_errors(&self) -> u64 {
        match self {
            Server::Epoll(server) => server.server().closed_on_errors(),
            Server::Uring(server) => server.closed_on_errors(),
        }
    }
}

/// A `#[test]` per server for each named function of an [`Engine`]: `epoll::name` and
/// `uring::name`.
macro_rules! on_both_servers {
    ($($name:ident),* $(,)?) => {
        mod epoll {
            $( #[test] fn $name() { super::$name($crate::common::Engine::Epoll) } )*
        }
        mod uring {
            $( #[test] fn $name() { super::$name($crate::common::Engine::Uring) } )*
        }
    };
}
pub(crate) use on_both_servers;
