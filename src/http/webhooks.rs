//! `/webhook-endpoints`: where a caller's events are POSTed as they are written, signed as the
//! Standard Webhooks specification says (docs/api/webhooks.md).

use super::ApiContext;
use super::error::described::{NOT_JSON, READ_UNAVAILABLE as UNAVAILABLE, TOO_LARGE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{JsonBody, QueryParams};
use crate::domain::{Access, EventCursor, EventType, Field, InvalidInput, WalletId};
use crate::wallet::webhooks::{Endpoint, EndpointAsked, EndpointState};
use axum::http::StatusCode;
use axum::{
    Json,
    extract::{Extension, State},
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};
use uuid::Uuid;

pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default()
        .routes(routes!(create, list))
        .routes(routes!(read, update, delete))
        .routes(routes!(rotate_secret))
        .routes(routes!(replay))
        .routes(routes!(attempts))
}

super::extract::uuid_path!(
    /// The `{id}` segment of a webhook endpoint's route: a UUID.
    EndpointPath,
    "The endpoint's id.",
    Field::EndpointId
);

const NO_ENDPOINT: &str = "`webhook_endpoint_not_found` (also another caller's endpoint)";

/// An endpoint to register or to set. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct EndpointRequest {
    /// Where to POST the events: a public `https` (or `http`) URL; a private, loopback or
    /// link-local address only if the operator allows its host (`WEBHOOK_ALLOW_HOSTS`).
    #[schema(example = "https://hooks.example.com/walletlock", max_length = 2048)]
    url: String,
    /// Of these event types only (every type, when left out or empty).
    #[schema(example = json!(["payment.accepted", "refund.accepted"]))]
    types: Option<Vec<String>>,
    /// Of these wallets only, each the caller's (every one of the caller's, when left out or empty).
    #[schema(example = json!(["alice"]))]
    wallet_ids: Option<Vec<String>>,
    /// Whether it receives events (default `true`): `false` disables it, `true` enables it again.
    enabled: Option<bool>,
}

