//! `/wallets/{id}/monitors`: balance monitors, set and removed under the wallet's lease like any
//! movement of it, so every movement after one is decided with it (docs/api/events.md).

use super::ApiContext;
use super::bodies::MonitorsBody;
use super::error::described::{
    MOVEMENT_CONFLICT, MOVEMENT_UNAVAILABLE, NO_WALLET, NOT_JSON, TOO_LARGE, UNAUTHORIZED,
};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{IdempotencyHeader, JsonBody, WalletPath};
use super::idempotent::{self, KeyedRequest, render_created, render_movement};
use crate::domain::{Access, Field, InvalidInput, Monitor, Movement, WalletId};
use axum::extract::{Extension, Path, State};
use axum::http::Uri;
use axum::response::Response;
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(set_monitor)).routes(routes!(remove_monitor))
}

/// The largest amount a monitor may watch for, either way: the largest balance a wallet may have.
const MOST: i64 = 1_000_000_000_000;

/// What a monitor's amount must be.
const RULE: &str = "a monitor is `{\"below\": n}` or `{\"above\": n}`, one of them, n a whole number of at most \
                    10^12 either way";

/// A balance monitor: one of `below` and `above`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewMonitor {
    /// An event `wallet.balance_below` each time a movement takes the balance below this.
    #[schema(minimum = -1_000_000_000_000_i64, maximum = 1_000_000_000_000_i64, example = 1000)]
    below: Option<i64>,
    /// An event `wallet.balance_above` each time a movement takes the balance above this.
    #[schema(minimum = -1_000_000_000_000_i64, maximum = 1_000_000_000_000_i64, example = 100000)]
    above: Option<i64>,
}

const INVALID: InvalidInput = InvalidInput { field: Field::Monitor, rule: RULE };

/// `monitor` if its amount is within bounds.
fn within_bounds(monitor: Option<Monitor>) -> Result<Monitor, InvalidInput> {
    monitor.filter(|monitor| monitor.amount().abs() <= MOST).ok_or(INVALID)
}

/// Sets a balance monitor on the wallet (setting one it has changes nothing). From then on, each
/// movement that takes the balance across it writes a `wallet.balance_below` or
/// `wallet.balance_above` event, with the movement's entry, in the movement's own commit: once per
/// crossing, and again only after the balance went back. At most 8 a wallet.
#[utoipa::path(
    post,
    path = "/wallets/{id}/monitors",
    tag = "wallets",
    security(("bearer" = [])),
    params(WalletPath, IdempotencyHeader),
    request_body(content = NewMonitor, content_type = "application/json"),
    responses(
        (status = 201, description = "The wallet's monitors, this one among them", body = MonitorsBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_monitor`, `invalid_idempotency_key`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 409, description = MOVEMENT_CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`too_many_monitors` (nothing changed); `idempotency_key_reused`",
            headers(("Idempotent-Replayed" = String))),
        (status = 503, description = MOVEMENT_UNAVAILABLE, body = ProblemDocument,
            content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn set_monitor(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
    body: JsonBody<NewMonitor>,
) -> Result<Response, ApiError> {
    let monitor = match (body.value.below, body.value.above) {
        (Some(amount), None) => Some(Monitor::Below(amount)),
        (None, Some(amount)) => Some(Monitor::Above(amount)),
        _ => None,
    };
    let movement = Movement::AddMonitor(within_bounds(monitor)?);
    let keyed = KeyedRequest { key, path: uri.path(), body: &body.raw };
    Ok(idempotent::apply_movement(&ctx, &access, &id, movement, keyed, render_created).await)
}

/// The monitor a path names: `below` or `above`, and its amount.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
struct MonitorPath {
    /// The wallet's id.
    #[param(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    id: String,
    /// `below` or `above`.
    #[param(pattern = "^(below|above)$", example = "below")]
    side: String,
    /// The monitor's amount.
    #[param(example = 1000)]
    amount: String,
}

/// Removes a balance monitor from the wallet, under its lease: no movement after it is decided
/// with it.
#[utoipa::path(
    delete,
    path = "/wallets/{id}/monitors/{side}/{amount}",
    tag = "wallets",
    security(("bearer" = [])),
    params(MonitorPath, IdempotencyHeader),
    responses(
        (status = 200, description = "The wallet's monitors left", body = MonitorsBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replayed response"))),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_monitor`, `invalid_idempotency_key`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`monitor_not_found` (nothing changed); `wallet_not_found` (also a wallet of \
                           another caller)"),
        (status = 409, description = MOVEMENT_CONFLICT, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 422, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`idempotency_key_reused`", headers(("Idempotent-Replayed" = String))),
        (status = 503, description = MOVEMENT_UNAVAILABLE, body = ProblemDocument,
            content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn remove_monitor(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    Path(MonitorPath { id, side, amount }): Path<MonitorPath>,
    IdempotencyHeader(key): IdempotencyHeader,
    uri: Uri,
) -> Result<Response, ApiError> {
    let id = WalletId::parse(&id)?;
    tracing::Span::current().record("wallet_id", id.as_str());
    let amount = amount.parse::<i64>().map_err(|_| INVALID)?;
    let monitor = within_bounds(Monitor::of_side(&side, amount))?;
    let keyed = KeyedRequest { key, path: uri.path(), body: &[] };
    Ok(idempotent::apply_movement(
        &ctx,
        &access,
        &id,
        Movement::RemoveMonitor(monitor),
        keyed,
        render_movement,
    )
    .await)
}
