//! The layer described in OpenAPI 3.1 (utoipa's types): the `Idempotency-Key` and `Prefer`
//! request headers, the `Idempotent-Replayed`, `Retry-After` and `Preference-Applied` response
//! headers, and a problem+json response for every status of [`ProblemType::ALL`], for a service
//! that documents its idempotent routes. Made from the same catalogue the answers are made from.
//!
//! utoipa 5's `Components` has no section for parameters or headers: those are functions that
//! return the same object every time, placed in each operation; the `Problem` schema and the
//! problem responses are components, referred to by `$ref`.

use std::collections::BTreeMap;

use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::{Header, HeaderBuilder};
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Required, Schema, Type};

use crate::ProblemType;

/// utoipa itself, the version these functions build for.
pub use utoipa;

/// The IETF draft the `Idempotency-Key` header follows.
pub const IDEMPOTENCY_KEY_DRAFT: &str =
    "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/";
/// RFC 9457, Problem Details for HTTP APIs: every refusal's body.
pub const PROBLEM_DETAILS_RFC: &str = "https://www.rfc-editor.org/rfc/rfc9457";
/// RFC 7240, `Prefer`: how a duplicate asks to wait.
pub const PREFER_RFC: &str = "https://www.rfc-editor.org/rfc/rfc7240";
/// The media type of every problem.
pub const PROBLEM_MEDIA_TYPE: &str = "application/problem+json";
/// The name of the problem schema among the components.
pub const PROBLEM_SCHEMA: &str = "Problem";

/// The key the layer takes, as a pattern: a bare key (printable ASCII, not `,`, which two merged
/// header lines make, nor `;`, which opens structured-field parameters; not starting with `"`,
/// not starting or ending with a space, which HTTP trims) of 1 to 255 bytes, or an RFC 8941
/// string (between quotes, `\"` and `\\` escaped, not spaces alone) of 1 to 255 bytes once
/// unescaped. Each unit of the quoted form is one byte of the key; the spaces before its first
/// other byte and the bytes after it are bounded by 127 each, so every key the pattern takes is
/// one the layer takes (a quoted key with more is taken by the layer, refused by the pattern).
const KEY_PATTERN: &str = concat!(
    r"^(?:",
    r"[!#-+\x2D-:<-~](?:[ !-+\x2D-:<-~]{0,253}[!-+\x2D-:<-~])?",
    r"|",
    r#"" {0,127}(?:[!#-\[\]-~]|\\["\\])(?:[ !#-\[\]-~]|\\["\\]){0,127}""#,
    r")$"
);

/// The `Idempotency-Key` request header, required.
pub fn idempotency_key_parameter() -> Parameter {
    ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some(format!(
            "The request's key ({IDEMPOTENCY_KEY_DRAFT}): 1 to 255 bytes of printable ASCII, not \
             spaces alone, scoped by tenant. The first request under a key runs; a retry with the \
             same request gets the stored answer with Idempotent-Replayed: true; another request \
             under the key is refused 422; one sent while the first runs, 409. Bare (as here) or \
             an RFC 8941 string (\"…\", only \\\" and \\\\ escaped), which may also hold , and ;; \
             the pattern bounds a quoted key's leading spaces and the rest to 127 bytes each."
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .pattern(Some(KEY_PATTERN)),
        ))
        .example(Some(serde_json::json!("order-7f3a")))
        .build()
}

/// The `Prefer` request header: `wait=N` holds a duplicate until the first attempt's answer is
/// stored, for at most N seconds (and the server's maximum); anything else is ignored.
pub fn prefer_parameter() -> Parameter {
    ParameterBuilder::new()
        .name("Prefer")
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(format!(
            "RFC 7240 ({PREFER_RFC}). wait=N: a duplicate of a request still running is held \
             until its answer is stored (then replayed) or N seconds pass (then 409), at most the \
             server's maximum; the answer says Preference-Applied. Other preferences are ignored."
        )))
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .example(Some(serde_json::json!("wait=5")))
        .build()
}

/// `Idempotent-Replayed: true` on a stored answer given again.
pub fn replayed_header() -> Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["true"])),
        )
        .description(Some(
            "true: this is the stored answer to the key's first request, given again byte for \
             byte; absent on the answer of the attempt that ran.",
        ))
        .build()
}

/// `Retry-After`: whole seconds, at least 1.
pub fn retry_after_header() -> Header {
    HeaderBuilder::new()
        .schema(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1)),
        )
        .description(Some(
            "Whole seconds to wait before sending the request again with the same key.",
        ))
        .build()
}

/// `Preference-Applied: wait=N` on the answer to a request that waited.
pub fn preference_applied_header() -> Header {
    HeaderBuilder::new()
        .schema(ObjectBuilder::new().schema_type(Type::String))
        .description(Some(
            "wait=N: the request was a duplicate and waited up to N seconds for the first \
             attempt's answer (N cut to the server's maximum).",
        ))
        .build()
}

