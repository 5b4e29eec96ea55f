//! Every problem the layer can answer, in one table: the answers are made from it
//! ([`ProblemType::problem`]), and so are the OpenAPI components (feature `openapi`), so a code a
//! client may see and a code the document declares cannot differ.

use axum::http::StatusCode;

use crate::Problem;

/// One kind of problem the layer answers: its status, its `code` (the word a client matches on),
/// its `title` (the status's reason phrase, as RFC 9457 asks of `type: about:blank`) and what it
/// means, for documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProblemType {
    /// The response status, and the document's `status`.
    pub status: u16,
    /// The document's `code`: stable, snake_case.
    pub code: &'static str,
    /// The document's `title`: the status's reason phrase.
    pub title: &'static str,
    /// When it is answered, and what the client should do.
    pub description: &'static str,
    /// Whether the answer carries `Retry-After`.
    pub retry_after: bool,
    /// Whether it is stored and replayed under its key (a refusal before execution never is).
    pub stored: bool,
}

/// A refusal before execution: nothing stored, the same key may be sent again.
const fn refused(
    status: u16,
    code: &'static str,
    title: &'static str,
    description: &'static str,
) -> ProblemType {
    ProblemType {
        status,
        code,
        title,
        description,
        retry_after: false,
        stored: false,
    }
}

