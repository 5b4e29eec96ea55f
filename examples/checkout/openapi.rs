//! The service's OpenAPI 3.1 document, made from its code: the schemas are derived from the
//! types the routes read and write, the idempotency parameters, headers and problems come from
//! the HTTP layer's catalogue (`idemflow::http::openapi`), and the service serves the result at
//! `GET /openapi.json` (`checkout openapi` prints it).
//!
//! The checkout route is a `WorkflowService` (a tower service, not a handler function), so its
//! operation is built here with utoipa's builders rather than `#[utoipa::path]`.

use idemflow::http::ProblemType;
use idemflow::http::openapi::{
    IDEMPOTENCY_KEY_DRAFT, PROBLEM_DETAILS_RFC, PROBLEM_MEDIA_TYPE, PROBLEM_SCHEMA, add_components,
    idempotent_operation, problem_response_ref,
};
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, ExternalDocs, InfoBuilder, OpenApi, OpenApiBuilder, PathItem, PathsBuilder,
    Ref, Required, Type,
};
use utoipa::{PartialSchema, ToSchema};

use crate::orders::OrderRow;
use crate::workflow::{CheckoutPaid, CheckoutProblem, CheckoutRequest};

/// Where the document is served.
pub const PATH: &str = "/openapi.json";

/// The bearer scheme's name among the components.
const BEARER: &str = "bearer";

/// The operation ids the links name.
const CREATE: &str = "createCheckout";
const READ: &str = "getCheckout";

/// The whole document.
pub fn document() -> OpenApi {
    let mut openapi = OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("idemflow checkout")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(format!(
                    "A checkout (order, card charge, order marked paid) made safe to retry by the \
                     Idempotency-Key header ({IDEMPOTENCY_KEY_DRAFT}); refusals are problem \
                     documents ({PROBLEM_DETAILS_RFC}). The bearer token is the tenant."
                )))
                .build(),
        )
        .external_docs(Some(ExternalDocs::new(IDEMPOTENCY_KEY_DRAFT)))
        .paths(
            PathsBuilder::new()
                .path("/v1/checkouts", PathItem::new(HttpMethod::Post, create()))
                .path(
                    "/v1/checkouts/{order_id}",
                    PathItem::new(HttpMethod::Get, read()),
                )
                .path(PATH, PathItem::new(HttpMethod::Get, itself())),
        )
        .build();
    add_components(&mut openapi);
    let components = openapi.components.get_or_insert_with(Default::default);
    for (name, schema) in [
        (CheckoutRequest::name(), CheckoutRequest::schema()),
        (CheckoutPaid::name(), CheckoutPaid::schema()),
        (CheckoutProblem::name(), CheckoutProblem::schema()),
        (OrderRow::name(), OrderRow::schema()),
    ] {
        components.schemas.insert(name.into_owned(), schema);
    }
    components.add_security_scheme(
        BEARER,
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    openapi.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
    openapi
}

/// A JSON response of the schema named `schema`, with `media_type`.
fn json(description: &str, media_type: &str, schema: &str) -> ResponseBuilder {
    ResponseBuilder::new().description(description).content(
        media_type,
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name(schema)))
            .build(),
    )
}

/// `POST /v1/checkouts`: the workflow route, its own answers and the layer's.
fn create() -> utoipa::openapi::path::Operation {
    let paid = json(
        "Paid: the order, its charge and its status. A retry under the key gets these bytes \
         again, with Idempotent-Replayed: true.",
        "application/json",
        &CheckoutPaid::name(),
    )
    .link(
        "readOrder",
        LinkBuilder::new()
            .operation_id(READ)
            .parameter("order_id", "$response.body#/order_id")
            .description("The order this checkout created.")
            .build(),
    )
    .link(
        "retry",
        LinkBuilder::new()
            .operation_id(CREATE)
            .parameter("header.Idempotency-Key", "$request.header.Idempotency-Key")
            .request_body(Some("$request.body"))
            .description("The same request again: the stored answer, replayed.")
            .build(),
    )
    .build();
    let problem =
        |description: &str| json(description, PROBLEM_MEDIA_TYPE, &CheckoutProblem::name()).build();
    let mut operation = OperationBuilder::new()
        .operation_id(Some(CREATE))
        .summary(Some(
            "Check out: create the order, charge the card, mark it paid",
        ))
        .request_body(Some(
            RequestBodyBuilder::new()
                .required(Some(Required::True))
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name(CheckoutRequest::name())))
                        .build(),
                )
                .build(),
        ))
        .response("201", paid)
        .response(
            "402",
            problem("The card was declined: stored, and replayed under the key."),
        )
        .response(
            "502",
            problem("The payment provider refused the charge request: stored, and replayed."),
        )
        .build();
    idempotent_operation(&mut operation);
    operation
}

/// `GET /v1/checkouts/{order_id}`: a plain read, outside the layer.
fn read() -> utoipa::openapi::path::Operation {
    let problem = |description: &str| -> Response {
        json(description, PROBLEM_MEDIA_TYPE, PROBLEM_SCHEMA).build()
    };
    OperationBuilder::new()
        .operation_id(Some(READ))
        .summary(Some("The order a checkout created, for its tenant only"))
        .parameter(
            ParameterBuilder::new()
                .name("order_id")
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(i64::schema())),
        )
        .response(
            "200",
            json("The order.", "application/json", &OrderRow::name()),
        )
        .response(
            ProblemType::UNAUTHORIZED.status.to_string(),
            problem_response_ref(ProblemType::UNAUTHORIZED.status),
        )
        .response(
            "404",
            problem("No such order for this tenant (`not_found`)."),
        )
        .response(
            "503",
            problem("The order could not be read (`unavailable`)."),
        )
        .build()
}

/// `GET /openapi.json`: this document.
fn itself() -> utoipa::openapi::path::Operation {
    OperationBuilder::new()
        .operation_id(Some("openapi"))
        .summary(Some("This OpenAPI document"))
        .securities(Some(Vec::<SecurityRequirement>::new()))
        .response(
            "200",
            ResponseBuilder::new().description("The document.").content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(
                        utoipa::openapi::ObjectBuilder::new().schema_type(Type::Object),
                    ))
                    .build(),
            ),
        )
        .build()
}

/// The document as served: compact JSON.
pub fn json_text() -> String {
    let mut value = serde_json::to_value(document()).expect("an OpenAPI document serializes");
    links_in_camel_case(&mut value);
    value.to_string()
}

/// utoipa 5 writes a link's fields in snake_case (`operation_id`, `request_body`), which no
/// OpenAPI tool reads: they are renamed to the specification's names.
fn links_in_camel_case(document: &mut serde_json::Value) {
    let Some(paths) = document["paths"].as_object_mut() else {
        return;
    };
    let operations = paths.values_mut().filter_map(|item| item.as_object_mut());
    for operation in operations.flat_map(|item| item.values_mut()) {
        let responses = operation.get_mut("responses");
        let Some(responses) = responses.and_then(|responses| responses.as_object_mut()) else {
            continue;
        };
        for response in responses.values_mut() {
            let Some(links) = response
                .get_mut("links")
                .and_then(|links| links.as_object_mut())
            else {
                continue;
            };
            for link in links.values_mut().filter_map(|link| link.as_object_mut()) {
                for (snake, camel) in [
                    ("operation_id", "operationId"),
                    ("operation_ref", "operationRef"),
                    ("request_body", "requestBody"),
                ] {
                    if let Some(field) = link.remove(snake) {
                        link.insert(camel.to_owned(), field);
                    }
                }
            }
        }
    }
}
