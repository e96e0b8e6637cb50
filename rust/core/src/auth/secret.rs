//! Where the job secret comes from, and the checks it must pass. Whoever needs it is given it
//! explicitly: there is no process-wide default.
//!
//! The secret is read from a file that only its owner may read (`ELASTIX_AUTH_TOKEN_FILE`,
//! `--rdzv-conf auth_token_file`, `elastix-store --auth-token-file`): a file that its group or
//! others may read is refused, as ssh refuses such keys. `ELASTIX_AUTH_TOKEN` holds the secret
//! itself and is accepted with a warning: environment variables leak (to child processes,
//! `/proc/<pid>/environ`, crash reports). The secret is never logged or printed: its `Debug`
//! names where it came from.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

/// Names the file that holds the job secret.
pub const TOKEN_FILE_VAR: &str = "ELASTIX_AUTH_TOKEN_FILE";
/// Holds the job secret itself (accepted, with a warning).
pub const TOKEN_VAR: &str = "ELASTIX_AUTH_TOKEN";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SecretError(String);

/// Where a secret came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    Environment,
    /// Given by the program (tests, an embedding).
    Given,
}

#[derive(Clone)]
pub struct Secret {
    bytes: Arc<[u8]>,
    source: Source,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(from {:?})", self.source)
    }
}

impl Eq for Secret {}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(self.bytes.ct_eq(&other.bytes))
    }
}

/// Secrets shorter than this are refused: a guess per microsecond must not find one.
pub const MIN_LEN: usize = 16;

impl Secret {
    /// Reads the secret from `path`, checking the file as ssh checks keys: not a symbolic link,
    /// a regular file owned by this user (or root) that nobody else may read or write, and
    /// every directory above it ([`check_directories`]) owned by this user or root and
    /// writable by nobody else. The file is opened once and the opened file is what is checked
    /// and read. Trailing whitespace is dropped, and the secret must be strong enough
    /// ([`check_strength`]).
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let shown = path.display();
        let fail = |why: String| SecretError(format!("job secret file {shown}: {why}"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|err| match err.raw_os_error() {
                Some(libc::ELOOP) => fail("it is a symbolic link; name the file itself".into()),
                _ => fail(format!("cannot read it: {err}")),
            })?;
        let metadata = file.metadata().map_err(|err| fail(format!("cannot read it: {err}")))?;
        if !metadata.is_file() {
            return Err(fail("not a regular file".into()));
        }
        // SAFETY: geteuid(2) takes nothing and cannot fail.
        let me = unsafe { libc::geteuid() };
        if metadata.uid() != me && metadata.uid() != 0 {
            return Err(fail(format!(
                "it belongs to user {} and this process runs as user {me}; the job secret must be your own file",
                metadata.uid()
            )));
        }
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(fail(format!(
                "it may be read or written by its group or others (mode {mode:03o}); chmod 600 it, as ssh requires \
                 of keys"
            )));
        }
        check_directories(path, me).map_err(fail)?;
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut bytes).map_err(|err| fail(err.to_string()))?;
        Secret::new(bytes, Source::File(path.to_owned())).map_err(|SecretError(why)| fail(why))
    }

    /// A secret given by the program (tests, an embedding): not checked for strength.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Secret, SecretError> {
        let bytes = trimmed(bytes.into());
        if bytes.is_empty() {
            return Err(SecretError("the job secret is empty".into()));
        }
        Ok(Secret { bytes: bytes.into(), source: Source::Given })
    }

    /// A secret a user gave (a file, the environment): checked, and from now on this process
    /// may not be dumped (no core file or debugger shows the secret).
    fn new(bytes: Vec<u8>, source: Source) -> Result<Secret, SecretError> {
        let bytes = trimmed(bytes);
        check_strength(&bytes)?;
        forbid_dumps();
        Ok(Secret { bytes: bytes.into(), source })
    }

    /// The secret the environment names: `ELASTIX_AUTH_TOKEN_FILE`, else `ELASTIX_AUTH_TOKEN`
    /// (with a warning), else none.
    pub fn from_env() -> Result<Option<Secret>, SecretError> {
        if let Some(path) = std::env::var_os(TOKEN_FILE_VAR) {
            if path.is_empty() {
                return Err(SecretError(format!(
                    "{TOKEN_FILE_VAR} is set but empty; name the secret file, or unset it"
                )));
            }
            return Secret::from_file(Path::new(&path)).map(Some);
        }
        match std::env::var_os(TOKEN_VAR) {
            Some(value) if value.is_empty() => {
                Err(SecretError(format!("{TOKEN_VAR} is set but empty; set a secret, or unset it")))
            }
            Some(value) => {
                static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        "using the job secret in {TOKEN_VAR}: environment variables leak (to child processes, \
                         /proc/<pid>/environ); prefer {TOKEN_FILE_VAR}=<a file only you can read>"
                    );
                }
                Secret::new(value.into_encoded_bytes(), Source::Environment)
                    .map(Some)
                    .map_err(|SecretError(why)| SecretError(format!("{TOKEN_VAR}: {why}")))
            }
            None => Ok(None),
        }
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The file it came from, which children that need the secret may be pointed at.
    pub fn file(&self) -> Option<&Path> {
        match &self.source {
            Source::File(path) => Some(path),
            _ => None,
        }
    }

    pub(crate) fn key(&self) -> &[u8] {
        &self.bytes
    }
}

