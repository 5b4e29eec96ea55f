//! A number in a request is executed as the client wrote it, or refused: never rounded to a
//! neighbour a double can hold. (An amount of 9007199254740993 was once charged as
//! 9007199254740992: the body is canonicalized as RFC 8785 doubles, and the workflow decoded the
//! canonical value.)

use idemflow::{Outcome, Rejection, Runner};
use sqlx::PgPool;

use crate::support::{Harness, count, create_orders, run, tenant};

fn checkout_body(amount: &str) -> Vec<u8> {
    format!(r#"{{"amount": {amount}, "source": "tok_visa"}}"#).into_bytes()
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_amount_a_double_cannot_hold_is_refused_and_nothing_is_stored(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let checkout = harness.checkout();

    let outcome = run(
        &runner,
        &checkout,
        &tenant(1),
        "big-amount",
        &checkout_body("9007199254740993"),
    )
    .await;
    let Outcome::Rejected(rejection @ Rejection::InvalidBody(_)) = &outcome else {
        panic!("expected the body refused, got {outcome:?}");
    };
    let why = rejection.to_string();
    assert!(
        why.contains("9007199254740993"),
        "the refusal names the number: {why}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(harness.provider.charge_count(), 0, "no card was charged");
}

/// Every accepted amount reaches the order table as sent; every refused one leaves nothing.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn every_accepted_amount_is_the_amount_sent(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let checkout = harness.checkout();
    let literals = [
        "9007199254740992",    // 2^53: a double holds it
        "9007199254740993",    // 2^53 + 1: it does not
        "-9007199254740993",   // nor its negative
        "9223372036854775807", // i64::MAX: rounds to 2^63
        "1e2",                 // 100, spelt otherwise
        "2500.0",              // 2500
        "2500.00000000000001", // not 2500
        "12345678901234567",   // 17 digits: rounds to ...568
        "1234567890123456",    // 16 digits, held exactly
        "4.5e15",              // 4500000000000000
    ];
    for (index, literal) in literals.iter().enumerate() {
        let key = format!("amount-{index}");
        let outcome = run(
            &runner,
            &checkout,
            &tenant(1),
            &key,
            &checkout_body(literal),
        )
        .await;
        let exact = exact_integer(literal);
        let stored: Option<i64> = sqlx::query_scalar("SELECT amount FROM orders WHERE key = $1")
            .bind(&key)
            .fetch_optional(&pool)
            .await
            .unwrap();
        match outcome {
            Outcome::Executed(_) => assert_eq!(
                stored.map(i128::from),
                exact,
                "{literal} was executed as {stored:?}"
            ),
            Outcome::Rejected(_) => {
                assert_eq!(stored, None, "{literal} was refused but left an order");
                let keys: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
                        .bind(&key)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                assert_eq!(keys, 0, "{literal} was refused but left its key");
            }
            other => panic!("{literal}: {other:?}"),
        }
    }
    // The ones a double holds exactly (as integers) must not be refused.
    for held in [
        "9007199254740992",
        "1e2",
        "2500.0",
        "1234567890123456",
        "4.5e15",
    ] {
        let key = format!(
            "amount-{}",
            literals.iter().position(|l| *l == held).unwrap()
        );
        let stored: Option<i64> = sqlx::query_scalar("SELECT amount FROM orders WHERE key = $1")
            .bind(&key)
            .fetch_optional(&pool)
            .await
            .unwrap();
        assert!(stored.is_some(), "{held} is exact and must be executed");
    }
}

/// The literal's exact value when it is an integer (by decimal arithmetic, not through a
/// double), for comparing with what was stored.
fn exact_integer(literal: &str) -> Option<i128> {
    let (mantissa, exponent) = match literal.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i32>().ok()?),
        None => (literal, 0),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, mantissa),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let fraction = fraction.trim_end_matches('0');
    let mut digits = format!("{whole}{fraction}");
    let mut scale = exponent - i32::try_from(fraction.len()).ok()?;
    while scale > 0 {
        digits.push('0');
        scale -= 1;
    }
    if scale < 0 {
        return None; // a fraction remains: not an integer
    }
    let magnitude: i128 = digits.parse().ok()?;
    Some(if negative { -magnitude } else { magnitude })
}
