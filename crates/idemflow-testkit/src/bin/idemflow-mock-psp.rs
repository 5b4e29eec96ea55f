//! `idemflow-mock-psp`: the mock payment provider, standalone.
//!
//! ```text
//! idemflow-mock-psp [--bind 127.0.0.1:4242] [--key-ttl SECONDS]
//! ```
//!
//! Prints the URL it listens on as the first line of stdout, then serves until Ctrl-C. Faults can
//! only be scripted from Rust, through `idemflow_testkit::provider::MockProvider`.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use idemflow_testkit::provider::{DEFAULT_KEY_TTL, MockProvider};

const USAGE: &str = "usage: idemflow-mock-psp [--bind ADDR] [--key-ttl SECONDS]

  --bind ADDR          address to listen on (default 127.0.0.1:0, a random port)
  --key-ttl SECONDS    how long an idempotency key is remembered (default 86400)

Prints the URL it listens on, then serves POST /v1/charges until Ctrl-C.";

#[derive(Debug)]
struct Args {
    bind: SocketAddr,
    key_ttl: Duration,
}

enum Parsed {
    Run(Args),
    Help,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Parsed, String> {
    let mut parsed = Args {
        bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        key_ttl: DEFAULT_KEY_TTL,
    };
    while let Some(arg) = args.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => {
                (name.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match name.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--bind" => {
                let v = value("--bind")?;
                parsed.bind = v
                    .parse()
                    .map_err(|e| format!("--bind {v}: not an address like 127.0.0.1:4242 ({e})"))?;
            }
            "--key-ttl" => {
                let v = value("--key-ttl")?;
                let seconds: u64 = v
                    .parse()
                    .map_err(|e| format!("--key-ttl {v}: not a number of seconds ({e})"))?;
                parsed.key_ttl = Duration::from_secs(seconds);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Parsed::Run(parsed))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Parsed::Run(args)) => args,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("idemflow-mock-psp: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let provider = match MockProvider::builder()
        .bind(args.bind)
        .key_ttl(args.key_ttl)
        .start()
        .await
    {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("idemflow-mock-psp: cannot listen on {}: {e}", args.bind);
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{}", provider.url())
        .and_then(|()| stdout.flush())
        .is_err()
    {
        return ExitCode::FAILURE;
    }
    drop(stdout);
    eprintln!(
        "idemflow-mock-psp: serving POST {}/v1/charges (key ttl {:?}); Ctrl-C to stop",
        provider.url(),
        args.key_ttl
    );
    let stopped = tokio::signal::ctrl_c().await;
    provider.shutdown().await;
    match stopped {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemflow-mock-psp: cannot wait for Ctrl-C: {e}");
            ExitCode::FAILURE
        }
    }
}
