//! Where the key of each intent is kept between attempts, and between runs of the caller.

use std::collections::HashMap;
use std::error::Error;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

/// A journal's failure: an IO error, or whatever a journal of the caller's own fails with.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct JournalError(Box<dyn Error + Send + Sync>);

impl JournalError {
    /// Wraps any error (or message) as a journal error.
    pub fn new(error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self(error.into())
    }
}

impl From<io::Error> for JournalError {
    fn from(error: io::Error) -> Self {
        Self(Box::new(error))
    }
}

/// What the journal's methods return.
pub type JournalResult<T> = Result<T, JournalError>;

/// Keeps one idempotency key per intent, so that a caller asking again for an intent it already
/// began (after a retry, a timeout, a restart) sends the same key and gets the first answer.
///
/// The client stores a new key *before* its first attempt; when [`store`](Self::store) returns
/// `Ok`, the key must survive a crash of the caller. The client only calls
/// [`forget`](Self::forget) when told to ([`IdempotentClient::finish`]), never on its own: after an
/// answer the caller may still need to retry with the same key.
///
/// An implementation may be backed by anything durable that the caller already has (the database
/// row of the order being placed, say). One intent should be driven by one caller at a time: the
/// client serialises its own look-ups, but two processes creating a key for the same new intent at
/// once would each store their own.
///
/// [`IdempotentClient::finish`]: crate::IdempotentClient::finish
#[async_trait]
pub trait KeyJournal: Send + Sync {
    /// The key stored for `intent`, if any.
    async fn load(&self, intent: &str) -> JournalResult<Option<String>>;

    /// Stores `key` for `intent`, durably, replacing any key stored before.
    async fn store(&self, intent: &str, key: &str) -> JournalResult<()>;

    /// Forgets `intent`'s key; forgetting an intent that has none is not an error.
    async fn forget(&self, intent: &str) -> JournalResult<()>;
}

#[async_trait]
impl<J: KeyJournal + ?Sized> KeyJournal for Arc<J> {
    async fn load(&self, intent: &str) -> JournalResult<Option<String>> {
        (**self).load(intent).await
    }

    async fn store(&self, intent: &str, key: &str) -> JournalResult<()> {
        (**self).store(intent, key).await
    }

    async fn forget(&self, intent: &str) -> JournalResult<()> {
        (**self).forget(intent).await
    }
}

/// A journal in memory: keys survive retries within the process, not a restart. Clones share
/// their keys.
///
/// ```
/// use idemflow_client::{KeyJournal, MemoryJournal};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idemflow_client::JournalError> {
/// let journal = MemoryJournal::new();
/// journal.store("checkout:cart-7781", "0190b6c2-8f4e-7c3a-9d2b-5e6f7a8b9c0d").await?;
/// assert_eq!(journal.clone().key("checkout:cart-7781").as_deref(), Some("0190b6c2-8f4e-7c3a-9d2b-5e6f7a8b9c0d"));
/// journal.forget("checkout:cart-7781").await?;
/// assert!(journal.is_empty());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryJournal {
    keys: Arc<Mutex<HashMap<String, String>>>,
}

impl MemoryJournal {
    /// An empty journal.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key stored for `intent`, if any.
    pub fn key(&self, intent: &str) -> Option<String> {
        self.keys().get(intent).cloned()
    }

    /// How many intents have a key.
    pub fn len(&self) -> usize {
        self.keys().len()
    }

