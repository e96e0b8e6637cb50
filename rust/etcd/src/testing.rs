//! A real etcd for tests (feature `testing`): one member on free ports of 127.0.0.1, its data
//! in a temporary directory, killed and removed when dropped. Needs `etcd` on PATH (Debian's
//! etcd-server, which `.ci/run` installs).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::client::{EtcdClient, EtcdOptions};

pub struct LocalEtcd {
    child: Child,
    data: PathBuf,
    /// Its ports, held for its life (etcd binds with SO_REUSEADDR: a restart finds them free).
    _ports: [socket2::Socket; 2],
    endpoint: String,
}

impl LocalEtcd {
    /// Starts one; `None` (said on stderr) where etcd is not installed.
    pub fn start() -> Option<LocalEtcd> {
        let which = Command::new("sh").args(["-c", "command -v etcd"]).output().ok()?;
        if !which.status.success() {
            eprintln!("etcd is not installed (Debian: etcd-server): skipping");
            return None;
        }
        // held (bound, not listening, SO_REUSEADDR) until etcd listens on them: a port probed
        // and let go could be taken meanwhile, or probed twice, by an etcd of another test
        let holders = [held_port(), held_port()];
        let port = |holder: &socket2::Socket| holder.local_addr().unwrap().as_socket().unwrap().port();
        let (client, peer) = (port(&holders[0]), port(&holders[1]));
        let data = std::env::temp_dir().join(format!("elastix-etcd-test-{}-{client}", std::process::id()));
        let child = Command::new("etcd")
            .args(["--name", "solo", "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("solo=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        Some(LocalEtcd { child, data, endpoint: format!("127.0.0.1:{client}"), _ports: holders })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A client whose requests are retried for up to 30 s (etcd takes a moment to start).
    pub fn client(&self) -> EtcdClient {
        let options =
            EtcdOptions { endpoints: vec![self.endpoint.clone()], tls: None, patience: Duration::from_secs(30) };
        EtcdClient::new(&options).expect("a client of the local etcd")
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// A port of 127.0.0.1 the kernel picked, bound with SO_REUSEADDR and not listening: no one
/// else can take it, and etcd (Go sets SO_REUSEADDR) can listen on it.
fn held_port() -> socket2::Socket {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    socket.set_reuse_address(true).expect("SO_REUSEADDR");
    socket.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into()).expect("a free port of 127.0.0.1");
    socket
}
