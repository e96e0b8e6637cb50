//! Shared memory between the ranks of one host, mapped and owned by Rust.
//!
//! A [`SharedMemory`] is created by one process ([`Backing::Memfd`]: an anonymous memfd, or
//! [`Backing::File`]: a file in a tmpfs directory, space reserved up front) and attached by the
//! others from its [`Handle`] (a memfd is opened through `/proc/<creator>/fd/<n>`). Once all
//! have attached, the creator drops the name ([`SharedMemory::release_name`]) and the memory is
//! freed by the kernel when the last process that maps it exits, however it exits.
//!
//! Words inside are reached by byte offsets, checked against the mapping's length and the
//! word's alignment ([`check_range`]), never by addresses.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64};
use std::sync::{Mutex, PoisonError};

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

/// Sizes are rounded up to whole pages.
pub const PAGE: usize = 4096;

/// Prefix of the segment files in a tmpfs directory; the creator's pid follows, so a stale
/// file (its creator crashed before dropping the name) can be recognised and removed.
pub const FILE_PREFIX: &str = "elastix-cc-";

/// Whether other processes of this user can open this process's memfds through
/// `/proc/<pid>/fd/<n>`: not once it is undumpable (it loaded the job secret), unless they are
/// privileged (root is). Such a process shares its segments as files instead.
pub fn memfd_attachable() -> bool {
    // SAFETY: prctl(PR_GET_DUMPABLE) takes plain integers and touches no memory of ours.
    let dumpable = unsafe { nix::libc::prctl(nix::libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
    dumpable == 1
}

/// Where a new segment's memory comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// An anonymous memfd: no name anywhere.
    Memfd,
    /// A file in this directory (a tmpfs such as /dev/shm), unlinked by `release_name`.
    File(PathBuf),
}

/// What another process needs to attach (serialised as JSON through the store).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Handle {
    Memfd { pid: u32, fd: i32, size: usize },
    File { path: PathBuf, size: usize },
}

impl Handle {
    pub fn size(&self) -> usize {
        match self {
            Handle::Memfd { size, .. } | Handle::File { size, .. } => *size,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> io::Result<Handle> {
        serde_json::from_str(text)
            .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, format!("bad segment handle {text:?}: {err}")))
    }
}

/// Why an offset was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OffsetError {
    #[error("{size} bytes at offset {offset} do not fit in the {len}-byte segment")]
    OutOfBounds { offset: usize, size: usize, len: usize },
    #[error("offset {offset} is not a multiple of {align}")]
    Misaligned { offset: usize, align: usize },
}

/// Checks that `size` bytes at `offset` lie inside `len` bytes and that `offset` is a multiple
/// of `align` (the mapping starts on a page, so that makes the address aligned too).
pub fn check_range(len: usize, offset: usize, size: usize, align: usize) -> Result<(), OffsetError> {
    match offset.checked_add(size) {
        Some(end) if end <= len => {}
        _ => return Err(OffsetError::OutOfBounds { offset, size, len }),
    }
    if align > 1 && offset % align != 0 {
        return Err(OffsetError::Misaligned { offset, align });
    }
    Ok(())
}

/// What keeps a segment reachable by name until every rank attached.
enum Name {
    Fd(#[allow(dead_code)] OwnedFd),
    Path(PathBuf),
}

/// A shared mapping of a memfd or a tmpfs file; unmapped when dropped.
pub struct SharedMemory {
    map: MmapRaw,
    handle: Handle,
    name: Mutex<Option<Name>>,
}

fn page_round(size: usize) -> io::Result<usize> {
    let pages = size.div_ceil(PAGE).max(1);
    pages
        .checked_mul(PAGE)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("segment size {size} is too large")))
}

/// A shared, read-write mapping of the first `size` bytes of `file` (at least that long).
fn map(file: &File, size: usize) -> io::Result<MmapRaw> {
    MmapOptions::new().len(size).map_raw(file)
}

