//! `/wallets`: open, read, deposit, pay, and page through the ledger.

use super::ApiContext;
use super::bodies::{EntryBody, MetadataObject, WalletBody};
use super::error::described::{
    MOVEMENT_CONFLICT, MOVEMENT_UNAVAILABLE, NO_WALLET, NOT_JSON, READ_UNAVAILABLE as UNAVAILABLE, TOO_LARGE,
    UNAUTHORIZED,
};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, QueryParams, WalletPath};
use super::history::{DEFAULT_PAGE, MAX_PAGE};
use super::idempotent::{self, KeyedRequest, render_movement, render_open};
use crate::domain;
use crate::domain::{Access, Field, Metadata};
use crate::idempotency::{Receipt, Scope};
use crate::wallet::{
    AlreadyExists, Amount, EntryFilter, InvalidInput, Movement, Order, WalletError, WalletId,
};
use axum::{
    Json,
    extract::{Extension, State},
    http::Uri,
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

// Response descriptions shared by the operations' documentation.
const KEY_REUSED: &str = "`idempotency_key_reused`: the key was used for a different request";

/// The wallet routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default()
        .routes(routes!(open_wallet))
        .routes(routes!(get_wallet))
        .routes(routes!(deposit))
        .routes(routes!(pay))
        .routes(routes!(transactions))
}

/// A new wallet. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct OpenWallet {
    /// The wallet's id; without one (or with null) the server makes a UUID.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    id: Option<String>,
    /// The opening balance in minor units; 0 when absent (or null).
    #[schema(minimum = 0, maximum = 1_000_000_000_000_i64, example = 10000)]
    balance: Option<i64>,
}

/// Opens a wallet, with its opening balance as its first ledger entry (`open`).
#[utoipa::path(
    post,
    path = "/wallets",
    tag = "wallets",
    security(("bearer" = [])),
    params(IdempotencyHeader),
    request_body(content = OpenWallet, content_type = "application/json"),
    responses(
        (status = 201, description = "The new wallet", body = WalletBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(
                ("GetWallet" = (operation_id = "get_wallet", parameters(("id" = "$response.body#/id")))),
                ("Deposit" = (operation_id = "deposit", parameters(("id" = "$response.body#/id")))),
                ("Pay" = (operation_id = "pay", parameters(("id" = "$response.body#/id")))),
                ("Transactions" = (operation_id = "transactions", parameters(("id" = "$response.body#/id")))),
            )),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_balance`, `invalid_idempotency_key`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`wallet_exists`; `idempotency_key_in_flight` (with `Retry-After`)",
            headers(
                ("Retry-After" = u64, description = "Seconds to wait"),
                ("Idempotent-Replayed" = String),
            )),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, description = KEY_REUSED, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`overloaded`, `dependency_unavailable`, `request_timeout`, \
                           `outcome_unknown`: retry after `Retry-After`",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn open_wallet(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<OpenWallet>,
) -> Result<Response, ApiError> {
    let id = match &body.value.id {
        Some(id) => WalletId::parse(id)?,
        None => WalletId::generate(),
    };
    tracing::Span::current().record("wallet_id", id.as_str());
    let balance = domain::opening_balance(body.value.balance.unwrap_or(0))?;
    let scope = Scope::wallet_creation(&access.caller);
    let claim =
        match idempotent::begin(&ctx, scope, KeyedRequest { key, path: uri.path(), body: &body.raw }).await {
            Ok(claim) => claim,
            Err(answered) => return Ok(answered),
        };
    let receipt = claim.map(|claim| Receipt { claim, render: render_open });
    let outcome = match ctx.wallets.open(&access.caller, &id, balance, receipt).await {
        Ok(wallet) => Ok(wallet),
        Err(WalletError::Exists) => Err(AlreadyExists),
        Err(err) => return Err(err.into()),
    };
    Ok(render_open(&outcome).into_response())
}

/// Reads a wallet's balance and version.
#[utoipa::path(
    get,
    path = "/wallets/{id}",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath),
    responses(
        (status = 200, description = "The wallet", body = WalletBody),
        (status = 400, description = "`invalid_wallet_id`", body = ProblemDocument,
            content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn get_wallet(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
) -> Result<Json<WalletBody>, ApiError> {
    Ok(Json(ctx.wallets.get(&access, &id).await?.into()))
}

/// Money in. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Deposit {
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: i64,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Deposits money, under the wallet's lease and with a fenced commit.
#[utoipa::path(
    post,
    path = "/wallets/{id}/deposit",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = Deposit, content_type = "application/json"),
    responses(
        (status = 200, description = "The deposit's ledger entry", body = EntryBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(("GetWallet" = (
                operation_id = "get_wallet",
                parameters(("id" = "$response.body#/wallet_id"))
            )))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_amount`, `invalid_metadata`, `invalid_idempotency_key`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = MOVEMENT_CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`balance_overflow` (with `balance`; nothing applied); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = MOVEMENT_UNAVAILABLE, body = ProblemDocument,
            content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn deposit(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<Deposit>,
) -> Result<Response, ApiError> {
    let Deposit { amount, metadata } = &body.value;
    let movement =
        Movement::Deposit { amount: Amount::new(*amount)?, metadata: Metadata::parse(metadata.clone())? };
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    Ok(idempotent::apply_movement(&ctx, &access, &id, movement, keyed, render_movement).await)
}

/// Money out. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Pay {
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 2500)]
    amount: i64,
    /// The caller's own note (an order number, say): at most 256 characters, no NUL.
    #[schema(max_length = 256, pattern = "^[^\\x00]*$", example = "order-1001")]
    reference: Option<String>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Pays from the wallet, if its balance covers the amount; nothing is applied otherwise.
