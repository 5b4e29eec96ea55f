//! A loopback TCP proxy in front of PostgreSQL that breaks the connection the way networks,
//! restarts and failovers do, on a test's command: cut every connection now, cut one in the middle
//! of its next statement, delay every message, or blackhole (swallow every byte, answer nothing,
//! send no reset). It counts what it forwards like [`crate::wire`]'s proxy, so a test can also
//! assert that the happy path kept its round trips.
//!
//! ```no_run
//! # async fn example(upstream: std::net::SocketAddr) {
//! use idemflow_testrig::faults::FaultProxy;
//!
//! let proxy = FaultProxy::start(upstream).await;
//! // Point the pool at 127.0.0.1:{proxy.port()}, warm it up, then:
//! proxy.cut_all(); // every pooled connection is now dead, and no client knows yet
//! proxy.blackhole(true); // the database "vanishes": no answer, no reset
//! proxy.heal(); // back to normal for new connections
//! # }
//! ```
//!
//! What each fault looks like to a client:
//!
//! - [`FaultProxy::cut_all`]: every open connection is closed (both sides see end of stream) the
//!   moment the proxy learns of it; new connections work. A pooled connection that was idle fails
//!   on its next use: the restart of a database, a pooler's recycling, a load balancer's idle cut.
//! - [`FaultProxy::cut_statement`]: the n-th statement from now (`Query` or `Execute`, on any
//!   connection) is forwarded to the server and its connection closed before any answer returns:
//!   the client cannot know whether it ran (a `COMMIT` cut so may have committed).
//! - [`FaultProxy::delay`]: every client message waits this long before it is forwarded.
//! - [`FaultProxy::blackhole`]: while on, bytes in both directions are read and dropped, and new
//!   connections are accepted and never forwarded: only a client's own timeouts end a request.
//! - [`FaultProxy::down`]: the database restarting: every open connection is cut, and while down a
//!   new connection is closed as soon as it is accepted (no server behind it).
//! - [`FaultProxy::retarget`]: the address moved to another server (a virtual IP or a DNS name
//!   switched to a promoted standby): every open connection is cut, and new ones reach the new
//!   server. Until then, new connections go to the old one, refused once it is gone.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::wire::{WireCounts, count_message};

/// The faults in force, shared by every connection through the proxy.
#[derive(Debug)]
struct Faults {
    /// Raised by `cut_all`: each connection ends when it sees the generation change.
    cuts: watch::Sender<u64>,
    /// Statements to forward before the one whose connection is cut; negative: no cut pending.
    cut_countdown: AtomicI64,
    blackhole: AtomicBool,
    down: AtomicBool,
    delay_ms: AtomicU64,
    connections: AtomicU64,
    /// Where new connections are forwarded; [`FaultProxy::retarget`] moves it.
    upstream: Mutex<SocketAddr>,
}

