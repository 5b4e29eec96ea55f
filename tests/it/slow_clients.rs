//! Slow and oversized clients against `idemflow_http::serve`, over real TCP on loopback, in raw
//! bytes (an HTTP client library would not send a header a byte at a time): a client that takes
//! too long over its headers or its body, or sends too much header, is cut off within its limit,
//! holds no idempotency key, and does not stop the server answering others. Keep-alive and a
//! graceful shutdown still work under the limits.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;
use idemflow::Runner;
use idemflow_http::{BearerTenant, IdempotencyLayer, ServeLimits};
use serde_json::Value;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The header read timeout the tests serve with: short, so a test waits little.
const HEADER_TIMEOUT: Duration = Duration::from_millis(500);
/// The body read timeout the tests serve with.
const BODY_TIMEOUT: Duration = Duration::from_millis(300);
/// How much later than its limit a cut-off may come on a loaded machine.
const MARGIN: Duration = Duration::from_secs(2);

fn limits() -> ServeLimits {
    ServeLimits::default()
        .with_header_read_timeout(HEADER_TIMEOUT)
        .with_body_read_timeout(BODY_TIMEOUT)
}

/// `/v1/notes` behind the idempotency layer (answers 201 with the body it was sent), `/echo`
/// without it (axum's `Bytes` extractor reads the body), `/slow` answers after 300 ms.
fn app(pool: &PgPool) -> Router {
    let layer =
        IdempotencyLayer::new(Runner::new(pool.clone()), "slow-clients.v1", BearerTenant).unwrap();
    Router::new()
        .route(
            "/v1/notes",
            post(|body: Bytes| async move { (StatusCode::CREATED, body) }),
        )
        .route_layer(layer)
        .route("/echo", post(|body: Bytes| async move { body }))
        .route(
            "/slow",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        )
}

/// Serves the app on a loopback port with the tests' limits.
async fn start(pool: &PgPool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(idemflow_http::serve(listener, app(pool), limits()).into_future());
    address
}

async fn keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A covered request's header block, `extra` header lines included, for a body of `length`.
fn head(key: &str, length: usize, extra: &str) -> String {
    format!(
        "POST /v1/notes HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acme\r\n\
         Idempotency-Key: \"{key}\"\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n{extra}\r\n"
    )
}

/// A whole covered request with a small JSON body.
fn note(key: &str) -> Vec<u8> {
    let body = format!("{{\"note\":\"{key}\"}}");
    [head(key, body.len(), "").into_bytes(), body.into_bytes()].concat()
}

/// One response read off `stream`, whole (by its `Content-Length`).
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Lowercase names.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(found, _)| found == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Reads one response, within `MARGIN` plus `wait`.
async fn read_answer(stream: &mut TcpStream, wait: Duration) -> Answer {
    tokio::time::timeout(wait + MARGIN, async {
        let mut read = Vec::new();
        let end = loop {
            if let Some(at) = read.windows(4).position(|window| window == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 4096];
            let count = stream.read(&mut chunk).await.unwrap();
            assert!(count > 0, "the connection closed mid-answer: {read:?}");
            read.extend_from_slice(&chunk[..count]);
        };
        let head = String::from_utf8(read[..end].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap()[9..12].parse().unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.to_ascii_lowercase(), value.trim().to_owned()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(name, _)| name == "content-length")
            .map_or(0, |(_, value)| value.parse().unwrap());
        let mut body = read[end..].to_vec();
        while body.len() < length {
            let mut chunk = [0u8; 4096];
            let count = stream.read(&mut chunk).await.unwrap();
            assert!(count > 0, "the connection closed mid-body");
            body.extend_from_slice(&chunk[..count]);
        }
        Answer {
            status,
            headers,
            body,
        }
    })
    .await
    .expect("an answer in time")
}

/// How a connection ended, seen from the client.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The server closed it (FIN).
    Eof,
    /// The server reset it (RST).
    Reset,
}

/// Reads until the server closes the connection (within `MARGIN` plus `wait`): what it sent
/// first, and how it closed.
async fn read_to_close(stream: &mut TcpStream, wait: Duration) -> (Vec<u8>, Ended) {
    tokio::time::timeout(wait + MARGIN, async {
        let mut read = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) => return (read, Ended::Eof),
                Ok(count) => read.extend_from_slice(&chunk[..count]),
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                    return (read, Ended::Reset);
                }
                Err(error) => panic!("reading: {error}"),
            }
        }
    })
    .await
    .expect("the server closes the connection in time")
}

/// hyper's own 431: no body, `Connection: close`.
fn assert_431(answer: &[u8]) {
    let answer = String::from_utf8_lossy(answer);
    assert!(
        answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{answer}"
    );
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(answer.contains("\r\ncontent-length: 0\r\n"), "{answer}");
    assert!(
        answer.ends_with("\r\n\r\n"),
        "nothing after the head: {answer}"
    );
}

