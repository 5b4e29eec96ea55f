//! Reading a body whole, within a limit, telling "too large" from "could not be read".

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;

/// Why a body was not read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// More than the limit: the reading stopped there.
    TooLarge,
    /// The stream failed (the client went away, a malformed chunked encoding, a handler's
    /// stream broke).
    Unreadable(Box<dyn std::error::Error + Send + Sync>),
}

/// Reads `body` up to `limit` bytes (a body of one buffer, the usual case, is not copied).
pub(crate) async fn read_limited(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge),
        Err(error) => Err(BodyError::Unreadable(error)),
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
