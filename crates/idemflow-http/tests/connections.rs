//! `idemflow_http::serve`'s connection limit, over loopback. A crowd of clients that open a
//! connection and send part of a header block, more of them than the limit, cannot keep a
//! legitimate request waiting: at the limit the connection idle the longest is closed to make
//! room, so the request behind them is served at once, not after rounds of header read
//! timeouts. With every held connection busy, the server stops accepting (new connections wait
//! in the listen backlog) rather than accept past its descriptors and fail.
//!
//! What the server holds is counted, not timed: the test and the server share one process, so
//! the server's sockets are the process's open descriptors (`/proc/self/fd`) less the clients'
//! own. One test in its own binary, so that no other test's descriptors come and go meanwhile.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)]

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use idemflow_http::{ServeLimits, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

const LIMIT: usize = 4;
const STALLED: usize = 6;
const HEADER_TIMEOUT: Duration = Duration::from_secs(3);
/// How much later than its bound a step may come on a loaded machine.
const MARGIN: Duration = Duration::from_secs(3);

/// The process's open descriptors. One reader at a time: reading the directory holds a
/// descriptor of its own, which a second reader would count.
fn open_descriptors(reading: &Mutex<()>) -> usize {
    let _one = reading.lock().unwrap();
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn request(path: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n").into_bytes()
}

/// Reads one answer (small, its body ending in `end`) off `stream`.
async fn answer(stream: &mut TcpStream, end: &[u8]) -> Vec<u8> {
    let mut answer = Vec::new();
    while !answer.ends_with(end) {
        let mut chunk = [0u8; 512];
        let read = stream.read(&mut chunk).await.unwrap();
        assert!(read > 0, "closed unanswered: {answer:?}");
        answer.extend_from_slice(&chunk[..read]);
    }
    answer
}

/// Whether the server has closed `stream` (it reads end of file, or a reset, within `wait`).
async fn closed(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut rest = [0u8; 64];
    match tokio::time::timeout(wait, stream.read(&mut rest)).await {
        Err(_still_open) => false,
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(read)) => panic!("answered: {:?}", &rest[..read]),
    }
}

async fn until(what: &str, condition: impl Fn() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < MARGIN, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_stalled_connections_cannot_hold_the_server_and_the_limit_holds() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (entered, inside, most_inside) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let release = Arc::new(Semaphore::new(0));
    let hold = {
        let (entered, inside, most_inside, release) = (
            entered.clone(),
            inside.clone(),
            most_inside.clone(),
            release.clone(),
        );
        move || async move {
            entered.fetch_add(1, Ordering::SeqCst);
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most_inside.fetch_max(now, Ordering::SeqCst);
            release.acquire().await.unwrap().forget();
            inside.fetch_sub(1, Ordering::SeqCst);
            "held"
        }
    };
    let router = Router::new()
        .route("/ping", post(|| async { "pong" }))
        .route("/hold", post(hold));
    let limits = ServeLimits::default()
        .with_max_connections(LIMIT)
        .with_header_read_timeout(HEADER_TIMEOUT);
    tokio::spawn(serve(listener, router, limits).into_future());

    // A first request, its connection closed by both sides: what serving costs in descriptors
    // beyond the connections themselves is in the baseline.
    let mut warm = TcpStream::connect(address).await.unwrap();
    warm.write_all(&request("/ping")).await.unwrap();
    assert!(
        answer(&mut warm, b"pong")
            .await
            .starts_with(b"HTTP/1.1 200")
    );
    drop(warm);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reading = Arc::new(Mutex::new(()));
    let baseline = open_descriptors(&reading);

    // The clients' own sockets, counted before each is opened (so never fewer than are open).
    let clients = Arc::new(AtomicUsize::new(0));
    let held = {
        let (reading, clients) = (reading.clone(), clients.clone());
        move || open_descriptors(&reading).saturating_sub(baseline + clients.load(Ordering::SeqCst))
    };
    // The most connections the server held at once, sampled until the end.
    let most = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (held, most, done) = (held.clone(), most.clone(), done.clone());
        // A thread of its own: a failed assertion ends the test without waiting for it.
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                most.fetch_max(held(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };

    // 1. More stalled clients than places, then a legitimate request behind them.
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        clients.fetch_add(1, Ordering::SeqCst);
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"POST /ping HTTP/1.1\r\nHost: te")
            .await
            .unwrap();
        stalled.push(stream);
    }
    clients.fetch_add(1, Ordering::SeqCst);
    let mut legitimate = TcpStream::connect(address).await.unwrap();
    let sent = Instant::now();
    legitimate.write_all(&request("/ping")).await.unwrap();
    let answered = tokio::time::timeout(MARGIN, answer(&mut legitimate, b"pong"))
        .await
        .expect("the legitimate request is answered");
    let waited = sent.elapsed();
    assert!(answered.starts_with(b"HTTP/1.1 200 OK\r\n"));
    assert!(
        waited < HEADER_TIMEOUT,
        "served after {waited:?}: it waited for header read timeouts"
    );
    // The oldest stalled clients were closed, unanswered, to make room once they had been idle
    // a second; the newest still hold the places left beside the legitimate connection.
    let mut still_held = 0;
    for stream in &mut stalled {
        if !closed(stream, Duration::from_millis(100)).await {
            still_held += 1;
        }
    }
    assert_eq!(still_held, LIMIT - 1, "stalled clients held beside it");
    // Those are cut off by the header read timeout, unanswered.
    for stream in &mut stalled {
        assert!(closed(stream, HEADER_TIMEOUT + MARGIN).await);
    }
    drop(stalled);
    drop(legitimate);
    clients.store(0, Ordering::SeqCst);
    until("every connection closed", || held() == 0).await;

    // 2. Every place busy: the server stops accepting. One more connection is accepted and
    // waits for a place; the rest wait in the backlog.
    let mut busy = Vec::new();
    for _ in 0..LIMIT + 3 {
        clients.fetch_add(1, Ordering::SeqCst);
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(&request("/hold")).await.unwrap();
        busy.push(stream);
    }
    until("the places are taken", || {
        entered.load(Ordering::SeqCst) == LIMIT
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        entered.load(Ordering::SeqCst),
        LIMIT,
        "only the held are served"
    );
    assert_eq!(held(), LIMIT + 1, "the held, and one waiting for a place");
    release.add_permits(busy.len());
    for stream in &mut busy {
        let answered = tokio::time::timeout(MARGIN, answer(stream, b"held"))
            .await
            .expect("each is served in its turn");
        // Kept alive, and idle once answered: closed to make room for one waiting.
        assert!(answered.starts_with(b"HTTP/1.1 200 OK\r\n"));
    }
    assert_eq!(entered.load(Ordering::SeqCst), LIMIT + 3);

    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let most = most.load(Ordering::SeqCst);
    let most_inside = most_inside.load(Ordering::SeqCst);
    println!(
        "limit {LIMIT}: {STALLED} stalled clients, the request behind them served in {waited:?}; \
         at most {most} connections held at once, {most_inside} requests served at once"
    );
    assert!(most <= LIMIT + 1, "{most} connections held at once");
    assert_eq!(most_inside, LIMIT, "requests served at once");
}