impl Faults {
    fn upstream(&self) -> SocketAddr {
        *self.upstream.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A fault-injecting proxy; see the [module documentation](self). Dropped, it keeps running until
/// the test's runtime ends; [`FaultProxy::heal`] is how a test ends a fault.
#[derive(Debug, Clone)]
pub struct FaultProxy {
    port: u16,
    faults: Arc<Faults>,
    counts: Arc<WireCounts>,
}

impl FaultProxy {
    /// Starts the proxy on a loopback port, forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (cuts, _) = watch::channel(0);
        let faults = Arc::new(Faults {
            cuts,
            cut_countdown: AtomicI64::new(-1),
            blackhole: AtomicBool::new(false),
            down: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            upstream: Mutex::new(upstream),
        });
        let counts = Arc::new(WireCounts::default());
        let (shared, shared_counts) = (faults.clone(), counts.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (faults, counts) = (shared.clone(), shared_counts.clone());
                tokio::spawn(async move {
                    if faults.down.load(Ordering::SeqCst) {
                        // Nothing listens behind the proxy: the connection ends at once.
                        drop(client);
                        return;
                    }
                    if faults.blackhole.load(Ordering::SeqCst) {
                        swallow_until_healed(client, &faults).await;
                        return;
                    }
                    // Subscribed before connecting: a cut (a retarget) while this connection is
                    // still being opened to the old server ends it too.
                    let cuts = faults.cuts.subscribe();
                    // Read per connection: a retarget applies to every connection opened after it.
                    let Ok(server) = TcpStream::connect(faults.upstream()).await else {
                        return;
                    };
                    faults.connections.fetch_add(1, Ordering::SeqCst);
                    relay(client, server, cuts, &faults, &counts).await;
                });
            }
        });
        Self {
            port,
            faults,
            counts,
        }
    }

    /// The loopback port to connect to instead of the database's.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What the proxy forwarded so far (round trips, commits, pings, executes).
    pub fn counts(&self) -> &Arc<WireCounts> {
        &self.counts
    }

    /// Connections forwarded to the database since the proxy started.
    pub fn connections(&self) -> u64 {
        self.faults.connections.load(Ordering::SeqCst)
    }

    /// Closes every open connection now. New connections are forwarded as usual.
    pub fn cut_all(&self) {
        self.faults.cuts.send_modify(|generation| *generation += 1);
    }

    /// Forwards the next statement to the database, then closes its connection before the answer
    /// comes back.
    pub fn cut_next_statement(&self) {
        self.cut_statement(1);
    }

    /// As [`FaultProxy::cut_next_statement`], for the `n`-th statement from now (1: the next).
    pub fn cut_statement(&self, n: u32) {
        self.faults
            .cut_countdown
            .store(i64::from(n) - 1, Ordering::SeqCst);
    }

    /// Whether a statement cut is still pending (its statement has not been sent yet).
    pub fn cut_pending(&self) -> bool {
        self.faults.cut_countdown.load(Ordering::SeqCst) >= 0
    }

    /// Delays every client message by `delay` before it is forwarded (zero: no delay).
    pub fn delay(&self, delay: Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.faults.delay_ms.store(millis, Ordering::SeqCst);
    }

    /// While on, every byte in both directions is read and dropped and new connections are never
    /// forwarded: no answer, no reset.
    pub fn blackhole(&self, on: bool) {
        self.faults.blackhole.store(on, Ordering::SeqCst);
    }

    /// While down, the database is restarting: every open connection is cut when it goes down,
    /// and each new one is closed as soon as it is accepted. Up again, connections are forwarded.
    pub fn down(&self, down: bool) {
        self.faults.down.store(down, Ordering::SeqCst);
        if down {
            self.cut_all();
        }
    }

    /// Points the proxy at another server, as a virtual IP or a DNS name is moved to a promoted
    /// standby: every open connection is cut (its client sees end of stream, as when the old
    /// server's host is gone), and every connection opened from now on is forwarded to
    /// `upstream`. The faults in force stay in force.
    pub fn retarget(&self, upstream: SocketAddr) {
        *self
            .faults
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = upstream;
        self.cut_all();
    }

    /// Where new connections are forwarded now.
    pub fn upstream(&self) -> SocketAddr {
        self.faults.upstream()
    }

    /// Ends every fault: no blackhole, no delay, no pending cut. Connections cut stay cut; those a
    /// blackhole held are closed, as a network that comes back finds the old sessions gone.
    pub fn heal(&self) {
        self.faults.blackhole.store(false, Ordering::SeqCst);
        self.faults.down.store(false, Ordering::SeqCst);
        self.faults.delay_ms.store(0, Ordering::SeqCst);
        self.faults.cut_countdown.store(-1, Ordering::SeqCst);
        self.cut_all();
    }
}

