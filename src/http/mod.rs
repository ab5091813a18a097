//! The HTTP API: routes, the problem format for errors, and the middleware every request goes
//! through (request id, replica name, tracing, body limit, timeout, panic handling, drain).

pub mod auth;
mod batches;
mod bodies;
pub mod error;
pub mod events;
mod extract;
mod health;
pub mod history;
mod holds;
mod idempotent;
mod limits;
pub mod listen;
mod monitors;
mod movements;
mod openapi;
mod probe;
pub mod server;
mod transfers;
mod wallets;
mod webhooks;

pub use error::ApiError;
pub use probe::probe;
pub use server::Draining;

use crate::telemetry::metrics::{HTTP_REQUEST_DURATION, HTTP_REQUESTS, REQUESTS_SHED};
use crate::wallet::Wallets;
use axum::{
    Router,
    extract::{MatchedPath, Request, State},
    http::{HeaderName, HeaderValue, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
};
use metrics_exporter_prometheus::PrometheusHandle;
use std::{sync::Arc, time::Duration};
use tokio::sync::Semaphore;
use tower::ServiceBuilder;
use tower_http::{
    catch_panic::CatchPanicLayer,
    classify::{
        ClassifiedResponse, ClassifyResponse, NeverClassifyEos, ServerErrorsAsFailures,
        ServerErrorsFailureClass, SharedClassifier,
    },
    request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer},
    trace::{DefaultOnRequest, DefaultOnResponse, OnResponse, TraceLayer},
};
use tracing::Level;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

/// An info span with `$field`s and the empty fields a movement's handling records on it (caller,
/// wallet, fence, outcome, lease wait, time in Postgres): a request's, or a batch item's.
macro_rules! movement_span {
    ($name:literal, $($field:tt)*) => {
        tracing::info_span!(
            $name,
            $($field)*
            caller = tracing::field::Empty,
            wallet_id = tracing::field::Empty,
            fence = tracing::field::Empty,
            outcome = tracing::field::Empty,
            lease_wait_ms = tracing::field::Empty,
            db_ms = tracing::field::Empty,
        )
    };
}
pub(crate) use movement_span;

/// The largest request body accepted, in bytes.
pub const BODY_LIMIT: usize = 16 * 1024;

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_SERVED_BY: HeaderName = HeaderName::from_static("x-served-by");

/// What every handler can reach. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ApiContext {
    pub wallets: Wallets,
    /// This replica's name, sent as `X-Served-By` on every response.
    pub replica: Arc<str>,
    /// Set once shutdown begins: readiness fails and responses close their connection.
    pub draining: Draining,
    /// Bound on one request from arrival to response.
    pub request_timeout: Duration,
    /// Renders the process's metrics for `GET /metrics`.
    pub metrics: PrometheusHandle,
    /// The API's callers and their tokens.
    pub callers: auth::Callers,
    /// One permit per `/wallets` request being handled; none left means `MAX_IN_FLIGHT` are, and
    /// the next is answered 503 `overloaded` unread.
    pub in_flight: Arc<Semaphore>,
}

