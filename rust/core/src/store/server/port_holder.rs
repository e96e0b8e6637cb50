//! Who holds a TCP port on this machine, for an "address in use" that says more than that:
//! the socket's inode from /proc/net/tcp and tcp6, then the process with a descriptor for it.
//! Best effort: another user's processes, or another network namespace, cannot be told.

use std::fs;

/// "pid N (command line)" of a process holding `port` (listening, or bound and idle), if
/// this process may see it.
pub fn describe_holder(port: u16) -> Option<String> {
    holder(port).map(|pid| format!("pid {pid} ({})", command_line(pid)))
}

/// The pid of a process holding `port` (listening, or bound and idle), if this process may
/// see it.
pub fn holder(port: u16) -> Option<u32> {
    let inodes: Vec<u64> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| fs::read_to_string(table).ok())
        .flat_map(|table| socket_inodes(&table, port))
        .collect();
    if inodes.is_empty() {
        return None;
    }
    let wanted: Vec<String> = inodes.iter().map(|inode| format!("socket:[{inode}]")).collect();
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else { continue };
        let holds = fds.flatten().any(|fd| {
            fs::read_link(fd.path()).is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
        });
        if holds {
            return Some(pid);
        }
    }
    None
}

/// The inodes of the sockets in a /proc/net/tcp table bound to local `port` and not
/// connected (LISTEN, or CLOSE: bound and idle).
fn socket_inodes(table: &str, port: u16) -> Vec<u64> {
    const LISTEN: &str = "0A";
    const CLOSE: &str = "07";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit_once(':')?.1;
            let state = *fields.get(3)?;
            let ours = u16::from_str_radix(local_port, 16).ok()? == port && (state == LISTEN || state == CLOSE);
            ours.then(|| fields.get(9)?.parse().ok()).flatten().filter(|inode| *inode != 0)
        })
        .collect()
}

/// Characters of a holder's command line shown.
const COMMAND_SHOWN: usize = 160;

/// The command line of `pid` on one line, shortened.
fn command_line(pid: u32) -> String {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|byte| *byte == 0)
        .filter(|word| !word.is_empty())
        .map(|w| String::from_utf8_lossy(w).into())
        .collect();
    match words.is_empty() {
        true => fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim().to_owned()).unwrap_or_default(),
        false => {
            let line = words.join(" ").split_whitespace().collect::<Vec<_>>().join(" ");
            match line.char_indices().nth(COMMAND_SHOWN) {
                Some((end, _)) => format!("{}...", &line[..end]),
                None => line,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str =
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1161 1 0 100 0 0 10 0
   1: 0100007F:07E8 0100007F:86BE 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
   2: 0100007F:1F90 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 3333 1 0
   3: 0100007F:1F90 0100007F:86BE 06 00000000:00000000 03:00000D21 00000000     0        0 0 3 0";

    #[test]
    fn listening_and_idle_bound_sockets_are_found_connections_are_not() {
        assert_eq!(socket_inodes(TABLE, 0x07E8), [1161]);
        assert_eq!(socket_inodes(TABLE, 0x1F90), [3333]);
        assert!(socket_inodes(TABLE, 1).is_empty());
    }

    #[test]
    fn the_holder_of_a_port_held_here_is_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let said = describe_holder(port).expect("a port this process holds");
        assert!(said.starts_with(&format!("pid {} (", std::process::id())), "{said}");
    }
}