/// Sends one whole request on a new connection and reads its answer.
async fn send(address: SocketAddr, request: &[u8]) -> Answer {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    read_answer(&mut stream, Duration::ZERO).await
}

/// (a) A client that sends its headers a byte at a time, slower than the header read timeout,
/// is disconnected without an answer once the timeout has passed (not before, not much after),
/// and a request on another connection meanwhile is served.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn headers_sent_a_byte_at_a_time_are_cut_off_while_others_are_served(pool: PgPool) {
    let address = start(&pool).await;
    // The pool's first connection is made here, not while the slow client's clock runs.
    assert_eq!(send(address, &note("warm-up")).await.status, 201);

    let mut slow = TcpStream::connect(address).await.unwrap();
    let connected = Instant::now();
    // Far more bytes than can be sent in time, one every 50 ms.
    let drip = head("slow", 2, &"X-Padding: a\r\n".repeat(40)).into_bytes();
    let other = tokio::spawn(async move {
        let answer = send(address, &note("meanwhile")).await;
        (answer.status, Instant::now())
    });
    let mut received = Vec::new();
    let mut ended = None;
    for byte in drip {
        if slow.write_all(&[byte]).await.is_err() {
            ended = Some(Ended::Reset);
            break;
        }
        let mut chunk = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(50), slow.read(&mut chunk)).await {
            Err(_still_open) => {}
            Ok(Ok(0)) => {
                ended = Some(Ended::Eof);
                break;
            }
            Ok(Ok(count)) => received.extend_from_slice(&chunk[..count]),
            Ok(Err(_reset)) => {
                ended = Some(Ended::Reset);
                break;
            }
        }
        assert!(
            connected.elapsed() < HEADER_TIMEOUT + MARGIN,
            "the slow client is still connected after {:?}",
            connected.elapsed()
        );
    }
    let cut_off = Instant::now();
    let held = cut_off - connected;
    let ended = ended.expect("the server closed the connection before the drip ended");
    println!("the slow client was cut off after {held:?} ({ended:?})");
    assert!(held >= HEADER_TIMEOUT, "cut off early, after {held:?}");
    assert!(
        held < HEADER_TIMEOUT + MARGIN,
        "cut off late, after {held:?}"
    );
    assert!(
        received.is_empty(),
        "a header timeout closes without an answer: {}",
        String::from_utf8_lossy(&received)
    );

    let (status, served) = other.await.unwrap();
    assert_eq!(status, 201, "the other connection's request is served");
    assert!(
        served < cut_off,
        "served while the slow client held its connection"
    );
    // Two requests ran; the slow one never reached the layer.
    assert_eq!(keys(&pool).await, 2);
}

/// (b) More header fields than `max_headers` (100): hyper answers 431 and closes the
/// connection; 100 fields are accepted. Nothing is stored for the refused request.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn too_many_headers_are_answered_431_and_the_connection_closed(pool: PgPool) {
    assert_eq!(ServeLimits::default().max_headers, 100);
    let address = start(&pool).await;
    let body = b"{}";
    // `head` sends 5 fields of its own (Host, Authorization, Idempotency-Key, Content-Type,
    // Content-Length).
    let fillers = |count: usize| {
        (0..count)
            .map(|index| format!("X-Filler-{index}: {index}\r\n"))
            .collect::<String>()
    };

    let mut stream = TcpStream::connect(address).await.unwrap();
    let request = [
        head("many", body.len(), &fillers(96)).into_bytes(),
        body.to_vec(),
    ]
    .concat();
    stream.write_all(&request).await.unwrap();
    let (answer, ended) = read_to_close(&mut stream, Duration::ZERO).await;
    assert_431(&answer);
    assert_eq!(ended, Ended::Eof, "closed after the answer");
    assert_eq!(keys(&pool).await, 0, "nothing stored for a refused request");

    let request = [
        head("enough", body.len(), &fillers(95)).into_bytes(),
        body.to_vec(),
    ]
    .concat();
    assert_eq!(send(address, &request).await.status, 201, "100 fields pass");
    assert_eq!(keys(&pool).await, 1);
}

/// (c) A header block larger than `max_header_bytes` (16 KiB): 431 and the connection closed;
/// one just under it is accepted.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_header_block_over_the_byte_limit_is_answered_431_and_the_connection_closed(
    pool: PgPool,
) {
    let limit = ServeLimits::default().max_header_bytes;
    assert_eq!(limit, 16 * 1024);
    let address = start(&pool).await;
    let body = b"{}";
    // A header block of `size` bytes, request line and final blank line included.
    let request = |key: &str, size: usize| {
        let bare = head(key, body.len(), "X-Padding: \r\n").len();
        let padding = "a".repeat(size - bare);
        let head = head(key, body.len(), &format!("X-Padding: {padding}\r\n"));
        assert_eq!(head.len(), size);
        [head.into_bytes(), body.to_vec()].concat()
    };

    let mut stream = TcpStream::connect(address).await.unwrap();
    stream
        .write_all(&request("large", limit + 100))
        .await
        .unwrap();
    let (answer, ended) = read_to_close(&mut stream, Duration::ZERO).await;
    assert_431(&answer);
    assert_eq!(ended, Ended::Eof, "closed after the answer");
    assert_eq!(keys(&pool).await, 0, "nothing stored for a refused request");

    let answer = send(address, &request("fits", limit - 100)).await;
    assert_eq!(answer.status, 201, "a block under the limit passes");
    assert_eq!(keys(&pool).await, 1);
}

