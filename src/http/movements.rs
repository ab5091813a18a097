//! `/movements`: money between 2 to 16 wallets at once, every leg or none (a payment split
//! between a merchant, a platform's fee and a tax wallet). A transfer is the two-leg case.

use super::ApiContext;
use super::bodies::{MetadataObject, MovementBody};
use super::error::described::{MOVEMENT_CONFLICT as CONFLICT, NOT_JSON, TOO_LARGE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, OptionalJsonBody};
use super::idempotent::{
    self, KeyedRequest, movement_record_response, render_movement_record, render_movement_settled,
};
use crate::domain::{self, Access, Amount, Field, HoldLife, Legs, Metadata};
use crate::idempotency::Scope;
use crate::wallet::{InvalidInput, SettleAs, WalletId};
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
        .routes(routes!(refund_movement))
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
pub(super) struct NewMovement {
    /// 2 to 16 legs on distinct wallets, summing to zero.
    #[schema(min_items = 2, max_items = 16)]
    legs: Vec<NewLeg>,
    /// The caller's own note: at most 256 characters, no NUL.
    #[schema(max_length = 256, pattern = "^[^\\x00]*$", example = "order-1001")]
    reference: Option<String>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
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
        (status = 201, description = "The movement, with one ledger entry a leg", body = MovementBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response")),
            links(("GetMovement" = (operation_id = "get_movement", parameters(("id" = "$response.body#/id")))))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_legs` (fewer than 2 or more than 16, a wallet twice, an amount of 0 or past \
                           10^12, not summing to zero, a bad wallet id), `invalid_reference`, \
                           `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, `invalid_body`"),
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
    let NewMovement { legs, reference, metadata, hold } = &body.value;
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
    let metadata = Metadata::parse(metadata.clone())?;
    let hold = hold
        .as_ref()
        .map(|hold| hold.expires_in.map_or(Ok(HoldLife::DEFAULT), HoldLife::seconds))
        .transpose()?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_movement_record);
    let result = ctx.wallets.move_between(&access, legs, reference, metadata, hold, key).await;
    Ok(movement_record_response(result, render_movement_record))
}

/// How much of a held movement to capture, or of a movement to refund. The body may be left out.
/// Unknown fields are refused.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct PartOf {
    /// Minor units, at most what is left; without it (or with null, or with no body), all of it.
    /// Each leg takes its share in proportion to its amount (the debits of it, and the credits
    /// of it, each rounded down, the units left over to the legs rounding took most from).
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
}

/// How much of a movement to move back. Unknown fields are refused.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct MovementRefund {
    /// Minor units, at most what is left to refund; without it (or with null, or with no body),
    /// all of it. Each leg gives back its share, as a capture's legs take theirs.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
    /// Your own key-value pairs, kept with every entry it writes (see `Metadata`).
    #[schema(value_type = Option<Metadata>)]
    metadata: MetadataObject,
}

/// Captures a held movement as a whole, under every wallet's lease: every leg's entry written and
/// every hold settled (what a hold reserved beyond its leg's share is released), or nothing.
#[utoipa::path(
    post,
    path = "/movements/{id}/capture",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath, IdempotencyHeader),
    request_body(content = Option<PartOf>, content_type = "application/json"),
    responses(
        (status = 200, description = "The movement, `captured`, with one ledger entry a leg", body = MovementBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, description = SETTLE_BAD, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = SETTLE_MISSING, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON, description = SETTLE_CONFLICT,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`capture_exceeds_hold` (with `held`: what the debit legs reserve), `balance_overflow` \
                           (with `leg`); nothing applied; `idempotency_key_reused`",
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
    OptionalJsonBody(body): OptionalJsonBody<PartOf>,
) -> Result<Response, ApiError> {
    let amount = body.value.amount.map(Amount::new).transpose()?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    settle(&ctx, &access, id, SettleAs::Capture(amount), keyed).await
}

/// Voids a held movement as a whole: every hold released, nothing charged.
#[utoipa::path(
    post,
    path = "/movements/{id}/void",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath, IdempotencyHeader),
    responses(
        (status = 200, description = "The movement, `voided`", body = MovementBody,
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
    settle(&ctx, &access, id, SettleAs::Void, KeyedRequest { key, path: uri.path(), body: b"" }).await
}

/// Captures or voids held movement `id`; its key is scoped as the movement's was.
async fn settle(
    ctx: &ApiContext,
    access: &Access,
    id: uuid::Uuid,
    settle: SettleAs,
    keyed: KeyedRequest<'_>,
) -> Result<Response, ApiError> {
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_movement_settled);
    let result = ctx.wallets.settle_movement(access, id, settle, key).await;
    Ok(movement_record_response(result, render_movement_settled))
}

/// Moves money back for a movement: all that is left of it, or `amount` of it, every leg by its
/// share, as a movement of its own that names it (`refund_of`), under every wallet's lease. Its
/// refunds never give back more than a leg moved. The caller must be able to use every wallet the
/// refund takes money from; the money goes back where it came from.
#[utoipa::path(
    post,
    path = "/movements/{id}/refund",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath, IdempotencyHeader),
    request_body(content = Option<MovementRefund>, content_type = "application/json"),
    responses(
        (status = 201, description = "The refund: a movement of every leg back, with one ledger entry a leg \
                                      whose share is not nothing", body = MovementBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_movement_id`, `invalid_amount`, `invalid_metadata`, `invalid_idempotency_key`, `malformed_json`, \
                           `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`movement_not_found` (also one that takes money from a wallet the caller may not use)"),
        (status = 409, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`movement_not_captured` (a held movement not captured moved nothing); `lease_lost`, \
                           `idempotency_key_in_flight`",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`refund_exceeds_payment` (with `refundable`), `insufficient_funds` (a wallet paid \
                           into spent it since), `balance_overflow` (with `leg`); nothing applied; \
                           `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn refund_movement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    MovementPath(id): MovementPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    OptionalJsonBody(body): OptionalJsonBody<MovementRefund>,
) -> Result<Response, ApiError> {
    let amount = body.value.amount.map(Amount::new).transpose()?;
    let metadata = Metadata::parse(body.value.metadata.clone())?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    let key = idempotent::keyed(Scope::transfers(&access.caller), keyed, render_movement_record);
    let result = ctx.wallets.refund_movement(&access, id, amount, metadata, key).await;
    Ok(movement_record_response(result, render_movement_record))
}

/// Reads a movement, with its legs.
#[utoipa::path(
    get,
    path = "/movements/{id}",
    tag = "transfers",
    security(("bearer" = [])),
    params(MovementPath),
    responses(
        (status = 200, description = "The movement", body = MovementBody),
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
) -> Result<Json<MovementBody>, ApiError> {
    Ok(Json(ctx.wallets.find_movement(&access, id).await?.into()))
}
