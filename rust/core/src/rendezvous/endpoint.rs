//! `--rdzv-endpoint host[:port]` and whether it names this machine (then this agent hosts the
//! store).

use std::net::IpAddr;
use std::time::Duration;

use super::error::{RendezvousError, Result};

/// torch's default port for the c10d rendezvous store.
pub const DEFAULT_PORT: u16 = 29400;

/// Parses `host`, `host:port`, `[v6]` or `[v6]:port`; an empty endpoint is `localhost`.
pub fn parse_endpoint(endpoint: &str, default_port: u16) -> Result<(String, u16)> {
    let endpoint = endpoint.trim();
    if endpoint.is_empty() {
        return Ok(("localhost".to_owned(), default_port));
    }
    let bad = |why: &str| RendezvousError::Config(format!("--rdzv-endpoint {endpoint:?}: {why}"));
    let (host, port) = if let Some(rest) = endpoint.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or_else(|| bad("expected ':' after ']'"))?)),
        }
    } else {
        match endpoint.rsplit_once(':') {
            // a bare IPv6 address has several colons and no port
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            _ => (endpoint, None),
        }
    };
    if host.is_empty() || !host.chars().all(|c| c.is_alphanumeric() || "._-:".contains(c)) {
        return Err(bad("not a valid host name or address"));
    }
    let port = match port {
        None => default_port,
        Some(port) => port.parse::<u16>().map_err(|_| bad("the port must be a number from 0 to 65535"))?,
    };
    Ok((host.to_owned(), port))
}

/// Parses `--rdzv-endpoint`: one endpoint, or an ordered, comma-separated list of them (the
/// sites the job's store may live at, see [`super::c10d::locate`]).
pub fn parse_endpoints(text: &str, default_port: u16) -> Result<Vec<(String, u16)>> {
    if !text.contains(',') {
        return Ok(vec![parse_endpoint(text, default_port)?]);
    }
    let mut sites: Vec<(String, u16)> = Vec::new();
    for part in text.split(',') {
        if part.trim().is_empty() {
            return Err(RendezvousError::Config(format!("--rdzv-endpoint {text:?}: an empty entry in the list")));
        }
        let site = parse_endpoint(part, default_port)?;
        if sites.contains(&site) {
            return Err(RendezvousError::Config(format!(
                "--rdzv-endpoint {text:?}: {}:{} is listed twice",
                site.0, site.1
            )));
        }
        sites.push(site);
    }
    Ok(sites)
}

/// Whether `host` names the address `local_addr` (as given, or both resolved): with
/// `--local-addr`, an agent hosts exactly the sites naming its own address, so that several
/// agents on one machine (127.0.0.x, network namespaces) each host their own.
pub async fn is_local_addr(host: &str, local_addr: &str) -> bool {
    if host.eq_ignore_ascii_case(local_addr) {
        return true;
    }
    let (ours, theirs) = tokio::join!(resolve(local_addr), resolve(host));
    theirs.iter().any(|ip| ours.contains(ip))
}

pub use crate::store::server::listener::is_loopback_name;

async fn resolve(host: &str) -> Vec<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    match tokio::time::timeout(RESOLVE_PATIENCE, tokio::net::lookup_host((host, 0))).await {
        Ok(Ok(addrs)) => addrs.map(|addr| addr.ip()).collect(),
        _ => Vec::new(),
    }
}

/// How long resolving the endpoint's name may take before it counts as not this machine.
const RESOLVE_PATIENCE: Duration = Duration::from_secs(10);

/// Whether `host` names this machine: "localhost", a loopback address, this machine's host
/// name (also as the first label of a longer name: a Kubernetes pod `job-0` is
/// `job-0.service`, a name its own DNS record may not have yet), or an address of one of its
/// interfaces (also after resolving `host`, through tokio's resolver so that a slow DNS
/// server does not hold up the runtime).
pub async fn is_this_machine(host: &str) -> bool {
    if host.eq_ignore_ascii_case("localhost") || names_host(host, &super::node::host_name()) {
        return true;
    }
    let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => match tokio::time::timeout(RESOLVE_PATIENCE, tokio::net::lookup_host((host, 0))).await {
            Ok(Ok(addrs)) => addrs.map(|addr| addr.ip()).collect(),
            Ok(Err(err)) => {
                tracing::warn!("cannot resolve the rendezvous endpoint {host:?}: {err}");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!(
                    "resolving the rendezvous endpoint {host:?} took over {RESOLVE_PATIENCE:?}; not hosting"
                );
                Vec::new()
            }
        },
    };
    let local = local_addresses();
    addrs.iter().any(|ip| ip.is_loopback() || local.contains(ip))
}

