//! The counting proxy in front of MySQL/MariaDB: what [`super::start_proxy`] is for PostgreSQL,
//! in the MySQL client/server protocol.
//!
//! Every packet is `int<3> length, int<1> sequence id, payload`. The server speaks first (its
//! greeting is packet 0); the client's handshake answer and any authentication exchange carry
//! sequence ids from 1. Once connected, every command the client sends starts a new sequence at
//! 0, and its first payload byte names it. So a client packet with sequence id 0 is a command:
//! one round trip, unless it is one the server does not answer. The connection must not use TLS
//! (`ssl-mode=disabled` in the URL), or the packets cannot be read.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::WireCounts;

/// `COM_QUIT`: the client closing; not answered.
const QUIT: u8 = 0x01;
/// `COM_QUERY`: a statement in the text protocol (sqlx's `BEGIN`, `COMMIT`, `ROLLBACK`).
const QUERY: u8 = 0x03;
/// `COM_PING`: sqlx's liveness check, counted apart.
const PING: u8 = 0x0e;
/// `COM_STMT_EXECUTE`: a prepared statement executed.
const EXECUTE: u8 = 0x17;
/// `COM_STMT_CLOSE`: a prepared statement dropped (its cache overflowed); not answered.
const CLOSE: u8 = 0x19;

/// Starts the proxy in front of `upstream`; returns its port and the shared counts. It runs
/// until the tokio runtime it was started on shuts down.
pub async fn start_proxy(upstream: std::net::SocketAddr) -> (u16, Arc<WireCounts>) {
    super::listen(upstream, relay).await
}

/// Counts one client packet: `sequence` its id, `payload` its body.
pub(crate) fn count_packet(counts: &WireCounts, sequence: u8, payload: &[u8]) {
    let Some(&command) = payload.first() else {
        return;
    };
    if sequence != 0 {
        return;
    }
    match command {
        QUIT | CLOSE => {}
        PING => {
            counts.pings.fetch_add(1, Ordering::SeqCst);
        }
        QUERY => {
            counts.round_trips.fetch_add(1, Ordering::SeqCst);
            let text = &payload[1..];
            let start = text
                .iter()
                .position(|byte| !byte.is_ascii_whitespace())
                .unwrap_or(text.len());
            if text[start..].to_ascii_uppercase().starts_with(b"COMMIT") {
                counts.commits.fetch_add(1, Ordering::SeqCst);
            }
        }
        EXECUTE => {
            counts.round_trips.fetch_add(1, Ordering::SeqCst);
            counts.executes.fetch_add(1, Ordering::SeqCst);
        }
        // COM_STMT_PREPARE and the rest: answered, so a round trip each.
        _ => {
            counts.round_trips.fetch_add(1, Ordering::SeqCst);
        }
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
    let downstream =
        tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
    let upstream = async move {
        let mut header = [0_u8; 4];
        loop {
            client_read.read_exact(&mut header).await?;
            let length = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
            let mut payload = vec![0; length];
            client_read.read_exact(&mut payload).await?;
            count_packet(&counts, header[3], &payload);
            server_write.write_all(&header).await?;
            server_write.write_all(&payload).await?;
            if header[3] == 0 && payload.first() == Some(&QUIT) {
                return Ok::<(), std::io::Error>(());
            }
        }
    };
    let result = upstream.await;
    downstream.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_start_a_sequence_and_the_handshake_does_not() {
        let counts = WireCounts::default();
        // The handshake answer (sequence 1) and an authentication switch answer (3).
        count_packet(&counts, 1, b"\x0d\xa2\x00\x00root");
        count_packet(&counts, 3, b"\x00");
        count_packet(&counts, 0, b"\x03BEGIN");
        count_packet(&counts, 0, b"\x16INSERT INTO t VALUES (?)");
        count_packet(&counts, 0, b"\x17\x01\x00\x00\x00");
        count_packet(&counts, 0, b"\x03 commit");
        count_packet(&counts, 0, b"\x19\x01\x00\x00\x00");
        count_packet(&counts, 0, b"\x0e");
        count_packet(&counts, 0, b"\x01");
        let counts = counts.snapshot();
        assert_eq!(counts.round_trips, 4);
        assert_eq!(counts.commits, 1);
        assert_eq!(counts.executes, 1);
        assert_eq!(counts.pings, 1);
    }
}
