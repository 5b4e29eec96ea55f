//! `idemflow_testrig::browser` against a small page served on loopback: a headless Chromium types
//! into a form and submits it, reads the page it gets back, answers `confirm()` dialogs both ways
//! (one guarding a form's submission), runs a script and saves a screenshot.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::Html;
use axum::routing::{get, post};
use idemflow_testrig::browser::{Browser, BrowserError};
use serde_json::json;

const HOME: &str = r#"<!doctype html>
<html><head><title>Keys</title></head>
<body>
<h1>Keys</h1>
<p id="intro">Look a key up.</p>
<form id="search" method="post" action="/search">
  <input id="key" name="key" autocomplete="off">
  <button type="submit">Search</button>
</form>
<form id="forget" method="post" action="/forget" onsubmit="return confirm('Forget order-42?')">
  <button type="submit" id="forget-button">Forget</button>
</form>
<button id="ask" onclick="document.getElementById('answer').textContent = confirm('Really?') ? 'yes' : 'no'">Ask</button>
<p id="answer"></p>
</body></html>
"#;

/// `+` as a space and `%XX` escapes, as a browser encodes a form.
fn form_decode(encoded: &str) -> String {
    let bytes = encoded.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        match bytes[index] {
            b'+' => decoded.push(b' '),
            b'%' if index + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[index + 1..index + 3]).unwrap();
                decoded.push(u8::from_str_radix(hex, 16).unwrap());
                index += 2;
            }
            byte => decoded.push(byte),
        }
        index += 1;
    }
    String::from_utf8(decoded).unwrap()
}

/// The value of field `name` in a form's body.
fn form_field(body: &str, name: &str) -> Option<String> {
    body.split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(field, _)| *field == name)
        .map(|(_, value)| form_decode(value))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn result_page(title: &str, result: &str) -> Html<String> {
    Html(format!(
        "<!doctype html><html><head><title>{title}</title></head><body>\
         <p id=\"result\">{}</p><ul><li>one</li><li>two</li></ul></body></html>",
        escape(result)
    ))
}

/// Serves the page on a loopback port; the count is how many forms `/forget` received.
async fn serve() -> (SocketAddr, Arc<AtomicUsize>) {
    let forgotten = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/", get(|| async { Html(HOME) }))
        .route(
            "/search",
            post(|body: String| async move {
                let key = form_field(&body, "key").unwrap_or_default();
                result_page("Found", &format!("Found: {key}"))
            }),
        )
        .route(
            "/forget",
            post(|State(forgotten): State<Arc<AtomicUsize>>| async move {
                forgotten.fetch_add(1, Ordering::SeqCst);
                result_page("Forgotten", "Forgotten")
            }),
        )
        .with_state(Arc::clone(&forgotten));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (address, forgotten)
}

#[tokio::test]
async fn a_headless_browser_fills_forms_answers_dialogs_and_takes_screenshots() {
    let started = Instant::now();
    let (address, forgotten) = serve().await;
    let home = format!("http://{address}/");
    let browser = Browser::start().await.unwrap();

    browser.goto(&home).await.unwrap();
    assert_eq!(browser.title().await.unwrap(), "Keys");
    assert_eq!(browser.current_url().await.unwrap(), home);
    assert_eq!(
        browser.find("#intro").await.unwrap().text().await.unwrap(),
        "Look a key up."
    );
    assert!(
        browser
            .page_source()
            .await
            .unwrap()
            .contains("id=\"search\"")
    );
    assert_eq!(browser.find_all("form").await.unwrap().len(), 2);

    // Absent elements: an error at once, a timeout when waited for.
    let absent = browser.find("#absent").await.unwrap_err();
    assert!(absent.is_no_such_element(), "{absent}");
    let waited = browser
        .wait_for("#absent", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(waited, BrowserError::Timeout { .. }), "{waited}");

    // Type, then submit by the form's button; the server's answer is the next page.
    let key = browser.find("#key").await.unwrap();
    assert_eq!(key.attribute("name").await.unwrap().as_deref(), Some("key"));
    assert_eq!(key.attribute("placeholder").await.unwrap(), None);
    key.send_keys("order-42 & <co>").await.unwrap();
    assert_eq!(
        key.property("value").await.unwrap(),
        json!("order-42 & <co>")
    );
    browser
        .find("#search")
        .await
        .unwrap()
        .submit()
        .await
        .unwrap();
    let result = browser
        .wait_for("#result", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(result.text().await.unwrap(), "Found: order-42 & <co>");
    assert_eq!(
        browser.current_url().await.unwrap(),
        format!("{home}search")
    );
    let items = browser
        .find("ul")
        .await
        .unwrap()
        .find_all("li")
        .await
        .unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[1].text().await.unwrap(), "two");

    // A script, with an element as argument and one as its result.
    let joined = browser
        .execute(
            "return arguments[0].textContent + arguments[1];",
            &[items[0].reference(), json!("!")],
        )
        .await
        .unwrap();
    assert_eq!(joined, json!("one!"));
    let last = browser
        .execute("return document.querySelector('li:last-child');", &[])
        .await
        .unwrap();
    assert_eq!(browser.element(&last).unwrap().text().await.unwrap(), "two");

    // A confirm() answered Cancel, then OK.
    browser.goto(&home).await.unwrap();
    let ask = browser.find("#ask").await.unwrap();
    ask.click().await.unwrap();
    assert_eq!(browser.alert_text().await.unwrap(), "Really?");
    browser.dismiss_alert().await.unwrap();
    let answer = browser.find("#answer").await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "no");
    ask.click().await.unwrap();
    browser.accept_alert().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "yes");
    let none = browser.alert_text().await.unwrap_err();
    assert_eq!(none.code(), Some("no such alert"), "{none}");

    // A confirm() guarding a form: Cancel sends nothing, OK sends the form.
    let forget = browser.find("#forget-button").await.unwrap();
    forget.click().await.unwrap();
    assert_eq!(browser.alert_text().await.unwrap(), "Forget order-42?");
    browser.dismiss_alert().await.unwrap();
    assert_eq!(browser.title().await.unwrap(), "Keys");
    assert_eq!(forgotten.load(Ordering::SeqCst), 0);
    forget.click().await.unwrap();
    browser.accept_alert().await.unwrap();
    let result = browser
        .wait_for("#result", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(result.text().await.unwrap(), "Forgotten");
    assert_eq!(forgotten.load(Ordering::SeqCst), 1);

    // A screenshot, at another window size.
    browser.set_window_size(800, 600).await.unwrap();
    let directory = std::env::temp_dir().join(format!(
        "idemflow-browser-screenshot-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&directory).unwrap();
    let path = directory.join("forgotten.png");
    browser.screenshot_png(&path).await.unwrap();
    let png = std::fs::read(&path).unwrap();
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG: {:?}",
        &png[..png.len().min(8)]
    );
    assert!(png.len() > 100, "{} bytes", png.len());
    std::fs::remove_dir_all(&directory).unwrap();

    browser.quit().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}
