//! `/wallets/{id}/holds` and `/holds`: reserve part of a wallet's available balance, then capture
//! it (charge it, in full or in part), void it, or let it expire.

use super::ApiContext;
use super::bodies::{HoldBody, HoldReceipt, MetadataObject};
use super::error::described::{
    MOVEMENT_CONFLICT, MOVEMENT_UNAVAILABLE as UNAVAILABLE, NOT_JSON, TOO_LARGE, UNAUTHORIZED,
};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, WalletPath};
use super::idempotent::{self, KeyedRequest, render_created, render_movement};
use crate::domain::{self, Access, Field, HoldLife, Metadata};
use crate::wallet::{Amount, Movement, WalletId};
use axum::{
    Json,
    extract::{Extension, State},
    http::Uri,
    response::Response,
};
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

const NO_HOLD: &str = "`hold_not_found` (also a hold on a wallet of another caller)";
const SETTLED: &str = "`hold_captured`, `hold_voided`, `hold_expired`: the hold is settled, nothing \
                       changed; `lease_lost` (nothing applied, retry); `idempotency_key_in_flight` \
                       (with `Retry-After`)";

/// The hold routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default()
        .routes(routes!(place_hold))
        .routes(routes!(get_hold))
        .routes(routes!(capture))
        .routes(routes!(void))
}

super::extract::uuid_path!(
    /// The `{id}` segment of a hold route: a UUID.
    HoldPath,
    "The hold's id.",
    Field::HoldId
);

/// A hold to place. Unknown fields are refused.
// `NewHold` in the document, as published; `PlaceHold` in the code, beside the store's `NewHold`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = NewHold)]
pub(super) struct PlaceHold {
    /// Minor units to reserve of the available balance.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 4000)]
    amount: i64,
    /// Seconds until it expires by itself: 1 to 604800 (7 days); 900 (15 minutes) without it.
    #[schema(minimum = 1, maximum = 604_800, example = 900)]
    expires_in: Option<i64>,
    /// The caller's own note (a ride, a booking): at most 256 characters, no NUL. The capture's
    /// `pay` entry carries it.
    #[schema(max_length = 256, pattern = "^[^\\x00]*$", example = "ride-77")]
    reference: Option<String>,
    /// Your own key-value pairs (see `Metadata`); the capture's `pay` entry keeps them.
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Reserves part of the wallet's available balance until it is captured, voided or expires:
/// under the wallet's lease with a fenced commit, like a payment.
#[utoipa::path(
    post,
    path = "/wallets/{id}/holds",
    tag = "holds",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = PlaceHold, content_type = "application/json"),
    responses(
        (status = 201, description = "The hold", body = HoldBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(
                ("GetHold" = (operation_id = "get_hold", parameters(("id" = "$response.body#/id")))),
                ("Capture" = (operation_id = "capture", parameters(("id" = "$response.body#/id")))),
                ("Void" = (operation_id = "void", parameters(("id" = "$response.body#/id")))),
            )),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_amount`, `invalid_expires_in`, `invalid_reference`, \
                           `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`wallet_not_found` (also a wallet of another caller)",
            body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = MOVEMENT_CONFLICT,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`insufficient_funds` (with `balance` and `available`; nothing held); \
                           `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn place_hold(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<PlaceHold>,
) -> Result<Response, ApiError> {
    let PlaceHold { amount, expires_in, reference, metadata } = &body.value;
    let life = expires_in.map_or(Ok(HoldLife::DEFAULT), HoldLife::seconds)?;
    let movement = Movement::Hold {
        amount: Amount::new(*amount)?,
        life,
        reference: domain::reference(reference.clone())?,
        metadata: Metadata::parse(metadata.clone())?,
    };
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    Ok(idempotent::apply_movement(&ctx, &access, &id, movement, keyed, render_created).await)
}

/// Reads a hold. One still held past `expires_at` reads `expired`: its amount is available again.
#[utoipa::path(
    get,
    path = "/holds/{id}",
    tag = "holds",
    security(("bearer" = [])),
    params(HoldPath),
    responses(
        (status = 200, description = "The hold", body = HoldBody),
        (status = 400, description = "`invalid_hold_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_HOLD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = "`dependency_unavailable`, `request_timeout`: retry after `Retry-After`",
            body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn get_hold(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    HoldPath(id): HoldPath,
) -> Result<Json<HoldBody>, ApiError> {
    Ok(Json(ctx.wallets.find_hold(&access, id).await?.into()))
}

/// How much of a hold to charge. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Capture {
    /// Minor units, at most the hold's amount; without it (or with null), all of it. The rest is
    /// released.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 3200)]
    amount: Option<i64>,
}

/// Charges the hold (once): a `pay` entry of the amount captured, and the rest released.
#[utoipa::path(
    post,
    path = "/holds/{id}/capture",
    tag = "holds",
    security(("bearer" = [])),
    params(HoldPath, IdempotencyHeader),
    request_body(content = Capture, content_type = "application/json"),
    responses(
        (status = 200, description = "The hold, `captured`, with the `pay` entry it wrote as `entry`",
            body = HoldReceipt,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_hold_id`, `invalid_amount`, `invalid_idempotency_key`, `malformed_json`, \
                           `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_HOLD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = SETTLED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"), ("Idempotent-Replayed" = String))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`capture_exceeds_hold` (with `held`; nothing charged); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn capture(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    HoldPath(hold): HoldPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<Capture>,
) -> Result<Response, ApiError> {
    let amount = body.value.amount.map(Amount::new).transpose()?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    settle(&ctx, &access, hold, Movement::Capture { hold, amount }, keyed).await
}

/// Releases the hold (once), charging nothing.
#[utoipa::path(
    post,
    path = "/holds/{id}/void",
    tag = "holds",
    security(("bearer" = [])),
    params(HoldPath, IdempotencyHeader),
    responses(
        (status = 200, description = "The hold, `voided`", body = HoldBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_hold_id`, `invalid_idempotency_key`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_HOLD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = SETTLED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"), ("Idempotent-Replayed" = String))),
        (status = 422, description = "`idempotency_key_reused`", body = ProblemDocument,
            content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn void(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    HoldPath(hold): HoldPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
) -> Result<Response, ApiError> {
    let keyed = KeyedRequest { key, path: uri.path(), body: b"" };
    settle(&ctx, &access, hold, Movement::Void { hold }, keyed).await
}

/// Runs a capture or void on the hold's wallet, under its lease; its key is scoped to that wallet.
async fn settle(
    ctx: &ApiContext,
    access: &Access,
    hold: Uuid,
    movement: Movement,
    keyed: KeyedRequest<'_>,
) -> Result<Response, ApiError> {
    let wallet: WalletId = ctx.wallets.wallet_of_hold(access, hold).await?;
    tracing::Span::current().record("wallet_id", wallet.as_str());
    Ok(idempotent::apply_movement(ctx, access, &wallet, movement, keyed, render_movement).await)
}
