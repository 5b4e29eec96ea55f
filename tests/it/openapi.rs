//! The checkout service's OpenAPI document, fetched from the running service: OpenAPI 3.1, the
//! Idempotency-Key header, every problem of the layer's catalogue, the same document the code
//! generates, and every status the service answers declared.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use idemflow::http::ProblemType;
use idemflow::http::openapi::{problem_response, problem_response_name};
use serde_json::{Value, json};

use crate::support::example::{DEMO_STEPS, example_binary};

/// The checkout service (`checkout serve`) on a free port and a SQLite file of its own; killed
/// when dropped.
struct Service {
    child: Child,
    url: String,
    http: reqwest::Client,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Service {
    fn start(name: &str) -> Service {
        let binary = example_binary();
        let directory =
            std::env::temp_dir().join(format!("idemflow-openapi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let database = format!("sqlite://{}", directory.join("checkout.db").display());
        let mut child = Command::new(binary)
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--database-url",
                &database,
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut url = None;
        for line in stdout.lines() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix("serve: listening on ") {
                url = rest.split_whitespace().next().map(str::to_owned);
                break;
            }
        }
        Service {
            child,
            url: url.expect("the service prints where it listens"),
            http: reqwest::Client::new(),
        }
    }

    async fn document(&self) -> Value {
        let response = self
            .http
            .get(format!("{}/openapi.json", self.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "application/json");
        response.json().await.unwrap()
    }

    /// `POST /v1/checkouts` with `headers` and `body`; its status and problem code, if any.
    async fn checkout(&self, headers: &[(&str, &str)], body: &str) -> (u16, Option<String>) {
        let mut request = self
            .http
            .post(format!("{}/v1/checkouts", self.url))
            .body(body.to_owned());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        (status, body["code"].as_str().map(str::to_owned))
    }
}

impl Service {
    /// The status of a checkout that declares a body over the limit and sends none: the answer
    /// comes before the body is read, so a client still sending would meet a closed connection.
    async fn declared_too_large(&self) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let address = self.url.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = format!(
            "POST /v1/checkouts HTTP/1.1\r\nhost: {address}\r\nauthorization: Bearer acme\r\n\
             content-type: application/json\r\nidempotency-key: declared-4\r\n\
             content-length: {}\r\n\r\n",
            2 << 20
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut head = [0; 12];
        stream.read_exact(&mut head).await.unwrap();
        let head = String::from_utf8_lossy(&head);
        head["HTTP/1.1 ".len()..].parse().unwrap()
    }
}

/// The headers of a well-formed checkout under `key`.
fn keyed(key: &str) -> [(&str, &str); 3] {
    [
        ("authorization", "Bearer acme"),
        ("content-type", "application/json"),
        ("idempotency-key", key),
    ]
}

#[tokio::test]
async fn the_service_serves_the_openapi_document_its_code_generates() {
    let service = tokio::task::spawn_blocking(|| Service::start("document"))
        .await
        .unwrap();
    let served = service.document().await;
    assert!(
        served["openapi"].as_str().unwrap().starts_with("3.1."),
        "{}",
        served["openapi"]
    );

    // No drift: the document the binary prints is the one it serves.
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let printed = Command::new(binary).arg("openapi").output().unwrap();
    assert!(printed.status.success());
    let printed: Value = serde_json::from_slice(&printed.stdout).unwrap();
    assert_eq!(printed, served);

    let create = &served["paths"]["/v1/checkouts"]["post"];
    let key = create["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|parameter| parameter["name"] == "Idempotency-Key")
        .expect("the Idempotency-Key parameter");
    assert_eq!(key["in"], "header");
    assert_eq!(key["required"], true);
    let text = served.to_string();
    for link in [
        "draft-ietf-httpapi-idempotency-key-header",
        "rfc9457",
        "Idempotent-Replayed",
        "Retry-After",
        "Prefer",
        "Preference-Applied",
    ] {
        assert!(text.contains(link), "the document names {link}");
    }

    // Every problem of the catalogue, as the layer describes it, and referred to by the route.
    for kind in ProblemType::ALL {
        let name = problem_response_name(kind.status);
        let component = &served["components"]["responses"][&name];
        assert_eq!(
            component,
            &serde_json::to_value(problem_response(kind.status)).unwrap()
        );
        assert_eq!(
            component["content"]["application/problem+json"]["examples"][kind.code]["value"]["code"],
            kind.code
        );
        assert_eq!(
            create["responses"][kind.status.to_string()]["$ref"],
            format!("#/components/responses/{name}")
        );
    }
}

/// Every status the service is seen to answer, in the demo's steps and to the requests below,
/// is declared for its operation.
#[tokio::test]
async fn every_status_the_checkout_answers_is_declared() {
    let service = tokio::task::spawn_blocking(|| Service::start("statuses"))
        .await
        .unwrap();
    let document = service.document().await;
    let body = r#"{"amount": 2500, "currency": "usd", "source": "tok_visa"}"#;
    let seen = [
        service.checkout(&keyed("declared-1"), body).await,
        service.checkout(&keyed("declared-1"), body).await,
        service
            .checkout(&keyed("declared-1"), &body.replace("2500", "9900"))
            .await,
        service
            .checkout(
                &keyed("declared-2"),
                &body.replace("tok_visa", "tok_chargeDeclined"),
            )
            .await,
        service.checkout(&keyed("declared-3"), "{").await,
        service
            .checkout(&keyed("declared-3"), r#"{"amount": -1}"#)
            .await,
        service.checkout(&keyed("declared-3")[..2], body).await,
        service.checkout(&keyed("declared-3")[1..], body).await,
        service
            .checkout(&[keyed("declared-3")[0], keyed("declared-3")[2]], body)
            .await,
        (service.declared_too_large().await, None),
    ];
    let mut statuses: Vec<u16> = seen.iter().map(|(status, _)| *status).collect();
    assert_eq!(
        statuses,
        [201, 201, 422, 402, 400, 422, 400, 401, 415, 413],
        "{seen:?}"
    );
    // The demo's steps print each status it was answered: "-> 409 Conflict …".
    statuses.extend(DEMO_STEPS.iter().filter_map(|line| {
        let status = line.strip_prefix("-> ")?.split_whitespace().next()?;
        status.parse::<u16>().ok()
    }));
    let create = &document["paths"]["/v1/checkouts"]["post"]["responses"];
    // The demo also reads the order back (200).
    let read = &document["paths"]["/v1/checkouts/{order_id}"]["get"]["responses"];
    for status in statuses {
        let status = status.to_string();
        assert!(
            create.get(&status).is_some() || read.get(&status).is_some(),
            "{status} is not declared: {create}"
        );
    }
    let order = service
        .http
        .get(format!("{}/v1/checkouts/nothing", service.url))
        .bearer_auth("acme")
        .send()
        .await
        .unwrap();
    assert_eq!(order.status(), 404);
    assert!(document["paths"]["/v1/checkouts/{order_id}"]["get"]["responses"]["404"].is_object());
}

/// The request schema refuses what the route refuses: no string of a request may hold U+0000
/// (the runner refuses it, 422, on every engine), so each string property's pattern says so.
#[tokio::test]
async fn the_request_schema_refuses_a_string_holding_nul_as_the_route_does() {
    let service = tokio::task::spawn_blocking(|| Service::start("nul"))
        .await
        .unwrap();
    let body = json!({"amount": 2500, "currency": "usd", "source": "tok\u{0}visa"}).to_string();
    let (status, code) = service.checkout(&keyed("nul-1"), &body).await;
    assert_eq!((status, code.as_deref()), (422, Some("request_invalid")));

    let document = service.document().await;
    let properties = &document["components"]["schemas"]["CheckoutRequest"]["properties"];
    for (name, property) in properties.as_object().unwrap() {
        if property["type"] != "string" {
            continue;
        }
        let pattern = property["pattern"].as_str().unwrap_or_default();
        assert!(
            refuses_nul(pattern),
            "{name}'s pattern {pattern:?} lets U+0000 through"
        );
    }
}

/// Whether a pattern can match no string holding U+0000: it excludes it in a negated class, or
/// is made only of positive classes and literals (no `.`, no negated class).
fn refuses_nul(pattern: &str) -> bool {
    let anchored = pattern.starts_with('^') && pattern.ends_with('$');
    anchored
        && (pattern.contains(r"[^\u0000]") || (!pattern.contains('.') && !pattern.contains("[^")))
}

/// The runner stores problems of its own (retries ran out, a terminal failure): each is in the
/// layer's catalogue with its status, so the document declares them.
#[test]
fn every_problem_the_runner_stores_is_in_the_catalogue() {
    let source =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/idemflow-runner/src");
    let mut seen = 0;
    let mut directories = vec![source];
    while let Some(directory) = directories.pop() {
        for entry in std::fs::read_dir(directory).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                directories.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (start, _) in text.match_indices("problem(") {
                let call = &text[start + "problem(".len()..];
                let Some((status, rest)) = call.split_once(", \"") else {
                    continue;
                };
                let (Ok(status), Some((code, _))) = (status.parse::<u16>(), rest.split_once('"'))
                else {
                    continue;
                };
                seen += 1;
                let kind = ProblemType::of_code(code).unwrap_or_else(|| {
                    panic!("{}: {code} is not in the catalogue", path.display())
                });
                assert_eq!(kind.status, status, "{code}");
            }
        }
    }
    assert!(seen >= 2, "the runner's problems were not found");
}

/// docs/http.md's table of statuses names every problem of the catalogue.
#[test]
fn every_problem_of_the_catalogue_is_in_the_http_documentation() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/http.md"),
    )
    .unwrap();
    for kind in ProblemType::ALL {
        assert!(
            page.contains(&format!("`code: {}`", kind.code))
                || page.contains(&format!("`{}`", kind.code)),
            "docs/http.md does not name {}",
            kind.code
        );
    }
}

/// The route refuses what the request schema refuses: an amount past the schema's `maximum`
/// (2^53 - 1) is refused 422, before anything runs, as the schema says, though 2^53 is a number
/// a double holds exactly and canonical JSON takes.
#[tokio::test]
async fn the_route_refuses_an_amount_past_the_schemas_maximum() {
    let service = tokio::task::spawn_blocking(|| Service::start("maximum"))
        .await
        .unwrap();
    let document = service.document().await;
    let amount = &document["components"]["schemas"]["CheckoutRequest"]["properties"]["amount"];
    let maximum = amount["maximum"].as_u64().expect("the amount's maximum");
    assert_eq!(maximum, (1 << 53) - 1);
    let at = |amount: u64| {
        json!({"amount": amount, "currency": "usd", "source": "tok_visa"}).to_string()
    };
    let (status, _) = service.checkout(&keyed("maximum-1"), &at(maximum)).await;
    assert_eq!(status, 201);
    let (status, code) = service
        .checkout(&keyed("maximum-2"), &at(maximum + 1))
        .await;
    assert_eq!((status, code.as_deref()), (422, Some("request_invalid")));
}

/// The Idempotency-Key parameter's pattern takes exactly the keys the service takes: each key
/// below is sent, and the pattern matches it if and only if the service did not refuse it 400;
/// but for a quoted key past 128 bytes, which the service takes and the pattern (bounded without
/// lookahead, which JSON Schema's validators do not all read) leaves out.
#[tokio::test]
async fn the_key_pattern_takes_exactly_the_keys_the_service_takes() {
    let service = tokio::task::spawn_blocking(|| Service::start("key-pattern"))
        .await
        .unwrap();
    let document = service.document().await;
    let parameters = document["paths"]["/v1/checkouts"]["post"]["parameters"]
        .as_array()
        .unwrap();
    let key = parameters
        .iter()
        .find(|parameter| parameter["name"] == "Idempotency-Key")
        .unwrap();
    let pattern = regex::Regex::new(key["schema"]["pattern"].as_str().unwrap()).unwrap();
    let long = "k".repeat(255);
    let longer = "k".repeat(256);
    let keys = [
        "order-7f3a".to_owned(),
        "a b".to_owned(),
        "a\"b".to_owned(),
        "a,b".to_owned(),
        "a;b".to_owned(),
        "\"quoted\"".to_owned(),
        "\"with \\\"escapes\\\\\"".to_owned(),
        "\" leading space\"".to_owned(),
        "\"a,b;c\"".to_owned(),
        "\"   \"".to_owned(),
        "\"\"".to_owned(),
        "\"unclosed".to_owned(),
        "\"a\"b".to_owned(),
        "\"a\\b\"".to_owned(),
        long.clone(),
        longer.clone(),
        format!("\"{long}\""),
        format!("\"{longer}\""),
    ];
    let body = r#"{"amount": 2500, "currency": "usd", "source": "tok_visa"}"#;
    for key in keys {
        let headers = [
            ("authorization", "Bearer acme"),
            ("content-type", "application/json"),
            ("idempotency-key", key.as_str()),
        ];
        let (status, code) = service.checkout(&headers, body).await;
        let taken = status != 400;
        let past_the_bound = key.starts_with('"') && key.len() > 130;
        assert_eq!(
            pattern.is_match(&key),
            taken && !past_the_bound,
            "{key:?}: answered {status} {code:?}, the pattern says otherwise"
        );
    }
}
