//! `/wallets/{id}/limits`: what a wallet may spend beside its balance (an overdraft) and the most
//! one debit may take, replaced under the wallet's lease like any movement of it, so no payment is
//! decided against half-changed limits (docs/api/limits.md).

use super::ApiContext;
use super::bodies::LimitsBody;
use super::error::described::{
    MOVEMENT_CONFLICT, MOVEMENT_UNAVAILABLE, NO_WALLET, NOT_JSON, READ_UNAVAILABLE as UNAVAILABLE, TOO_LARGE,
    UNAUTHORIZED,
};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, WalletPath};
use super::idempotent::{self, KeyedRequest, render_movement};
use crate::domain::{Access, Amount, Field, InvalidInput, Limits, Movement};
use axum::Json;
use axum::extract::{Extension, State};
use axum::http::Uri;
use axum::response::Response;
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(set_limits, get_limits))
}

/// A wallet's limits, each left out for none. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewLimits {
    /// How far below zero the balance may go (a credit line).
    #[schema(minimum = 0, maximum = 1_000_000_000_000_i64, example = 50000)]
    overdraft: Option<i64>,
    /// The most one debit may take: a payment, a hold, a transfer's or movement's debit leg.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 20000)]
    per_payment: Option<i64>,
}

impl NewLimits {
    fn limits(&self) -> Result<Limits, InvalidInput> {
        let invalid = || InvalidInput {
            field: Field::Limits,
            rule: "`overdraft` is a whole number from 0 to 10^12, `per_payment` from 1 to 10^12",
        };
        let overdraft = match self.overdraft {
            None | Some(0) => 0,
            Some(overdraft) => Amount::new(overdraft).map_err(|_| invalid())?.get(),
        };
        let per_payment = self.per_payment.map(Amount::new).transpose().map_err(|_| invalid())?;
        Ok(Limits { overdraft, per_payment: per_payment.map(Amount::get) })
    }
}

/// Replaces the wallet's limits (a limit left out is none), under its lease, in the queue of its
/// movements: every movement after it is decided with the new limits, none with half of them.
/// An overdraft less than what the wallet already owes is refused.
#[utoipa::path(
    put,
    path = "/wallets/{id}/limits",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = NewLimits, content_type = "application/json"),
    responses(
        (status = 200, description = "The wallet's limits now", body = LimitsBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_limits`, `invalid_idempotency_key`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = MOVEMENT_CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`limit_below_used` (nothing changed); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = MOVEMENT_UNAVAILABLE, body = ProblemDocument,
            content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn set_limits(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<NewLimits>,
) -> Result<Response, ApiError> {
    let movement = Movement::SetLimits(body.value.limits()?);
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    Ok(idempotent::apply_movement(&ctx, &access, &id, movement, keyed, render_movement).await)
}

/// The wallet's limits.
#[utoipa::path(
    get,
    path = "/wallets/{id}/limits",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath),
    responses(
        (status = 200, description = "The wallet's limits", body = LimitsBody),
        (status = 400, description = "`invalid_wallet_id`", body = ProblemDocument,
            content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn get_limits(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
) -> Result<Json<LimitsBody>, ApiError> {
    Ok(Json(ctx.wallets.get(&access, &id).await?.rules.limits.into()))
}