/// A connection accepted during a blackhole: read and drop until the proxy is healed (then closed).
async fn swallow_until_healed(mut client: TcpStream, faults: &Faults) {
    let mut cuts = faults.cuts.subscribe();
    let mut sink = [0_u8; 4096];
    loop {
        tokio::select! {
            read = client.read(&mut sink) => match read {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
            _ = cuts.changed() => return,
        }
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    mut cuts: watch::Receiver<u64>,
    faults: &Arc<Faults>,
    counts: &WireCounts,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let downstream = tokio::spawn(forward_answers(server_read, client_write, faults.clone()));
    tokio::select! {
        _ = forward_messages(client_read, server_write, faults, counts) => {}
        _ = cuts.changed() => {}
    }
    // Either side closing, a cut, or a statement cut mid-way: both directions end, and the
    // sockets close as they drop.
    downstream.abort();
}

/// Server to client, byte for byte, or into the void during a blackhole.
async fn forward_answers(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    faults: Arc<Faults>,
) {
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if faults.blackhole.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// Client to server, message by message (so a statement can be cut after it is sent), counted.
async fn forward_messages(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    faults: &Faults,
    counts: &WireCounts,
) -> std::io::Result<()> {
    // Startup: length-prefixed packets without a type byte until the real startup message.
    loop {
        let length = from.read_i32().await?;
        let mut body = vec![0; usize::try_from(length - 4).unwrap_or(0)];
        from.read_exact(&mut body).await?;
        to.write_i32(length).await?;
        to.write_all(&body).await?;
        let code = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
        // 80877103: SSLRequest, 80877104: GSSENCRequest. Anything else is the startup.
        if code != 80_877_103 && code != 80_877_104 {
            break;
        }
    }
    let mut since_sync = 0_u32;
    loop {
        let kind = from.read_u8().await?;
        let length = from.read_i32().await?;
        let mut body = vec![0; usize::try_from(length - 4).unwrap_or(0)];
        from.read_exact(&mut body).await?;
        if faults.blackhole.load(Ordering::SeqCst) {
            continue;
        }
        let delay = faults.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        count_message(counts, kind, &body, &mut since_sync);
        to.write_u8(kind).await?;
        to.write_i32(length).await?;
        to.write_all(&body).await?;
        let statement = kind == b'Q' || kind == b'E';
        let cut_here = statement
            && faults
                .cut_countdown
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                    (left >= 0).then(|| left - 1)
                })
                == Ok(0);
        if cut_here {
            // An Execute is answered only after the Sync that follows it: send that too, so
            // the statement runs, then close before the answer can come back.
            if kind == b'E' {
                to.write_all(&[b'S', 0, 0, 0, 4]).await?;
            }
            to.flush().await?;
            // Give the server the bytes before the connection goes.
            tokio::time::sleep(Duration::from_millis(50)).await;
            return Ok(());
        }
        if kind == b'X' {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A server that greets every connection with `name` and keeps it open until the client
    /// goes: enough to tell which upstream a connection reached.
    async fn greeter(name: u8) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut connection, _)) = listener.accept().await {
                tokio::spawn(async move {
                    connection.write_all(&[name]).await.unwrap();
                    let mut sink = [0_u8; 64];
                    while matches!(connection.read(&mut sink).await, Ok(read) if read > 0) {}
                });
            }
        });
        address
    }

    async fn greeting(connection: &mut TcpStream) -> Option<u8> {
        let mut byte = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), connection.read(&mut byte))
            .await
            .expect("an answer or end of stream in time");
        match read {
            Ok(1) => Some(byte[0]),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_retarget_cuts_open_connections_and_sends_new_ones_to_the_new_upstream() {
        let (old, new) = (greeter(b'o').await, greeter(b'n').await);
        let proxy = FaultProxy::start(old).await;
        let mut before = TcpStream::connect(("127.0.0.1", proxy.port()))
            .await
            .unwrap();
        assert_eq!(greeting(&mut before).await, Some(b'o'));

        proxy.retarget(new);
        assert_eq!(proxy.upstream(), new);
        // The connection opened before is cut, not left talking to the old server.
        assert_eq!(greeting(&mut before).await, None);
        let mut after = TcpStream::connect(("127.0.0.1", proxy.port()))
            .await
            .unwrap();
        assert_eq!(greeting(&mut after).await, Some(b'n'));
        assert_eq!(proxy.connections(), 2);
    }
}