/// The whole API with its middleware. Each route is registered once, by its handler module, with
/// its documentation; the OpenAPI document at `/openapi.json` is what this router collected.
pub fn router(ctx: ApiContext) -> Router {
    let served_by = HeaderValue::from_str(&ctx.replica).unwrap_or(HeaderValue::from_static("walletlock"));
    let replica = ctx.replica.clone();
    let items = batch_items(&ctx);
    // Merged in the order the document lists the paths (routing does not depend on it).
    let (routes, api) = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .merge(
            permitted_routes(items)
                .route_layer(middleware::from_fn_with_state(ctx.clone(), auth::require_token)),
        )
        // A reader of the feed may wait: it holds none of the permits movements are shed by.
        .merge(events::router().route_layer(middleware::from_fn_with_state(ctx.clone(), auth::require_token)))
        .merge(
            webhooks::router().route_layer(middleware::from_fn_with_state(ctx.clone(), auth::require_token)),
        )
        .merge(health::router())
        .merge(openapi::router())
        .split_for_parts();
    openapi::publish(api);
    routes
        .fallback(|| async { ApiError::RouteNotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(ctx.clone(), bounded_and_draining))
        .layer(middleware::from_fn(record_request_metrics))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(
            ServiceBuilder::new()
                .layer(middleware::from_fn(move |request: Request, next: Next| {
                    let served_by = served_by.clone();
                    async move {
                        let mut response = next.run(request).await;
                        response.headers_mut().insert(X_SERVED_BY.clone(), served_by);
                        response
                    }
                }))
                // Before anything that allocates, logs or waits: a request shed costs this replica
                // a permit's check and a fixed answer (`shed_when_full`).
                .layer(middleware::from_fn_with_state(ctx.clone(), shed_when_full))
                .layer(SetRequestIdLayer::new(X_REQUEST_ID.clone(), MakeRequestUuid))
                .layer(
                    TraceLayer::new(SharedClassifier::new(ShedOrServerError))
                        .make_span_with(move |request: &Request| {
                            let route = request.extensions().get::<MatchedPath>().map(MatchedPath::as_str);
                            let request_id =
                                request.headers().get(&X_REQUEST_ID).and_then(|v| v.to_str().ok());
                            movement_span!(
                                "request",
                                request_id,
                                replica = &*replica,
                                method = %request.method(),
                                route = route.unwrap_or(request.uri().path()),
                            )
                        })
                        .on_request(DefaultOnRequest::new().level(Level::DEBUG))
                        .on_response(LogResponse),
                )
                .layer(PropagateRequestIdLayer::new(X_REQUEST_ID.clone()))
                .layer(CatchPanicLayer::custom(|_panic| ApiError::Panic.into_response())),
        )
        .with_state(ctx)
}

/// The router a batch's items run through (see [`batches`]): the routes of the movements a batch
/// may hold, with the token check, the body limit and panics answered as the API does, and without
/// the layers the batch applies to itself once (shedding, timeout, tracing, metrics).
fn batch_items(ctx: &ApiContext) -> batches::Items {
    let (routes, _) = OpenApiRouter::default()
        .merge(wallets::router())
        .merge(transfers::router())
        .merge(movements::router())
        .merge(holds::router())
        .split_for_parts();
    let routes = routes
        .route_layer(middleware::from_fn_with_state(ctx.clone(), auth::require_token))
        .fallback(|| async { ApiError::RouteNotFound })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(CatchPanicLayer::custom(|_panic| ApiError::Panic.into_response()))
        .with_state(ctx.clone());
    batches::Items(routes)
}

/// Registers the shed counter's `in_flight` reason at zero (`crate::wallet` registers its
/// `wallet_queue`); the metrics themselves are declared in `crate::telemetry::metrics`.
pub fn register_metrics() {
    metrics::counter!(REQUESTS_SHED.name, "reason" => "in_flight").absolute(0);
}

/// Counts each request and times it, by route (the matched pattern, so ids do not explode the
/// label set) and status.
async fn record_request_metrics(request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let method = request.method().to_string();
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str).to_owned();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::histogram!(HTTP_REQUEST_DURATION.name, "method" => method.clone(), "route" => route.clone())
        .record(started.elapsed());
    metrics::counter!(HTTP_REQUESTS.name, "method" => method, "route" => route, "status" => status)
        .increment(1);
    response
}

/// The routes whose requests take one of the `MAX_IN_FLIGHT` permits: the movements, the wallets
/// and their reads, batches (not the change feed, webhooks, health or the document).
fn permitted_routes(items: batches::Items) -> OpenApiRouter<ApiContext> {
    wallets::router()
        .merge(history::router())
        .merge(transfers::router())
        .merge(movements::router())
        .merge(holds::router())
        .merge(monitors::router())
        .merge(limits::router())
        .merge(batches::router(items))
}

