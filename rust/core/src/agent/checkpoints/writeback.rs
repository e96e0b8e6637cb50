//! Writing a large file without a burst of dirty pages: a persisted step is hundreds of MB per
//! rank, and left to the page cache it sits dirty until the final fsync writes it all at once.
//! Past the kernel's dirty limits every writer on the machine is throttled meanwhile (a training
//! loop appending to its log stalled for 1.6 s at a time here), and the fsync's journal commit
//! holds up other files' syncs. So the writeback of each chunk starts as soon as it is written,
//! and the writer waits for the chunk two behind it: at most two chunks of a file are dirty at
//! once, and the final fsync finds nothing left to write (RocksDB's `bytes_per_sync` does the
//! same). Pages written are then dropped from the cache: a checkpoint on disk is read back only
//! after a fault, and it would evict what the machine is using.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Starts the writeback of `file`'s bytes `[offset, offset + len)` without waiting for it.
pub fn start(file: &File, offset: u64, len: u64) -> io::Result<()> {
    sync_range(file, offset, len, libc::SYNC_FILE_RANGE_WRITE)
}

/// Waits until `file`'s bytes `[offset, offset + len)` are written (starting what is not yet),
/// then drops them from the page cache.
pub fn finish(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let all = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    sync_range(file, offset, len, all)?;
    // advice only: a kernel that ignores it keeps the pages cached, which is no error
    let _ = nix::fcntl::posix_fadvise(
        file,
        to_off(offset)?,
        to_off(len)?,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    );
    Ok(())
}

fn sync_range(file: &File, offset: u64, len: u64, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: sync_file_range only reads its arguments; the descriptor is borrowed from `file`,
    // which stays open for the call. It touches no memory of this process.
    let result = unsafe { libc::sync_file_range(file.as_raw_fd(), to_off(offset)?, to_off(len)?, flags) };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn to_off(value: u64) -> io::Result<libc::off64_t> {
    libc::off64_t::try_from(value).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past 2^63"))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};

    use super::*;

    #[test]
    fn chunks_written_back_in_turn_read_back_whole() {
        let mut file = tempfile_in_target();
        let chunk = vec![7u8; 1 << 16];
        for index in 0..4u64 {
            file.write_all(&chunk).unwrap();
            start(&file, index * chunk.len() as u64, chunk.len() as u64).unwrap();
            if index >= 2 {
                finish(&file, (index - 2) * chunk.len() as u64, chunk.len() as u64).unwrap();
            }
        }
        finish(&file, 0, 4 * chunk.len() as u64).unwrap();
        file.rewind().unwrap();
        let mut back = Vec::new();
        file.read_to_end(&mut back).unwrap();
        assert_eq!(back.len(), 4 * chunk.len());
        assert!(back.iter().all(|byte| *byte == 7));
    }

    #[test]
    fn a_descriptor_that_cannot_be_synced_is_an_error_not_a_panic() {
        let (reader, _writer) = std::os::unix::net::UnixStream::pair().unwrap();
        let file = File::from(std::os::fd::OwnedFd::from(reader));
        assert!(start(&file, 0, 10).is_err());
    }

    fn tempfile_in_target() -> File {
        let path = std::env::temp_dir().join(format!("elastix-writeback-{}", std::process::id()));
        let file = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