impl ProblemType {
    /// A covered method without an `Idempotency-Key` header.
    pub const IDEMPOTENCY_KEY_MISSING: Self = refused(
        400,
        "idempotency_key_missing",
        "Bad Request",
        "The request has no Idempotency-Key header; send one.",
    );
    /// A malformed key, or the header sent twice.
    pub const IDEMPOTENCY_KEY_INVALID: Self = refused(
        400,
        "idempotency_key_invalid",
        "Bad Request",
        "The Idempotency-Key is not 1-255 bytes of printable ASCII (bare or an RFC 8941 string), \
         is only spaces, or was sent twice.",
    );
    /// A JSON body that does not parse or canonicalize.
    pub const BODY_INVALID: Self = refused(
        400,
        "body_invalid",
        "Bad Request",
        "The body is not JSON that canonicalizes (RFC 8785): a syntax error, a duplicate member, \
         invalid UTF-8, or a number a double cannot hold as written.",
    );
    /// A body whose stream failed.
    pub const BODY_UNREADABLE: Self = refused(
        400,
        "body_unreadable",
        "Bad Request",
        "The body could not be read.",
    );
    /// A `Content-Type` that does not say one thing for sure.
    pub const CONTENT_TYPE_INVALID: Self = refused(
        400,
        "content_type_invalid",
        "Bad Request",
        "Content-Type was sent twice, or a multipart one does not name one boundary for sure.",
    );
    /// No tenant: the resolver refused the request (the one [`crate::BearerTenant`] answers).
    pub const UNAUTHORIZED: Self = refused(
        401,
        "unauthorized",
        "Unauthorized",
        "No tenant could be resolved from the request's credentials.",
    );
    /// A workflow route asked with a method it does not cover.
    pub const METHOD_NOT_ALLOWED: Self = refused(
        405,
        "method_not_allowed",
        "Method Not Allowed",
        "The route does not take this method; Allow lists those it takes.",
    );
    /// The body did not arrive in time (served by [`crate::serve`]).
    pub const BODY_TIMEOUT: Self = refused(
        408,
        "body_timeout",
        "Request Timeout",
        "The body did not arrive within the server's body read timeout; the connection is \
         closed. Send the request again with the same key.",
    );
    /// The key's first request is still running.
    pub const REQUEST_IN_PROGRESS: Self = ProblemType {
        retry_after: true,
        ..refused(
            409,
            "request_in_progress",
            "Conflict",
            "A request with this key is still running; retry after Retry-After, or send \
             Prefer: wait=N to be held until its answer is stored.",
        )
    };
    /// A body over the route's limit.
    pub const BODY_TOO_LARGE: Self = refused(
        413,
        "body_too_large",
        "Payload Too Large",
        "The body exceeds the route's limit.",
    );
    /// A workflow route given a body that is not JSON.
    pub const UNSUPPORTED_MEDIA_TYPE: Self = refused(
        415,
        "unsupported_media_type",
        "Unsupported Media Type",
        "The route takes application/json (or a +json type).",
    );
    /// The key was used for another request.
    pub const IDEMPOTENCY_KEY_REUSED: Self = refused(
        422,
        "idempotency_key_reused",
        "Unprocessable Entity",
        "The key was used before for a different request (method, target or body) or another \
         workflow; use a new key for a new request.",
    );
    /// JSON that is not the workflow's request.
    pub const REQUEST_INVALID: Self = refused(
        422,
        "request_invalid",
        "Unprocessable Entity",
        "The body is JSON but not the route's request: the wrong shape, or it fails the \
         route's checks.",
    );
    /// A bug, answered in general terms; the attempt counts and the key resumes.
    pub const INTERNAL_ERROR: Self = refused(
        500,
        "internal_error",
        "Internal Server Error",
        "The attempt failed on an internal error; retry with the same key.",
    );
    /// Every attempt the retry policy allows failed (stored by the runner).
    pub const RETRIES_EXHAUSTED: Self = ProblemType {
        stored: true,
        ..refused(
            500,
            "retries_exhausted",
            "Internal Server Error",
            "Every attempt the route's retry policy allows failed; this answer is stored and \
             replayed.",
        )
    };
    /// A phase failed terminally without an answer of its own (stored by the runner).
    pub const REQUEST_FAILED: Self = ProblemType {
        stored: true,
        ..refused(
            500,
            "request_failed",
            "Internal Server Error",
            "The request failed for good; this answer is stored and replayed.",
        )
    };
    /// A local phase ended the runner's transaction, so its writes may have committed without
    /// their recovery point: the key is never run again (stored by the runner).
    pub const TRANSACTION_ENDED: Self = ProblemType {
        stored: true,
        ..refused(
            500,
            "transaction_ended",
            "Internal Server Error",
            "A step of the request ended its database transaction itself; the request is not \
             run again, and this answer is stored and replayed.",
        )
    };
    /// A handler answered with an event stream (stored).
    pub const RESPONSE_NOT_STORABLE: Self = ProblemType {
        stored: true,
        ..refused(
            500,
            "response_not_storable",
            "Internal Server Error",
            "The handler answered with an event stream, which cannot be stored and replayed.",
        )
    };
    /// A handler's answer over the storable size (stored).
    pub const RESPONSE_TOO_LARGE: Self = ProblemType {
        stored: true,
        ..refused(
            500,
            "response_too_large",
            "Internal Server Error",
            "The handler's answer exceeds the size the layer stores.",
        )
    };
    /// A phase failed and will be run again.
    pub const INTERRUPTED: Self = ProblemType {
        retry_after: true,
        ..refused(
            503,
            "interrupted",
            "Service Unavailable",
            "The request started and will be finished; retry with the same key after \
             Retry-After.",
        )
    };
    /// The database could not be reached.
    pub const UNAVAILABLE: Self = ProblemType {
        retry_after: true,
        ..refused(
            503,
            "unavailable",
            "Service Unavailable",
            "The service could not process the request; retry with the same key.",
        )
    };
    /// SQLite's writer was held past the busy timeout; nothing was written.
    pub const DATABASE_BUSY: Self = ProblemType {
        retry_after: true,
        ..refused(
            503,
            "database_busy",
            "Service Unavailable",
            "The database is busy and nothing was written; retry with the same key shortly.",
        )
    };
    /// No place among the covered requests (served by [`crate::serve`]).
    pub const OVERLOADED: Self = ProblemType {
        retry_after: true,
        ..refused(
            503,
            "overloaded",
            "Service Unavailable",
            "The server is processing as many requests as it takes at once; nothing was \
             stored, retry with the same key.",
        )
    };

