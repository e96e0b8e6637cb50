//! The ring itself: made with what this kernel supports, checked for the operations the
//! server needs, and a submission queue that never refuses an entry (a full one is handed to
//! the kernel first). Each submission carries an [`Op`], which its completion gives back.

use std::io;

use io_uring::{opcode, squeue, IoUring, Probe};

/// The oldest kernel the server runs on: multishot receive came in 6.0.
const OLDEST_KERNEL: (u32, u32) = (6, 0);

/// What a completion is for; a connection's operations name its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Accept,
    /// The accept failed and waits before it is armed again.
    AcceptRetry,
    Stop,
    /// The idle timer's period.
    Tick,
    /// The end of the wait for connections to close at shutdown.
    Grace,
    /// A cancellation (the cancelled operation completes on its own).
    Cancel,
    Recv(u32),
    Send(u32),
}

const KIND_SHIFT: u32 = 56;

impl Op {
    pub fn token(self) -> u64 {
        let (kind, slot) = match self {
            Op::Accept => (1, 0),
            Op::AcceptRetry => (2, 0),
            Op::Stop => (3, 0),
            Op::Tick => (4, 0),
            Op::Grace => (5, 0),
            Op::Cancel => (6, 0),
            Op::Recv(slot) => (8, slot),
            Op::Send(slot) => (9, slot),
        };
        (kind << KIND_SHIFT) | u64::from(slot)
    }

    pub fn of(token: u64) -> Option<Op> {
        let slot = token as u32; // the low half: a slot where there is one
        Some(match token >> KIND_SHIFT {
            1 => Op::Accept,
            2 => Op::AcceptRetry,
            3 => Op::Stop,
            4 => Op::Tick,
            5 => Op::Grace,
            6 => Op::Cancel,
            8 => Op::Recv(slot),
            9 => Op::Send(slot),
            _ => return None,
        })
    }
}

/// One completion, copied out of the queue (so that handling it may submit more).
#[derive(Clone, Copy, Debug)]
pub(super) struct Completion {
    pub op: Op,
    pub result: i32,
    pub flags: u32,
}

pub(super) struct Ring(IoUring);

impl Ring {
    /// A ring of `entries` submissions (and four times as many completions), with the
    /// single-issuer and deferred-task-run optimizations where the kernel has them.
    pub fn new(entries: u32) -> io::Result<Ring> {
        kernel_is_recent_enough()?;
        let fast = IoUring::builder()
            .setup_cqsize(entries * 4)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_coop_taskrun()
            .build(entries);
        let ring = match fast {
            Ok(ring) => ring,
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                IoUring::builder().setup_cqsize(entries * 4).build(entries).map_err(unavailable)?
            }
            Err(err) => return Err(unavailable(err)),
        };
        supports_what_the_server_uses(&ring)?;
        Ok(Ring(ring))
    }

    /// Queues `entry`, handing the queue to the kernel first if it is full.
    ///
    /// # Safety
    ///
    /// Whatever `entry` points to (a buffer, a timespec) must stay valid and unmoved until its
    /// completion is reaped.
    pub unsafe fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: the caller keeps what `entry` points to alive until its completion.
            if unsafe { self.0.submission().push(entry) }.is_ok() {
                return;
            }
            if let Err(err) = self.0.submit() {
                // the entries stay queued; the loop's next submit reports a lasting failure
                tracing::debug!("io_uring submit while the queue was full: {err}");
            }
        }
    }

    /// Registers the ring of `entries` buffer descriptions at `addr` as buffer group `group`.
    ///
    /// # Safety
    ///
    /// The descriptions, and the buffers they name, must stay valid until the ring is dropped.
    pub unsafe fn register_buffers(&self, addr: u64, entries: u16, group: u16) -> io::Result<()> {
        // SAFETY: the caller keeps the descriptions alive for as long as the ring.
        unsafe { self.0.submitter().register_buf_ring_with_flags(addr, entries, group, 0) }
    }

    /// Submits what is queued and waits for at least one completion.
    pub fn submit_and_wait(&mut self) -> io::Result<()> {
        match self.0.submit_and_wait(1) {
            Ok(_) => Ok(()),
            // a signal, or the completion queue momentarily full: the loop reaps and retries
            Err(err) if matches!(err.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Moves every completion now in the queue into `into`.
    pub fn reap(&mut self, into: &mut Vec<Completion>) {
        for entry in self.0.completion() {
            match Op::of(entry.user_data()) {
                Some(op) => into.push(Completion { op, result: entry.result(), flags: entry.flags() }),
                None => tracing::debug!(token = entry.user_data(), "io_uring completion of no operation of ours"),
            }
        }
    }
}

fn unavailable(err: io::Error) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("io_uring is not available to this process: {err}"))
}

fn kernel_is_recent_enough() -> io::Result<()> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let release = release.trim();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).filter_map(|part| part.parse::<u32>().ok());
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    if version < OLDEST_KERNEL {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "kernel {release} predates multishot receive (io_uring's server needs {}.{} or later)",
                OLDEST_KERNEL.0, OLDEST_KERNEL.1
            ),
        ));
    }
    Ok(())
}

fn supports_what_the_server_uses(ring: &IoUring) -> io::Result<()> {
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(unavailable)?;
    let needed = [
        ("accept", opcode::AcceptMulti::CODE),
        ("recv", opcode::RecvMulti::CODE),
        ("send", opcode::Send::CODE),
        ("async_cancel", opcode::AsyncCancel::CODE),
        ("timeout", opcode::Timeout::CODE),
        ("poll_add", opcode::PollAdd::CODE),
    ];
    match needed.iter().find(|(_, code)| !probe.is_supported(*code)) {
        Some((name, _)) => {
            Err(io::Error::new(io::ErrorKind::Unsupported, format!("this kernel's io_uring has no {name} operation")))
        }
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_survives_its_token() {
        for op in [
            Op::Accept,
            Op::AcceptRetry,
            Op::Stop,
            Op::Tick,
            Op::Grace,
            Op::Cancel,
            Op::Recv(0),
            Op::Recv(u32::MAX),
            Op::Send(7),
        ] {
            assert_eq!(Op::of(op.token()), Some(op));
        }
        assert_eq!(Op::of(0), None);
        assert_eq!(Op::of(u64::MAX), None);
    }
}
