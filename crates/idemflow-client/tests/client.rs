//! The client against a real HTTP server on loopback that fails as scripted.

use std::collections::{HashMap, VecDeque};
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idemflow_client::{
    ClientError, ClientRetryPolicy, FileJournal, IdempotentClient, KeyJournal, LastAttempt,
    MemoryJournal,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// What the server does with one request.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Answers with this status, and this `Retry-After` if any.
    Fail(u16, Option<&'static str>),
    /// Answers after this long.
    Hang(Duration),
    /// Answers 201 the first time a key is seen, then replays that answer.
    Answer,
}

#[derive(Debug, Clone)]
struct Seen {
    key: Option<String>,
    at: Instant,
    content_type: Option<String>,
}

#[derive(Debug, Default)]
struct Script {
    steps: VecDeque<Step>,
    otherwise: Option<Step>,
    seen: Vec<Seen>,
    answered: HashMap<String, u32>,
}

#[derive(Debug, Clone)]
struct Server {
    script: Arc<Mutex<Script>>,
    url: String,
}

impl Server {
    /// A server on 127.0.0.1 that plays `steps`, then `Step::Answer`.
    async fn start(steps: impl IntoIterator<Item = Step>) -> Result<Self, std::io::Error> {
        let script = Arc::new(Mutex::new(Script {
            steps: steps.into_iter().collect(),
            ..Script::default()
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let app = axum::Router::new()
            .route("/v1/orders", axum::routing::post(handle))
            .with_state(Arc::clone(&script));
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(Self {
            script,
            url: format!("http://{address}/v1/orders"),
        })
    }

    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What to do once the steps are played (instead of answering).
    fn otherwise(&self, step: Step) {
        self.script().otherwise = Some(step);
    }

    fn seen(&self) -> Vec<Seen> {
        self.script().seen.clone()
    }

    fn keys(&self) -> Vec<String> {
        self.seen()
            .into_iter()
            .map(|seen| seen.key.unwrap_or_default())
            .collect()
    }
}

async fn handle(
    State(script): State<Arc<Mutex<Script>>>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let key = text("idempotency-key");
    let step = {
        let mut script = script.lock().unwrap_or_else(PoisonError::into_inner);
        script.seen.push(Seen {
            key: key.clone(),
            at: Instant::now(),
            content_type: text("content-type"),
        });
        let otherwise = script.otherwise.unwrap_or(Step::Answer);
        script.steps.pop_front().unwrap_or(otherwise)
    };
    match step {
        Step::Fail(status, retry_after) => {
            let mut response = (
                StatusCode::from_u16(status).unwrap_or_default(),
                "try later",
            )
                .into_response();
            if let Some(seconds) = retry_after {
                response
                    .headers_mut()
                    .insert("retry-after", HeaderValue::from_static(seconds));
            }
            response
        }
        Step::Hang(duration) => {
            tokio::time::sleep(duration).await;
            (StatusCode::CREATED, "late").into_response()
        }
        Step::Answer => {
            let key = key.unwrap_or_default();
            let mut script = script.lock().unwrap_or_else(PoisonError::into_inner);
            let times = script.answered.entry(key.clone()).or_default();
            *times += 1;
            let mut response =
                (StatusCode::CREATED, format!(r#"{{"order_for":{key:?}}}"#)).into_response();
            if *times > 1 {
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            response
        }
    }
}

/// Fast retries, a deadline that keeps a failing test short.
fn fast() -> ClientRetryPolicy {
    ClientRetryPolicy::default()
        .with_initial_backoff(Duration::from_millis(20))
        .with_max_backoff(Duration::from_millis(200))
        .with_multiplier(2.0)
        .with_jitter(0.2)
        .with_deadline(Duration::from_secs(5))
        .with_min_retry_after(Duration::from_millis(10))
        .with_max_retry_after(Duration::from_secs(60))
}

fn client<J: KeyJournal>(journal: J, policy: ClientRetryPolicy) -> IdempotentClient<J> {
    IdempotentClient::new(reqwest::Client::new(), journal).with_policy(policy)
}

fn order() -> serde_json::Value {
    serde_json::json!({ "cart": "cart-7781", "amount_minor": 4200 })
}

/// The key inside an sf-string, checked to be a UUIDv7 in its usual spelling.
fn uuid_v7_in(header: &str) -> Result<String, String> {
    let inner = header
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
        .ok_or_else(|| format!("not an sf-string: {header}"))?;
    let uuid = uuid::Uuid::parse_str(inner).map_err(|error| error.to_string())?;
    if uuid.get_version() != Some(uuid::Version::SortRand) {
        return Err(format!("not a UUIDv7: {inner}"));
    }
    if uuid.hyphenated().to_string() != inner {
        return Err(format!("not in the hyphenated lower-case form: {inner}"));
    }
    Ok(inner.to_owned())
}

#[tokio::test]
async fn failures_are_retried_with_one_key_until_the_answer() -> TestResult {
    let server = Server::start([
        Step::Fail(503, None),
        Step::Fail(409, Some("0")),
        Step::Fail(500, Some("0")),
        Step::Fail(429, Some("0")),
    ])
    .await?;
    let client = client(MemoryJournal::new(), fast());

    let reply = client
        .post_json("checkout:cart-7781", &server.url, &order())
        .await?;

    assert_eq!(reply.status, 201);
    assert!(!reply.replayed);
    assert_eq!(reply.attempts, 5);
    let keys = server.keys();
    assert_eq!(keys.len(), 5);
    assert!(keys.iter().all(|key| *key == keys[0]), "{keys:?}");
    assert_eq!(uuid_v7_in(&keys[0])?, reply.key);
    assert_eq!(
        client.journal().key("checkout:cart-7781").as_deref(),
        Some(reply.key.as_str())
    );
    let body: serde_json::Value = reply.json()?;
    assert_eq!(body["order_for"], keys[0]);
    let content_types: Vec<_> = server.seen().into_iter().map(|s| s.content_type).collect();
    assert!(
        content_types
            .iter()
            .all(|c| c.as_deref() == Some("application/json"))
    );

    // Asked again before finishing: the same key, and the server replays its answer.
    let again = client
        .post_json("checkout:cart-7781", &server.url, &order())
        .await?;
    assert_eq!((again.status.as_u16(), again.attempts), (201, 1));
    assert!(again.replayed);
    assert_eq!(again.key, reply.key);
    assert_eq!(again.body, reply.body);
    Ok(())
}

#[tokio::test]
async fn other_client_errors_are_answers_and_are_not_retried() -> TestResult {
    for status in [400, 401, 402, 403, 404, 408, 413, 415, 422] {
        let server = Server::start([Step::Fail(status, Some("0"))]).await?;
        let client = client(MemoryJournal::new(), fast());
        let started = Instant::now();

        let reply = client.post_json("refused", &server.url, &order()).await?;

        assert_eq!(reply.status, status);
        assert_eq!(reply.attempts, 1, "{status}");
        assert_eq!(server.seen().len(), 1, "{status}");
        assert!(started.elapsed() < Duration::from_secs(1));
        // The key stays until the caller finishes the intent.
        assert_eq!(client.journal().len(), 1);
    }
    Ok(())
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_deadline() -> TestResult {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let deadline = Duration::from_millis(400);
    let client = client(MemoryJournal::new(), fast().with_deadline(deadline));
    let started = Instant::now();

    let outcome = client
        .post_json(
            "nobody-home",
            format!("http://127.0.0.1:{port}/v1/orders"),
            &order(),
        )
        .await;

    let elapsed = started.elapsed();
    let Err(ClientError::DeadlineExceeded { attempts, last }) = outcome else {
        return Err(format!("expected DeadlineExceeded, got {outcome:?}").into());
    };
    assert!(attempts >= 3, "{attempts} attempts");
    assert!(
        matches!(&*last, LastAttempt::Transport(error) if error.is_connect()),
        "{last:?}"
    );
    assert!(elapsed <= deadline + Duration::from_secs(1), "{elapsed:?}");
    assert!(
        elapsed >= deadline / 4,
        "gave up long before the deadline: {elapsed:?}"
    );
    assert!(client.journal().key("nobody-home").is_some());
    Ok(())
}

#[tokio::test]
async fn a_timed_out_attempt_is_retried_and_a_hung_one_is_cut_at_the_deadline() -> TestResult {
    let server = Server::start([Step::Hang(Duration::from_secs(10))]).await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()?;
    let client = IdempotentClient::new(http, MemoryJournal::new()).with_policy(fast());
    let reply = client.post_json("slow", &server.url, &order()).await?;
    assert_eq!((reply.status.as_u16(), reply.attempts), (201, 2));
    let keys = server.keys();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);

    let hung = Server::start([]).await?;
    hung.otherwise(Step::Hang(Duration::from_secs(10)));
    let deadline = Duration::from_millis(300);
    let client = client_with_deadline(deadline);
    let started = Instant::now();
    let outcome = client.post_json("hung", &hung.url, &order()).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(
            &outcome,
            Err(ClientError::DeadlineExceeded { attempts: 1, last }) if matches!(**last, LastAttempt::Unfinished)
        ),
        "{outcome:?}"
    );
    assert!(
        elapsed >= deadline && elapsed < deadline + Duration::from_secs(1),
        "{elapsed:?}"
    );
    Ok(())
}

fn client_with_deadline(deadline: Duration) -> IdempotentClient<MemoryJournal> {
    client(MemoryJournal::new(), fast().with_deadline(deadline))
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_gives_up_at_once() -> TestResult {
    let server = Server::start([]).await?;
    server.otherwise(Step::Fail(503, Some("120")));
    let client = client_with_deadline(Duration::from_secs(5));
    let started = Instant::now();

    let outcome = client.post_json("maintenance", &server.url, &order()).await;

    let Err(ClientError::DeadlineExceeded { attempts, last }) = outcome else {
        return Err(format!("expected DeadlineExceeded, got {outcome:?}").into());
    };
    assert_eq!(attempts, 1);
    assert!(
        matches!(&*last, LastAttempt::Response(reply) if reply.status == 503 && &reply.body[..] == b"try later"),
        "{last:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    Ok(())
}

#[tokio::test]
async fn a_restarted_client_reuses_the_key_from_its_file_journal() -> TestResult {
    let dir = tempfile::tempdir()?;
    let server = Server::start([]).await?;
    server.otherwise(Step::Fail(503, None));
    let intent = "checkout:cart-7781";

    // The first run gets nowhere before its deadline, then "crashes".
    let first = client(
        FileJournal::open(dir.path())?,
        fast().with_deadline(Duration::from_millis(150)),
    );
    let outcome = first.post_json(intent, &server.url, &order()).await;
    assert!(
        matches!(outcome, Err(ClientError::DeadlineExceeded { .. })),
        "{outcome:?}"
    );
    let first_key = uuid_v7_in(&server.keys()[0])?;
    drop(first);

    // The restarted caller asks for the same intent: the same key, and the answer.
    server.otherwise(Step::Answer);
    let journal = FileJournal::open(dir.path())?;
    assert_eq!(
        std::fs::read_to_string(journal.path_for(intent))?,
        first_key
    );
    let restarted = client(journal, fast());
    let reply = restarted.post_json(intent, &server.url, &order()).await?;
    assert_eq!(reply.status, 201);
    assert_eq!(reply.key, first_key);
    let keys = server.keys();
    assert!(keys.len() >= 2);
    assert!(keys.iter().all(|key| *key == keys[0]), "{keys:?}");

    // Finished: the file is gone, and the next call with that name is a new request.
    restarted.finish(intent).await?;
    assert!(!restarted.journal().path_for(intent).exists());
    let next = restarted.post_json(intent, &server.url, &order()).await?;
    assert_ne!(next.key, first_key);
    assert!(!next.replayed);
    Ok(())
}

#[tokio::test]
async fn finish_makes_the_next_call_use_a_new_key() -> TestResult {
    let server = Server::start([]).await?;
    let client = client(MemoryJournal::new(), fast());

    let first = client
        .post_json("pay:invoice-9", &server.url, &order())
        .await?;
    let replay = client
        .post_json("pay:invoice-9", &server.url, &order())
        .await?;
    assert_eq!(replay.key, first.key);
    assert!(replay.replayed);

    client.finish("pay:invoice-9").await?;
    assert!(client.journal().is_empty());
    let fresh = client
        .post_json("pay:invoice-9", &server.url, &order())
        .await?;
    assert_ne!(fresh.key, first.key);
    assert!(!fresh.replayed);
    assert_eq!(uuid_v7_in(&format!("\"{}\"", fresh.key))?, fresh.key);
    // Other intents have their own keys.
    let other = client
        .post_json("pay:invoice-10", &server.url, &order())
        .await?;
    assert_ne!(other.key, fresh.key);
    Ok(())
}

#[tokio::test]
async fn concurrent_calls_for_one_new_intent_share_one_key() -> TestResult {
    let server = Server::start([]).await?;
    let client = client(MemoryJournal::new(), fast());
    let body = order();
    let (a, b) = tokio::join!(
        client.post_json("twice", &server.url, &body),
        client.post_json("twice", &server.url, &body),
    );
    assert_eq!(a?.key, b?.key);
    Ok(())
}

/// The time between the first two attempts, after a response that asked for `retry_after`.
async fn gap_after(
    status: u16,
    retry_after: Option<&'static str>,
) -> Result<Duration, Box<dyn Error + Send + Sync>> {
    let server = Server::start([Step::Fail(status, retry_after)]).await?;
    let client = client(
        MemoryJournal::new(),
        fast()
            .with_initial_backoff(Duration::from_millis(100))
            .with_jitter(0.0),
    );
    let reply = client.post_json("later", &server.url, &order()).await?;
    assert_eq!((reply.status.as_u16(), reply.attempts), (201, 2));
    let seen = server.seen();
    Ok(seen[1].at.duration_since(seen[0].at))
}

#[tokio::test]
async fn retry_after_is_honoured_on_409() -> TestResult {
    let gap = gap_after(409, Some("1")).await?;
    assert!(
        gap >= Duration::from_millis(990) && gap < Duration::from_millis(2500),
        "{gap:?}"
    );
    Ok(())
}

#[tokio::test]
async fn retry_after_is_honoured_on_429() -> TestResult {
    let gap = gap_after(429, Some("1")).await?;
    assert!(
        gap >= Duration::from_millis(990) && gap < Duration::from_millis(2500),
        "{gap:?}"
    );
    Ok(())
}

#[tokio::test]
async fn retry_after_is_honoured_on_503_and_backoff_applies_without_it() -> TestResult {
    let (with, without) = tokio::join!(gap_after(503, Some("1")), gap_after(503, None));
    let (with, without) = (with?, without?);
    assert!(
        with >= Duration::from_millis(990) && with < Duration::from_millis(2500),
        "{with:?}"
    );
    assert!(
        without >= Duration::from_millis(100) && without < Duration::from_millis(900),
        "{without:?}"
    );
    Ok(())
}
