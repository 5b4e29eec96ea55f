//! The client's guards, against real servers on loopback: redirects, two clients racing on one
//! journal, `Retry-After` bounds, permanent statuses and replays, the response size limit, the
//! key's age, the key's form, and the file journal's permissions.

use std::collections::{BTreeSet, HashMap};
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use idemflow_client::{
    ClientError, ClientRetryPolicy, FileJournal, IdempotentClient, KeyForm, KeyJournal,
    MemoryJournal,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// One request a test server saw.
#[derive(Debug, Clone)]
struct Hit {
    method: Method,
    path: String,
    /// The `Idempotency-Key` header exactly as sent.
    key: Option<String>,
    body: Bytes,
    at: Instant,
}

/// Every request a test server saw, in order.
#[derive(Debug, Clone, Default)]
struct Log(Arc<Mutex<Vec<Hit>>>);

impl Log {
    /// Logs a request; returns how many came before it.
    fn record(&self, method: Method, uri: &Uri, headers: &HeaderMap, body: Bytes) -> usize {
        let key = headers
            .get("idempotency-key")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let mut hits = self.hits();
        hits.push(Hit {
            method,
            path: uri.path().to_owned(),
            key,
            body,
            at: Instant::now(),
        });
        hits.len() - 1
    }

    fn hits(&self) -> std::sync::MutexGuard<'_, Vec<Hit>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn all(&self) -> Vec<Hit> {
        self.hits().clone()
    }

    fn count(&self, path: &str) -> usize {
        self.hits().iter().filter(|hit| hit.path == path).count()
    }
}

/// Serves `app` on 127.0.0.1, returns its base URL (`http://127.0.0.1:port`).
async fn serve(app: Router) -> Result<String, std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{address}"))
}

/// A server whose every request, on every path, is logged and answered by `answer(n)` (`n` counts
/// requests from 0).
async fn scripted(
    answer: impl Fn(usize) -> Response + Clone + Send + Sync + 'static,
) -> Result<(String, Log), std::io::Error> {
    let log = Log::default();
    let handler = {
        let log = log.clone();
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (log, answer) = (log.clone(), answer.clone());
            async move { answer(log.record(method, &uri, &headers, body)) }
        }
    };
    let url = serve(Router::new().fallback(any(handler))).await?;
    Ok((url, log))
}

fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT)
}

/// `code` with the header `name: value`.
fn with_header(code: u16, name: &'static str, value: &'static str) -> Response {
    let mut response = (status(code), "body").into_response();
    response
        .headers_mut()
        .insert(name, HeaderValue::from_static(value));
    response
}

/// Fast retries and a short deadline: a test that fails, fails fast.
fn fast() -> ClientRetryPolicy {
    ClientRetryPolicy::default()
        .with_initial_backoff(Duration::from_millis(20))
        .with_max_backoff(Duration::from_millis(100))
        .with_jitter(0.0)
        .with_deadline(Duration::from_secs(2))
        .with_min_retry_after(Duration::from_millis(10))
}

fn client<J: KeyJournal>(journal: J) -> IdempotentClient<J> {
    IdempotentClient::new(reqwest::Client::new(), journal).with_policy(fast())
}

fn order() -> serde_json::Value {
    serde_json::json!({ "cart": "cart-7781", "amount_minor": 4200 })
}

// 1. Redirects.

/// POST /v1/orders answers `code` towards /v1/elsewhere; /v1/elsewhere answers 200 to anything.
async fn moved(code: u16) -> Result<(String, Log), std::io::Error> {
    let log = Log::default();
    let orders = {
        let log = log.clone();
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| async move {
            log.record(method, &uri, &headers, body);
            with_header(code, "location", "/v1/elsewhere")
        }
    };
    let elsewhere = {
        let log = log.clone();
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| async move {
            log.record(method, &uri, &headers, body);
            (StatusCode::OK, "not the order").into_response()
        }
    };
    let app = Router::new()
        .route("/v1/orders", post(orders))
        .route("/v1/elsewhere", any(elsewhere));
    Ok((serve(app).await?, log))
}