#[utoipa::path(
    post,
    path = "/wallets/{id}/pay",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = Pay, content_type = "application/json"),
    responses(
        (status = 200, description = "The payment's ledger entry", body = EntryBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(("GetWallet" = (
                operation_id = "get_wallet",
                parameters(("id" = "$response.body#/wallet_id"))
            )))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_amount`, `invalid_reference`, \
                           `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = MOVEMENT_CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`insufficient_funds` (with `balance`; nothing applied); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = MOVEMENT_UNAVAILABLE, body = ProblemDocument,
            content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn pay(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<Pay>,
) -> Result<Response, ApiError> {
    let Pay { amount, reference, metadata } = body.value;
    let movement = Movement::Pay {
        amount: Amount::new(amount)?,
        reference: domain::reference(reference)?,
        metadata: Metadata::parse(metadata)?,
    };
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    Ok(idempotent::apply_movement(&ctx, &access, &id, movement, keyed, render_movement).await)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct PageQuery {
    /// At most this many entries (default 50).
    #[param(minimum = 1, maximum = 500, example = 50)]
    limit: Option<i64>,
    /// The `next_cursor` of the previous page.
    #[param(pattern = "^[1-9][0-9]{0,17}$", example = "2")]
    before: Option<String>,
}

/// A page of a wallet's ledger, newest first.
#[derive(Debug, Serialize, ToSchema)]
struct Page {
    transactions: Vec<EntryBody>,
    /// Pass as `before` to get the next (older) page; null on the last page.
    #[schema(required = true, pattern = "^[1-9][0-9]*$", example = "2")]
    next_cursor: Option<String>,
}

/// Pages through the wallet's ledger, newest first: `/wallets/{id}/entries?order=desc` with a
/// cursor of its own (the last version seen), kept for the callers that use it.
#[utoipa::path(
    get,
    path = "/wallets/{id}/transactions",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath, PageQuery),
    responses(
        (status = 200, description = "A page of the wallet's ledger entries, newest first", body = Page),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_limit`, `invalid_cursor`, \
                           `invalid_query` (an unknown, repeated or mistyped parameter)"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn transactions(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    QueryParams(query): QueryParams<PageQuery>,
) -> Result<Json<Page>, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(InvalidInput { field: Field::Limit, rule: "an integer from 1 to 500" }.into());
    }
    // A cursor is the version of the last entry on the previous page; entries are numbered from 1.
    let before = match query.before.as_deref() {
        None => None,
        Some(cursor) => {
            Some(cursor.parse::<i64>().ok().filter(|version| *version >= 1).ok_or(InvalidInput {
                field: Field::Before,
                rule: "a next_cursor returned by this endpoint",
            })?)
        }
    };
    let newest_first = EntryFilter { order: Order::Desc, after: before, limit, ..EntryFilter::default() };
    let transactions = ctx.wallets.entries(&access, &id, &newest_first).await?;
    // Versions are contiguous from 1, so there is an older page exactly when the oldest entry on
    // this one is not the wallet's first.
    let next_cursor =
        transactions.last().filter(|oldest| oldest.version > 1).map(|oldest| oldest.version.to_string());
    let transactions = transactions.into_iter().map(EntryBody::from).collect();
    Ok(Json(Page { transactions, next_cursor }))
}
