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
use crate::domain::{
    Access, Amount, Field, InvalidInput, Limits, LimitsSet, MOST_VELOCITY, Movement, Per, VelocityLimit,
};
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
    /// Velocity limits: at most an amount, or a number of debits, per window; at most 8, one per
    /// window.
    velocity: Option<Vec<NewVelocity>>,
    /// The IANA time zone of calendar windows (`Europe/Paris`); UTC when left out.
    #[schema(example = "Europe/Paris")]
    timezone: Option<String>,
}

/// One velocity limit: `amount`, `count` or both.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewVelocity {
    /// `day`, `week` (from Monday), `month` in the wallet's time zone, or a fixed window of whole
    /// seconds, minutes, hours or days (`30s`, `1m`, `24h`, `7d`) counted from the Unix epoch.
    #[schema(example = "day")]
    per: String,
    /// The most the window's debits may take in all.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 200000)]
    amount: Option<i64>,
    /// The most debits the window may have.
    #[schema(minimum = 1, maximum = 1_000_000_000_i64, example = 50)]
    count: Option<i64>,
}

/// The most debits a velocity limit may count per window.
const MOST_COUNT: i64 = 1_000_000_000;

impl NewLimits {
    fn limits(&self) -> Result<LimitsSet, InvalidInput> {
        let invalid = |rule| InvalidInput { field: Field::Limits, rule };
        let amounts =
            || invalid("`overdraft` is a whole number from 0 to 10^12, `per_payment` from 1 to 10^12");
        let overdraft = match self.overdraft {
            None | Some(0) => 0,
            Some(overdraft) => Amount::new(overdraft).map_err(|_| amounts())?.get(),
        };
        let per_payment = self.per_payment.map(Amount::new).transpose().map_err(|_| amounts())?;
        let velocity = self.velocity.as_deref().unwrap_or_default();
        if velocity.len() > MOST_VELOCITY {
            return Err(invalid("at most 8 velocity limits"));
        }
        let mut limits: Vec<VelocityLimit> = Vec::with_capacity(velocity.len());
        for new in velocity {
            let per = Per::parse(&new.per).ok_or(invalid(
                "`per` is `day`, `week`, `month`, or a whole number of `s`, `m`, `h` or `d` up to 366 days",
            ))?;
            let amount = new
                .amount
                .map(Amount::new)
                .transpose()
                .map_err(|_| invalid("a velocity limit's `amount` is a whole number from 1 to 10^12"))?;
            if new.count.is_some_and(|count| !(1..=MOST_COUNT).contains(&count)) {
                return Err(invalid("a velocity limit's `count` is a whole number from 1 to 10^9"));
            }
            if amount.is_none() && new.count.is_none() {
                return Err(invalid("a velocity limit has an `amount`, a `count`, or both"));
            }
            if limits.iter().any(|limit| limit.per == per) {
                return Err(invalid("one velocity limit per window: give it both an `amount` and a `count`"));
            }
            limits.push(VelocityLimit { per, amount: amount.map(Amount::get), count: new.count });
        }
        let timezone =
            self.timezone.as_deref().map(str::parse::<chrono_tz::Tz>).transpose().map_err(|_| {
                invalid("`timezone` is an IANA time zone name, such as `Europe/Paris` or `UTC`")
            })?;
        let spend = Limits { overdraft, per_payment: per_payment.map(Amount::get) };
        Ok(LimitsSet { limits: spend, velocity: limits, timezone })
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
    Ok(Json(LimitsBody::of(&ctx.wallets.get(&access, &id).await?.rules, chrono::Utc::now())))
}