impl SharedMemory {
    /// Creates `size` bytes (rounded up to pages) of zeroed shared memory.
    pub fn create(size: usize, backing: &Backing) -> io::Result<SharedMemory> {
        let size = page_round(size)?;
        match backing {
            Backing::Memfd => {
                let fd = memfd_create(c"elastix-collectives", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
                let file = File::from(fd);
                file.set_len(size as u64)?;
                // Nobody (another process of this user included) can shrink it under our
                // mappings, which would turn accesses into SIGBUS.
                fcntl(&file, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW))?;
                let map = map(&file, size)?;
                let handle = Handle::Memfd { pid: std::process::id(), fd: file_fd(&file), size };
                Ok(SharedMemory { map, handle, name: Mutex::new(Some(Name::Fd(file.into()))) })
            }
            Backing::File(dir) => {
                let path = dir.join(format!("{FILE_PREFIX}{}-{:016x}", std::process::id(), fastrand::u64(..)));
                let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
                let made = reserve(&file, size, dir).and_then(|()| map(&file, size));
                match made {
                    Ok(map) => Ok(SharedMemory {
                        map,
                        handle: Handle::File { path: path.clone(), size },
                        name: Mutex::new(Some(Name::Path(path))),
                    }),
                    Err(err) => {
                        let _ = std::fs::remove_file(&path);
                        Err(err)
                    }
                }
            }
        }
    }

