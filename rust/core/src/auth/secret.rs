//! Where the job secret comes from, and the one this process uses.
//!
//! The secret is read from a file that only its owner may read (`ELASTIX_AUTH_TOKEN_FILE`,
//! `--rdzv-conf auth_token_file`, `elastix-store --auth-token-file`): a file that its group or
//! others may read is refused, as ssh refuses such keys. `ELASTIX_AUTH_TOKEN` holds the secret
//! itself and is accepted with a warning: environment variables leak (to child processes,
//! `/proc/<pid>/environ`, crash reports). The secret is never logged or printed: its `Debug`
//! names where it came from.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
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

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(self.bytes.ct_eq(&other.bytes))
    }
}

impl Secret {
    /// Reads the secret from `path`: a regular file that only its owner may read or write,
    /// holding at least one byte besides trailing whitespace (which is dropped).
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let shown = path.display();
        let metadata = std::fs::metadata(path)
            .map_err(|err| SecretError(format!("job secret file {shown}: cannot read it: {err}")))?;
        if !metadata.is_file() {
            return Err(SecretError(format!("job secret file {shown}: not a regular file")));
        }
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError(format!(
                "job secret file {shown} may be read or written by its group or others (mode {mode:03o}); \
                 chmod 600 it, as ssh requires of keys"
            )));
        }
        let bytes = std::fs::read(path).map_err(|err| SecretError(format!("job secret file {shown}: {err}")))?;
        Secret::new(bytes, Source::File(path.to_owned()))
            .map_err(|SecretError(why)| SecretError(format!("job secret file {shown}: {why}")))
    }

    /// A secret given by the program.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Secret, SecretError> {
        Secret::new(bytes.into(), Source::Given)
    }

    fn new(mut bytes: Vec<u8>, source: Source) -> Result<Secret, SecretError> {
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        if bytes.is_empty() {
            return Err(SecretError("the job secret is empty".into()));
        }
        Ok(Secret { bytes: bytes.into(), source })
    }

    /// The secret the environment names: `ELASTIX_AUTH_TOKEN_FILE`, else `ELASTIX_AUTH_TOKEN`
    /// (with a warning), else none.
    pub fn from_env() -> Result<Option<Secret>, SecretError> {
        if let Some(path) = std::env::var_os(TOKEN_FILE_VAR).filter(|path| !path.is_empty()) {
            return Secret::from_file(Path::new(&path)).map(Some);
        }
        match std::env::var_os(TOKEN_VAR).filter(|value| !value.is_empty()) {
            Some(value) => {
                static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        "using the job secret in {TOKEN_VAR}: environment variables leak (to child processes, \
                         /proc/<pid>/environ); prefer {TOKEN_FILE_VAR}=<a file only you can read>"
                    );
                }
                Secret::new(value.into_encoded_bytes(), Source::Environment).map(Some)
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

/// The secret this process uses: `None` until first asked for; then what the environment
/// names, unless [`use_secret`] chose one first.
static PROCESS: Mutex<Option<Result<Option<Secret>, SecretError>>> = Mutex::new(None);

/// The job secret this process's servers and clients use by default (read from the
/// environment on first use; an unusable secret file is an error every time it is asked for).
pub fn process_secret() -> Result<Option<Secret>, SecretError> {
    let mut process = PROCESS.lock().unwrap_or_else(PoisonError::into_inner);
    process.get_or_insert_with(Secret::from_env).clone()
}

/// Makes `secret` this process's: it must agree with the environment's, if that names one.
pub fn use_secret(secret: Secret) -> Result<(), SecretError> {
    let mut process = PROCESS.lock().unwrap_or_else(PoisonError::into_inner);
    match process.get_or_insert_with(Secret::from_env) {
        Ok(Some(existing)) => same_secret(existing, &secret),
        current => {
            *current = Ok(Some(secret));
            Ok(())
        }
    }
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

/// [`process_secret`] for a server's or client's default: an unusable secret file is logged
/// (the agent and the Python bindings check it first and fail with the error).
pub fn process_secret_or_log() -> Option<Secret> {
    process_secret().unwrap_or_else(|err| {
        tracing::error!("{err}; connections made without the job secret will be refused by servers that hold it");
        None
    })
}

/// The file children that need the secret are pointed at (`ELASTIX_AUTH_TOKEN_FILE`): the
/// secret's own file, or, for a secret from `ELASTIX_AUTH_TOKEN`, a file only this user can
/// read, written once (and removed by [`remove_children_file`]). `None` without a secret.
pub fn children_file() -> Result<Option<PathBuf>, SecretError> {
    let Some(secret) = process_secret()? else { return Ok(None) };
    if let Some(path) = secret.file() {
        return Ok(Some(path.to_owned()));
    }
    let mut written = CHILDREN_FILE.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(path) = written.as_ref() {
        return Ok(Some(path.clone()));
    }
    let path = std::env::temp_dir().join(format!("elastix-secret-{}-{:016x}", std::process::id(), fastrand::u64(..)));
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(|err| {
        SecretError(format!("cannot write the job secret for the workers to {}: {err}", path.display()))
    })?;
    std::io::Write::write_all(&mut file, secret.key()).map_err(|err| {
        SecretError(format!("cannot write the job secret for the workers to {}: {err}", path.display()))
    })?;
    *written = Some(path.clone());
    Ok(Some(path))
}

/// Removes the file [`children_file`] wrote, if it wrote one.
pub fn remove_children_file() {
    if let Some(path) = CHILDREN_FILE.lock().unwrap_or_else(PoisonError::into_inner).take() {
        let _ = std::fs::remove_file(path);
    }
}

static CHILDREN_FILE: Mutex<Option<PathBuf>> = Mutex::new(None);

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn file(dir: &Path, name: &str, contents: &[u8], mode: u32) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn a_file_only_its_owner_can_read_holds_the_secret_and_nobody_else_may() {
        let dir = std::env::temp_dir().join(format!("elastix-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = file(&dir, "good", b"s3cret-value\n", 0o600);
        let secret = Secret::from_file(&good).unwrap();
        assert_eq!(secret.key(), b"s3cret-value");
        assert!(!format!("{secret:?}").contains("s3cret"), "Debug never shows the secret");
        let open = file(&dir, "open", b"s3cret-value", 0o644);
        let err = Secret::from_file(&open).unwrap_err().to_string();
        assert!(err.contains("chmod 600") && err.contains("644") && !err.contains("s3cret"), "{err}");
        let blank = file(&dir, "blank", b" \n", 0o600);
        assert!(Secret::from_file(&blank).unwrap_err().to_string().contains("empty"));
        assert!(Secret::from_file(&dir.join("missing")).unwrap_err().to_string().contains("cannot read it"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
