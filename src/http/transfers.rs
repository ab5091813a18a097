//! `/transfers` and `/wallets/{id}/refunds`: money between wallets, and back.

use super::ApiContext;
use super::bodies::{EntryBody, MetadataObject, TransferBody};
use super::error::described::{MOVEMENT_CONFLICT as CONFLICT, NOT_JSON, TOO_LARGE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, WalletPath};
use super::idempotent::{self, KeyedRequest, render_entry, render_transfer};
use crate::domain;
use crate::domain::{Access, Field, Metadata};
use crate::idempotency::Scope;
use crate::wallet::{Amount, Between, InvalidInput, Parties, Refund, WalletId};
use axum::{
    Json,
    extract::{Extension, State},
    http::Uri,
    response::Response,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

// Response descriptions shared by the operations' documentation.
const UNAVAILABLE: &str = "`lock_timeout`, `dependency_unavailable`, `request_timeout`, `outcome_unknown`: \
                           retry after `Retry-After`";

/// The transfer and refund routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default()
        .routes(routes!(transfer))
        .routes(routes!(get_transfer))
        .routes(routes!(refund_transfer))
        .routes(routes!(refund_payment))
}

super::extract::uuid_path!(
    /// The `{id}` segment of a transfer route: a UUID.
    TransferPath,
    "The transfer's id.",
    Field::TransferId
);

/// Money from one wallet to another. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewTransfer {
    /// The paying wallet.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    from: String,
    /// The paid wallet; not `from`.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "bob")]
    to: String,
    /// Minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 2500)]
    amount: i64,
    /// The caller's own note: at most 256 characters, no NUL.
    #[schema(max_length = 256, pattern = "^[^\\x00]*$", example = "invoice-77")]
    reference: Option<String>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Moves money from one wallet to another: both legs in one transaction, under both wallets'
/// leases, or nothing.
#[utoipa::path(
    post,
    path = "/transfers",
    tag = "transfers",
    security(("bearer" = [])),
    params(IdempotencyHeader),
    request_body(content = NewTransfer, content_type = "application/json"),
    responses(
        (status = 200, description = "The transfer, with its two ledger entries", body = TransferBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(("GetTransfer" = (operation_id = "get_transfer", parameters(("id" = "$response.body#/id")))))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`same_wallet`, `invalid_wallet_id` (`field`: `from` or `to`), `invalid_amount`, \
                           `invalid_reference`, `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`wallet_not_found` (`field`: `from` or `to`; also a wallet the caller may not pay from or into)"),
        (status = 409, description = CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`insufficient_funds` (`balance` of `from`), `balance_overflow` (`balance` of `to`); \
                           nothing applied; `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn transfer(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<NewTransfer>,
) -> Result<Response, ApiError> {
    let NewTransfer { from, to, amount, reference, metadata } = &body.value;
    let party = |id: &str, field| WalletId::parse(id).map_err(|invalid| InvalidInput { field, ..invalid });
    let parties = Parties::new(party(from, Field::From)?, party(to, Field::To)?)?;
    tracing::Span::current().record("wallet_id", parties.from.as_str());
    let between = Between {
        parties,
        amount: Amount::new(*amount)?,
        reference: domain::reference(reference.clone())?,
        metadata: Metadata::parse(metadata.clone())?,
    };
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_transfer);
    Ok(idempotent::transfer_response(ctx.wallets.transfer(&access, between, key).await))
}

/// A transfer and what has been refunded of it.
#[derive(Debug, Serialize, ToSchema)]
struct TransferState {
    #[serde(flatten)]
    transfer: TransferBody,
    /// What the refunds of this transfer add up to so far (at most its amount).
    #[schema(minimum = 0, example = 0)]
    refunded: i64,
}

/// Reads a transfer, with its two ledger entries and what has been refunded of it.
#[utoipa::path(
    get,
    path = "/transfers/{id}",
    tag = "transfers",
    security(("bearer" = [])),
    params(TransferPath),
    responses(
        (status = 200, description = "The transfer", body = TransferState),
        (status = 400, description = "`invalid_transfer_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`transfer_not_found` (also one with neither wallet the caller's)", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = "`dependency_unavailable`, `request_timeout`: retry after `Retry-After`",
            body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn get_transfer(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    TransferPath(id): TransferPath,
) -> Result<Json<TransferState>, ApiError> {
    let found = ctx.wallets.find_transfer(&access, id).await?;
    Ok(Json(TransferState { transfer: found.transfer.into(), refunded: found.refunded }))
}

/// How much of a transfer to move back. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct TransferRefund {
    /// Minor units; without it (or with null), all that is not yet refunded.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Moves money of a transfer back, from its `to` to its `from`, as a transfer of its own (with
/// `refund_of`). The refunds of one transfer never add up to more than it.
#[utoipa::path(
    post,
    path = "/transfers/{id}/refund",
    tag = "transfers",
    security(("bearer" = [])),
    params(TransferPath, IdempotencyHeader),
    request_body(content = TransferRefund, content_type = "application/json"),
    responses(
        (status = 200, description = "The refund: a transfer from the original's `to` to its `from`",
            body = TransferBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_transfer_id`, `invalid_amount`, `invalid_metadata`, `invalid_idempotency_key`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`transfer_not_found` (also one the caller may not refund: the wallet it paid into is not the caller's)", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`refund_exceeds_payment` (with `refundable`), `insufficient_funds` (the payee \
                           no longer has it), `balance_overflow`; nothing applied; `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn refund_transfer(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    TransferPath(id): TransferPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<TransferRefund>,
) -> Result<Response, ApiError> {
    let amount = body.value.amount.map(Amount::new).transpose()?;
    let metadata = Metadata::parse(body.value.metadata.clone())?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_transfer);
    Ok(idempotent::transfer_response(ctx.wallets.refund_transfer(&access, id, amount, metadata, key).await))
}

/// Money back into a wallet for one of its payments. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct PaymentRefund {
    /// The id of a `pay` entry of this wallet.
    #[schema(format = Uuid)]
    payment: String,
    /// Minor units; without it (or with null), all that is not yet refunded.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Puts money back into the wallet for one of its payments, as a `refund` entry that names it
/// (`refund_of`). The refunds of one payment never add up to more than it.
#[utoipa::path(
    post,
    path = "/wallets/{id}/refunds",
    tag = "transfers",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = PaymentRefund, content_type = "application/json"),
    responses(
        (status = 200, description = "The refund's ledger entry", body = EntryBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_payment_id`, `invalid_amount`, \
                           `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`wallet_not_found`; `payment_not_found` (no `pay` entry of this wallet has this id)"),
        (status = 409, description = CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`refund_exceeds_payment` (with `refundable`), `balance_overflow`; nothing \
                           applied; `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn refund_payment(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<PaymentRefund>,
) -> Result<Response, ApiError> {
    let payment = Uuid::parse_str(&body.value.payment)
        .map_err(|_| InvalidInput { field: Field::Payment, rule: "the id of a pay entry (a UUID)" })?;
    let amount = body.value.amount.map(Amount::new).transpose()?;
    let metadata = Metadata::parse(body.value.metadata.clone())?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::wallet(&access.caller, &id), keyed, render_entry);
    let refund = Refund { wallet: id, payment, amount, metadata };
    Ok(idempotent::entry_response(ctx.wallets.refund_payment(&access, refund, key).await))
}