    /// Maps the segment another process created.
    pub fn attach(handle: &Handle) -> io::Result<SharedMemory> {
        let path = match handle {
            Handle::Memfd { pid, fd, .. } => PathBuf::from(format!("/proc/{pid}/fd/{fd}")),
            Handle::File { path, .. } => path.clone(),
        };
        let file = OpenOptions::new().read(true).write(true).custom_flags(nix::libc::O_CLOEXEC).open(&path).map_err(
            |err| io::Error::new(err.kind(), format!("cannot open shared memory {}: {err}", path.display())),
        )?;
        let size = handle.size();
        let actual = file.metadata()?.len();
        if actual < size as u64 || size % PAGE != 0 || size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared memory {} has {actual} bytes, not the {size} its handle says", path.display()),
            ));
        }
        let map = map(&file, size)?;
        Ok(SharedMemory { map, handle: handle.clone(), name: Mutex::new(None) })
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The start of the mapping, valid for `len()` bytes while `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Drops what lets other processes attach (the creator's memfd, or the file's name).
    pub fn release_name(&self) -> io::Result<()> {
        let name = self.name.lock().unwrap_or_else(PoisonError::into_inner).take();
        match name {
            Some(Name::Path(path)) => match std::fs::remove_file(path) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            },
            Some(Name::Fd(_)) | None => Ok(()),
        }
    }

    /// Checks that `size` bytes at `offset` are inside and aligned to `align`.
    pub fn check(&self, offset: usize, size: usize, align: usize) -> Result<(), OffsetError> {
        check_range(self.len(), offset, size, align)
    }

    /// The u64 at `offset` (8-aligned).
    pub fn u64_at(&self, offset: usize) -> Result<&AtomicU64, OffsetError> {
        self.check(offset, 8, 8)?;
        // SAFETY: the 8 bytes are inside the mapping, which lives as long as `&self`, and
        // aligned (page-aligned base, 8-aligned offset). Every bit pattern is a valid u64, so
        // whatever other processes (or views of this one) write there only changes the value
        // an atomic access sees; the protocol's counters are written atomically everywhere.
        Ok(unsafe { &*(self.as_ptr().add(offset) as *const AtomicU64) })
    }

    /// The i64 at `offset` (8-aligned).
    pub fn i64_at(&self, offset: usize) -> Result<&AtomicI64, OffsetError> {
        self.check(offset, 8, 8)?;
        // SAFETY: as in `u64_at`.
        Ok(unsafe { &*(self.as_ptr().add(offset) as *const AtomicI64) })
    }

    /// The u32 at `offset` (4-aligned).
    pub fn u32_at(&self, offset: usize) -> Result<&AtomicU32, OffsetError> {
        self.check(offset, 4, 4)?;
        // SAFETY: as in `u64_at`, for 4 bytes at a 4-aligned offset.
        Ok(unsafe { &*(self.as_ptr().add(offset) as *const AtomicU32) })
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // A creator that goes before every rank attached leaves no file behind.
        let _ = self.release_name();
    }
}

fn file_fd(file: &File) -> i32 {
    use std::os::fd::AsRawFd;
    file.as_raw_fd()
}

/// Reserves the space now, so that a full tmpfs is an error here and not a SIGBUS later.
fn reserve(file: &File, size: usize, dir: &Path) -> io::Result<()> {
    let len = i64::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    nix::fcntl::posix_fallocate(file, 0, len).map_err(|errno| {
        let err = io::Error::from(errno);
        io::Error::new(err.kind(), format!("cannot reserve {size} bytes in {}: {err}", dir.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn ranges_are_checked_for_bounds_alignment_and_overflow() {
        assert_eq!(check_range(4096, 0, 8, 8), Ok(()));
        assert_eq!(check_range(4096, 4088, 8, 8), Ok(()));
        assert_eq!(check_range(4096, 4089, 8, 1), Err(OffsetError::OutOfBounds { offset: 4089, size: 8, len: 4096 }));
        assert_eq!(check_range(4096, 4096, 8, 8), Err(OffsetError::OutOfBounds { offset: 4096, size: 8, len: 4096 }));
        assert_eq!(check_range(4096, 12, 8, 8), Err(OffsetError::Misaligned { offset: 12, align: 8 }));
        assert_eq!(check_range(4096, 12, 4, 4), Ok(()));
        assert!(matches!(check_range(4096, usize::MAX - 3, 8, 8), Err(OffsetError::OutOfBounds { .. })));
        assert_eq!(check_range(4096, 4096, 0, 1), Ok(()));
    }

    #[test]
    fn words_are_reached_only_by_checked_offsets() {
        let mem = SharedMemory::create(100, &Backing::Memfd).unwrap();
        assert_eq!(mem.len(), PAGE);
        mem.u64_at(8).unwrap().store(7, Ordering::SeqCst);
        assert_eq!(mem.u64_at(8).unwrap().load(Ordering::SeqCst), 7);
        assert_eq!(mem.u32_at(8).unwrap().load(Ordering::SeqCst), 7, "little-endian low half");
        assert!(mem.u64_at(8).is_ok() && mem.i64_at(PAGE - 8).is_ok());
        assert!(matches!(mem.u64_at(4), Err(OffsetError::Misaligned { .. })));
        assert!(matches!(mem.u64_at(PAGE), Err(OffsetError::OutOfBounds { .. })));
        assert!(matches!(mem.u32_at(usize::MAX), Err(OffsetError::OutOfBounds { .. })));
    }

    #[test]
    fn a_memfd_is_shared_with_whoever_attaches_and_cannot_shrink() {
        let mem = SharedMemory::create(2 * PAGE, &Backing::Memfd).unwrap();
        let peer = SharedMemory::attach(&Handle::from_json(&mem.handle().to_json()).unwrap()).unwrap();
        mem.u64_at(64).unwrap().store(42, Ordering::SeqCst);
        assert_eq!(peer.u64_at(64).unwrap().load(Ordering::SeqCst), 42);
        let Handle::Memfd { pid, fd, .. } = mem.handle().clone() else { panic!("memfd") };
        let file = OpenOptions::new().write(true).open(format!("/proc/{pid}/fd/{fd}")).unwrap();
        assert!(file.set_len(0).is_err(), "sealed against shrinking");
        mem.release_name().unwrap();
    }

    #[test]
    fn a_file_segment_is_unlinked_when_released_and_a_short_file_is_refused() {
        let dir = std::env::temp_dir();
        let mem = SharedMemory::create(PAGE, &Backing::File(dir.clone())).unwrap();
        let Handle::File { path, size } = mem.handle().clone() else { panic!("file") };
        assert!(path.starts_with(&dir) && path.file_name().unwrap().to_string_lossy().starts_with(FILE_PREFIX));
        let too_big = Handle::File { path: path.clone(), size: size * 2 };
        assert_eq!(SharedMemory::attach(&too_big).err().unwrap().kind(), io::ErrorKind::InvalidData);
        let peer = SharedMemory::attach(mem.handle()).unwrap();
        mem.release_name().unwrap();
        assert!(!path.exists());
        peer.u64_at(0).unwrap().store(1, Ordering::SeqCst);
        assert_eq!(mem.u64_at(0).unwrap().load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_dropped_creator_leaves_no_file() {
        let mem = SharedMemory::create(PAGE, &Backing::File(std::env::temp_dir())).unwrap();
        let Handle::File { path, .. } = mem.handle().clone() else { panic!("file") };
        drop(mem);
        assert!(!path.exists());
    }
}
