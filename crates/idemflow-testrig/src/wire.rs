//! A loopback TCP proxy in front of PostgreSQL that counts what the client sends, so tests (and
//! the `idemflow-bench` tool) can assert round trips and commits per request from the wire rather
//! than from the engine's word.
//!
//! Frontend protocol: a startup packet without a type byte (possibly preceded by an SSL or GSS
//! encryption request, answered with one byte), then typed messages `type, int32 length, body`.
//! A round trip ends with `Sync` (extended protocol) or is one `Query` (simple protocol). A `Sync`
//! with no message before it since the previous one is sqlx's connection ping, counted apart.
//!
//! [`mysql`] is the same proxy for MySQL/MariaDB.

pub mod mysql;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The proxy's running counts, shared by every connection through it; read them with
/// [`WireCounts::snapshot`] and subtract two snapshots for what happened in between.
#[derive(Debug, Default)]
pub struct WireCounts {
    round_trips: AtomicU64,
    commits: AtomicU64,
    pings: AtomicU64,
    executes: AtomicU64,
    errors: AtomicU64,
}

/// A snapshot of the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Requests that waited for the server, pings excluded.
    pub round_trips: u64,
    /// `COMMIT` statements.
    pub commits: u64,
    /// sqlx's liveness pings (bare `Sync`), sent on acquire and on release.
    pub pings: u64,
    /// Statements executed through the extended protocol.
    pub executes: u64,
    /// Errors the server answered with (`ErrorResponse`; not counted for MySQL): each is also an
    /// ERROR line in the server's log, which an operator may alert on.
    pub errors: u64,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, earlier: Counts) -> Counts {
        Counts {
            round_trips: self.round_trips - earlier.round_trips,
            commits: self.commits - earlier.commits,
            pings: self.pings - earlier.pings,
            executes: self.executes - earlier.executes,
            errors: self.errors - earlier.errors,
        }
    }
}

impl WireCounts {
    /// The counts so far.
    pub fn snapshot(&self) -> Counts {
        Counts {
            round_trips: self.round_trips.load(Ordering::SeqCst),
            commits: self.commits.load(Ordering::SeqCst),
            pings: self.pings.load(Ordering::SeqCst),
            executes: self.executes.load(Ordering::SeqCst),
            errors: self.errors.load(Ordering::SeqCst),
        }
    }
}

/// Starts the proxy; returns its port and the shared counts. It runs until the tokio runtime it
/// was started on shuts down (the end of the test).
pub async fn start_proxy(upstream: std::net::SocketAddr) -> (u16, Arc<WireCounts>) {
    listen(upstream, relay).await
}

/// A loopback listener that connects each client to `upstream` and hands both to `relay`, which
/// counts into the counts every connection shares.
pub(crate) async fn listen<F>(
    upstream: std::net::SocketAddr,
    relay: fn(TcpStream, TcpStream, Arc<WireCounts>) -> F,
) -> (u16, Arc<WireCounts>)
where
    F: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let port = listener.local_addr().expect("proxy address").port();
    let counts = Arc::new(WireCounts::default());
    let shared = counts.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let counts = shared.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = relay(client, server, counts).await;
            });
        }
    });
    (port, counts)
}

/// Counts one client message of type `kind`; `since_sync` is the number of messages since the
/// last `Sync` on this connection.
pub(crate) fn count_message(counts: &WireCounts, kind: u8, body: &[u8], since_sync: &mut u32) {
    match kind {
        b'Q' => {
            counts.round_trips.fetch_add(1, Ordering::SeqCst);
            if body.to_ascii_uppercase().starts_with(b"COMMIT") {
                counts.commits.fetch_add(1, Ordering::SeqCst);
            }
        }
        b'S' => {
            if *since_sync == 0 {
                counts.pings.fetch_add(1, Ordering::SeqCst);
            } else {
                counts.round_trips.fetch_add(1, Ordering::SeqCst);
            }
            *since_sync = 0;
        }
        b'E' => {
            counts.executes.fetch_add(1, Ordering::SeqCst);
            *since_sync += 1;
        }
        _ => *since_sync += 1,
    }
}

/// The server's side: before its first message, an answer to each SSL or GSS encryption request
/// is one byte (`N` here: an accepted one would leave nothing readable); then typed messages
/// `type, int32 length, body`, where `E` is an error (and `N` a notice).
async fn relay_backend(
    server: &mut tokio::net::tcp::OwnedReadHalf,
    client: &mut tokio::net::tcp::OwnedWriteHalf,
    counts: &WireCounts,
) -> std::io::Result<()> {
    let mut started = false;
    loop {
        let kind = server.read_u8().await?;
        client.write_u8(kind).await?;
        if !started && kind == b'N' {
            continue;
        }
        started = true;
        let length = server.read_i32().await?;
        let mut body = vec![0; usize::try_from(length - 4).unwrap_or(0)];
        server.read_exact(&mut body).await?;
        if kind == b'E' {
            counts.errors.fetch_add(1, Ordering::SeqCst);
        }
        client.write_i32(length).await?;
        client.write_all(&body).await?;
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    counts: Arc<WireCounts>,
) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let server_counts = counts.clone();
    let downstream = tokio::spawn(async move {
        relay_backend(&mut server_read, &mut client_write, &server_counts).await
    });
    let upstream = async move {
        // Startup: length-prefixed packets without a type byte until the real startup message.
        loop {
            let length = client_read.read_i32().await?;
            let mut body = vec![0; usize::try_from(length - 4).unwrap_or(0)];
            client_read.read_exact(&mut body).await?;
            server_write.write_i32(length).await?;
            server_write.write_all(&body).await?;
            let code = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
            // 80877103: SSLRequest, 80877104: GSSENCRequest. Anything else is the startup.
            if code != 80_877_103 && code != 80_877_104 {
                break;
            }
        }
        let mut since_sync = 0_u32;
        loop {
            let kind = client_read.read_u8().await?;
            let length = client_read.read_i32().await?;
            let mut body = vec![0; usize::try_from(length - 4).unwrap_or(0)];
            client_read.read_exact(&mut body).await?;
            count_message(&counts, kind, &body, &mut since_sync);
            server_write.write_u8(kind).await?;
            server_write.write_i32(length).await?;
            server_write.write_all(&body).await?;
            if kind == b'X' {
                return Ok::<(), std::io::Error>(());
            }
        }
    };
    let result = upstream.await;
    downstream.abort();
    result
}