/// Whether a request's path is one of [`permitted_routes`]': told by the path, since a request is
/// shed before it is routed (`tests::the_paths_that_take_a_permit_are_the_permitted_routes`).
fn takes_a_permit(path: &str) -> bool {
    ["/wallets", "/transfers", "/movements", "/holds", batches::PATH]
        .iter()
        .any(|prefix| path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/')))
}

/// Sheds a `/wallets` request when the replica already handles `MAX_IN_FLIGHT`: a 503
/// `overloaded` with Retry-After, as the replica's first step (inside only `X-Served-By`): before
/// a request id is made, a span opened or a line logged, a metric labelled, a timer set, the token
/// checked or the body read. So a flood costs this replica a bounded amount of memory and, for
/// each request shed, a permit's check and a fixed answer, and it waits for nothing. The permit is
/// held until the response is ready (a movement whose client left runs on to its end outside it).
async fn shed_when_full(State(ctx): State<ApiContext>, request: Request, next: Next) -> Response {
    if !takes_a_permit(request.uri().path()) {
        return next.run(request).await;
    }
    let Ok(_permit) = ctx.in_flight.clone().try_acquire_owned() else {
        metrics::counter!(REQUESTS_SHED.name, "reason" => "in_flight").increment(1);
        let request_id = request.headers().get(&X_REQUEST_ID).cloned();
        if request.uri().path() == batches::PATH {
            batches::discard_body(request.into_body()).await;
        }
        let mut response = ApiError::Overloaded.into_response();
        if let Some(request_id) = request_id {
            response.headers_mut().insert(X_REQUEST_ID.clone(), request_id);
        }
        return response;
    };
    next.run(request).await
}

/// What a request's trace counts as a failure (logged at error level): a 5xx, but not a request
/// shed ([`error::Shed`]), which is an answer a flood gets by design, counted by
/// `walletlock_requests_shed_total`, not a failure to log a line for each.
#[derive(Debug, Clone, Copy)]
struct ShedOrServerError;

impl ClassifyResponse for ShedOrServerError {
    type FailureClass = ServerErrorsFailureClass;
    type ClassifyEos = NeverClassifyEos<ServerErrorsFailureClass>;

    fn classify_response<B>(
        self,
        response: &Response<B>,
    ) -> ClassifiedResponse<Self::FailureClass, Self::ClassifyEos> {
        if response.extensions().get::<error::Shed>().is_some() {
            return ClassifiedResponse::Ready(Ok(()));
        }
        ServerErrorsAsFailures::new().classify_response(response)
    }

    fn classify_error<E: std::fmt::Display + 'static>(self, error: &E) -> Self::FailureClass {
        ServerErrorsAsFailures::new().classify_error(error)
    }
}

/// Logs each response at info level ("finished processing request", with its status and latency),
/// a request shed at debug level only.
#[derive(Debug, Clone, Copy)]
struct LogResponse;

impl<B> OnResponse<B> for LogResponse {
    fn on_response(self, response: &Response<B>, latency: Duration, span: &tracing::Span) {
        let level =
            if response.extensions().get::<error::Shed>().is_some() { Level::DEBUG } else { Level::INFO };
        DefaultOnResponse::new().level(level).on_response(response, latency, span);
    }
}

/// Bounds each request in time, and during shutdown asks the client (nginx) to close the
/// connection after this response, so it opens its next one to a replica that is staying.
async fn bounded_and_draining(State(ctx): State<ApiContext>, request: Request, next: Next) -> Response {
    // A read of the feed may wait for an event besides (it bounds its own wait).
    // A batch bounds its items by REQUEST_TIMEOUT itself, and then has a moment to answer them all.
    let bound = match request.uri().path() {
        events::PATH => ctx.request_timeout + crate::wallet::MAX_WAIT,
        batches::PATH => ctx.request_timeout + batches::ANSWER_GRACE,
        _ => ctx.request_timeout,
    };
    let mut response = match tokio::time::timeout(bound, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::Timeout(bound).into_response(),
    };
    if response.status().is_success() {
        tracing::Span::current().record("outcome", "ok");
    }
    if ctx.draining.is_draining() {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paths_that_take_a_permit_are_the_permitted_routes() {
        let paths = |routes: OpenApiRouter<ApiContext>| -> Vec<String> {
            routes.split_for_parts().1.paths.paths.into_keys().collect()
        };
        let permitted = paths(permitted_routes(batches::Items(Router::new())));
        assert!(permitted.len() > 10, "{permitted:?}");
        for path in permitted {
            assert!(takes_a_permit(&path), "{path} is shed by the in-flight bound");
        }
        for routes in [events::router(), webhooks::router(), health::router(), openapi::router()] {
            for path in paths(routes) {
                assert!(!takes_a_permit(&path), "{path} takes no permit");
            }
        }
    }
}
