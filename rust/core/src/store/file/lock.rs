//! The store's file, opened by its path and locked for one operation, as torch does it: an
//! `flock` on the whole file, shared to read and exclusive to write.
//!
//! Each operation opens the path anew, so every operation has an open file of its own: `flock`
//! then excludes threads of one process, and a forked child and its parent, exactly as it
//! excludes processes. After locking, the open file is checked to be the one the path names
//! still: a file deleted between the open and the lock is let go and the path opened again.

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::file_error;
use super::replica::FileId;
use crate::store::error::Result;

/// Who else may hold the lock at the same time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    /// Other readers: for operations that only read.
    Shared,
    /// No one: for operations that write.
    Exclusive,
}

/// The file, open and locked; unlocked and closed when dropped.
pub(super) struct Locked<'a> {
    file: Flock<File>,
    path: &'a Path,
    pub id: FileId,
    /// The file's length when it was locked, plus what this operation appended.
    pub len: u64,
}

impl<'a> Locked<'a> {
    /// Opens the file at `path`, creating it (empty) if it is missing, and locks it exclusively.
    pub fn create(path: &'a Path) -> Result<Locked<'a>> {
        loop {
            if let Some(locked) = Self::lock(path, open_creating(path)?, Access::Exclusive)? {
                return Ok(locked);
            }
        }
    }

    /// Opens the file at `path` and locks it; `None` if there is no file there.
    pub fn existing(path: &'a Path, access: Access) -> Result<Option<Locked<'a>>> {
        loop {
            let file = match open(path, access, false) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(err) => return Err(file_error(path, format!("cannot open the file: {err}"))),
            };
            if let Some(locked) = Self::lock(path, file, access)? {
                return Ok(Some(locked));
            }
        }
    }

    /// Locks `file`; `None` if, by then, `path` no longer names it.
    fn lock(path: &'a Path, file: File, access: Access) -> Result<Option<Locked<'a>>> {
        let arg = match access {
            Access::Shared => FlockArg::LockShared,
            Access::Exclusive => FlockArg::LockExclusive,
        };
        let mut file = file;
        let file = loop {
            match Flock::lock(file, arg) {
                Ok(locked) => break locked,
                Err((back, Errno::EINTR)) => file = back,
                Err((_, errno)) => return Err(file_error(path, format!("cannot lock the file: {errno}"))),
            }
        };
        let ours = file.metadata().map_err(|err| file_error(path, format!("cannot stat the file: {err}")))?;
        match std::fs::metadata(path) {
            Ok(named) if id(&named) == id(&ours) => Ok(Some(Locked { id: id(&ours), len: ours.len(), file, path })),
            Ok(_) => Ok(None),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(file_error(path, format!("cannot stat the path: {err}"))),
        }
    }

    pub fn path(&self) -> &'a Path {
        self.path
    }

    /// The file's bytes from `from` to the end.
    pub fn read_from(&self, from: u64) -> Result<Vec<u8>> {
        let unread = usize::try_from(self.len - from.min(self.len))
            .map_err(|_| file_error(self.path, "the file is too large to read into memory"))?;
        let mut bytes = vec![0; unread];
        self.file.read_exact_at(&mut bytes, from).map_err(|err| self.error("cannot read the file", err))?;
        Ok(bytes)
    }

    /// Writes `bytes` at `at`, first cutting off whatever the file holds from there on.
    pub fn write_at(&mut self, at: u64, bytes: &[u8]) -> Result<()> {
        if self.len > at {
            self.file.set_len(at).map_err(|err| self.error("cannot cut off a torn entry", err))?;
            self.len = at;
        }
        self.file.write_all_at(bytes, at).map_err(|err| self.error("cannot write the file", err))?;
        self.len = at + bytes.len() as u64;
        Ok(())
    }

    /// Deletes the file; it stays locked (and open) until dropped.
    pub fn remove(&self) -> Result<()> {
        std::fs::remove_file(self.path).map_err(|err| self.error("cannot delete the finished store's file", err))
    }

    fn error(&self, what: &str, err: io::Error) -> crate::store::StoreError {
        file_error(self.path, format!("{what}: {err}"))
    }
}

fn id(metadata: &Metadata) -> FileId {
    (metadata.dev(), metadata.ino())
}

fn open(path: &Path, access: Access, create: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(access == Access::Exclusive);
    if create {
        options.create(true).truncate(false).mode(0o644);
    }
    options.open(path)
}

/// Opens the file to create it, naming a missing directory in the error.
fn open_creating(path: &Path) -> Result<File> {
    open(path, Access::Exclusive, true).map_err(|err| {
        let parent = path.parent().filter(|dir| !dir.as_os_str().is_empty());
        let reason = match parent {
            Some(dir) if err.kind() == io::ErrorKind::NotFound && !dir.is_dir() => {
                format!("cannot create the file: directory {} does not exist", dir.display())
            }
            _ => format!("cannot open or create the file: {err}"),
        };
        file_error(path, reason)
    })
}
