//! The API's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]` annotations and
//! the schemas of the types they take and return, served at `GET /openapi.json`.
//!
//! The document is built from the router itself: each handler module registers its routes with
//! `utoipa_axum`'s `routes!`, which takes a route's path and method from its handler's
//! `#[utoipa::path]`, so a route and its documentation are one registration and there is no list of
//! paths to keep in step. [`ApiDoc`] holds only what belongs to no route (the info and the tags);
//! `super::router` merges the handler modules' routers onto it and hands the paths they collected
//! to [`publish`], which adds the bearer scheme and the headers every response carries and renders
//! the document once.

use super::ApiContext;
use axum::{http::header, response::IntoResponse};
use serde_json::Value;
use std::sync::OnceLock;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ObjectBuilder, RefOr, Type, header::HeaderBuilder};
use utoipa::{Modify, OpenApi};
use utoipa_axum::{router::OpenApiRouter, routes};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "walletlock",
        description = "Wallets whose payments are never lost or applied twice: each runs under its \
                       wallet's lease in Redis and commits with a fenced update in Postgres. Amounts \
                       are integers in minor units. Every error is an RFC 9457 problem with a stable \
                       `code`."
    ),
    tags(
        (name = "wallets", description = "Open, read, deposit, pay, page through the ledger (bearer token)"),
        (name = "transfers", description = "Money between wallets, and refunds (bearer token)"),
        (name = "batches", description = "Up to 1,000 movements in one request, each decided on its own (bearer token)"),
        (name = "holds", description = "Reserve now, capture or void later, or let expire (bearer token)"),
        (name = "events", description = "Every wallet's events in order, with long polling (bearer token)"),
        (name = "webhooks", description = "Endpoints that receive the events, signed (bearer token)"),
        (name = "operations", description = "Health, readiness, metrics and this document; no token"),
    )
)]
pub struct ApiDoc;

/// The security scheme the `/wallets` operations name, and the headers every response carries;
/// applied by [`publish`] once the router has collected the paths.
struct BearerAndCommonHeaders;

/// Sent on every response: (name, description).
const COMMON_HEADERS: [(&str, &str); 2] = [
    ("X-Request-Id", "The request's id: the caller's own `X-Request-Id` if it sent one, else a fresh one"),
    ("X-Served-By", "The replica that answered"),
];

impl Modify for BearerAndCommonHeaders {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
        for item in openapi.paths.paths.values_mut() {
            let operations =
                [&mut item.get, &mut item.post, &mut item.put, &mut item.delete].into_iter().flatten();
            for response in operations.flat_map(|op| op.responses.responses.values_mut()) {
                let RefOr::T(response) = response else { continue };
                for (name, description) in COMMON_HEADERS {
                    let schema = ObjectBuilder::new().schema_type(Type::String);
                    let header =
                        HeaderBuilder::new().schema(Some(schema)).description(Some(description)).build();
                    response.headers.insert(name.to_owned(), RefOr::T(header));
                }
            }
        }
    }
}

/// Whether a documented response header is sent on every response of its status: utoipa's header
/// object has no `required`, so it is added to the rendered document.
fn always_sent(header: &str, status: &str) -> bool {
    match header {
        "X-Request-Id" | "X-Served-By" | "WWW-Authenticate" => true,
        // Every 503 problem says when to retry; a 409 only with `idempotency_key_in_flight`.
        "Retry-After" => status == "503",
        _ => false,
    }
}

/// The document as JSON, from what the router collected.
fn document(mut api: utoipa::openapi::OpenApi) -> Value {
    BearerAndCommonHeaders.modify(&mut api);
    let mut document = serde_json::to_value(api).expect("the OpenAPI document serializes");
    if let Some(paths) = document.get_mut("paths").and_then(Value::as_object_mut) {
        for operation in
            paths.values_mut().filter_map(Value::as_object_mut).flat_map(|item| item.values_mut())
        {
            let Some(responses) = operation.get_mut("responses").and_then(Value::as_object_mut) else {
                continue;
            };
            for (status, response) in responses.iter_mut() {
                let Some(headers) = response.get_mut("headers").and_then(Value::as_object_mut) else {
                    continue;
                };
                for (name, header) in headers.iter_mut() {
                    if always_sent(name, status)
                        && let Some(header) = header.as_object_mut()
                    {
                        header.insert("required".into(), Value::Bool(true));
                    }
                }
            }
        }
    }
    document
}

/// Rendered once, by [`publish`].
static DOCUMENT: OnceLock<String> = OnceLock::new();

/// Renders the document from the OpenAPI the assembled router collected, for `GET /openapi.json`.
/// Every router a process builds has the same routes, so the first one's document serves them all.
pub fn publish(api: utoipa::openapi::OpenApi) {
    DOCUMENT.get_or_init(|| document(api).to_string());
}

/// This document's route.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(openapi_json))
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((
        status = 200,
        description = "The API's OpenAPI 3.1 document",
        body = Object,
        content_type = "application/json"
    ))
)]
async fn openapi_json() -> impl IntoResponse {
    let document = DOCUMENT.get().expect("the router publishes the document when it is built");
    ([(header::CONTENT_TYPE, "application/json")], document.as_str())
}