/// Every directory above a secret's file, symbolic links resolved, as ssh checks a key's: owned
/// by this user (`me`) or root, and writable by nobody else (a sticky directory such as /tmp
/// above the file's own excepted, where nobody may replace what is not theirs). Anyone who may
/// write to one of them could have put the file there, or may swap it or a directory on the
/// way for their own.
fn check_directories(path: &Path, me: libc::uid_t) -> Result<(), String> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let real =
        std::fs::canonicalize(dir).map_err(|err| format!("cannot resolve its directory {}: {err}", dir.display()))?;
    // SAFETY: getegid(2) takes nothing and cannot fail.
    let my_group = unsafe { libc::getegid() };
    for each in real.ancestors() {
        let metadata = std::fs::metadata(each).map_err(|err| format!("cannot check {}: {err}", each.display()))?;
        let shown = if each == real && real != dir {
            format!("{} ({})", each.display(), dir.display())
        } else {
            each.display().to_string()
        };
        if metadata.uid() != me && metadata.uid() != 0 {
            return Err(format!(
                "it is under {shown}, a directory that belongs to user {} (this process runs as user {me}): they could \
                 swap it; keep it in a directory of your own",
                metadata.uid()
            ));
        }
        let mode = metadata.permissions().mode();
        // above the file's own directory, a sticky one (such as /tmp) lets nobody replace
        // what is not theirs; the file's own directory must be writable by nobody else at all
        let sticky = mode & 0o1000 != 0 && each != real;
        // a group of its own (user private groups) is this user alone
        let by_group = mode & 0o020 != 0 && metadata.gid() != my_group;
        if !sticky && (mode & 0o002 != 0 || by_group) {
            return Err(format!(
                "it is under {shown}, a directory {} may write to (mode {:03o}): anyone who can could have put it \
                 there or may replace it; keep it in a directory only you may write to",
                if mode & 0o002 != 0 { "everyone" } else { "its group" },
                mode & 0o777
            ));
        }
    }
    Ok(())
}

fn trimmed(mut bytes: Vec<u8>) -> Vec<u8> {
    while bytes.last().is_some_and(u8::is_ascii_whitespace) {
        bytes.pop();
    }
    bytes
}

/// Refuses secrets that are visibly guessable: shorter than [`MIN_LEN`] bytes, made of fewer
/// than 8 different bytes, or one short piece repeated. (A stranger cannot test guesses
/// offline against elastix's handshake, but a weak secret falls to guesses online too, and it
/// is usually reused elsewhere.)
pub fn check_strength(bytes: &[u8]) -> Result<(), SecretError> {
    const ADVICE: &str = "`elastix secret FILE` writes a strong one (or `openssl rand -hex 32 > FILE`)";
    if bytes.is_empty() {
        return Err(SecretError("the job secret is empty".into()));
    }
    if bytes.len() < MIN_LEN {
        return Err(SecretError(format!(
            "the job secret is {} bytes long; at least {MIN_LEN} random bytes are needed: {ADVICE}",
            bytes.len()
        )));
    }
    let distinct = bytes.iter().collect::<std::collections::HashSet<_>>().len();
    let repeats = (1..=bytes.len() / 2)
        .any(|period| bytes.len() % period == 0 && bytes[period..] == bytes[..bytes.len() - period]);
    if distinct < 8 || repeats {
        return Err(SecretError(format!(
            "the job secret is easy to guess ({}); use random bytes: {ADVICE}",
            if repeats { "one piece repeated" } else { "fewer than 8 different characters" }
        )));
    }
    // words, keyboard walks, sequences, dates: zxcvbn's estimate of the guesses needed, over
    // the first bytes (a long random secret is strong on its first ones already)
    if let Ok(text) = std::str::from_utf8(&bytes[..bytes.len().min(ESTIMATED_BYTES)]) {
        let guesses = zxcvbn::zxcvbn(text, &[]).guesses_log10();
        if guesses < MIN_GUESSES_LOG10 {
            return Err(SecretError(format!(
                "the job secret is easy to guess (about 10^{guesses:.0} guesses find it: words, sequences or \
                 keyboard patterns); use random bytes: {ADVICE}"
            )));
        }
    }
    Ok(())
}

