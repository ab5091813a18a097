//! Every error the API returns, as an RFC 9457 problem (`application/problem+json`).
//!
//! Each problem carries `type`, `title`, `status`, `detail` and a stable `code` that clients can
//! match on. A 4xx explains what was wrong with the request; a 5xx says only what the caller can
//! do (retry later) and logs the cause, so no internals reach the client. Every code, with its
//! status, is listed once in [`codes`], which `docs/api/errors.md` is printed from.

pub mod codes;

use crate::domain::{LimitKind, Per};
use crate::idempotency::{Prior, StoredResponse};
use crate::wallet::{Field, InvalidInput, Refusal, SameWallet, WalletError};
use axum::{
    extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use codes::ErrorCode;
use serde::Serialize;
use std::time::Duration;

/// Seconds a client should wait before retrying a 503.
const RETRY_AFTER_SECONDS: u64 = 1;

/// The content type of every error response.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem document: the body of every error response, as sent and as stored for an
/// idempotency key.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(
    as = Problem,
    example = json!({
        "type": "urn:walletlock:problem:insufficient_funds",
        "title": "Insufficient funds",
        "status": 422,
        "detail": "the balance of 8000 does not cover this payment",
        "code": "insufficient_funds",
        "balance": 8000
    })
)]
pub struct ProblemDocument {
    /// `urn:walletlock:problem:` and the code.
    #[serde(rename = "type")]
    #[schema(pattern = "^urn:walletlock:problem:[a-z_]+$")]
    problem_type: String,
    title: &'static str,
    /// The HTTP status code.
    #[schema(minimum = 400, maximum = 599)]
    status: u16,
    /// What went wrong, for a person; for a 5xx only what the caller can do.
    detail: String,
    /// Stable: what clients match on (`docs/api/errors.md` lists every code).
    #[schema(pattern = "^[a-z_]+$", example = "insufficient_funds")]
    code: &'static str,
    /// With a `400` for a field that broke its rule: the field's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = "amount")]
    field: Option<&'static str>,
    /// With `insufficient_funds` and `balance_overflow`: the wallet's balance.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = 8000)]
    balance: Option<i64>,
    /// With `insufficient_funds`: what of the balance active holds leave available.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 8000)]
    available: Option<i64>,
    /// With `capture_exceeds_hold`: the amount the hold holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 1, example = 4000)]
    held: Option<i64>,
    /// With `refund_exceeds_payment`: what is left to refund of the payment or transfer.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 700)]
    refundable: Option<i64>,
    /// With `limit_exceeded`: the limit the debit would pass (`per_payment`, `velocity_amount`,
    /// `velocity_count`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = "per_payment")]
    limit: Option<&'static str>,
    /// With `limit_exceeded`: the most that limit allows now (an amount, or a number of debits).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 5000)]
    left: Option<i64>,
    /// With `limit_exceeded` of a velocity limit: its window (`day`, `week`, `month`, `1m`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = "day")]
    per: Option<String>,
    /// With `limit_exceeded` of a velocity limit: when its window ends and frees room again.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    resets_at: Option<chrono::DateTime<chrono::Utc>>,
    /// With a movement refused at one of its legs: the leg, from 0 in the request's order (its
    /// `balance` and `available` are that leg's wallet's).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, maximum = 15, example = 1)]
    leg: Option<usize>,
    /// With `invalid_batch` about one of its items: the item, from 0 in the batch's order.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, maximum = 999, example = 3)]
    item: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field broke its rule (an amount of 0, an id with a slash).
    #[error(transparent)]
    InvalidInput(#[from] InvalidInput),
    /// A transfer from a wallet to itself.
    #[error(transparent)]
    SameWallet(#[from] SameWallet),
    /// The request could not be read: malformed JSON, a wrong type, a missing field.
    #[error("{detail}")]
    BadRequest { code: &'static ErrorCode, detail: String },
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("the request body is larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("a valid bearer token is required")]
    Unauthorized,
    #[error("no route for this path")]
    RouteNotFound,
    #[error("this method is not allowed on this path")]
    MethodNotAllowed,
    #[error(transparent)]
    Wallet(#[from] WalletError),
    #[error("this Idempotency-Key was used for a different request")]
    IdempotencyKeyReused,
    #[error("the first request with this Idempotency-Key is still in flight")]
    IdempotencyKeyInFlight,
    #[error("the request did not complete within {0:?}")]
    Timeout(Duration),
    /// The replica was already handling `MAX_IN_FLIGHT` requests: this one was refused unread.
    #[error("the replica already handles MAX_IN_FLIGHT requests")]
    Overloaded,
    #[error("the request handler panicked")]
    Panic,
    /// A `POST /batches` that cannot be read as a batch (`item`: the item at fault, if one is):
    /// refused whole, nothing applied.
    #[error("{detail}")]
    InvalidBatch { item: Option<usize>, detail: String },
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge { limit: super::BODY_LIMIT },
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(
                "send the body as JSON, with Content-Type: application/json".into(),
            ),
            _ => {
                let code = match rejection {
                    JsonRejection::JsonSyntaxError(_) => &codes::MALFORMED_JSON,
                    _ => &codes::INVALID_BODY,
                };
                ApiError::BadRequest { code, detail: rejection.body_text() }
            }
        }
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge { limit: super::BODY_LIMIT },
            _ => ApiError::BadRequest { code: &codes::INVALID_BODY, detail: rejection.body_text() },
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::BadRequest { code: &codes::INVALID_PATH, detail: rejection.body_text() }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::BadRequest { code: &codes::INVALID_QUERY, detail: rejection.body_text() }
    }
}

/// The parts of one problem document.
struct Problem {
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
    field: Option<&'static str>,
    balance: Option<i64>,
    available: Option<i64>,
    held: Option<i64>,
    refundable: Option<i64>,
    limit: Option<&'static str>,
    left: Option<i64>,
    per: Option<String>,
    resets_at: Option<chrono::DateTime<chrono::Utc>>,
    leg: Option<usize>,
    item: Option<usize>,
    retry_after: bool,
}

impl Problem {
    fn new(code: &'static ErrorCode, title: &'static str, detail: impl Into<String>) -> Self {
        Self::with_code(code.status, code.code, title, detail)
    }

    /// A value that breaks `field`'s rule: a 400 with the field's own code (each of them listed in
    /// [`codes`], as a test there checks).
    fn invalid_field(field: Field, detail: impl Into<String>) -> Self {
        Self::with_code(StatusCode::BAD_REQUEST, field.code(), "Invalid input", detail).with_field(field)
    }

    fn with_code(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            code,
            title,
            detail: detail.into(),
            field: None,
            balance: None,
            available: None,
            held: None,
            refundable: None,
            limit: None,
            left: None,
            per: None,
            resets_at: None,
            leg: None,
            item: None,
            retry_after: false,
        }
    }

    fn with_field(mut self, field: Field) -> Self {
        self.field = Some(field.name());
        self
    }

    fn with_balance(mut self, balance: i64) -> Self {
        self.balance = Some(balance);
        self
    }

    fn retry_later(mut self) -> Self {
        self.retry_after = true;
        self
    }
}

impl ApiError {
    fn problem(&self) -> Problem {
        match self {
            ApiError::InvalidInput(invalid) => Problem::invalid_field(invalid.field, invalid.to_string()),
            ApiError::SameWallet(same) => {
                Problem::new(&codes::SAME_WALLET, "Same wallet", same.to_string()).with_field(Field::To)
            }
            ApiError::BadRequest { code, detail } => Problem::new(code, "Bad request", detail.clone()),
            ApiError::UnsupportedMediaType(detail) => {
                Problem::new(&codes::UNSUPPORTED_MEDIA_TYPE, "Unsupported media type", detail.clone())
            }
            ApiError::PayloadTooLarge { .. } => {
                Problem::new(&codes::PAYLOAD_TOO_LARGE, "Payload too large", self.to_string())
            }
            ApiError::Unauthorized => Problem::new(
                &codes::UNAUTHORIZED,
                "Unauthorized",
                "send Authorization: Bearer <token> with a token this service knows",
            ),
            ApiError::RouteNotFound => Problem::new(&codes::NOT_FOUND, "Not found", self.to_string()),
            ApiError::MethodNotAllowed => {
                Problem::new(&codes::METHOD_NOT_ALLOWED, "Method not allowed", self.to_string())
            }
            ApiError::Wallet(err) => wallet_problem(err),
            ApiError::IdempotencyKeyReused => reused(),
            ApiError::IdempotencyKeyInFlight => in_flight(),
            ApiError::Timeout(_) => Problem::new(
                &codes::REQUEST_TIMEOUT,
                "Request timed out",
                "the request did not complete in time; it is safe to retry with the same Idempotency-Key",
            )
            .retry_later(),
            ApiError::Overloaded => overloaded(
                "this replica is handling as many requests as it takes; nothing was applied, retry later",
            ),
            ApiError::Panic => internal(),
            ApiError::InvalidBatch { item, detail } => {
                let detail = match item {
                    Some(item) => format!("item {item}: {detail}; nothing of the batch was applied"),
                    None => format!("{detail}; nothing of the batch was applied"),
                };
                let mut problem = Problem::new(&codes::INVALID_BATCH, "Invalid batch", detail);
                problem.item = *item;
                problem
            }
        }
    }
}

fn reused() -> Problem {
    Problem::new(
        &codes::IDEMPOTENCY_KEY_REUSED,
        "Idempotency key reused",
        "this Idempotency-Key was already used with a different method, path or body; nothing was applied",
    )
}

fn in_flight() -> Problem {
    Problem::new(
        &codes::IDEMPOTENCY_KEY_IN_FLIGHT,
        "Request in flight",
        "the first request with this Idempotency-Key is still running; retry shortly to get its response",
    )
    .retry_later()
}

/// A request refused before any work because the replica or the wallet's queue was full.
fn overloaded(detail: &'static str) -> Problem {
    Problem::new(&codes::OVERLOADED, "Overloaded", detail).retry_later()
}

fn internal() -> Problem {
    Problem::new(
        &codes::INTERNAL_ERROR,
        "Internal error",
        "the server failed to handle the request; it has been logged",
    )
}

fn wallet_problem(err: &WalletError) -> Problem {
    match err {
        WalletError::NotFound => {
            Problem::new(&codes::WALLET_NOT_FOUND, "Wallet not found", "no wallet has this id")
        }
        WalletError::PartyNotFound { field } => Problem::new(
            &codes::WALLET_NOT_FOUND,
            "Wallet not found",
            format!("no wallet has the id given as `{}`", field.name()),
        )
        .with_field(*field),
        WalletError::NotOpenYet => Problem::new(
            &codes::WALLET_NOT_YET_OPEN,
            "Wallet not yet open",
            "the wallet opened after this instant: it had no balance then",
        )
        .with_field(Field::At),
        WalletError::TransferNotFound => {
            Problem::new(&codes::TRANSFER_NOT_FOUND, "Transfer not found", "no transfer has this id")
        }
        WalletError::EndpointNotFound => Problem::new(
            &codes::WEBHOOK_ENDPOINT_NOT_FOUND,
            "Webhook endpoint not found",
            "no webhook endpoint of yours has this id",
        ),
        WalletError::EndpointRefused(why) => Problem::new(
            &codes::INVALID_WEBHOOK_URL,
            "Invalid input",
            format!("url: {why}; an endpoint is a public http or https URL (or a host the operator allows)"),
        ),
        WalletError::PaymentNotFound => Problem::new(
            &codes::PAYMENT_NOT_FOUND,
            "Payment not found",
            "this wallet has no payment with this id",
        )
        .with_field(Field::Payment),
        WalletError::Exists => {
            Problem::new(&codes::WALLET_EXISTS, "Wallet exists", "a wallet with this id already exists")
        }
        WalletError::HoldNotFound => {
            Problem::new(&codes::HOLD_NOT_FOUND, "Hold not found", "no hold has this id")
        }
        WalletError::MovementNotHeld => Problem::new(
            &codes::MOVEMENT_NOT_HELD,
            "Movement not held",
            "the movement was posted when it was made; nothing to capture or void",
        ),
        WalletError::MovementNotCaptured => Problem::new(
            &codes::MOVEMENT_NOT_CAPTURED,
            "Movement not captured",
            "the movement was placed as a hold and not captured: it moved no money, nothing to refund",
        ),
        WalletError::HoldOfMovement { movement } => Problem::new(
            &codes::HOLD_OF_MOVEMENT,
            "Hold of a movement",
            format!(
                "the hold reserves a leg of movement {movement}: capture or void that movement; nothing changed"
            ),
        ),
        WalletError::MovementNotFound => {
            Problem::new(&codes::MOVEMENT_NOT_FOUND, "Movement not found", "no movement has this id")
        }
        WalletError::LegNotFound { leg } => {
            let mut problem = Problem::new(
                &codes::WALLET_NOT_FOUND,
                "Wallet not found",
                format!("no wallet has the id of leg {leg} (or this caller may not move its money that way)"),
            )
            .with_field(Field::Legs);
            problem.leg = Some(*leg);
            problem
        }
        WalletError::LegRefused { leg, refusal } => {
            let mut problem = wallet_problem(&WalletError::Refused(*refusal));
            problem.detail = format!("leg {leg}: {}; nothing of the movement was applied", problem.detail);
            problem.leg = Some(*leg);
            problem
        }
        WalletError::Refused(Refusal::InsufficientFunds { balance, available }) => {
            let detail = if balance == available {
                format!("the balance of {balance} does not cover this payment")
            } else {
                format!("the available {available} of the balance of {balance} does not cover this payment")
            };
            let mut problem =
                Problem::new(&codes::INSUFFICIENT_FUNDS, "Insufficient funds", detail).with_balance(*balance);
            problem.available = Some(*available);
            problem
        }
        WalletError::Refused(Refusal::HoldExpired) => Problem::new(
            &codes::HOLD_EXPIRED,
            "Hold expired",
            "the hold passed its expiry before it was captured or voided; its amount is released",
        ),
        WalletError::Refused(Refusal::HoldCaptured) => Problem::new(
            &codes::HOLD_CAPTURED,
            "Hold captured",
            "the hold was captured already; nothing changed",
        ),
        WalletError::Refused(Refusal::HoldVoided) => {
            Problem::new(&codes::HOLD_VOIDED, "Hold voided", "the hold was voided; nothing changed")
        }
        WalletError::Refused(Refusal::CaptureExceedsHold { held }) => {
            let mut problem = Problem::new(
                &codes::CAPTURE_EXCEEDS_HOLD,
                "Capture exceeds hold",
                format!("the hold holds {held}; nothing was charged"),
            )
            .with_field(Field::Amount);
            problem.held = Some(*held);
            problem
        }
        WalletError::Refused(Refusal::TooManyMonitors { most }) => Problem::new(
            &codes::TOO_MANY_MONITORS,
            "Too many monitors",
            format!("a wallet has at most {most} monitors: remove one first; nothing was changed"),
        ),
        WalletError::Refused(Refusal::MonitorNotFound) => Problem::new(
            &codes::MONITOR_NOT_FOUND,
            "Monitor not found",
            "the wallet has no such monitor; nothing was changed",
        ),
        WalletError::Refused(Refusal::LimitExceeded { limit, left, resets_at }) => {
            let per = limit.per().map(Per::name);
            let window = per.as_ref().map(|per| format!(" per {per}")).unwrap_or_default();
            let until = resets_at.map(|at| format!(" until {}", at.to_rfc3339())).unwrap_or_default();
            let allows = match limit {
                LimitKind::Count(_) => format!("{left} more debits"),
                _ => format!("at most {left}"),
            };
            let mut problem = Problem::new(
                &codes::LIMIT_EXCEEDED,
                "Limit exceeded",
                format!(
                    "the wallet's {}{window} limit allows {allows}{until}; nothing was applied",
                    limit.as_str()
                ),
            )
            .with_field(Field::Amount);
            (problem.limit, problem.left, problem.per, problem.resets_at) =
                (Some(limit.as_str()), Some(*left), per, *resets_at);
            problem
        }
        WalletError::Refused(Refusal::LimitBelowUsed { limit, used }) => {
            let detail = match limit.per() {
                None => format!(
                    "the wallet already owes {used} beyond its balance and holds: the overdraft cannot be less; nothing was changed"
                ),
                Some(per) => format!(
                    "this {} window has taken {used} already: its {} limit cannot be less; nothing was changed",
                    per.name(),
                    if matches!(limit, LimitKind::Count(_)) { "count" } else { "amount" },
                ),
            };
            let mut problem = Problem::new(&codes::LIMIT_BELOW_USED, "Limit below what is used", detail)
                .with_field(Field::Limits);
            (problem.limit, problem.per) = (Some(limit.as_str()), limit.per().map(Per::name));
            problem
        }
        WalletError::Refused(Refusal::BalanceOverflow { balance }) => Problem::new(
            &codes::BALANCE_OVERFLOW,
            "Balance overflow",
            format!("the balance of {balance} cannot hold this deposit"),
        )
        .with_balance(*balance),
        WalletError::Refused(Refusal::RefundExceedsPayment { refundable }) => {
            let mut problem = Problem::new(
                &codes::REFUND_EXCEEDS_PAYMENT,
                "Refund exceeds payment",
                format!("only {refundable} is left to refund; nothing was applied"),
            );
            problem.refundable = Some(*refundable);
            problem
        }
        WalletError::LockTimeout { .. } => Problem::new(
            &codes::LOCK_TIMEOUT,
            "Wallet busy",
            "other payments held this wallet for the whole wait; nothing was applied, retry later",
        )
        .retry_later(),
        WalletError::Overloaded => overloaded(
            "this wallet has as many payments waiting on this replica as it takes; nothing was applied, retry later",
        ),
        WalletError::LeaseLost => Problem::new(
            &codes::LEASE_LOST,
            "Lease lost",
            "this replica lost the wallet's lease before committing; nothing was applied, it is safe to retry",
        ),
        WalletError::FenceExhausted(_) => Problem::new(
            &codes::FENCE_EXHAUSTED,
            "Wallet needs an operator",
            "this wallet's fencing token reached its largest value; nothing was applied, and nothing \
             can be until an operator resets it",
        ),
        WalletError::FenceImplausible { .. } => Problem::new(
            &codes::FENCE_IMPLAUSIBLE,
            "Wallet needs an operator",
            "this wallet's fencing token in Redis was moved far past the wallet's; nothing was applied, \
             and nothing can be until an operator deletes the counter",
        ),
        WalletError::Unavailable { .. } => Problem::new(
            &codes::DEPENDENCY_UNAVAILABLE,
            "Service unavailable",
            "a backing service did not answer in time; nothing was applied, retry later",
        )
        .retry_later(),
        WalletError::KeyTakenOver | WalletError::AlreadyRan(Prior::InFlight) => in_flight(),
        WalletError::AlreadyRan(Prior::Reused) => reused(),
        // The HTTP edge sends a replay as it was stored (`super::idempotent`); reaching here is a bug.
        WalletError::AlreadyRan(Prior::Replay(_)) => internal(),
        WalletError::OutcomeUnknown(_) => Problem::new(
            &codes::OUTCOME_UNKNOWN,
            "Outcome unknown",
            "the database connection failed while committing; the payment may have been applied: \
             retry with the same Idempotency-Key to learn its outcome",
        )
        .retry_later(),
        WalletError::Internal(_) => internal(),
    }
}

impl ApiError {
    /// The problem document as bytes, as sent and as stored for an idempotency key.
    pub fn render(&self) -> StoredResponse {
        let problem = self.problem();
        let document = ProblemDocument {
            problem_type: format!("urn:walletlock:problem:{}", problem.code),
            title: problem.title,
            status: problem.status.as_u16(),
            detail: problem.detail,
            code: problem.code,
            field: problem.field,
            balance: problem.balance,
            available: problem.available,
            held: problem.held,
            refundable: problem.refundable,
            limit: problem.limit,
            left: problem.left,
            per: problem.per,
            resets_at: problem.resets_at,
            leg: problem.leg,
            item: problem.item,
        };
        StoredResponse {
            status: problem.status.as_u16(),
            content_type: PROBLEM_JSON.to_owned(),
            body: serde_json::to_vec(&document).unwrap_or_default(),
        }
    }
}

/// An error and its sources, as `error: source: source's source`. Written by hand rather than
/// through `anyhow`, which would capture (and, in a log line, resolve) a backtrace on every 5xx
/// when `RUST_BACKTRACE` is set: milliseconds of CPU and tens of MiB of debug info per replica.
struct SourceChain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for SourceChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// Marks a response as a request shed (`503 overloaded`): the request's trace logs it at debug
/// level, not as a finished request and a failed one (two lines a shed request, in a flood).
#[derive(Debug, Clone, Copy)]
pub struct Shed;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let problem = self.problem();
        let rendered = self.render();
        // The cause of a 5xx goes to the log, with its whole source chain; the client gets the
        // code. A dependency that is down or a wallet that stayed busy is an operational state
        // (a warning); anything else is a bug (an error). A shed request is neither: it comes in
        // floods, is counted (`walletlock_requests_shed_total`), and a line each would make the
        // flood cost work.
        if problem.code == codes::OVERLOADED.code {
            tracing::debug!(code = problem.code, error = %SourceChain(&self), "request shed");
        } else if problem.status == StatusCode::SERVICE_UNAVAILABLE
            || problem.status == StatusCode::GATEWAY_TIMEOUT
        {
            tracing::warn!(code = problem.code, error = %SourceChain(&self), "request failed");
        } else if problem.status.is_server_error() {
            tracing::error!(code = problem.code, error = %SourceChain(&self), "request failed");
        }
        tracing::Span::current().record("outcome", problem.code);
        let mut response = rendered.into_response();
        if problem.code == codes::OVERLOADED.code {
            // So the request's trace logs it at debug level too (`super::ShedOrServerError`).
            response.extensions_mut().insert(Shed);
        }
        if problem.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        if problem.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(r#"Bearer realm="walletlock""#));
        }
        response
    }
}

