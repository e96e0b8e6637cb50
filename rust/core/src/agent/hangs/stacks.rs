//! Stack dumps of live workers: a worker that imported elastix has Python's `faulthandler`
//! armed on a signal of its own (its heartbeat slot says which), writing every thread's stack
//! to its stacks file. The agent sends that signal and reads what the file gained. A worker
//! that has not armed it is never sent the signal (its default action would kill it).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Duration;

/// How long a dump may take to appear and finish.
pub const DUMP_WAIT: Duration = Duration::from_secs(2);
/// A dump that grew nothing for this long is complete.
const SETTLED: Duration = Duration::from_millis(100);
const POLL: Duration = Duration::from_millis(10);
/// Most bytes of one dump kept (a process with thousands of threads).
const MOST: u64 = 256 << 10;

/// Makes process `pid` dump its stacks into `file` with `signal`, and returns the dump, or
/// why there is none.
pub async fn dump(pid: u32, signal: u64, file: &Path) -> Result<String, String> {
    let signal = i32::try_from(signal).ok().filter(|s| *s > 0).ok_or("it has not armed stack dumps")?;
    let start = std::fs::metadata(file).map_or(0, |m| m.len());
    // SAFETY: kill(2) takes plain integers and touches no memory of this process.
    if unsafe { libc::kill(pid as i32, signal) } != 0 {
        return Err(format!("cannot signal it: {}", std::io::Error::last_os_error()));
    }
    let deadline = tokio::time::Instant::now() + DUMP_WAIT;
    let (mut size, mut changed) = (start, tokio::time::Instant::now());
    loop {
        tokio::time::sleep(POLL).await;
        let now_size = std::fs::metadata(file).map_or(start, |m| m.len());
        let now = tokio::time::Instant::now();
        if now_size != size {
            (size, changed) = (now_size, now);
        } else if size > start && now - changed >= SETTLED {
            break;
        }
        if now >= deadline {
            break;
        }
    }
    if size <= start {
        return Err(format!("it wrote no stack dump within {DUMP_WAIT:?}"));
    }
    read_from(file, start, size).map_err(|err| format!("cannot read {}: {err}", file.display()))
}

fn read_from(file: &Path, start: u64, end: u64) -> std::io::Result<String> {
    let mut file = std::fs::File::open(file)?;
    let from = start.max(end.saturating_sub(MOST));
    file.seek(SeekFrom::Start(from))?;
    let mut bytes = Vec::new();
    file.take(end - from).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).trim_end().to_owned())
}