/// The fewest guesses (log10) a secret must take, as zxcvbn estimates them: at a million
/// online guesses a second, 10^12 take eleven days.
const MIN_GUESSES_LOG10: f64 = 12.0;
/// Bytes of a secret whose guesses are estimated (the estimate grows with the length).
const ESTIMATED_BYTES: usize = 128;

/// Makes this process undumpable: no core file, and no other process of this user may attach
/// a debugger or read its memory or environment, once it holds the job secret.
fn forbid_dumps() {
    // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers and touches no memory of ours.
    let done = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if done != 0 {
        tracing::debug!("cannot make this process undumpable: {}", std::io::Error::last_os_error());
    }
}

/// Writes a new strong secret (32 random bytes, in hex) to `path`, a file that must not exist
/// yet, readable by its owner only; refuses what [`Secret::from_file`] would refuse.
pub fn write_new(path: &Path) -> Result<(), SecretError> {
    let shown = path.display();
    // refused before anything is written there
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    let me = unsafe { libc::geteuid() };
    check_directories(path, me).map_err(|why| SecretError(format!("job secret file {shown}: {why}")))?;
    let mut bytes = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
    let text: String = bytes.iter().map(|byte| format!("{byte:02x}")).chain(["\n".to_owned()]).collect();
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|err| match err.kind() {
            std::io::ErrorKind::AlreadyExists => {
                SecretError(format!("{shown} exists already; elastix never overwrites a secret (remove it first)"))
            }
            _ => SecretError(format!("cannot write {shown}: {err}")),
        })?;
    let written = std::io::Write::write_all(&mut file, text.as_bytes()).and_then(|()| file.sync_all());
    drop(file);
    let checked = written
        .map_err(|err| SecretError(format!("cannot write {shown}: {err}")))
        .and_then(|()| Secret::from_file(path).map(drop));
    if checked.is_err() {
        let _ = std::fs::remove_file(path);
    }
    checked
}

/// Two sources of the job secret must agree.
pub fn same_secret(one: &Secret, other: &Secret) -> Result<(), SecretError> {
    if one == other {
        return Ok(());
    }
    Err(SecretError(format!(
        "two different job secrets are given: {:?} and {:?}; give one",
        one.source(),
        other.source()
    )))
}

/// The file children that need `secret` are pointed at (`ELASTIX_AUTH_TOKEN_FILE`): the
/// secret's own file, or, for a secret from `ELASTIX_AUTH_TOKEN`, its private copy
/// ([`private_copy`]).
pub fn children_file(secret: &Secret) -> Result<PathBuf, SecretError> {
    match secret.file() {
        Some(path) => Ok(path.to_owned()),
        None => Ok(private_copy(secret)?.join(PRIVATE_COPY_NAME)),
    }
}

/// The private copy's file name, in its directory.
pub const PRIVATE_COPY_NAME: &str = "secret";

/// The directory (of mode 0700, under the temporary directory) holding a copy of `secret`
/// that children can be pointed at, for a secret without a file of its own (from
/// `ELASTIX_AUTH_TOKEN`); written once per process, removed by [`remove_children_file`], or by
/// the cleanup watchdog if this process is killed.
pub fn private_copy(secret: &Secret) -> Result<PathBuf, SecretError> {
    let mut written = CHILDREN_DIR.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(dir) = written.as_ref() {
        return Ok(dir.clone());
    }
    let dir = std::env::temp_dir().join(format!("elastix-secret-{}-{:016x}", std::process::id(), fastrand::u64(..)));
    let fail = |err: std::io::Error| {
        SecretError(format!("cannot write the job secret for the workers to {}: {err}", dir.display()))
    };
    std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(fail)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join(PRIVATE_COPY_NAME))
        .map_err(fail)?;
    std::io::Write::write_all(&mut file, secret.key()).map_err(fail)?;
    *written = Some(dir.clone());
    Ok(dir)
}

