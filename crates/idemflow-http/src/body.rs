//! Reading a body whole, within a limit, telling "too large" and "too slow" from "could not be
//! read".

use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;

/// Why a body was not read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// More than the limit: the reading stopped there.
    TooLarge,
    /// It did not arrive within [`crate::ServeLimits::body_read_timeout`] (only a body served by
    /// [`crate::serve`] has a deadline).
    TimedOut(Duration),
    /// The stream failed (the client went away, a malformed chunked encoding, a handler's
    /// stream broke).
    Unreadable(Box<dyn std::error::Error + Send + Sync>),
}

/// Reads `body` up to `limit` bytes (a body of one buffer, the usual case, is not copied).
pub(crate) async fn read_limited(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge),
        Err(error) => match BodyReadTimeout::find(error.as_ref()) {
            Some(timeout) => Err(BodyError::TimedOut(timeout.0)),
            None => Err(BodyError::Unreadable(error)),
        },
    }
}

/// The error a body served by [`crate::serve`] gives when it has not arrived whole within
/// `body_read_timeout` of the first read.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} ms", .0.as_millis())]
pub(crate) struct BodyReadTimeout(pub Duration);

impl BodyReadTimeout {
    /// The deadline's error in `error`, however wrapped (axum's `Body` and `Limited` each wrap
    /// the stream's error in one of their own).
    fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a Self> {
        let mut current = Some(error);
        while let Some(error) = current {
            if let Some(timeout) = error.downcast_ref::<Self>() {
                return Some(timeout);
            }
            current = error.source();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_within_the_limit_and_refuses_beyond_it() {
        let body = Body::from(vec![7u8; 100]);
        assert_eq!(read_limited(body, 100).await.expect("fits").len(), 100);
        let body = Body::from(vec![7u8; 101]);
        assert!(matches!(
            read_limited(body, 100).await,
            Err(BodyError::TooLarge)
        ));
        let chunks = futures_stream(vec![vec![1u8; 60], vec![2u8; 60]]);
        assert!(matches!(
            read_limited(chunks, 100).await,
            Err(BodyError::TooLarge)
        ));
        let chunks = futures_stream(vec![vec![1u8; 40], vec![2u8; 60]]);
        let read = read_limited(chunks, 100).await.expect("fits");
        assert_eq!(&read[..40], &[1u8; 40][..]);
        assert_eq!(&read[40..], &[2u8; 60][..]);
    }

    #[tokio::test]
    async fn tells_a_body_past_its_deadline_from_one_that_failed() {
        let timeout = Duration::from_millis(300);
        let stalled = Body::from_stream(Failing(Some(BodyReadTimeout(timeout))));
        assert!(matches!(
            read_limited(stalled, 100).await,
            Err(BodyError::TimedOut(after)) if after == timeout
        ));
        let broken = Body::from_stream(Failing(Some(std::io::Error::other("reset"))));
        assert!(matches!(
            read_limited(broken, 100).await,
            Err(BodyError::Unreadable(_))
        ));
    }

    /// A stream whose one item is an error.
    struct Failing<E>(Option<E>);

    impl<E: Unpin> futures_core::Stream for Failing<E> {
        type Item = Result<Bytes, E>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(self.0.take().map(Err))
        }
    }

    fn futures_stream(chunks: Vec<Vec<u8>>) -> Body {
        let stream = tokio_stream_iter(chunks);
        Body::from_stream(stream)
    }

    fn tokio_stream_iter(
        chunks: Vec<Vec<u8>>,
    ) -> impl futures_core::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
        Chunks(chunks.into_iter().map(Bytes::from).collect())
    }

    struct Chunks(std::collections::VecDeque<Bytes>);

    impl futures_core::Stream for Chunks {
        type Item = Result<Bytes, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(self.0.pop_front().map(Ok))
        }
    }
}