    /// Every problem the layer, its workflow routes, the runner under them and
    /// [`crate::serve`] answer, by status.
    pub const ALL: &'static [ProblemType] = &[
        Self::IDEMPOTENCY_KEY_MISSING,
        Self::IDEMPOTENCY_KEY_INVALID,
        Self::BODY_INVALID,
        Self::BODY_UNREADABLE,
        Self::CONTENT_TYPE_INVALID,
        Self::UNAUTHORIZED,
        Self::METHOD_NOT_ALLOWED,
        Self::BODY_TIMEOUT,
        Self::REQUEST_IN_PROGRESS,
        Self::BODY_TOO_LARGE,
        Self::UNSUPPORTED_MEDIA_TYPE,
        Self::IDEMPOTENCY_KEY_REUSED,
        Self::REQUEST_INVALID,
        Self::INTERNAL_ERROR,
        Self::RETRIES_EXHAUSTED,
        Self::REQUEST_FAILED,
        Self::TRANSACTION_ENDED,
        Self::RESPONSE_NOT_STORABLE,
        Self::RESPONSE_TOO_LARGE,
        Self::INTERRUPTED,
        Self::UNAVAILABLE,
        Self::DATABASE_BUSY,
        Self::OVERLOADED,
    ];

    /// The entry for `code`, if the layer answers it.
    pub fn of_code(code: &str) -> Option<Self> {
        Self::ALL.iter().find(|kind| kind.code == code).copied()
    }

    /// The status, as axum has it.
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// This problem, saying `detail`; without `Retry-After` (the caller knows how long).
    pub fn problem(&self, detail: impl Into<String>) -> Problem {
        Problem::new(self.status_code(), self.code, detail)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn codes_are_unique_and_titles_are_the_reason_phrases() {
        let codes: BTreeSet<_> = ProblemType::ALL.iter().map(|kind| kind.code).collect();
        assert_eq!(codes.len(), ProblemType::ALL.len(), "a code listed twice");
        for kind in ProblemType::ALL {
            assert_eq!(
                Some(kind.title),
                kind.status_code().canonical_reason(),
                "{}",
                kind.code
            );
            assert!(
                kind.code
                    .bytes()
                    .all(|byte| byte.is_ascii_lowercase() || byte == b'_'),
                "{} is not snake_case",
                kind.code
            );
        }
    }

    /// Every string literal in a call that makes a problem in this crate's source is a code of
    /// the catalogue: a problem added with a literal code and not listed fails here.
    #[test]
    fn every_code_the_layer_answers_is_in_the_catalogue() {
        let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut checked = 0;
        for entry in std::fs::read_dir(&source).expect("the crate's source") {
            let path = entry.expect("an entry").path();
            let text = std::fs::read_to_string(&path).expect("a source file");
            for literal in problem_code_literals(&text) {
                checked += 1;
                assert!(
                    ProblemType::of_code(&literal).is_some(),
                    "{}: the code {literal:?} is not in ProblemType::ALL",
                    path.display()
                );
            }
        }
        // The catalogue's own `code` fields are literals too: the scan must have seen them.
        assert!(
            checked >= ProblemType::ALL.len(),
            "only {checked} literals seen"
        );
    }

    /// The snake_case literals in the arguments of every `Problem::new(`, `stored_problem(` and
    /// `refused(` call, and every `code: "…"` field.
    fn problem_code_literals(text: &str) -> Vec<String> {
        let mut found = Vec::new();
        for opener in ["Problem::new(", "stored_problem(", "refused(", "code: \""] {
            for (start, _) in text.match_indices(opener) {
                let rest = &text[start + opener.len() - usize::from(opener.ends_with('"'))..];
                let call = &rest[..rest.find(')').unwrap_or(rest.len()).min(400)];
                found.extend(
                    call.split('"')
                        .skip(1)
                        .step_by(2)
                        .filter(|word| is_code(word))
                        .map(str::to_owned),
                );
            }
        }
        found
    }

    fn is_code(word: &str) -> bool {
        // In these calls a lowercase word is a code: a detail has spaces, a title capitals.
        !word.is_empty()
            && !word.starts_with('_')
            && word
                .bytes()
                .all(|byte| byte.is_ascii_lowercase() || byte == b'_')
    }
}