/// A response as stored for an idempotency key (or about to be), sent as it is: the same bytes now
/// and on every replay.
impl IntoResponse for StoredResponse {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let content_type =
            HeaderValue::from_str(&self.content_type).unwrap_or(HeaderValue::from_static("application/json"));
        (status, [(header::CONTENT_TYPE, content_type)], axum::body::Body::from(self.body)).into_response()
    }
}

/// Response descriptions the operations' documentation shares (see `super::openapi`).
pub mod described {
    pub const UNAUTHORIZED: &str = "`unauthorized`: no known bearer token";
    pub const TOO_LARGE: &str = "`payload_too_large`: the body is over 16 KiB";
    pub const NOT_JSON: &str = "`unsupported_media_type`: the body is not `application/json`";
    /// A 503 of a movement under a wallet's lease.
    pub const MOVEMENT_UNAVAILABLE: &str = "`overloaded`, `lock_timeout`, `dependency_unavailable`, \
                                            `request_timeout`, `outcome_unknown`: retry after `Retry-After`; \
                                            `fence_exhausted`, `fence_implausible`: the wallet needs an operator \
                                            (no `Retry-After`)";
    /// A 404 of a wallet's route.
    pub const NO_WALLET: &str = "`wallet_not_found` (also a wallet of another caller: to it, it does not exist); \
                                 `not_found` for an empty id";
    /// A 503 of a read, which takes no lease.
    pub const READ_UNAVAILABLE: &str =
        "`overloaded`, `dependency_unavailable`, `request_timeout`: retry after `Retry-After`";
    /// A 409 of a movement under a wallet's lease.
    pub const MOVEMENT_CONFLICT: &str =
        "`lease_lost` (nothing applied, retry); `idempotency_key_in_flight` (with `Retry-After`)";
}
