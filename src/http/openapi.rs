//! The API's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]` annotations and
//! the schemas of the types they take and return, served at `GET /openapi.json`.

use super::{ApiContext, health, holds, transfers, wallets};
use axum::{Router, http::header, response::IntoResponse, routing::get};
use serde_json::Value;
use std::sync::LazyLock;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ObjectBuilder, RefOr, Type, header::HeaderBuilder};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "walletlock",
        description = "Wallets whose payments are never lost or applied twice: each runs under its \
                       wallet's lease in Redis and commits with a fenced update in Postgres. Amounts \
                       are integers in minor units. Every error is an RFC 9457 problem with a stable \
                       `code`."
    ),
    paths(
        wallets::open_wallet,
        wallets::get_wallet,
        wallets::deposit,
        wallets::pay,
        wallets::transactions,
        transfers::transfer,
        transfers::get_transfer,
        transfers::refund_transfer,
        transfers::refund_payment,
        holds::place_hold,
        holds::get_hold,
        holds::capture,
        holds::void,
        health::healthz,
        health::readyz,
        health::metrics,
        openapi_json,
    ),
    modifiers(&BearerAndCommonHeaders),
    tags(
        (name = "wallets", description = "Open, read, deposit, pay, page through the ledger (bearer token)"),
        (name = "transfers", description = "Money between wallets, and refunds (bearer token)"),
        (name = "holds", description = "Reserve now, capture or void later, or let expire (bearer token)"),
        (name = "operations", description = "Health, readiness, metrics and this document; no token"),
    )
)]
pub struct ApiDoc;

/// The security scheme the `/wallets` operations name, and the headers every response carries.
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
            let operations = [&mut item.get, &mut item.post].into_iter().flatten();
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

/// The document as JSON.
pub fn document() -> Value {
    let mut document = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes");
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

/// Rendered once.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| document().to_string());

pub fn router() -> Router<ApiContext> {
    Router::new().route("/openapi.json", get(openapi_json))
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
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT.as_str())
}
