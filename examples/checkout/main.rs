//! The checkout example: a three-phase workflow against PostgreSQL, run the ways a client would
//! run it — a first attempt, a retry, a reused key with another amount, a declined card — and
//! printed as it goes.
//!
//! Run it with `scripts/checkout` (which finds or starts a PostgreSQL), or
//! `DATABASE_URL=postgres://... cargo run --example checkout`.

mod psp;
mod worker;
mod workflow;

use std::time::{SystemTime, UNIX_EPOCH};

use idemflow::{Outcome, Request, Runner, TenantId};
use sqlx::postgres::PgPoolOptions;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,idemflow_runner::resumer=info")
            }),
        )
        .init();
    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (scripts/checkout sets it for you)")?;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .test_before_acquire(false)
        .connect(&database_url)
        .await?;
    idemflow::migrate(&pool).await?;
    sqlx::query(workflow::ORDERS_TABLE).execute(&pool).await?;

    let arguments: Vec<String> = std::env::args().skip(1).collect();
    match arguments
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] | ["tour"] => tour(pool).await,
        ["worker"] => {
            worker::run(
                pool,
                workflow::checkout(psp::PaymentProvider::default()),
                default_metrics_bind(),
            )
            .await
        }
        ["worker", "--metrics-bind", bind] => {
            worker::run(
                pool,
                workflow::checkout(psp::PaymentProvider::default()),
                bind.parse()?,
            )
            .await
        }
        _ => Err("usage: checkout [tour | worker [--metrics-bind ADDRESS]]".into()),
    }
}

fn default_metrics_bind() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 9464))
}

/// Runs the workflow the ways a client would, printing each outcome.
async fn tour(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    let orders_before: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM checkout_orders")
        .fetch_one(&pool)
        .await?;
    let provider = psp::PaymentProvider::default();
    let checkout = workflow::checkout(provider.clone());
    let runner = Runner::new(pool.clone());
    let tenant = TenantId::new("acme")?;
    // A fresh key per run of the example, as a client makes one per purchase.
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let key = format!("checkout-{nanos}");
    let body = br#"{"amount": 2500, "currency": "usd", "source": "tok_visa"}"#;
    let post = |body: &'static [u8]| Request {
        method: "POST",
        path: "/v1/checkouts",
        body,
    };

    println!(
        "idemflow checkout example: workflow {} with phases {:?}",
        checkout.name(),
        checkout.phase_names()
    );
    println!("tenant {tenant}, key {key}\n");

    println!("1. first attempt");
    let first = runner.run(&checkout, &tenant, &key, post(body)).await?;
    show(&first);

    println!("2. the client retries (its response was lost): the stored response comes back");
    let retry = runner
        .run(
            &checkout,
            &tenant,
            &key,
            post(br#"{"source":"tok_visa","currency":"usd","amount":2500}"#),
        )
        .await?;
    show(&retry);
    if let (Outcome::Executed(original), Outcome::Replayed(replayed)) = (&first, &retry) {
        println!(
            "   byte-identical to the first response: {}\n",
            original == replayed
        );
    } else {
        return Err("the retry was not a replay of the first attempt".into());
    }

    println!("3. the same key with another amount: refused, nothing runs");
    let mismatch = runner
        .run(
            &checkout,
            &tenant,
            &key,
            post(br#"{"amount": 9900, "currency": "usd", "source": "tok_visa"}"#),
        )
        .await?;
    show(&mismatch);

    println!("4. a declined card, under a new key: a 402 stored and replayed like any response");
    let declined_key = format!("{key}-declined");
    let declined = br#"{"amount": 1200, "currency": "usd", "source": "tok_chargeDeclined"}"#;
    show(
        &runner
            .run(&checkout, &tenant, &declined_key, post(declined))
            .await?,
    );
    show(
        &runner
            .run(&checkout, &tenant, &declined_key, post(declined))
            .await?,
    );

    println!("5. a malformed body: rejected before execution, no key stored");
    show(
        &runner
            .run(
                &checkout,
                &tenant,
                &format!("{key}-bad"),
                post(b"{\"amount\": 1,"),
            )
            .await?,
    );

    println!("6. the provider is down: the key stays started, resumable from its recovery point");
    let outage_key = format!("{key}-outage");
    provider.fail_next_call();
    let outage = br#"{"amount": 700, "currency": "usd", "source": "tok_visa"}"#;
    show(
        &runner
            .run(&checkout, &tenant, &outage_key, post(outage))
            .await?,
    );
    println!(
        "   ... the client retries once the retry time has passed: no second order, one charge"
    );
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    show(
        &runner
            .run(&checkout, &tenant, &outage_key, post(outage))
            .await?,
    );
    let derived = format!("{tenant}:{outage_key}:charge");
    println!(
        "   provider calls with derived key {derived}: {}\n",
        provider.calls_with(&derived)
    );

    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM checkout_orders WHERE id > $1")
        .bind(orders_before)
        .fetch_one(&pool)
        .await?;
    println!(
        "orders written by this run: {orders}; charges made at the provider: {}",
        provider.charges_made()
    );
    Ok(())
}

fn show(outcome: &Outcome) {
    match outcome {
        Outcome::Executed(response) => {
            println!(
                "   executed -> {} {}\n",
                response.status,
                String::from_utf8_lossy(&response.body)
            );
        }
        Outcome::Replayed(response) => {
            println!(
                "   replayed -> {} {}\n",
                response.status,
                String::from_utf8_lossy(&response.body)
            );
        }
        Outcome::Mismatch => {
            println!("   mismatch -> 422: this key was used for a different request\n")
        }
        Outcome::InProgress { retry_after } => {
            println!("   in progress -> 409, retry after {retry_after:?}\n")
        }
        Outcome::Rejected(rejection) => println!("   rejected -> 400: {rejection}\n"),
        Outcome::Interrupted { retry_after, error } => {
            println!("   interrupted -> 503 ({error}); resumable after {retry_after:?}\n");
        }
        Outcome::Released(response) => {
            println!("   released -> {} (not stored)\n", response.status)
        }
    }
}
