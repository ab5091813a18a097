//! `/movements`: money between 2 to 16 wallets at once, every leg or none (a payment split
//! between a merchant, a platform's fee and a tax wallet). A transfer is the two-leg case.

use super::ApiContext;
use super::error::described::{MOVEMENT_CONFLICT as CONFLICT, NOT_JSON, TOO_LARGE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody};
use super::idempotent::{
    self, KeyedRequest, movement_record_response, render_movement_record, render_movement_settled,
};
use crate::domain::{self, Access, Field, HoldLife, Legs};
use crate::idempotency::Scope;
use crate::ledger::transfer::MovementRecord;
use crate::wallet::{InvalidInput, WalletId};
use axum::{
    Json,
    extract::{Extension, State},
    http::Uri,
    response::Response,
};
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

const UNAVAILABLE: &str = "`lock_timeout`, `dependency_unavailable`, `request_timeout`, `outcome_unknown`: \
                           retry after `Retry-After`";

/// What a capture or a void of a held movement may answer besides its movement.
const SETTLE_BAD: &str = "`invalid_movement_id`, `invalid_idempotency_key`";
const SETTLE_MISSING: &str = "`movement_not_found`; `wallet_not_found` (with `leg`)";
const SETTLE_CONFLICT: &str = "`hold_captured`, `hold_voided`, `hold_expired` (with `leg`; nothing changed); \
                               `movement_not_held`; `lease_lost`, `idempotency_key_in_flight`";

/// The movement routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default()
        .routes(routes!(create_movement))
        .routes(routes!(get_movement))
        .routes(routes!(capture_movement))
        .routes(routes!(void_movement))
}

super::extract::uuid_path!(
    /// The `{id}` segment of a movement route: a UUID.
    MovementPath,
    "The movement's id.",
    Field::MovementId
);

/// One leg of a movement. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewLeg {
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "merchant")]
    wallet_id: String,
    /// Minor units: negative out of the wallet, positive into it; 1 to 10^12 either way.
    #[schema(minimum = -1_000_000_000_000_i64, maximum = 1_000_000_000_000_i64, example = -1000)]
    amount: i64,
}

/// Money between 2 to 16 wallets at once. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewMovement {
    /// 2 to 16 legs on distinct wallets, summing to zero.
    #[schema(min_items = 2, max_items = 16)]
    legs: Vec<NewLeg>,
    /// The caller's own note: at most 256 characters, no NUL.
    #[schema(max_length = 256, pattern = "^[^\\x00]*$", example = "order-1001")]
    reference: Option<String>,
    /// Place the movement as a hold instead: every debit leg reserved until it is captured or
    /// voided as a whole, or expires; no entry is written until the capture.
    hold: Option<NewMovementHold>,
}

/// How long a held movement's reservation lasts. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewMovementHold {
    /// Seconds until it expires by itself: 1 to 604800 (7 days); 900 (15 minutes) without it.
    #[schema(minimum = 1, maximum = 604_800, example = 900)]
    expires_in: Option<i64>,
}

/// Moves money between 2 to 16 wallets at once: every leg in one transaction, under every
/// wallet's lease, or nothing. Money leaves only the caller's wallets and goes into wallets the
/// caller may pay into (as a transfer's).
#[utoipa::path(
    post,
    path = "/movements",
    tag = "transfers",
    security(("bearer" = [])),
    params(IdempotencyHeader),
    request_body(content = NewMovement, content_type = "application/json"),
    responses(
        (status = 201, description = "The movement, with one ledger entry a leg", body = MovementRecord,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(("GetMovement" = (operation_id = "get_movement", parameters(("id" = "$response.body#/id")))))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_legs` (fewer than 2 or more than 16, a wallet twice, an amount of 0 or past \
                           10^12, not summing to zero, a bad wallet id), `invalid_reference`, \
                           `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`wallet_not_found` (with `leg`; also a wallet the caller may not take from or pay into)"),
        (status = 409, description = CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`insufficient_funds`, `balance_overflow` (with `leg` and that wallet's `balance`); \
                           nothing applied; `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn create_movement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<NewMovement>,
) -> Result<Response, ApiError> {
    let NewMovement { legs, reference, hold } = &body.value;
    let legs = legs
        .iter()
        .map(|leg| {
            let wallet = WalletId::parse(&leg.wallet_id)
                .map_err(|_| InvalidInput { field: Field::Legs, rule: Legs::RULE })?;
            Ok((wallet, leg.amount))
        })
        .collect::<Result<Vec<_>, InvalidInput>>()?;
    let legs = Legs::new(legs)?;
    if let Some((first, _, _)) = legs.iter().next() {
        tracing::Span::current().record("wallet_id", first.as_str());
    }
    let reference = domain::reference(reference.clone())?;
    let hold = hold
        .as_ref()
        .map(|hold| hold.expires_in.map_or(Ok(HoldLife::DEFAULT), HoldLife::seconds))
        .transpose()?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_movement_record);
    let result = ctx.wallets.move_between(&access, legs, reference, hold, key).await;
    Ok(movement_record_response(result, render_movement_record))
}

/// Captures a held movement as a whole: every leg's entry written and every hold settled, under
/// every wallet's lease, or nothing.
#[utoipa::path(
    post,
    path = "/movements/{id}/capture",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath, IdempotencyHeader),
    responses(
        (status = 200, description = "The movement, `captured`, with one ledger entry a leg", body = MovementRecord,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, description = SETTLE_BAD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = SETTLE_MISSING, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON, description = SETTLE_CONFLICT,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`balance_overflow` (with `leg`); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn capture_movement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    MovementPath(id): MovementPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
) -> Result<Response, ApiError> {
    settle(&ctx, &access, id, true, KeyedRequest { key, path: uri.path(), body: b"" }).await
}

/// Voids a held movement as a whole: every hold released, nothing charged.
#[utoipa::path(
    post,
    path = "/movements/{id}/void",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath, IdempotencyHeader),
    responses(
        (status = 200, description = "The movement, `voided`", body = MovementRecord,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, description = SETTLE_BAD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = SETTLE_MISSING, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON, description = SETTLE_CONFLICT,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 422, description = "`idempotency_key_reused`", body = ProblemDocument,
            content_type = PROBLEM_JSON, headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn void_movement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    MovementPath(id): MovementPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
) -> Result<Response, ApiError> {
    settle(&ctx, &access, id, false, KeyedRequest { key, path: uri.path(), body: b"" }).await
}

/// Captures or voids held movement `id`; its key is scoped as the movement's was.
async fn settle(
    ctx: &ApiContext,
    access: &Access,
    id: uuid::Uuid,
    capture: bool,
    keyed: KeyedRequest<'_>,
) -> Result<Response, ApiError> {
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_movement_settled);
    let result = ctx.wallets.settle_movement(access, id, capture, key).await;
    Ok(movement_record_response(result, render_movement_settled))
}

/// Reads a movement, with its legs.
#[utoipa::path(
    get,
    path = "/movements/{id}",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath),
    responses(
        (status = 200, description = "The movement", body = MovementRecord),
        (status = 400, description = "`invalid_movement_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`movement_not_found` (also one none of whose wallets is the caller's)",
            body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = "`dependency_unavailable`, `request_timeout`: retry after `Retry-After`",
            body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn get_movement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    MovementPath(id): MovementPath,
) -> Result<Json<MovementRecord>, ApiError> {
    Ok(Json(ctx.wallets.find_movement(&access, id).await?))
}
