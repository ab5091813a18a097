//! `/wallets`: open, read, deposit, pay, and page through the ledger.

use super::ApiContext;
use super::auth::Caller;
use super::error::ApiError;
use super::extract::{IdempotencyHeader, JsonBody, QueryParams, WalletPath};
use super::idempotent::{self, Keyed, render_movement, render_open};
use crate::idempotency::{Receipt, Scope};
use crate::ledger::{Entry, Wallet};
use crate::wallet::{AlreadyExists, Amount, InvalidInput, Movement, WalletError, WalletId, domain};
use axum::{
    Json, Router,
    extract::{Extension, State},
    http::Uri,
    response::Response,
    routing::{get, post},
};
use serde::{Deserialize, Serialize};

pub fn router() -> Router<ApiContext> {
    Router::new()
        .route("/wallets", post(open_wallet))
        .route("/wallets/{id}", get(get_wallet))
        .route("/wallets/{id}/deposit", post(deposit))
        .route("/wallets/{id}/pay", post(pay))
        .route("/wallets/{id}/transactions", get(transactions))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenWallet {
    id: Option<String>,
    balance: Option<i64>,
}

async fn open_wallet(
    State(ctx): State<ApiContext>,
    Extension(caller): Extension<Caller>,
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
    let scope = Scope::wallet_creation(&caller.0);
    let claim = match idempotent::begin(&ctx, scope, Keyed { key, path: uri.path(), body: &body.raw }).await {
        Ok(claim) => claim,
        Err(answered) => return Ok(answered),
    };
    let receipt = claim.map(|claim| Receipt { claim, render: render_open });
    let outcome = match ctx.wallets.open(&id, balance, receipt).await {
        Ok(wallet) => Ok(wallet),
        Err(WalletError::Exists) => Err(AlreadyExists),
        Err(err) => return Err(err.into()),
    };
    Ok(idempotent::into_response(render_open(&outcome)))
}

async fn get_wallet(
    State(ctx): State<ApiContext>,
    WalletPath(id): WalletPath,
) -> Result<Json<Wallet>, ApiError> {
    Ok(Json(ctx.wallets.get(&id).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Deposit {
    amount: i64,
}

async fn deposit(
    State(ctx): State<ApiContext>,
    Extension(caller): Extension<Caller>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<Deposit>,
) -> Result<Response, ApiError> {
    let movement = Movement::Deposit { amount: Amount::new(body.value.amount)? };
    let keyed = Keyed { key, path: uri.path(), body: &body.raw };
    Ok(move_money(&ctx, &caller, &id, movement, keyed).await)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pay {
    amount: i64,
    reference: Option<String>,
}

async fn pay(
    State(ctx): State<ApiContext>,
    Extension(caller): Extension<Caller>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<Pay>,
) -> Result<Response, ApiError> {
    let Pay { amount, reference } = body.value;
    let movement = Movement::Pay { amount: Amount::new(amount)?, reference: domain::reference(reference)? };
    let keyed = Keyed { key, path: uri.path(), body: &body.raw };
    Ok(move_money(&ctx, &caller, &id, movement, keyed).await)
}

/// Runs a validated movement, honouring its idempotency key.
async fn move_money(
    ctx: &ApiContext,
    caller: &Caller,
    id: &WalletId,
    movement: Movement,
    keyed: Keyed<'_>,
) -> Response {
    let claim = match idempotent::begin(ctx, Scope::wallet(&caller.0, id), keyed).await {
        Ok(claim) => claim,
        Err(answered) => return answered,
    };
    let receipt = claim.map(|claim| Receipt { claim, render: render_movement });
    let result = ctx.wallets.apply(id, movement, receipt).await;
    if let Ok(entry) = &result {
        tracing::Span::current().record("fence", entry.fence);
    }
    idempotent::movement_response(result)
}

/// At most this many entries per page.
const MAX_PAGE: i64 = 500;
const DEFAULT_PAGE: i64 = 50;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PageQuery {
    limit: Option<i64>,
    /// The `next_cursor` of the previous page.
    before: Option<String>,
}

#[derive(Debug, Serialize)]
struct Page {
    transactions: Vec<Entry>,
    /// Pass as `before` to get the next (older) page; null on the last page.
    next_cursor: Option<String>,
}

async fn transactions(
    State(ctx): State<ApiContext>,
    WalletPath(id): WalletPath,
    QueryParams(query): QueryParams<PageQuery>,
) -> Result<Json<Page>, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(InvalidInput { field: "limit", rule: "an integer from 1 to 500" }.into());
    }
    // A cursor is the version of the last entry on the previous page; entries are numbered from 1.
    let before = match query.before.as_deref() {
        None => None,
        Some(cursor) => Some(
            cursor
                .parse::<i64>()
                .ok()
                .filter(|version| *version >= 1)
                .ok_or(InvalidInput { field: "before", rule: "a next_cursor returned by this endpoint" })?,
        ),
    };
    let transactions = ctx.wallets.history(&id, before, limit).await?;
    // Versions are contiguous from 1, so there is an older page exactly when the oldest entry on
    // this one is not the wallet's first.
    let next_cursor =
        transactions.last().filter(|oldest| oldest.version > 1).map(|oldest| oldest.version.to_string());
    Ok(Json(Page { transactions, next_cursor }))
}
