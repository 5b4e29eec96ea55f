//! A headless Chromium driven over WebDriver (W3C), for tests of web pages served on loopback.
//!
//! [`Browser::start`] runs `chromedriver` on a free port of `127.0.0.1` as a child process, waits
//! until it is ready and opens a session with a headless Chromium on a fresh profile. The browser
//! then loads pages, finds elements by CSS selector, types, clicks, answers `confirm()` dialogs,
//! runs scripts and takes screenshots. Dropping the [`Browser`] (or [`Browser::quit`]) closes the
//! browser and ends `chromedriver`.
//!
//! The binaries are `/usr/bin/chromedriver` and `/usr/bin/chromium` (Debian's `chromium-driver`
//! and `chromium` packages, which `scripts/lib/packages.sh` installs), or the ones named by
//! `IDEMFLOW_CHROMEDRIVER` and `IDEMFLOW_CHROMIUM`. When one is missing, [`Browser::start`] fails
//! with [`BrowserError::Missing`]; a test that needs a browser fails rather than skips.
//!
//! ```no_run
//! use std::time::Duration;
//! use idemflow_testrig::browser::Browser;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idemflow_testrig::browser::BrowserError> {
//! let browser = Browser::start().await?;
//! browser.goto("http://127.0.0.1:8080/keys").await?;
//! browser.find("input[name=key]").await?.send_keys("order-42").await?;
//! browser.find("form#search").await?.submit().await?;
//! let row = browser.wait_for("tr.key", Duration::from_secs(5)).await?;
//! assert!(row.text().await?.contains("order-42"));
//! browser.find("button.delete").await?.click().await?;
//! assert_eq!(browser.alert_text().await?, "Delete order-42?");
//! browser.accept_alert().await?;
//! browser.quit().await
//! # }
//! ```

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde_json::{Value, json};

/// The variable naming the `chromedriver` binary (default [`DEFAULT_CHROMEDRIVER`]).
pub const CHROMEDRIVER_VAR: &str = "IDEMFLOW_CHROMEDRIVER";
/// The variable naming the Chromium binary (default [`DEFAULT_CHROMIUM`]).
pub const CHROMIUM_VAR: &str = "IDEMFLOW_CHROMIUM";
/// Where Debian's `chromium-driver` package installs `chromedriver`.
pub const DEFAULT_CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// Where Debian's `chromium` package installs Chromium.
pub const DEFAULT_CHROMIUM: &str = "/usr/bin/chromium";

/// The key WebDriver names an element reference by, in requests and responses.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// How long `chromedriver` may take to answer `/status` as ready.
const DRIVER_READY: Duration = Duration::from_secs(20);
/// How long one WebDriver command may take (starting the browser is the slowest).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How often [`Browser::wait_for`] looks again.
const POLL: Duration = Duration::from_millis(50);