    /// Whether no intent has a key.
    pub fn is_empty(&self) -> bool {
        self.keys().is_empty()
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        // The map is never left half-updated, so a panic elsewhere leaves it usable.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl KeyJournal for MemoryJournal {
    async fn load(&self, intent: &str) -> JournalResult<Option<String>> {
        Ok(self.key(intent))
    }

    async fn store(&self, intent: &str, key: &str) -> JournalResult<()> {
        self.keys().insert(intent.to_owned(), key.to_owned());
        Ok(())
    }

    async fn forget(&self, intent: &str) -> JournalResult<()> {
        self.keys().remove(intent);
        Ok(())
    }
}

/// A journal in a directory: one small file per intent, named by the hex SHA-256 of the intent
/// (so any intent is a safe file name) with the extension `.key`, holding the key and nothing else.
///
/// A key is written to a temporary file in the same directory, flushed to disk, renamed over the
/// intent's file, and the directory flushed: a crash leaves either the old file or the whole new
/// one, never half a key. A crash between writing and renaming may leave a `.*.tmp` file behind;
/// it is never read, and may be deleted.
#[derive(Debug, Clone)]
pub struct FileJournal {
    dir: PathBuf,
}

impl FileJournal {
    /// A journal in `dir`, created (with its parents) if missing.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `intent`'s key.
    pub fn path_for(&self, intent: &str) -> PathBuf {
        self.dir.join(format!("{}.key", file_stem(intent)))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> JournalResult<T> {
        match tokio::task::spawn_blocking(work).await {
            Ok(result) => Ok(result?),
            Err(join) => Err(JournalError::new(join)),
        }
    }
}

#[async_trait]
impl KeyJournal for FileJournal {
    async fn load(&self, intent: &str) -> JournalResult<Option<String>> {
        let path = self.path_for(intent);
        self.blocking(move || match fs::read_to_string(&path) {
            Ok(key) => Ok(Some(key)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        })
        .await
    }

    async fn store(&self, intent: &str, key: &str) -> JournalResult<()> {
        let (dir, path, key) = (self.dir.clone(), self.path_for(intent), key.to_owned());
        self.blocking(move || write_atomically(&dir, &path, key.as_bytes()))
            .await
    }

    async fn forget(&self, intent: &str) -> JournalResult<()> {
        let (dir, path) = (self.dir.clone(), self.path_for(intent));
        self.blocking(move || {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(error) => return Err(error),
            }
            sync_dir(&dir)
        })
        .await
    }
}

/// The hex SHA-256 of the intent.
fn file_stem(intent: &str) -> String {
    Sha256::digest(intent.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Temporary file, fsync, rename over `path`, fsync of the directory.
fn write_atomically(dir: &Path, path: &Path, contents: &[u8]) -> io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned());
    let temp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.unwrap_or_default(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&temp, path)
    })();
    if let Err(error) = written {
        // Best effort: the temporary file is never read, so leaving it is harmless.
        let _ = fs::remove_file(&temp);
        return Err(error);
    }
    sync_dir(dir)
}

/// Makes a rename or removal in `dir` durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        // Directories cannot be opened for a flush here; the rename itself is atomic.
        let _ = dir;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_name_is_the_hex_sha256_of_the_intent() {
        assert_eq!(
            file_stem("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let journal = FileJournal {
            dir: PathBuf::from("/j"),
        };
        assert_eq!(
            journal.path_for("../../etc/passwd"),
            PathBuf::from(format!("/j/{}.key", file_stem("../../etc/passwd")))
        );
    }

    #[tokio::test]
    async fn a_file_journal_stores_replaces_and_forgets_leaving_no_temporary_file()
    -> Result<(), Box<dyn Error + Send + Sync>> {
        let dir = tempfile::tempdir()?;
        let journal = FileJournal::open(dir.path().join("nested/keys"))?;
        assert_eq!(journal.load("a").await?, None);
        journal.store("a", "key-1").await?;
        journal.store("b", "key-2").await?;
        journal.store("a", "key-3").await?;
        assert_eq!(journal.load("a").await?.as_deref(), Some("key-3"));
        assert_eq!(journal.load("b").await?.as_deref(), Some("key-2"));
        assert_eq!(fs::read_to_string(journal.path_for("a"))?, "key-3");
        let mut names: Vec<_> = fs::read_dir(journal.dir())?
            .map(|entry| entry.map(|entry| entry.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        names.sort();
        let mut expected = vec![
            format!("{}.key", file_stem("a")),
            format!("{}.key", file_stem("b")),
        ];
        expected.sort();
        assert_eq!(names, expected);
        journal.forget("a").await?;
        journal.forget("a").await?;
        assert_eq!(journal.load("a").await?, None);
        assert_eq!(journal.load("b").await?.as_deref(), Some("key-2"));
        Ok(())
    }
}