/// Whether `host` is the host name `own`, or a longer name whose first label is it (not an
/// address: 10.0.0.1 is not host "10").
fn names_host(host: &str, own: &str) -> bool {
    let short = |name: &str| name.split('.').next().unwrap_or_default().to_owned();
    host.eq_ignore_ascii_case(own)
        || (host.parse::<IpAddr>().is_err() && !own.is_empty() && short(host).eq_ignore_ascii_case(&short(own)))
}

fn local_addresses() -> Vec<IpAddr> {
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    interfaces
        .filter_map(|interface| interface.address)
        .filter_map(|address| {
            if let Some(v4) = address.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                address.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_ports_and_brackets() {
        assert_eq!(parse_endpoint("node1:1234", 29400).unwrap(), ("node1".into(), 1234));
        assert_eq!(parse_endpoint("node1", 29400).unwrap(), ("node1".into(), 29400));
        assert_eq!(parse_endpoint("", 29400).unwrap(), ("localhost".into(), 29400));
        assert_eq!(parse_endpoint("[::1]:5", 29400).unwrap(), ("::1".into(), 5));
        assert_eq!(parse_endpoint("[fe80::1]", 29400).unwrap(), ("fe80::1".into(), 29400));
        assert_eq!(parse_endpoint("::1", 29400).unwrap(), ("::1".into(), 29400));
        assert_eq!(parse_endpoint("localhost:0", 29400).unwrap(), ("localhost".into(), 0));
        assert!(parse_endpoint("host:99999", 29400).is_err());
        assert!(parse_endpoint("host:port", 29400).is_err());
        assert!(parse_endpoint("[::1", 29400).is_err());
        assert!(parse_endpoint("bad host:1", 29400).is_err());
    }

    #[test]
    fn parses_lists_of_sites() {
        assert_eq!(parse_endpoints("a:1", 29400).unwrap(), vec![("a".into(), 1)]);
        assert_eq!(
            parse_endpoints("a:1, b ,[::1]:3", 29400).unwrap(),
            vec![("a".into(), 1), ("b".into(), 29400), ("::1".into(), 3)]
        );
        assert!(parse_endpoints("a:1,,b:2", 29400).unwrap_err().to_string().contains("empty entry"));
        assert!(parse_endpoints("a:1,a:1", 29400).unwrap_err().to_string().contains("listed twice"));
        assert!(parse_endpoints("a:1,b:x", 29400).is_err());
    }

    #[tokio::test]
    async fn matches_the_local_address() {
        assert!(is_local_addr("127.0.0.2", "127.0.0.2").await);
        assert!(names_host("job-0.job", "job-0") && names_host("JOB-0", "job-0.cluster.local"));
        assert!(names_host("n1.example", "n1.example") && !names_host("n10.job", "n1"));
        assert!(!names_host("10.0.0.1", "10") && !names_host("job-1.job", "job-0"));
        assert!(is_local_addr("localhost", "127.0.0.1").await);
        assert!(!is_local_addr("127.0.0.2", "127.0.0.3").await);
    }

    #[tokio::test]
    async fn recognises_this_machine() {
        assert!(is_this_machine("localhost").await);
        assert!(is_this_machine("127.0.0.1").await);
        assert!(is_this_machine("127.0.0.2").await);
        assert!(is_this_machine(&crate::rendezvous::node::host_name()).await);
        assert!(!is_this_machine("192.0.2.1").await); // TEST-NET-1, never local
        assert!(!is_this_machine("nonexistent.invalid").await);
    }
}