/// What went wrong driving the browser.
#[derive(Debug, thiserror::Error)]
pub enum BrowserError {
    /// A binary is not installed where it was looked for.
    #[error(
        "{what} not found at {} (set {variable} to another path, or install Debian's {package} \
         package: scripts/lib/packages.sh's idemflow_require_chromium does, as root)",
        path.display()
    )]
    Missing {
        /// `chromedriver` or `chromium`.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// The variable that names another path.
        variable: &'static str,
        /// The Debian package that installs it.
        package: &'static str,
    },
    /// `chromedriver` could not be run, or did not become ready.
    #[error("chromedriver did not start: {0}")]
    Driver(String),
    /// WebDriver answered a command with an error.
    #[error("WebDriver {command}: {code}: {message}")]
    WebDriver {
        /// The command, as `METHOD /path` below the session.
        command: String,
        /// WebDriver's error code: `no such element`, `no such alert`, `unexpected alert open`…
        code: String,
        /// Its message.
        message: String,
    },
    /// [`Browser::wait_for`] found no element in time.
    #[error("no element matches {selector:?} after {waited:?}")]
    Timeout {
        /// The CSS selector waited for.
        selector: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The HTTP exchange with `chromedriver` failed.
    #[error("talking to chromedriver: {0}")]
    Http(#[from] reqwest::Error),
    /// `chromedriver` answered something that is not WebDriver's shape.
    #[error("unexpected answer from chromedriver to {command}: {answer}")]
    Protocol {
        /// The command.
        command: String,
        /// What came back.
        answer: String,
    },
    /// Reading or writing a local file (the profile, a screenshot).
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl BrowserError {
    /// WebDriver's error code, when the error is WebDriver's.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::WebDriver { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether the error is WebDriver's `no such element`.
    pub fn is_no_such_element(&self) -> bool {
        self.code() == Some("no such element")
    }
}

/// The binary named by `variable`, else `default`; an error naming the package when it is absent.
fn binary(
    what: &'static str,
    variable: &'static str,
    default: &str,
    package: &'static str,
) -> Result<PathBuf, BrowserError> {
    let path = std::env::var_os(variable)
        .filter(|value| !value.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from);
    if path.is_file() {
        Ok(path)
    } else {
        Err(BrowserError::Missing {
            what,
            path,
            variable,
            package,
        })
    }
}

/// A directory of its own under the system's temporary directory, removed on drop.
#[derive(Debug)]
struct Profile(PathBuf);

impl Profile {
    fn create() -> Result<Self, BrowserError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "idemflow-browser-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path)?;
        Ok(Self(path))
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `chromedriver` child process; shut down (and killed if it lingers) on drop.
#[derive(Debug)]
struct Driver {
    child: Child,
    address: SocketAddr,
}

impl Driver {
    /// Runs `chromedriver` on a free port; tries another port if it exits at once (the port was
    /// taken between choosing and binding it).
    fn spawn(path: &Path) -> Result<Self, BrowserError> {
        let mut last = String::new();
        for _ in 0..3 {
            let address = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?;
            let mut child = Command::new(path)
                .arg(format!("--port={}", address.port()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|error| {
                    BrowserError::Driver(format!("running {}: {error}", path.display()))
                })?;
            std::thread::sleep(Duration::from_millis(20));
            match child.try_wait()? {
                None => return Ok(Self { child, address }),
                Some(status) => last = format!("{} exited at once: {status}", path.display()),
            }
        }
        Err(BrowserError::Driver(last))
    }

    fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Polls `/status` until the driver says it is ready.
    async fn ready(&mut self, http: &reqwest::Client) -> Result<(), BrowserError> {
        let started = Instant::now();
        let status = format!("{}/status", self.url());
        loop {
            if let Some(exit) = self.child.try_wait()? {
                return Err(BrowserError::Driver(format!(
                    "chromedriver exited before it was ready: {exit}"
                )));
            }
            if let Ok(response) = http.get(&status).send().await
                && let Ok(body) = response.json::<Value>().await
                && body["value"]["ready"] == Value::Bool(true)
            {
                return Ok(());
            }
            if started.elapsed() > DRIVER_READY {
                return Err(BrowserError::Driver(format!(
                    "chromedriver not ready at {status} after {DRIVER_READY:?}"
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // chromedriver's /shutdown closes the browsers of its sessions, then exits: killing it
        // outright would leave a browser behind. Plain HTTP over a blocking socket, as drop cannot
        // await.
        if let Ok(mut stream) = TcpStream::connect_timeout(&self.address, Duration::from_secs(1)) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let request = format!(
                "GET /shutdown HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.address
            );
            if stream.write_all(request.as_bytes()).is_ok() {
                let _ = stream.read_to_end(&mut Vec::new());
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The HTTP client and the session's URL, shared by the browser and its elements.
#[derive(Debug)]
struct Session {
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`.
    url: String,
}

impl Session {
    /// Sends one command below the session and returns its `value`.
    async fn command(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, BrowserError> {
        let url = format!("{}{path}", self.url);
        let name = format!("{method} {path}");
        let request = self.http.request(method.clone(), &url);
        let request = match body {
            Some(body) => request.json(&body),
            // POSTs carry a JSON object even when they have nothing to say.
            None if method == reqwest::Method::POST => request.json(&json!({})),
            None => request,
        };
        answer(name, request.send().await?).await
    }

    async fn get(&self, path: &str) -> Result<Value, BrowserError> {
        self.command(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, BrowserError> {
        self.command(reqwest::Method::POST, path, Some(body)).await
    }

    /// A string `value`.
    async fn get_string(&self, path: &str) -> Result<String, BrowserError> {
        match self.get(path).await? {
            Value::String(text) => Ok(text),
            other => Err(BrowserError::Protocol {
                command: format!("GET {path}"),
                answer: other.to_string(),
            }),
        }
    }
}

/// The `value` of a WebDriver response, or its error.
async fn answer(command: String, response: reqwest::Response) -> Result<Value, BrowserError> {
    let status = response.status();
    let text = response.text().await?;
    let Ok(mut body) = serde_json::from_str::<Value>(&text) else {
        return Err(BrowserError::Protocol {
            command,
            answer: format!("{status}: {text}"),
        });
    };
    let value = body["value"].take();
    if let Some(code) = value.get("error").and_then(Value::as_str) {
        return Err(BrowserError::WebDriver {
            command,
            code: code.to_owned(),
            message: value["message"].as_str().unwrap_or_default().to_owned(),
        });
    }
    if !status.is_success() {
        return Err(BrowserError::Protocol {
            command,
            answer: format!("{status}: {text}"),
        });
    }
    Ok(value)
}

/// A headless Chromium session. See the [module](self) documentation.
#[derive(Debug)]
pub struct Browser {
    session: Arc<Session>,
    /// Declared after the session, before the profile: dropped in that order, so the browser is
    /// gone before its profile is removed.
    driver: Driver,
    _profile: Profile,
}

impl Browser {
    /// Starts `chromedriver` and a headless Chromium (window 1280×900, a fresh profile).
    ///
    /// Fails with [`BrowserError::Missing`] when either binary is not installed.
    pub async fn start() -> Result<Self, BrowserError> {
        let chromedriver = binary(
            "chromedriver",
            CHROMEDRIVER_VAR,
            DEFAULT_CHROMEDRIVER,
            "chromium-driver",
        )?;
        let chromium = binary("chromium", CHROMIUM_VAR, DEFAULT_CHROMIUM, "chromium")?;
        let profile = Profile::create()?;
        let http = reqwest::Client::builder()
            .timeout(COMMAND_TIMEOUT)
            .no_proxy()
            .build()?;
        let mut driver = Driver::spawn(&chromedriver)?;
        driver.ready(&http).await?;
        let capabilities = json!({
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    // A dialog stays open until the test answers it; other commands fail
                    // meanwhile with `unexpected alert open`.
                    "unhandledPromptBehavior": "ignore",
                    "timeouts": { "implicit": 0, "pageLoad": 30_000, "script": 30_000 },
                    "goog:chromeOptions": {
                        "binary": chromium.to_string_lossy(),
                        "args": [
                            "--headless=new",
                            // Chromium's sandbox refuses to run as root.
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            "--window-size=1280,900",
                            "--no-first-run",
                            "--no-default-browser-check",
                            format!("--user-data-dir={}", profile.0.display()),
                        ],
                    },
                },
            },
        });
        let response = http
            .post(format!("{}/session", driver.url()))
            .json(&capabilities)
            .send()
            .await?;
        let value = answer("POST /session".to_owned(), response).await?;
        let Some(id) = value["sessionId"].as_str() else {
            return Err(BrowserError::Protocol {
                command: "POST /session".to_owned(),
                answer: value.to_string(),
            });
        };
        let session = Session {
            url: format!("{}/session/{id}", driver.url()),
            http,
        };
        Ok(Self {
            session: Arc::new(session),
            driver,
            _profile: profile,
        })
    }

    /// Closes the browser and ends `chromedriver`. (Dropping does too, without waiting for the
    /// browser's answer.)
    pub async fn quit(self) -> Result<(), BrowserError> {
        self.session
            .command(reqwest::Method::DELETE, "", None)
            .await
            .map(drop)
    }

    /// Loads `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) -> Result<(), BrowserError> {
        self.session
            .post("/url", json!({ "url": url }))
            .await
            .map(drop)
    }

    /// The URL of the page shown.
    pub async fn current_url(&self) -> Result<String, BrowserError> {
        self.session.get_string("/url").await
    }

    /// The page's title.
    pub async fn title(&self) -> Result<String, BrowserError> {
        self.session.get_string("/title").await
    }

    /// The page's HTML as the browser holds it now (scripts' changes included).
    pub async fn page_source(&self) -> Result<String, BrowserError> {
        self.session.get_string("/source").await
    }

    /// Goes back one page in the history.
    pub async fn back(&self) -> Result<(), BrowserError> {
        self.session.post("/back", json!({})).await.map(drop)
    }

    /// Reloads the page.
    pub async fn refresh(&self) -> Result<(), BrowserError> {
        self.session.post("/refresh", json!({})).await.map(drop)
    }

    /// The first element matching the CSS selector, now; `no such element` when there is none.
    pub async fn find(&self, css: &str) -> Result<Element, BrowserError> {
        let value = self.session.post("/element", locator(css)).await?;
        Element::from_reference(&self.session, &value, "/element")
    }

    /// Every element matching the CSS selector, in document order (none is not an error).
    pub async fn find_all(&self, css: &str) -> Result<Vec<Element>, BrowserError> {
        let value = self.session.post("/elements", locator(css)).await?;
        elements(&self.session, &value, "/elements")
    }

    /// The first element matching the CSS selector, looking again until one appears or `timeout`
    /// has passed ([`BrowserError::Timeout`]).
    pub async fn wait_for(&self, css: &str, timeout: Duration) -> Result<Element, BrowserError> {
        let started = Instant::now();
        loop {
            match self.find(css).await {
                Err(error) if error.is_no_such_element() => {}
                found => return found,
            }
            if started.elapsed() >= timeout {
                return Err(BrowserError::Timeout {
                    selector: css.to_owned(),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The text of the open `alert()`, `confirm()` or `prompt()`; `no such alert` when none is.
    pub async fn alert_text(&self) -> Result<String, BrowserError> {
        self.session.get_string("/alert/text").await
    }

    /// Answers the open dialog with OK (`confirm()` returns true).
    pub async fn accept_alert(&self) -> Result<(), BrowserError> {
        self.session
            .post("/alert/accept", json!({}))
            .await
            .map(drop)
    }

    /// Answers the open dialog with Cancel (`confirm()` returns false).
    pub async fn dismiss_alert(&self) -> Result<(), BrowserError> {
        self.session
            .post("/alert/dismiss", json!({}))
            .await
            .map(drop)
    }

    /// Runs `script` as the body of a function in the page, with `args` as `arguments` (an
    /// [`Element::reference`] is the element itself there), and returns what it returns (an
    /// element comes back as a reference: [`Browser::element`] turns it into an [`Element`]).
    pub async fn execute(&self, script: &str, args: &[Value]) -> Result<Value, BrowserError> {
        self.session
            .post("/execute/sync", json!({ "script": script, "args": args }))
            .await
    }

    /// The element an element reference returned by [`Browser::execute`] names.
    pub fn element(&self, reference: &Value) -> Result<Element, BrowserError> {
        Element::from_reference(&self.session, reference, "/execute/sync")
    }

    /// Saves a PNG screenshot of the viewport to `path`.
    pub async fn screenshot_png(&self, path: impl AsRef<Path>) -> Result<(), BrowserError> {
        let encoded = self.session.get_string("/screenshot").await?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_bytes())
            .map_err(|error| BrowserError::Protocol {
                command: "GET /screenshot".to_owned(),
                answer: format!("not base64: {error}"),
            })?;
        std::fs::write(path, png)?;
        Ok(())
    }

    /// Resizes the window (outer size, in CSS pixels).
    pub async fn set_window_size(&self, width: u32, height: u32) -> Result<(), BrowserError> {
        self.session
            .post("/window/rect", json!({ "width": width, "height": height }))
            .await
            .map(drop)
    }

    /// The address `chromedriver` listens on.
    pub fn driver_address(&self) -> SocketAddr {
        self.driver.address
    }
}

/// A CSS locator.
fn locator(css: &str) -> Value {
    json!({ "using": "css selector", "value": css })
}

/// The elements of an array of element references.
fn elements(
    session: &Arc<Session>,
    value: &Value,
    command: &str,
) -> Result<Vec<Element>, BrowserError> {
    let Some(references) = value.as_array() else {
        return Err(BrowserError::Protocol {
            command: command.to_owned(),
            answer: value.to_string(),
        });
    };
    references
        .iter()
        .map(|reference| Element::from_reference(session, reference, command))
        .collect()
}

/// An element of the page shown when it was found. (A page loaded since makes it stale: WebDriver
/// answers `stale element reference`.)
#[derive(Debug, Clone)]
pub struct Element {
    session: Arc<Session>,
    id: String,
}

impl Element {
    fn from_reference(
        session: &Arc<Session>,
        reference: &Value,
        command: &str,
    ) -> Result<Self, BrowserError> {
        match reference.get(ELEMENT_KEY).and_then(Value::as_str) {
            Some(id) => Ok(Self {
                session: Arc::clone(session),
                id: id.to_owned(),
            }),
            None => Err(BrowserError::Protocol {
                command: command.to_owned(),
                answer: reference.to_string(),
            }),
        }
    }

    fn path(&self, rest: &str) -> String {
        format!("/element/{}{rest}", self.id)
    }

    /// The element as an argument of [`Browser::execute`].
    pub fn reference(&self) -> Value {
        json!({ ELEMENT_KEY: self.id })
    }

    /// Its rendered text (what a reader sees: hidden parts left out).
    pub async fn text(&self) -> Result<String, BrowserError> {
        self.session.get_string(&self.path("/text")).await
    }

    /// Clicks it, in its middle, as a user would (it is scrolled into view first).
    pub async fn click(&self) -> Result<(), BrowserError> {
        self.session
            .post(&self.path("/click"), json!({}))
            .await
            .map(drop)
    }

    /// Types `text` into it, after what it already holds.
    pub async fn send_keys(&self, text: &str) -> Result<(), BrowserError> {
        self.session
            .post(&self.path("/value"), json!({ "text": text }))
            .await
            .map(drop)
    }

    /// Empties an input or text area.
    pub async fn clear(&self) -> Result<(), BrowserError> {
        self.session
            .post(&self.path("/clear"), json!({}))
            .await
            .map(drop)
    }

    /// Its attribute `name` as written in the HTML (`None` when absent).
    pub async fn attribute(&self, name: &str) -> Result<Option<String>, BrowserError> {
        let value = self
            .session
            .get(&self.path(&format!("/attribute/{name}")))
            .await?;
        Ok(value.as_str().map(str::to_owned))
    }

    /// Its DOM property `name` (an input's current `value`, a checkbox's `checked`…).
    pub async fn property(&self, name: &str) -> Result<Value, BrowserError> {
        self.session
            .get(&self.path(&format!("/property/{name}")))
            .await
    }

    /// Whether it is shown.
    pub async fn is_displayed(&self) -> Result<bool, BrowserError> {
        let path = self.path("/displayed");
        match self.session.get(&path).await? {
            Value::Bool(shown) => Ok(shown),
            other => Err(BrowserError::Protocol {
                command: format!("GET {path}"),
                answer: other.to_string(),
            }),
        }
    }

    /// The first element inside it matching the CSS selector.
    pub async fn find(&self, css: &str) -> Result<Element, BrowserError> {
        let path = self.path("/element");
        let value = self.session.post(&path, locator(css)).await?;
        Self::from_reference(&self.session, &value, &path)
    }

    /// Every element inside it matching the CSS selector.
    pub async fn find_all(&self, css: &str) -> Result<Vec<Element>, BrowserError> {
        let path = self.path("/elements");
        let value = self.session.post(&path, locator(css)).await?;
        elements(&self.session, &value, &path)
    }

    /// Submits its form (itself, when it is a form) by clicking the form's submit button, as a
    /// user would: the form's `onsubmit` runs (a `confirm()` in it opens), and the button's name
    /// and value are sent. Fails with `no such element` when the form has no submit button.
    pub async fn submit(&self) -> Result<(), BrowserError> {
        let script = "const element = arguments[0];\n\
             const form = element instanceof HTMLFormElement ? element : (element.form || element.closest('form'));\n\
             if (!form) { return null; }\n\
             return Array.from(form.elements).find((control) =>\n\
               (control instanceof HTMLButtonElement && control.type === 'submit') ||\n\
               (control instanceof HTMLInputElement && (control.type === 'submit' || control.type === 'image'))) || null;";
        let button = self
            .session
            .post(
                "/execute/sync",
                json!({ "script": script, "args": [self.reference()] }),
            )
            .await?;
        if button.is_null() {
            return Err(BrowserError::WebDriver {
                command: "submit".to_owned(),
                code: "no such element".to_owned(),
                message: "no form with a submit button holds this element".to_owned(),
            });
        }
        Self::from_reference(&self.session, &button, "submit")?
            .click()
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_names_the_package_and_the_script_that_installs_it() {
        let error = binary(
            "chromedriver",
            "IDEMFLOW_BROWSER_TEST_NEVER_SET",
            "/nonexistent/chromedriver",
            "chromium-driver",
        )
        .expect_err("the path does not exist");
        let message = error.to_string();
        for part in [
            "/nonexistent/chromedriver",
            "chromium-driver",
            "IDEMFLOW_BROWSER_TEST_NEVER_SET",
            "scripts/lib/packages.sh",
        ] {
            assert!(message.contains(part), "{part} not in: {message}");
        }
    }
}
