//! Where the key of each intent is kept between attempts, and between runs of the caller.

use std::collections::HashMap;
use std::error::Error;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
#[cfg(unix)]
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
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
/// The client stores a new key with [`store_new`](Self::store_new) *before* its first attempt;
/// when it returns `Ok`, the key must survive a crash of the caller. The client only calls
/// [`forget`](Self::forget) when told to ([`IdempotentClient::finish`]), never on its own: after an
/// answer the caller may still need to retry with the same key.
///
/// An implementation may be backed by anything durable that the caller already has (the database
/// row of the order being placed, say). If two clients (two processes) may start the same new
/// intent at once on one journal, implement `store_new` atomically (an `INSERT … ON CONFLICT DO
/// NOTHING` then a `SELECT`, say): the provided one is a `load` then a `store`, and lets both store
/// their own key and send it. Within one client, look-ups are serialised, so any journal gives two
/// concurrent calls for one intent one key.
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

    /// Stores `key` for `intent`, durably, unless a key is stored already; returns the key that is
    /// stored once it returns: `key`, or the one that was there.
    ///
    /// The client makes new keys with this, so that two clients racing on one new intent send
    /// the same key: implementations should store-if-absent atomically, as [`MemoryJournal`] and
    /// [`FileJournal`] do. The provided implementation is [`load`](Self::load), then
    /// [`store`](Self::store) if nothing was there: racy, two writers at once may each store, and
    /// each get, their own key.
    async fn store_new(&self, intent: &str, key: &str) -> JournalResult<String> {
        if let Some(stored) = self.load(intent).await? {
            return Ok(stored);
        }
        self.store(intent, key).await?;
        Ok(key.to_owned())
    }
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

    async fn store_new(&self, intent: &str, key: &str) -> JournalResult<String> {
        (**self).store_new(intent, key).await
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

    async fn store_new(&self, intent: &str, key: &str) -> JournalResult<String> {
        Ok(self
            .keys()
            .entry(intent.to_owned())
            .or_insert_with(|| key.to_owned())
            .clone())
    }
}

/// A journal in a directory: one small file per intent, named by the hex SHA-256 of the intent
/// (so any intent is a safe file name) with the extension `.key`, holding the key and nothing else.
///
/// A key is written to a temporary file in the same directory and flushed to disk; then
/// [`store`](KeyJournal::store) renames it over the intent's file, while
/// [`store_new`](KeyJournal::store_new) hard-links it to the intent's file, which fails if that
/// file exists (so of two clients, even in two processes, racing on one new intent, exactly one
/// stores its key and both get it); then the directory is flushed. A crash leaves either the old
/// file or the whole new one, never half a key. A crash before the temporary file is removed may
/// leave a `.*.tmp` file behind; it is never read, and may be deleted. `store_new` needs a file
/// system with hard links (FAT and some network file systems have none).
///
/// Keys are credentials of a sort (whoever has one can fetch the stored answer): on unix, files
/// are created readable by their owner only (mode 0600), and so are the directory and the parents
/// that [`open`](Self::open) creates (0700).
#[derive(Debug, Clone)]
pub struct FileJournal {
    dir: PathBuf,
}

impl FileJournal {
    /// A journal in `dir`, created (with its parents, mode 0700 on unix) if missing, and each new
    /// directory flushed into its parent so that it survives a crash. An existing directory is
    /// used as it is, whatever its mode.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Self> {
        let dir = dir.into();
        create_private_dir(&dir)?;
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

    async fn store_new(&self, intent: &str, key: &str) -> JournalResult<String> {
        let (dir, path, key) = (self.dir.clone(), self.path_for(intent), key.to_owned());
        self.blocking(move || write_new(&dir, &path, &key)).await
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
    idemflow_core::hex::encode(&Sha256::digest(intent.as_bytes()))
}

/// Temporary file, fsync, rename over `path`, fsync of the directory.
fn write_atomically(dir: &Path, path: &Path, contents: &[u8]) -> io::Result<()> {
    let temp = write_temp(dir, path, contents)?;
    if let Err(error) = fs::rename(&temp, path) {
        // Best effort: the temporary file is never read, so leaving it is harmless.
        let _ = fs::remove_file(&temp);
        return Err(error);
    }
    sync_dir(dir)
}

/// How many times [`write_new`] tries when the intent's file vanishes between its link and its
/// read (a `forget` running meanwhile).
const WRITE_NEW_TRIES: usize = 8;

/// Stores `key` at `path` unless a file is there, and returns the key `path` then holds: temporary
/// file, fsync, hard link to `path` (which fails if `path` exists: of two writers exactly one
/// wins), removal of the temporary file, fsync of the directory; or, if `path` was there, what it
/// holds. The linked file was whole before it had its name, so a reader never sees half a key.
fn write_new(dir: &Path, path: &Path, key: &str) -> io::Result<String> {
    let temp = write_temp(dir, path, key.as_bytes())?;
    let stored = link_or_read(&temp, path, key);
    // Best effort: the temporary file is never read, so leaving it is harmless.
    let _ = fs::remove_file(&temp);
    let stored = stored?;
    sync_dir(dir)?;
    Ok(stored)
}

/// Links `temp` (holding `key`) to `path`, or reads the key already at `path`.
fn link_or_read(temp: &Path, path: &Path, key: &str) -> io::Result<String> {
    for _ in 0..WRITE_NEW_TRIES {
        match fs::hard_link(temp, path) {
            Ok(()) => return Ok(key.to_owned()),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
            Err(error) => return Err(error),
        }
        match fs::read_to_string(path) {
            Ok(stored) => return Ok(stored),
            // Forgotten since the link failed: try again.
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    Err(io::Error::other(format!(
        "{} kept appearing and vanishing while a new key was stored",
        path.display()
    )))
}

/// Writes `contents` to a new temporary file next to `path` (readable by its owner only, on
/// unix), flushed to disk; returns its path.
fn write_temp(dir: &Path, path: &Path, contents: &[u8]) -> io::Result<PathBuf> {
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
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        options.mode(0o600);
        let mut file = options.open(&temp)?;
        file.write_all(contents)?;
        file.sync_all()
    })();
    if let Err(error) = written {
        // Best effort, as above.
        let _ = fs::remove_file(&temp);
        return Err(error);
    }
    Ok(temp)
}

/// Creates `dir` and its missing parents, readable by their owner only (0700 on unix), and makes
/// each new one durable in its parent.
fn create_private_dir(dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|path| !path.as_os_str().is_empty() && !path.exists())
        .collect();
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    builder.mode(0o700);
    builder.create(dir)?;
    for created in missing.iter().rev() {
        match created.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent)?,
            _ => sync_dir(Path::new("."))?,
        }
    }
    Ok(())
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