impl EndpointRequest {
    fn asked(self) -> Result<(EndpointAsked, Option<bool>), ApiError> {
        let types = self
            .types
            .unwrap_or_default()
            .iter()
            .map(|name| {
                EventType::parse(name).ok_or(InvalidInput { field: Field::EventType, rule: "event types" })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let wallets = self.wallet_ids.unwrap_or_default();
        if wallets.len() > 100 || types.len() > EventType::ALL.len() {
            return Err(InvalidInput { field: Field::WalletId, rule: "at most 100 wallets" }.into());
        }
        let wallet_ids = wallets.iter().map(|id| WalletId::parse(id)).collect::<Result<Vec<_>, _>>()?;
        Ok((EndpointAsked { url: self.url, types, wallet_ids }, self.enabled))
    }
}

/// A webhook endpoint.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = WebhookEndpoint)]
struct EndpointBody {
    id: Uuid,
    url: String,
    /// The event types it receives (every type, when empty).
    types: Vec<EventType>,
    /// The wallets whose events it receives (every one of the caller's, when empty).
    wallet_ids: Vec<String>,
    /// The key its deliveries are signed with (`webhook-signature`, Standard Webhooks); shown
    /// when it is registered, read alone, or given a new one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]
    secret: Option<String>,
    enabled: bool,
    /// Why walletlock disabled it (it kept failing past the retry period); null otherwise.
    #[schema(required = true)]
    disabled_reason: Option<String>,
    /// Since when it has answered no delivery (refused, timed out): then one waiting wallet is
    /// tried at a time, backed off, until it answers again. Null while it answers.
    #[schema(required = true)]
    failing_since: Option<DateTime<Utc>>,
    /// Its place in the feed: every event up to here is delivered, or waits (`waiting`).
    after: String,
    /// The wallets whose next event it has not taken yet: their events wait, retried with
    /// backoff, while other wallets' go on. Shown when the endpoint is read alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    waiting: Option<Vec<WaitingBody>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

/// A wallet whose event the endpoint has not taken.
#[derive(Debug, Serialize, ToSchema)]
struct WaitingBody {
    wallet_id: String,
    /// The number of the wallet's event it waits on.
    sequence: i64,
    attempts: i32,
    next_attempt_at: DateTime<Utc>,
    last_error: String,
}

fn endpoint_body(state: EndpointState, secret: bool, waiting: bool) -> EndpointBody {
    let EndpointState { endpoint: e, pending } = state;
    EndpointBody {
        id: e.id,
        url: e.url,
        types: e.types,
        wallet_ids: e.wallet_ids,
        secret: secret.then_some(e.secret),
        enabled: e.enabled,
        disabled_reason: e.disabled_reason,
        failing_since: e.failing.map(|failing| failing.since),
        after: e.after.to_string(),
        waiting: waiting.then(|| {
            pending
                .into_iter()
                .map(|p| WaitingBody {
                    wallet_id: p.wallet_id,
                    sequence: p.seq,
                    attempts: p.attempts,
                    next_attempt_at: p.next_attempt_at,
                    last_error: p.last_error,
                })
                .collect()
        }),
        created_at: e.created_at,
        updated_at: e.updated_at,
    }
}

fn alone(endpoint: Endpoint) -> EndpointState {
    EndpointState { endpoint, pending: Vec::new() }
}

/// Registers an endpoint: the caller's events written from now on are POSTed to it, each
/// wallet's in order, retried until it takes them.
#[utoipa::path(
    post,
    path = "/webhook-endpoints",
    tag = "webhooks",
    security(("bearer" = [])),
    request_body(content = EndpointRequest, content_type = "application/json"),
    responses(
        (status = 201, description = "The endpoint, with its secret", body = EndpointBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_webhook_url`, `invalid_event_type`, `invalid_wallet_id`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`wallet_not_found` (one of `wallet_ids`, or another caller's)",
            body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn create(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    body: JsonBody<EndpointRequest>,
) -> Result<(StatusCode, Json<EndpointBody>), ApiError> {
    let (asked, enabled) = body.value.asked()?;
    let endpoint = ctx.wallets.create_endpoint(&access, asked, enabled.unwrap_or(true)).await?;
    Ok((StatusCode::CREATED, Json(endpoint_body(alone(endpoint), true, false))))
}

/// The caller's endpoints, oldest first (without their secrets).
#[derive(Debug, Serialize, ToSchema)]
struct EndpointsBody {
    endpoints: Vec<EndpointBody>,
}

/// The caller's endpoints.
#[utoipa::path(
    get,
    path = "/webhook-endpoints",
    tag = "webhooks",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The caller's endpoints", body = EndpointsBody),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn list(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
) -> Result<Json<EndpointsBody>, ApiError> {
    let endpoints = ctx.wallets.endpoints(&access).await?;
    Ok(Json(EndpointsBody {
        endpoints: endpoints.into_iter().map(|e| endpoint_body(alone(e), false, false)).collect(),
    }))
}

/// One endpoint, with its secret and the wallets whose events wait.
#[utoipa::path(
    get,
    path = "/webhook-endpoints/{id}",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath),
    responses(
        (status = 200, description = "The endpoint", body = EndpointBody),
        (status = 400, description = "`invalid_endpoint_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_ENDPOINT, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn read(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
) -> Result<Json<EndpointBody>, ApiError> {
    Ok(Json(endpoint_body(ctx.wallets.endpoint(&access, id).await?, true, true)))
}

/// Sets an endpoint's URL, types and wallets, and enables or disables it (`enabled`; left out:
/// enabled).
#[utoipa::path(
    put,
    path = "/webhook-endpoints/{id}",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath),
    request_body(content = EndpointRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The endpoint", body = EndpointBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_endpoint_id`, `invalid_webhook_url`, `invalid_event_type`, `invalid_wallet_id`, \
                           `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = "`webhook_endpoint_not_found`, `wallet_not_found`", body = ProblemDocument,
            content_type = PROBLEM_JSON),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn update(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
    body: JsonBody<EndpointRequest>,
) -> Result<Json<EndpointBody>, ApiError> {
    let (asked, enabled) = body.value.asked()?;
    let endpoint = ctx.wallets.update_endpoint(&access, id, asked, enabled.unwrap_or(true)).await?;
    Ok(Json(endpoint_body(alone(endpoint), false, false)))
}

/// Deletes an endpoint: nothing more is sent to it.
#[utoipa::path(
    delete,
    path = "/webhook-endpoints/{id}",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "`invalid_endpoint_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_ENDPOINT, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn delete(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
) -> Result<StatusCode, ApiError> {
    ctx.wallets.delete_endpoint(&access, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Gives an endpoint a new signing secret, used from its next delivery on.
#[utoipa::path(
    post,
    path = "/webhook-endpoints/{id}/rotate-secret",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath),
    responses(
        (status = 200, description = "The endpoint, with its new secret", body = EndpointBody),
        (status = 400, description = "`invalid_endpoint_id`", body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_ENDPOINT, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn rotate_secret(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
) -> Result<Json<EndpointBody>, ApiError> {
    let endpoint = ctx.wallets.rotate_endpoint_secret(&access, id).await?;
    Ok(Json(endpoint_body(alone(endpoint), true, false)))
}

/// Where to deliver from again.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ReplayRequest {
    /// An event's `cursor` (or a feed page's `next`): the events after it are sent again.
    #[schema(example = "48211-7-alice")]
    after: String,
}

/// Sends the caller's events after `after` to the endpoint again, in order (those it took before
/// come again with the same `webhook-id`); a place after the endpoint's own changes nothing.
#[utoipa::path(
    post,
    path = "/webhook-endpoints/{id}/replay",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath),
    request_body(content = ReplayRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The endpoint, at its place now", body = EndpointBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_endpoint_id`, `invalid_cursor`, `malformed_json`, `invalid_body`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_ENDPOINT, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 413, description = TOO_LARGE, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn replay(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
    body: JsonBody<ReplayRequest>,
) -> Result<Json<EndpointBody>, ApiError> {
    let after = EventCursor::parse(&body.value.after)
        .ok_or(InvalidInput { field: Field::Cursor, rule: "an event's cursor" })?;
    let endpoint = ctx.wallets.replay_endpoint(&access, id, after).await?;
    Ok(Json(endpoint_body(alone(endpoint), false, false)))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct AttemptsQuery {
    /// At most this many attempts, newest first (default 100).
    #[param(minimum = 1, maximum = 500, example = 100)]
    limit: Option<i64>,
}

/// One delivery attempt.
#[derive(Debug, Serialize, ToSchema)]
struct AttemptBody {
    /// The event's `id` (its `webhook-id`).
    event_id: String,
    attempted_at: DateTime<Utc>,
    /// The endpoint's HTTP status; null when it did not answer.
    #[schema(required = true)]
    status: Option<i16>,
    latency_ms: i32,
    /// Why it did not take the event; null when it did.
    #[schema(required = true)]
    error: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
struct AttemptsBody {
    attempts: Vec<AttemptBody>,
}

/// The latest delivery attempts to an endpoint (kept 7 days), newest first.
#[utoipa::path(
    get,
    path = "/webhook-endpoints/{id}/attempts",
    tag = "webhooks",
    security(("bearer" = [])),
    params(EndpointPath, AttemptsQuery),
    responses(
        (status = 200, description = "The attempts", body = AttemptsBody),
        (status = 400, description = "`invalid_endpoint_id`, `invalid_limit`, `invalid_query`", body = ProblemDocument,
            content_type = PROBLEM_JSON),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_ENDPOINT, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn attempts(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    EndpointPath(id): EndpointPath,
    QueryParams(query): QueryParams<AttemptsQuery>,
) -> Result<Json<AttemptsBody>, ApiError> {
    let limit = query.limit.unwrap_or(100);
    if !(1..=500).contains(&limit) {
        return Err(InvalidInput { field: Field::Limit, rule: "an integer from 1 to 500" }.into());
    }
    let attempts = ctx.wallets.endpoint_attempts(&access, id, limit).await?;
    Ok(Json(AttemptsBody {
        attempts: attempts
            .into_iter()
            .map(|a| AttemptBody {
                event_id: a.event_id,
                attempted_at: a.attempted_at,
                status: a.status,
                latency_ms: a.latency_ms,
                error: a.error,
            })
            .collect(),
    }))
}
