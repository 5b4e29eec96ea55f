//! The minimal example (`examples/hello`), run as a newcomer runs it: the built binary on a free
//! port and a SQLite file of its own, then the request it prints, sent twice and once changed.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use crate::support::example::built_example;

/// Kills the example when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_hello_example_charges_once_and_replays_the_first_answer() {
    let binary = tokio::task::spawn_blocking(|| built_example("hello"))
        .await
        .unwrap();
    let directory = std::env::temp_dir().join(format!("idemflow-hello-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let mut child = Command::new(binary)
        .args([
            "127.0.0.1:0".as_ref(),
            directory.join("hello.db").as_os_str(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _running = Running(child);
    // Read to the end, not only to the address: the example prints more after it, and a closed
    // pipe would make its next print fail (and the example with it).
    let (address, found) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(base) = line.strip_prefix("hello: listening on ") {
                let _ = address.send(base.to_owned());
            }
        }
    });
    let base = tokio::task::spawn_blocking(move || found.recv())
        .await
        .unwrap()
        .expect("the example prints the address it listens on");

    let client = reqwest::Client::new();
    let pay = |amount: u64| {
        client
            .post(format!("{base}/payments"))
            .bearer_auth("acme")
            .header("Idempotency-Key", "k1")
            .json(&serde_json::json!({ "amount": amount }))
            .send()
    };
    let first = pay(500).await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.bytes().await.unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&first_body).unwrap();
    assert!(
        answer["charge"]
            .as_str()
            .is_some_and(|id| id.starts_with("ch_")),
        "the card was charged: {answer}"
    );

    let again = pay(500).await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.bytes().await.unwrap(),
        first_body,
        "the first answer, byte for byte"
    );

    let changed = pay(900).await.unwrap();
    assert_eq!(
        changed.status(),
        422,
        "another request under the key is refused"
    );
    let _ = std::fs::remove_dir_all(&directory);
}