/// (d) A body that stalls after its headers: 408 problem+json (`body_timeout`) once the body
/// read timeout has passed, the connection closed, and no key stored: the layer reads the body
/// before it claims the key, so the same key sent again whole runs. A route without the layer,
/// reading the body with axum's `Bytes` extractor, gets the same 408.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_body_that_stalls_is_answered_408_and_holds_no_key(pool: PgPool) {
    let address = start(&pool).await;
    for path in ["/v1/notes", "/echo"] {
        let mut stream = TcpStream::connect(address).await.unwrap();
        let head = head("stalled", 40, "").replace("/v1/notes", path);
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(b"{\"note\":").await.unwrap(); // 8 of the 40 bytes, then nothing
        let sent = Instant::now();
        let answer = read_answer(&mut stream, BODY_TIMEOUT).await;
        let waited = sent.elapsed();
        println!("{path}: answered after {waited:?}");
        assert!(
            waited >= BODY_TIMEOUT,
            "{path}: answered early, after {waited:?}"
        );
        assert_eq!(answer.status, 408, "{path}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(answer.header("connection"), Some("close"));
        let problem: Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(problem["status"], 408, "{path}: {problem}");
        assert_eq!(problem["code"], "body_timeout", "{path}: {problem}");
        let (rest, _) = read_to_close(&mut stream, Duration::ZERO).await;
        assert!(rest.is_empty(), "{path}: nothing after the answer");
    }
    assert_eq!(
        keys(&pool).await,
        0,
        "a request whose body never came holds no key"
    );

    let answer = send(address, &note("stalled")).await;
    assert_eq!(answer.status, 201, "the same key, sent whole, runs");
    assert_eq!(keys(&pool).await, 1);
}

/// (e) Keep-alive: two requests on one connection are both answered on it; left idle, the
/// connection is closed once the header read timeout has passed (the clock runs while the
/// server waits for a request's first byte).
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn keep_alive_serves_two_requests_on_one_connection(pool: PgPool) {
    let address = start(&pool).await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    // The server's idle clock starts after it has answered, so after the last request was sent.
    let mut last_sent = Instant::now();
    for key in ["first", "second"] {
        last_sent = Instant::now();
        stream.write_all(&note(key)).await.unwrap();
        let answer = read_answer(&mut stream, Duration::ZERO).await;
        assert_eq!(answer.status, 201, "{key}");
        assert_eq!(answer.body, format!("{{\"note\":\"{key}\"}}").into_bytes());
        assert_eq!(answer.header("connection"), None, "{key}: kept alive");
    }
    assert_eq!(keys(&pool).await, 2);

    let (rest, ended) = read_to_close(&mut stream, HEADER_TIMEOUT).await;
    let held = last_sent.elapsed();
    assert!(rest.is_empty());
    assert_eq!(ended, Ended::Eof);
    assert!(held >= HEADER_TIMEOUT, "closed early, after {held:?}");
}

/// A graceful shutdown under the limits: the request in flight is answered, new connections are
/// refused, and the server's future completes.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_graceful_shutdown_answers_requests_in_flight_and_refuses_new_connections(pool: PgPool) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server: JoinHandle<std::io::Result<()>> = tokio::spawn(
        idemflow_http::serve(listener, app(&pool), limits())
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .into_future(),
    );
    let mut in_flight = TcpStream::connect(address).await.unwrap();
    in_flight
        .write_all(b"POST /slow HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // the handler is running
    stop.send(()).unwrap();
    // The listener is closed once the signal came: new connections are refused.
    let stopping = Instant::now();
    loop {
        match TcpStream::connect(address).await {
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => break,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                // Queued when the listener closed: reset, and the next attempt is refused.
            }
            Err(error) => panic!("connecting: {error}"),
            Ok(_accepted_before_the_stop) => {
                assert!(stopping.elapsed() < MARGIN, "still accepting connections");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    let answer = read_answer(&mut in_flight, Duration::from_millis(300)).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, b"done");
    let (rest, ended) = read_to_close(&mut in_flight, Duration::ZERO).await;
    assert!(rest.is_empty());
    assert_eq!(ended, Ended::Eof, "closed after its answer");
    tokio::time::timeout(MARGIN, server)
        .await
        .expect("the server stops once its connections have")
        .unwrap()
        .unwrap();
}