#[tokio::test]
async fn a_redirect_is_an_error_that_names_the_new_location_and_is_not_followed() -> TestResult {
    for code in [301, 302, 303, 307, 308] {
        let (base, log) = moved(code).await?;
        let client = IdempotentClient::with_default_http(MemoryJournal::new())?.with_policy(fast());

        let outcome = client
            .post_json("moved", format!("{base}/v1/orders"), &order())
            .await;

        let Err(ClientError::Redirected {
            status,
            location,
            followed,
            key,
            attempts,
        }) = outcome
        else {
            return Err(format!("{code}: expected Redirected, got {outcome:?}").into());
        };
        assert_eq!(status, code);
        assert_eq!(location, Some(format!("{base}/v1/elsewhere")), "{code}");
        assert!(!followed, "{code}");
        assert_eq!(attempts, 1, "{code}");
        assert_eq!(client.journal().key("moved"), Some(key), "{code}");
        assert_eq!(
            (log.count("/v1/orders"), log.count("/v1/elsewhere")),
            (1, 0),
            "{code}: sent once, not followed"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_redirect_followed_by_the_callers_http_client_is_not_reported_as_success() -> TestResult {
    for code in [302, 303, 307] {
        let (base, log) = moved(code).await?;
        // reqwest's default policy follows up to 10 redirects.
        let client = client(MemoryJournal::new());

        let outcome = client
            .post_json("moved", format!("{base}/v1/orders"), &order())
            .await;

        let Err(ClientError::Redirected {
            status,
            location,
            followed,
            attempts,
            ..
        }) = outcome
        else {
            return Err(format!("{code}: expected Redirected, got {outcome:?}").into());
        };
        assert_eq!(status, StatusCode::OK, "{code}: the status at the end");
        assert_eq!(location, Some(format!("{base}/v1/elsewhere")), "{code}");
        assert!(followed, "{code}");
        assert_eq!(attempts, 1, "{code}: not retried");
        let followed: Vec<_> = log
            .all()
            .into_iter()
            .filter(|hit| hit.path == "/v1/elsewhere")
            .map(|hit| hit.method)
            .collect();
        // 302 and 303 turn the POST into a GET; 307 sends the POST, key and body again.
        let method = if code == 307 {
            Method::POST
        } else {
            Method::GET
        };
        assert_eq!(followed, [method], "{code}");
        assert!(client.journal().key("moved").is_some());
    }
    Ok(())
}

// 2. Two clients, one journal directory.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_on_one_journal_directory_send_one_key_per_new_intent() -> TestResult {
    let (base, log) = scripted(|_| (StatusCode::CREATED, "done").into_response()).await?;
    let url = format!("{base}/v1/orders");
    let dir = tempfile::tempdir()?;
    let first = client(FileJournal::open(dir.path())?);
    let second = client(FileJournal::open(dir.path())?);

    for round in 0..50 {
        let intent = format!("race-{round}");
        let body = serde_json::json!({ "intent": intent });
        let (a, b) = tokio::join!(
            first.post_json(&intent, &url, &body),
            second.post_json(&intent, &url, &body),
        );
        let (a, b) = (a?, b?);
        assert_eq!(a.key, b.key, "{intent}");
        assert_eq!(first.journal().load(&intent).await?, Some(a.key));
    }

    let mut keys: HashMap<String, BTreeSet<String>> = HashMap::new();
    for hit in log.all() {
        let body: serde_json::Value = serde_json::from_slice(&hit.body)?;
        let intent = body["intent"].as_str().unwrap_or_default().to_owned();
        keys.entry(intent)
            .or_default()
            .insert(hit.key.unwrap_or_default());
    }
    assert_eq!(keys.len(), 50);
    let split: Vec<_> = keys.iter().filter(|(_, keys)| keys.len() != 1).collect();
    assert!(split.is_empty(), "intents sent with two keys: {split:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_store_new_on_one_directory_agrees_on_one_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    for round in 0..20 {
        let intent = format!("intent-{round}");
        let mut tasks = Vec::new();
        for writer in 0..4 {
            let journal = FileJournal::open(dir.path())?;
            let intent = intent.clone();
            tasks.push(tokio::spawn(async move {
                journal
                    .store_new(&intent, &format!("key-{round}-{writer}"))
                    .await
            }));
        }
        let mut won = BTreeSet::new();
        for task in tasks {
            won.insert(task.await??);
        }
        assert_eq!(won.len(), 1, "{intent}: {won:?}");
        let stored = FileJournal::open(dir.path())?.load(&intent).await?;
        assert_eq!(stored.as_ref(), won.first(), "{intent}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    Ok(())
}

#[tokio::test]
async fn store_new_keeps_the_key_already_stored() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = FileJournal::open(dir.path())?;
    let memory = MemoryJournal::new();
    let journals: [&dyn KeyJournal; 2] = [&file, &memory];
    for journal in journals {
        assert_eq!(journal.store_new("a", "first").await?, "first");
        assert_eq!(journal.store_new("a", "second").await?, "first");
        assert_eq!(journal.load("a").await?.as_deref(), Some("first"));
        journal.forget("a").await?;
        assert_eq!(journal.store_new("a", "third").await?, "third");
    }
    Ok(())
}

// 3. Retry-After bounds.

#[tokio::test]
async fn a_retry_after_of_zero_or_in_the_past_waits_at_least_the_floor() -> TestResult {
    for asked in ["0", "Sun, 06 Nov 1994 08:49:37 GMT"] {
        let (base, log) = scripted(move |_| with_header(503, "retry-after", asked)).await?;
        let floor = Duration::from_millis(100);
        let deadline = Duration::from_millis(500);
        let client = client(MemoryJournal::new())
            .with_policy(fast().with_min_retry_after(floor).with_deadline(deadline));

        let outcome = client.post_json("busy", &base, &order()).await;

        let Err(ClientError::DeadlineExceeded { attempts, .. }) = outcome else {
            return Err(format!("{asked}: expected DeadlineExceeded, got {outcome:?}").into());
        };
        // Each wait is at least the floor, so the deadline leaves room for so many attempts.
        let most = u32::try_from(deadline.as_millis() / floor.as_millis() + 1)?;
        assert!(
            (2..=most).contains(&attempts),
            "{asked}: {attempts} attempts"
        );
        let hits = log.all();
        for pair in hits.windows(2) {
            let gap = pair[1].at.duration_since(pair[0].at);
            assert!(gap >= floor, "{asked}: attempts {gap:?} apart");
        }
    }
    Ok(())
}

#[tokio::test]
async fn a_huge_retry_after_is_capped_when_the_deadline_is_unbounded() -> TestResult {
    let (base, log) = scripted(|seen| match seen {
        0 => with_header(503, "retry-after", "999999999"),
        1 => with_header(429, "retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
        _ => (StatusCode::CREATED, "done").into_response(),
    })
    .await?;
    let client = client(MemoryJournal::new()).with_policy(
        fast()
            .with_deadline(Duration::MAX)
            .with_max_retry_after(Duration::from_millis(50)),
    );

    let body = order();
    let call = client.post_json("throttled", &base, &body);
    let reply = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .map_err(|_| "still waiting after 5 s: the Retry-After was not capped")??;

    assert_eq!((reply.status.as_u16(), reply.attempts), (201, 3));
    let hits = log.all();
    let gap = hits[1].at.duration_since(hits[0].at);
    assert!(gap >= Duration::from_millis(50), "{gap:?}");
    Ok(())
}

// 4. Permanent server errors and replays are answers.

#[tokio::test]
async fn not_implemented_and_version_not_supported_are_answers() -> TestResult {
    for code in [501, 505] {
        let (base, log) = scripted(move |_| (status(code), "never").into_response()).await?;
        let client = client(MemoryJournal::new())
            .with_policy(fast().with_deadline(Duration::from_millis(500)));

        let reply = client.post_json("permanent", &base, &order()).await?;

        assert_eq!((reply.status.as_u16(), reply.attempts), (code, 1));
        assert_eq!(log.all().len(), 1, "{code}");
    }
    for code in [500, 502, 503, 504] {
        let (base, log) = scripted(move |seen| match seen {
            0 => (status(code), "passing").into_response(),
            _ => (StatusCode::CREATED, "done").into_response(),
        })
        .await?;
        let reply = client(MemoryJournal::new())
            .post_json("transient", &base, &order())
            .await?;
        assert_eq!((reply.status.as_u16(), reply.attempts), (201, 2), "{code}");
        assert_eq!(log.all().len(), 2, "{code}");
    }
    Ok(())
}

#[tokio::test]
async fn a_replayed_answer_is_never_retried_whatever_its_status() -> TestResult {
    for code in [500, 503, 409, 429] {
        let (base, log) = scripted(move |_| {
            let mut response = with_header(code, "idempotent-replayed", "true");
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from_static("0"));
            response
        })
        .await?;
        let client = client(MemoryJournal::new())
            .with_policy(fast().with_deadline(Duration::from_millis(500)));

        let reply = client.post_json("stored", &base, &order()).await?;

        assert_eq!(reply.status, code);
        assert!(reply.replayed, "{code}");
        assert_eq!(reply.attempts, 1, "{code}");
        assert_eq!(log.all().len(), 1, "{code}");
    }
    Ok(())
}

// 5. The response size limit.

#[tokio::test]
async fn a_response_beyond_the_limit_is_an_error_and_is_not_retried() -> TestResult {
    let limit = 16 * 1024;
    for (length, fits) in [(limit, true), (limit + 1, false), (64 * 1024, false)] {
        let (base, log) =
            scripted(move |_| (StatusCode::OK, vec![b'x'; length]).into_response()).await?;
        let client = client(MemoryJournal::new()).with_max_response_bytes(limit);

        let outcome = client.post_json("big", &base, &order()).await;

        match outcome {
            Ok(reply) if fits => assert_eq!(reply.body.len(), length),
            Err(ClientError::ResponseTooLarge {
                limit: reported,
                attempts: 1,
                ..
            }) if !fits => assert_eq!(reported, limit),
            Ok(reply) => {
                let got = (reply.status, reply.body.len());
                return Err(format!("{length} bytes: got a reply {got:?}").into());
            }
            Err(error) => return Err(format!("{length} bytes: got {error:?}").into()),
        }
        assert_eq!(log.all().len(), 1, "{length}");
    }
    Ok(())
}

/// A server that answers every request with a chunked 200 of `total` bytes (no `Content-Length`),
/// written 1 KiB at a time; returns its URL and how many connections it accepted.
async fn streaming(total: usize) -> Result<(String, Arc<Mutex<usize>>), std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let accepted = Arc::new(Mutex::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            *counter.lock().unwrap_or_else(PoisonError::into_inner) += 1;
            tokio::spawn(async move {
                if read_request(&mut socket).await.is_err() {
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("400\r\n{}\r\n", "x".repeat(1024));
                for _ in 0..total / 1024 {
                    // The client hangs up once it has read enough.
                    if socket.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
                let _ = socket.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    Ok((format!("http://{address}/v1/orders"), accepted))
}

/// Reads one request's head and its `Content-Length` body.
async fn read_request(socket: &mut tokio::net::TcpStream) -> std::io::Result<()> {
    let mut buffer = Vec::new();
    let mut chunk = [0_u8; 4096];
    let head_end = loop {
        let read = socket.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buffer.extend_from_slice(&chunk[..read]);
        if let Some(at) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0);
    while buffer.len() < head_end + length {
        let read = socket.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    Ok(())
}

#[tokio::test]
async fn a_streamed_response_is_read_no_further_than_the_limit() -> TestResult {
    let (url, accepted) = streaming(1024 * 1024).await?;
    let client = client(MemoryJournal::new()).with_max_response_bytes(8 * 1024);

    let outcome = client.post_json("stream", &url, &order()).await;

    assert!(
        matches!(
            outcome,
            Err(ClientError::ResponseTooLarge {
                limit: 8192,
                attempts: 1,
                ..
            })
        ),
        "{outcome:?}"
    );
    assert_eq!(*accepted.lock().unwrap_or_else(PoisonError::into_inner), 1);
    assert!(client.journal().key("stream").is_some());
    Ok(())
}

// 6. The key's age.

/// A UUIDv7 made `age` ago.
fn key_made_ago(age: Duration) -> Result<String, Box<dyn Error + Send + Sync>> {
    let then = SystemTime::now()
        .checked_sub(age)
        .ok_or("too old")?
        .duration_since(UNIX_EPOCH)?;
    let timestamp =
        uuid::Timestamp::from_unix(uuid::NoContext, then.as_secs(), then.subsec_nanos());
    Ok(uuid::Uuid::new_v7(timestamp).to_string())
}

#[tokio::test]
async fn a_key_older_than_the_max_age_is_reported_and_not_sent() -> TestResult {
    let (base, log) = scripted(|_| (StatusCode::CREATED, "done").into_response()).await?;
    let day = Duration::from_secs(24 * 60 * 60);
    let old = key_made_ago(day + Duration::from_secs(3600))?;
    let journal = MemoryJournal::new();
    journal.store("old", &old).await?;

    // The default max age is idemflow's default retention, 24 h.
    let outcome = client(journal.clone())
        .post_json("old", &base, &order())
        .await;

    let Err(ClientError::KeyExpired { intent, key, age }) = outcome else {
        return Err(format!("expected KeyExpired, got {outcome:?}").into());
    };
    assert_eq!((intent.as_str(), key.as_str()), ("old", old.as_str()));
    assert!(
        age >= day + Duration::from_secs(3599) && age < day + Duration::from_secs(3700),
        "{age:?}"
    );
    assert!(log.all().is_empty(), "nothing was sent");
    assert_eq!(journal.key("old"), Some(old.clone()), "the key is kept");

    // A longer max age, or none, sends it.
    let longer = client(journal.clone()).with_key_max_age(2 * day);
    assert_eq!(longer.post_json("old", &base, &order()).await?.key, old);
    let unbounded = client(journal.clone()).without_key_max_age();
    assert_eq!(unbounded.post_json("old", &base, &order()).await?.key, old);
    assert_eq!(log.all().len(), 2);

    // A shorter one judges younger keys; keys that are not UUIDv7 are never judged.
    let hour_old = key_made_ago(Duration::from_secs(3600))?;
    journal.store("hour", &hour_old).await?;
    let strict = client(journal.clone()).with_key_max_age(Duration::from_secs(60));
    let outcome = strict.post_json("hour", &base, &order()).await;
    assert!(
        matches!(&outcome, Err(ClientError::KeyExpired { key, .. }) if *key == hour_old),
        "{outcome:?}"
    );
    journal.store("legacy", "order-7781-attempt").await?;
    journal
        .store("v4", "9b2f0c4e-8a1d-4c3b-9e5f-1a2b3c4d5e6f")
        .await?;
    for intent in ["legacy", "v4"] {
        let reply = strict.post_json(intent, &base, &order()).await?;
        assert_eq!(reply.status, 201, "{intent}");
    }
    Ok(())
}

// 7. The key's form.

#[tokio::test]
async fn the_key_is_sent_quoted_by_default_and_bare_on_request() -> TestResult {
    let (base, log) = scripted(|_| (StatusCode::CREATED, "done").into_response()).await?;
    let quoted = client(MemoryJournal::new());
    let bare = client(MemoryJournal::new()).with_key_form(KeyForm::Bare);

    let quoted_reply = quoted.post_json("form", &base, &order()).await?;
    let bare_reply = bare.post_json("form", &base, &order()).await?;

    let sent: Vec<_> = log.all().into_iter().map(|hit| hit.key).collect();
    assert_eq!(
        sent,
        [
            Some(format!("\"{}\"", quoted_reply.key)),
            Some(bare_reply.key.clone())
        ]
    );
    Ok(())
}

// 8. The file journal's permissions.

#[cfg(unix)]
#[tokio::test]
async fn a_file_journal_is_private_to_its_owner() -> TestResult {
    use std::os::unix::fs::PermissionsExt;

    let mode = |path: &std::path::Path| -> std::io::Result<u32> {
        Ok(std::fs::metadata(path)?.permissions().mode() & 0o777)
    };
    let root = tempfile::tempdir()?;
    let dir = root.path().join("shop/keys");
    let journal = FileJournal::open(&dir)?;
    assert_eq!(mode(&dir)?, 0o700, "the journal's directory");
    assert_eq!(
        mode(&root.path().join("shop"))?,
        0o700,
        "a parent it created"
    );

    journal.store("stored", "key-1").await?;
    assert_eq!(mode(&journal.path_for("stored"))?, 0o600);
    journal.store_new("new", "key-2").await?;
    assert_eq!(mode(&journal.path_for("new"))?, 0o600);

    // A directory that exists is left as it is.
    let shared = root.path().join("shared");
    std::fs::create_dir(&shared)?;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o750))?;
    FileJournal::open(&shared)?;
    assert_eq!(mode(&shared)?, 0o750);
    Ok(())
}
