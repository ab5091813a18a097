//! Liveness, readiness, and the metrics endpoint.

use super::ApiContext;
use crate::wallet::RedisOutage;
use axum::{
    Json,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
};
use serde::Serialize;
use std::time::Duration;
use utoipa_axum::{router::OpenApiRouter, routes};

/// How long each dependency may take to answer a readiness probe.
const PROBE_LIMIT: Duration = Duration::from_millis(800);

/// The health, readiness and metrics routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(healthz)).routes(routes!(readyz)).routes(routes!(metrics))
}

/// `GET /healthz`'s answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Liveness {
    status: LiveStatus,
    /// The replica that answered.
    replica: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LiveStatus {
    Ok,
}

/// `GET /readyz`'s answer, ready or not.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Readiness {
    status: ReadyStatus,
    /// The replica that answered.
    replica: String,
    redis: DependencyStatus,
    postgres: DependencyStatus,
    /// How this replica moves money right now: under Redis leases, or under Postgres alone (a
    /// Redis outage, with `REDIS_OUTAGE=postgres`).
    payments: PaymentPath,
}

/// `ready`: Redis and Postgres answer. `degraded`: Postgres answers and Redis does not, and
/// payments go on under Postgres alone (`REDIS_OUTAGE=postgres`), still a 200. `draining`: shutting
/// down. `unavailable`: Postgres does not answer, or Redis does not and `REDIS_OUTAGE=refuse`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReadyStatus {
    Ready,
    Degraded,
    Draining,
    Unavailable,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PaymentPath {
    Lease,
    PostgresOnly,
}

/// Whether a dependency answered the probe in time.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DependencyStatus {
    Ok,
    Unavailable,
}

/// This replica's metrics, in the Prometheus text format.
///
/// Pool and process gauges are sampled now; counters and histograms are kept as they happen.
/// Scraped from each replica directly: nginx does not forward /metrics.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((
        status = 200,
        description = "This replica's metrics, in the Prometheus text format",
        body = String,
        content_type = "text/plain; version=0.0.4"
    ))
)]
pub(super) async fn metrics(State(ctx): State<ApiContext>) -> impl IntoResponse {
    ctx.wallets.sample_pool_metrics();
    crate::telemetry::metrics::sample_process();
    ctx.metrics.run_upkeep();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], ctx.metrics.render())
}

/// Liveness: the process is alive and serving HTTP.
///
/// Says nothing about Redis or Postgres, so an orchestrator does not restart a healthy replica
/// because a dependency is down.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process serves HTTP (liveness)", body = Liveness))
)]
pub(super) async fn healthz(State(ctx): State<ApiContext>) -> Json<Liveness> {
    Json(Liveness { status: LiveStatus::Ok, replica: ctx.replica.to_string() })
}

/// Readiness: whether this replica can take payments.
///
/// Ready when Redis and Postgres both answer within a short bound and the replica is not shutting
/// down; degraded (still a 200) when only Postgres answers and payments go on under Postgres alone
/// (`REDIS_OUTAGE=postgres`). A 503 tells a load balancer or orchestrator to send traffic elsewhere.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Postgres answers, and Redis does or payments go on without it (degraded); not draining", body = Readiness),
        (status = 503, description = "A dependency payments need did not answer in 800 ms, or draining", body = Readiness),
    )
)]
pub(super) async fn readyz(State(ctx): State<ApiContext>) -> (StatusCode, Json<Readiness>) {
    let (redis_ok, postgres_ok) = ctx.wallets.dependencies_answer(PROBE_LIMIT).await;
    let (policy, in_outage) = ctx.wallets.redis_outage();
    let draining = ctx.draining.is_draining();
    let word = |ok: bool| if ok { DependencyStatus::Ok } else { DependencyStatus::Unavailable };
    let status = if draining {
        ReadyStatus::Draining
    } else if !postgres_ok {
        ReadyStatus::Unavailable
    } else if redis_ok {
        ReadyStatus::Ready
    } else if policy == RedisOutage::Postgres {
        ReadyStatus::Degraded
    } else {
        ReadyStatus::Unavailable
    };
    let code = match status {
        ReadyStatus::Ready | ReadyStatus::Degraded => StatusCode::OK,
        ReadyStatus::Draining | ReadyStatus::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    };
    let body = Readiness {
        status,
        replica: ctx.replica.to_string(),
        redis: word(redis_ok),
        postgres: word(postgres_ok),
        payments: if in_outage { PaymentPath::PostgresOnly } else { PaymentPath::Lease },
    };
    (code, Json(body))
}