/// The problem document (RFC 9457) every refusal carries; `code` names which one.
pub fn problem_schema() -> Schema {
    let string = || ObjectBuilder::new().schema_type(Type::String);
    let codes = ProblemType::ALL.iter().map(|kind| kind.code);
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(format!(
            "A problem document ({PROBLEM_DETAILS_RFC}), type about:blank: title is the status's \
             reason phrase, code a stable word to match on."
        )))
        .property("type", string().default(Some("about:blank".into())))
        .property("title", string())
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(400))
                .maximum(Some(599)),
        )
        .property("detail", string())
        .property(
            "code",
            string().description(Some(format!(
                "The problem, in a word. The layer's: {}.",
                codes.collect::<Vec<_>>().join(", ")
            ))),
        )
        .required("type")
        .required("title")
        .required("status")
        .build()
        .into()
}

/// The name among the components of the problem response for `status`: `Problem409`.
pub fn problem_response_name(status: u16) -> String {
    format!("Problem{status}")
}

/// A `$ref` to the problem response for `status`.
pub fn problem_response_ref(status: u16) -> RefOr<Response> {
    RefOr::Ref(Ref::from_response_name(problem_response_name(status)))
}

/// The statuses of the catalogue, each once, in order.
pub fn problem_statuses() -> Vec<u16> {
    let mut statuses: Vec<u16> = ProblemType::ALL.iter().map(|kind| kind.status).collect();
    statuses.dedup();
    statuses
}

/// The problem response for `status`: the catalogue's problems of that status, each described
/// and given as an example, with `Retry-After` where they carry it.
pub fn problem_response(status: u16) -> Response {
    let kinds: Vec<&ProblemType> = ProblemType::ALL
        .iter()
        .filter(|kind| kind.status == status)
        .collect();
    let described = kinds
        .iter()
        .map(|kind| format!("`{}`: {}", kind.code, kind.description))
        .collect::<Vec<_>>()
        .join(" ");
    let examples = kinds.iter().map(|kind| {
        let value =
            idemflow_core::problem_document(kind.status, kind.title, kind.code, kind.description);
        (kind.code, ExampleBuilder::new().value(Some(value)).build())
    });
    let content = ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))
        .examples_from_iter(examples)
        .build();
    let mut response = ResponseBuilder::new()
        .description(described)
        .content(PROBLEM_MEDIA_TYPE, content);
    if kinds.iter().any(|kind| kind.retry_after) {
        response = response.header("Retry-After", retry_after_header());
    }
    if kinds.iter().any(|kind| kind.stored) {
        response = response.header("Idempotent-Replayed", replayed_header());
    }
    if status == 409 {
        // A duplicate that waited and still found the first attempt running.
        response = response.header("Preference-Applied", preference_applied_header());
    }
    response.build()
}

/// Adds the `Problem` schema and a problem response per status of the catalogue
/// (`Problem400` …) to a document's components; use it as utoipa's `Modify`
/// (`#[openapi(modifiers(&IdempotencyComponents))]`) or call [`add_components`].
#[derive(Debug, Clone, Copy, Default)]
pub struct IdempotencyComponents;

impl utoipa::Modify for IdempotencyComponents {
    fn modify(&self, openapi: &mut OpenApi) {
        add_components(openapi);
    }
}

/// What [`IdempotencyComponents`] does.
pub fn add_components(openapi: &mut OpenApi) {
    let components = openapi.components.get_or_insert_with(Default::default);
    components
        .schemas
        .insert(PROBLEM_SCHEMA.to_owned(), problem_schema().into());
    for status in problem_statuses() {
        components.responses.insert(
            problem_response_name(status),
            problem_response(status).into(),
        );
    }
}

/// Describes `operation` as a route behind the layer (or a workflow route): the
/// `Idempotency-Key` and `Prefer` parameters; on each response it declares already (what the
/// route answers, stored and replayed), `Idempotent-Replayed` and `Preference-Applied`; and a
/// `$ref` to the problem response of every status of the catalogue it does not declare itself.
pub fn idempotent_operation(operation: &mut Operation) {
    let parameters = operation.parameters.get_or_insert_with(Vec::new);
    parameters.push(idempotency_key_parameter());
    parameters.push(prefer_parameter());
    let responses: &mut BTreeMap<String, RefOr<Response>> = &mut operation.responses.responses;
    for response in responses.values_mut() {
        if let RefOr::T(response) = response {
            let headers = &mut response.headers;
            headers.insert("Idempotent-Replayed".to_owned(), replayed_header());
            headers.insert("Preference-Applied".to_owned(), preference_applied_header());
        }
    }
    for status in problem_statuses() {
        responses
            .entry(status.to_string())
            .or_insert_with(|| problem_response_ref(status));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_of_the_catalogue_is_an_example_of_its_status() {
        let mut openapi = OpenApi::default();
        add_components(&mut openapi);
        let document = serde_json::to_value(&openapi).expect("a document");
        for kind in ProblemType::ALL {
            let name = problem_response_name(kind.status);
            let example = &document["components"]["responses"][&name]["content"]
                [PROBLEM_MEDIA_TYPE]["examples"][kind.code]["value"];
            assert_eq!(example["code"], kind.code, "{name}: {document}");
            assert_eq!(example["status"], kind.status);
        }
    }

    #[test]
    fn the_key_pattern_takes_a_bare_key_and_not_what_the_layer_refuses() {
        let parameter = serde_json::to_value(idempotency_key_parameter()).expect("JSON");
        let pattern = parameter["schema"]["pattern"].as_str().expect("a pattern");
        assert_eq!(pattern, KEY_PATTERN);
        assert_eq!(parameter["in"], "header");
        assert_eq!(parameter["required"], true);
    }
}
