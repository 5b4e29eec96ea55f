//! Panics in users' code (phases, their outputs' serialization, the failure path) caught as
//! failed attempts: a panic must not end the task that holds a key, leaving it leased and its
//! attempt unrecorded, nor reach an HTTP server's connection task.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// What a caught panic said.
#[derive(Debug, Clone)]
pub(crate) struct Panic(String);

impl fmt::Display for Panic {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl Panic {
    fn from_payload(payload: &(dyn Any + Send)) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|text| (*text).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a payload that is not text".to_owned());
        Self(message)
    }
}

/// Runs `work`, turning a panic into `Err`.
///
/// Unwind safety: a phase that panics leaves its own state as it was; the engine's state it
/// touches is the transaction, which is rolled back (or closed) after any failure.
pub(crate) fn catch_panic<F: Future>(work: F) -> CatchPanic<F> {
    CatchPanic(Box::pin(work))
}

/// Calls `work` now, turning a panic into `Err`.
pub(crate) fn catch_panic_now<T>(work: impl FnOnce() -> T) -> Result<T, Panic> {
    catch_unwind(AssertUnwindSafe(work)).map_err(|payload| Panic::from_payload(payload.as_ref()))
}

/// The future [`catch_panic`] returns.
pub(crate) struct CatchPanic<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchPanic<F> {
    type Output = Result<F::Output, Panic>;

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let work = self.0.as_mut();
        match catch_unwind(AssertUnwindSafe(|| work.poll(context))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => Poll::Ready(Err(Panic::from_payload(payload.as_ref()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_becomes_an_error_with_its_message() {
        let caught = catch_panic(async {
            tokio::task::yield_now().await;
            panic!("boom {}", 7)
        })
        .await;
        assert_eq!(
            caught.err().map(|panic| panic.to_string()),
            Some("boom 7".to_owned())
        );
        assert_eq!(catch_panic(async { 3 }).await.ok(), Some(3));
        assert!(catch_panic_now(|| -> u8 { panic!("static text") }).is_err());
    }
}
