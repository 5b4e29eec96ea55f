//! Retention's loop, whatever it expires (finished keys, processed messages): batches back to
//! back until one comes back short, paced to a rate.

use std::future::Future;
use std::time::{Duration, Instant};

/// Runs `batch(batch_size)` until a batch deletes fewer than `batch_size` rows, at most
/// `max_rows_per_second` rows per second (`None`: back to back); returns how many in all.
///
/// Paced against the whole run's schedule (not batch by batch), so the timer's rounding of each
/// short sleep does not add up: the rate holds at the limit.
pub async fn paced<F, Fut, E>(
    batch_size: i64,
    max_rows_per_second: Option<u32>,
    mut batch: F,
) -> Result<u64, E>
where
    F: FnMut(i64) -> Fut,
    Fut: Future<Output = Result<u64, E>>,
{
    let batch_size = batch_size.max(1);
    let rate = max_rows_per_second.filter(|&rate| rate > 0).map(f64::from);
    let began = Instant::now();
    let mut total = 0;
    loop {
        let deleted = batch(batch_size).await?;
        total += deleted;
        if deleted < u64::try_from(batch_size).unwrap_or(u64::MAX) {
            return Ok(total);
        }
        if let Some(rate) = rate {
            let due = began + Duration::from_secs_f64(total as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn batches_run_until_one_comes_back_short() {
        let mut left = 1_250_u64;
        let mut batches = 0;
        let total = paced::<_, _, ()>(500, None, |size| {
            batches += 1;
            let deleted = left.min(size as u64);
            left -= deleted;
            async move { Ok(deleted) }
        })
        .await;
        assert_eq!((total, batches), (Ok(1_250), 3));
    }

    #[tokio::test]
    async fn a_failed_batch_ends_the_run_with_its_error() {
        let total = paced(10, Some(1_000), |_| async { Err::<u64, _>("down") }).await;
        assert_eq!(total, Err("down"));
    }
}