/// The directory [`private_copy`] wrote, if it wrote one.
pub fn private_copy_dir() -> Option<PathBuf> {
    CHILDREN_DIR.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// Removes the private copy [`private_copy`] wrote, if it wrote one.
pub fn remove_children_file() {
    if let Some(dir) = CHILDREN_DIR.lock().unwrap_or_else(PoisonError::into_inner).take() {
        let _ = std::fs::remove_file(dir.join(PRIVATE_COPY_NAME));
        let _ = std::fs::remove_dir(dir);
    }
}

static CHILDREN_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const STRONG: &[u8] = b"9f2c41d07be85a36e1c4";

    fn private_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("elastix-secret-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        dir
    }

    fn file(dir: &Path, name: &str, contents: &[u8], mode: u32) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn refusal(path: &Path) -> String {
        Secret::from_file(path).unwrap_err().to_string()
    }

    #[test]
    fn a_file_only_its_owner_can_read_holds_the_secret_and_nobody_else_may() {
        let dir = private_dir("modes");
        let good = file(&dir, "good", &[STRONG, b"\n"].concat(), 0o600);
        let secret = Secret::from_file(&good).unwrap();
        assert_eq!(secret.key(), STRONG);
        assert!(!format!("{secret:?}").contains("9f2c"), "Debug never shows the secret");
        let open = file(&dir, "open", STRONG, 0o644);
        let err = refusal(&open);
        assert!(err.contains("chmod 600") && err.contains("644") && !err.contains("9f2c"), "{err}");
        assert!(refusal(&file(&dir, "blank", b" \n", 0o600)).contains("empty"));
        assert!(refusal(&dir.join("missing")).contains("cannot read it"));
        assert!(refusal(&dir).contains("not a regular file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn links_other_owners_and_shared_directories_are_refused() {
        let dir = private_dir("places");
        let good = file(&dir, "good", STRONG, 0o600);
        let link = dir.join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        assert!(refusal(&link).contains("symbolic link"), "{}", refusal(&link));
        let other = file(&dir, "other", STRONG, 0o600);
        std::os::unix::fs::chown(&other, Some(12345), None).unwrap();
        let err = refusal(&other);
        assert!(err.contains("belongs to user 12345"), "{err}");
        let shared = dir.join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let err = refusal(&file(&shared, "secret", STRONG, 0o600));
        assert!(err.contains("everyone may write to"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_directory_above_the_file_is_checked_with_links_resolved() {
        let dir = private_dir("above");
        // a private directory inside one that others may write to (not sticky): anyone could swap it
        let open = dir.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let inner = open.join("inner");
        std::fs::DirBuilder::new().mode(0o700).create(&inner).unwrap();
        let err = refusal(&file(&inner, "secret", STRONG, 0o600));
        assert!(err.contains("everyone may write to") && err.contains("/open"), "{err}");
        // reached through a symbolic link: the real directories are the ones checked
        let link = dir.join("link");
        std::os::unix::fs::symlink(&inner, &link).unwrap();
        let err = refusal(&link.join("secret"));
        assert!(err.contains("everyone may write to") && err.contains("/open"), "{err}");
        // a directory of another user's, above the file
        let theirs = dir.join("theirs");
        std::fs::DirBuilder::new().mode(0o755).create(&theirs).unwrap();
        let mine = theirs.join("mine");
        std::fs::DirBuilder::new().mode(0o700).create(&mine).unwrap();
        let secret = file(&mine, "secret", STRONG, 0o600);
        std::os::unix::fs::chown(&theirs, Some(12345), None).unwrap();
        let err = refusal(&secret);
        assert!(err.contains("belongs to user 12345"), "{err}");
        // a sticky directory above the file's own (as /tmp is) is fine
        let sticky = dir.join("sticky");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let private = sticky.join("private");
        std::fs::DirBuilder::new().mode(0o700).create(&private).unwrap();
        Secret::from_file(&file(&private, "secret", STRONG, 0o600)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn weak_secrets_are_refused_with_the_way_to_a_strong_one() {
        let weak: [&[u8]; 7] = [
            b"summer2024",
            b"aaaaaaaaaaaaaaaaaaaa",
            b"summer2024summer2024",
            b"abababababababababab",
            // long enough and varied, but words, sequences and keyboard walks
            b"password12345678",
            b"qwertyuiopasdfgh",
            b"0123456789abcdef0123",
        ];
        for weak in weak {
            let err = check_strength(weak).unwrap_err().to_string();
            assert!(err.contains("elastix secret"), "{err}");
        }
        check_strength(STRONG).unwrap();
        check_strength(b"correct horse battery staple").unwrap();
    }

    #[test]
    fn a_new_secret_is_strong_private_and_never_overwrites() {
        let dir = private_dir("new");
        let path = dir.join("job.secret");
        write_new(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let secret = Secret::from_file(&path).unwrap();
        assert_eq!(secret.key().len(), 64);
        assert!(write_new(&path).unwrap_err().to_string().contains("exists already"));
        let shared = dir.join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let err = write_new(&shared.join("job.secret")).unwrap_err().to_string();
        assert!(err.contains("everyone may write to") && !shared.join("job.secret").exists(), "{err}");
        assert_eq!(Secret::from_file(&path).unwrap(), secret, "untouched");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
