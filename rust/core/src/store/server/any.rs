//! Either store server, chosen by what the job needs and what the kernel allows: io_uring
//! ([`UringServer`]) where it can serve, tokio's epoll ([`StoreServer`]) where it cannot (a job
//! secret, whose handshake runs on epoll; a kernel or seccomp filter without io_uring).
//!
//! Every server elastix starts in-process (the agent's rendezvous and workers' stores, a
//! master `TCPStore`) and `elastix-store` choose here, so that they all serve alike;
//! `ELASTIX_STORE_IO` (auto, uring or epoll) overrides the choice for all of them.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::OnceLock;

use super::uring::{self, UringServer};
use super::{ServerConfig, StoreServer, Trusts};

/// How a server waits for its clients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Io {
    /// io_uring where it can serve the configuration in this process, else epoll.
    #[default]
    Auto,
    Uring,
    Epoll,
}

impl Io {
    /// The environment variable that picks the server for every store started in-process.
    pub const ENV: &'static str = "ELASTIX_STORE_IO";
    pub const NAMES: [&'static str; 3] = ["auto", "uring", "epoll"];

    /// What `ELASTIX_STORE_IO` asks for (auto where it is unset or empty).
    pub fn from_env() -> io::Result<Io> {
        match std::env::var(Io::ENV) {
            Ok(value) if !value.is_empty() => value
                .parse()
                .map_err(|err: String| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {err}", Io::ENV))),
            _ => Ok(Io::Auto),
        }
    }

    /// The server to start for `config`: `Uring` or `Epoll`. An error (`InvalidInput`) where
    /// io_uring was asked for and cannot serve; `Auto` says at DEBUG why it takes epoll.
    pub fn resolve(self, config: &ServerConfig) -> io::Result<Io> {
        match (self, Io::why_not_uring(config)) {
            (Io::Epoll, _) => Ok(Io::Epoll),
            (Io::Uring, Some(reason)) => {
                Err(io::Error::new(io::ErrorKind::InvalidInput, format!("the io_uring store server: {reason}")))
            }
            (Io::Uring | Io::Auto, None) => Ok(Io::Uring),
            (Io::Auto, Some(reason)) => {
                tracing::debug!("store server on epoll: {reason}");
                Ok(Io::Epoll)
            }
        }
    }

    /// Why io_uring cannot serve `config` in this process, if it cannot.
    pub fn why_not_uring(config: &ServerConfig) -> Option<String> {
        if config.auth.is_some() {
            Some("the job secret's handshake runs on epoll".to_owned())
        } else {
            uring_available().err()
        }
    }
}

impl FromStr for Io {
    type Err = String;

    fn from_str(name: &str) -> Result<Io, String> {
        match name {
            "auto" => Ok(Io::Auto),
            "uring" => Ok(Io::Uring),
            "epoll" => Ok(Io::Epoll),
            other => Err(format!("{other:?} is no server; expected one of {}", Io::NAMES.join(", "))),
        }
    }
}

impl fmt::Display for Io {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Io::Auto => "auto",
            Io::Uring => "uring",
            Io::Epoll => "epoll",
        })
    }
}

/// Whether this process may serve on io_uring (asked of the kernel once: a probe makes a ring).
fn uring_available() -> Result<(), String> {
    static AVAILABLE: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABLE.get_or_init(|| uring::available().map_err(|err| err.to_string())).clone()
}

/// A running store server, on whichever [`Io`] chose. Dropping it stops the server.
pub enum AnyServer {
    /// On the tokio runtime it was started in.
    Epoll(StoreServer),
    /// On a thread of its own.
    Uring(UringServer),
}

impl AnyServer {
    /// Starts the server `ELASTIX_STORE_IO` (default auto) picks for `config`; epoll's runs on
    /// the current tokio runtime.
    pub fn start(config: &ServerConfig) -> io::Result<AnyServer> {
        AnyServer::start_on(Io::from_env()?, config)
    }

    /// Starts the server `io` picks for `config`.
    pub fn start_on(io: Io, config: &ServerConfig) -> io::Result<AnyServer> {
        Ok(match io.resolve(config)? {
            Io::Uring => AnyServer::Uring(UringServer::start(config)?),
            _ => AnyServer::Epoll(StoreServer::start(config)?),
        })
    }

    /// Starts on `port` if it can be bound (a restarted job keeps its address), else on the
    /// port `config` asks for.
    pub fn start_preferring(config: &ServerConfig, port: Option<u16>) -> io::Result<AnyServer> {
        if let Some(port) = port.filter(|port| *port != 0 && config.listen_fd.is_none()) {
            match AnyServer::start(&ServerConfig { port, ..config.clone() }) {
                Ok(server) => return Ok(server),
                Err(err) => tracing::debug!(port, "cannot serve on the previous port again ({err}); taking another"),
            }
        }
        AnyServer::start(config)
    }

    /// Which server this is: `Uring` or `Epoll`.
    pub fn io(&self) -> Io {
        match self {
            AnyServer::Epoll(_) => Io::Epoll,
            AnyServer::Uring(_) => Io::Uring,
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        match self {
            AnyServer::Epoll(server) => server.local_addr(),
            AnyServer::Uring(server) => server.local_addr(),
        }
    }

    pub fn port(&self) -> u16 {
        self.local_addr().port()
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        match self {
            AnyServer::Epoll(server) => server.connections(),
            AnyServer::Uring(server) => server.connections(),
        }
    }

    /// A handle that lets plain clients from given addresses in; a server without a secret
    /// (every io_uring one) lets everybody in already.
    pub fn trusts(&self) -> Trusts {
        match self {
            AnyServer::Epoll(server) => server.trusts(),
            AnyServer::Uring(_) => Trusts(std::sync::Weak::new()),
        }
    }

    /// Stops accepting, closes every connection and waits for the server to end.
    pub async fn shutdown(self) {
        match self {
            AnyServer::Epoll(server) => server.shutdown().await,
            // its stop takes milliseconds (everything in flight is cancelled), but blocks
            AnyServer::Uring(server) => drop(tokio::task::spawn_blocking(move || server.shutdown()).await),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{PlainClients, Secret};

    #[test]
    fn names_read_back_as_written_and_others_are_refused() {
        for io in [Io::Auto, Io::Uring, Io::Epoll] {
            assert_eq!(io.to_string().parse::<Io>(), Ok(io));
        }
        let refused = "iouring".parse::<Io>().unwrap_err();
        assert!(refused.contains("auto, uring, epoll"), "{refused}");
    }

    #[test]
    fn a_secret_is_served_on_epoll_and_refused_by_uring() {
        let config = ServerConfig::default()
            .requiring(Some(&Secret::from_bytes("a-long-enough-job-secret-0123456789").unwrap()), PlainClients::Refuse);
        assert_eq!(Io::Auto.resolve(&config).unwrap(), Io::Epoll);
        assert_eq!(Io::Epoll.resolve(&config).unwrap(), Io::Epoll);
        let err = Io::Uring.resolve(&config).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn auto_takes_uring_where_this_kernel_offers_it() {
        let expected = if uring::available().is_ok() { Io::Uring } else { Io::Epoll };
        assert_eq!(Io::Auto.resolve(&ServerConfig::default()).unwrap(), expected);
    }
}
