//! `/wallets`: open, read, deposit, pay, and page through the ledger.

use super::ApiContext;
use super::error::ApiError;
use super::extract::{JsonBody, QueryParams, WalletPath};
use crate::ledger::{Entry, Wallet};
use crate::wallet::{Amount, InvalidInput, Movement, WalletId, domain};
use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
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
    JsonBody(body): JsonBody<OpenWallet>,
) -> Result<impl IntoResponse, ApiError> {
    let id = match body.id {
        Some(id) => WalletId::parse(&id)?,
        None => WalletId::generate(),
    };
    tracing::Span::current().record("wallet_id", id.as_str());
    let balance = domain::opening_balance(body.balance.unwrap_or(0))?;
    let (wallet, _open) = ctx.wallets.open(&id, balance).await?;
    let location = format!("/wallets/{}", wallet.id);
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(wallet)))
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
    WalletPath(id): WalletPath,
    JsonBody(body): JsonBody<Deposit>,
) -> Result<Json<Entry>, ApiError> {
    let movement = Movement::Deposit { amount: Amount::new(body.amount)? };
    Ok(Json(ctx.wallets.apply(&id, movement).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pay {
    amount: i64,
    reference: Option<String>,
}

async fn pay(
    State(ctx): State<ApiContext>,
    WalletPath(id): WalletPath,
    JsonBody(body): JsonBody<Pay>,
) -> Result<Json<Entry>, ApiError> {
    let movement =
        Movement::Pay { amount: Amount::new(body.amount)?, reference: domain::reference(body.reference)? };
    Ok(Json(ctx.wallets.apply(&id, movement).await?))
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
