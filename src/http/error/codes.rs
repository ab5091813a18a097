//! Every stable `code` a problem document carries, with its HTTP status, who answers with it, and
//! what it means for the caller: the one list of them. A replica's problems are built from these
//! constants (`super::Problem::new`), nginx's own are written out in `nginx.conf` (a test below
//! holds the two to this list), and `walletlock error-codes` prints the table of
//! `docs/api/errors.md` from it.

use axum::http::StatusCode;

/// Who answers with a code: a replica, nginx in front of the replicas (`nginx.conf`), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnsweredBy {
    Replica,
    Nginx,
    Both,
}

impl AnsweredBy {
    pub fn describe(self) -> &'static str {
        match self {
            AnsweredBy::Replica => "replica",
            AnsweredBy::Nginx => "nginx",
            AnsweredBy::Both => "replica, nginx",
        }
    }
}

/// One stable code: what clients match on.
#[derive(Debug)]
pub struct ErrorCode {
    pub code: &'static str,
    pub status: StatusCode,
    pub answered_by: AnsweredBy,
    /// What it means for the caller, and what to do (Markdown, for `docs/api/errors.md`).
    pub meaning: &'static str,
}

const fn replica(status: StatusCode, code: &'static str, meaning: &'static str) -> ErrorCode {
    ErrorCode { code, status, answered_by: AnsweredBy::Replica, meaning }
}

const fn nginx(status: StatusCode, code: &'static str, meaning: &'static str) -> ErrorCode {
    ErrorCode { code, status, answered_by: AnsweredBy::Nginx, meaning }
}

const fn both(status: StatusCode, code: &'static str, meaning: &'static str) -> ErrorCode {
    ErrorCode { code, status, answered_by: AnsweredBy::Both, meaning }
}

use StatusCode as S;

/// The meaning every field's code shares (`domain::Field::code` names them).
const FIELD_BROKE_ITS_RULE: &str =
    "a field broke its rule (`field` names it: `from` or `to` for a transfer's wallets); fix the request";
const REQUEST_UNREADABLE: &str =
    "the request could not be read (not JSON, a wrong type, a missing, unknown or repeated field)";
const HOLD_SETTLED: &str = "the hold is settled (captured, voided, or past `expires_at`); nothing changed";

pub const INVALID_AMOUNT: ErrorCode = replica(S::BAD_REQUEST, "invalid_amount", FIELD_BROKE_ITS_RULE);
pub const INVALID_WALLET_ID: ErrorCode = replica(S::BAD_REQUEST, "invalid_wallet_id", FIELD_BROKE_ITS_RULE);
pub const INVALID_BALANCE: ErrorCode = replica(S::BAD_REQUEST, "invalid_balance", FIELD_BROKE_ITS_RULE);
pub const INVALID_REFERENCE: ErrorCode = replica(S::BAD_REQUEST, "invalid_reference", FIELD_BROKE_ITS_RULE);
pub const INVALID_METADATA: ErrorCode = replica(S::BAD_REQUEST, "invalid_metadata", FIELD_BROKE_ITS_RULE);
pub const INVALID_LIMIT: ErrorCode = replica(S::BAD_REQUEST, "invalid_limit", FIELD_BROKE_ITS_RULE);
pub const INVALID_CURSOR: ErrorCode = replica(S::BAD_REQUEST, "invalid_cursor", FIELD_BROKE_ITS_RULE);
pub const INVALID_IDEMPOTENCY_KEY: ErrorCode =
    replica(S::BAD_REQUEST, "invalid_idempotency_key", FIELD_BROKE_ITS_RULE);
pub const INVALID_TRANSFER_ID: ErrorCode =
    replica(S::BAD_REQUEST, "invalid_transfer_id", FIELD_BROKE_ITS_RULE);
pub const INVALID_PAYMENT_ID: ErrorCode = replica(S::BAD_REQUEST, "invalid_payment_id", FIELD_BROKE_ITS_RULE);
pub const INVALID_HOLD_ID: ErrorCode = replica(S::BAD_REQUEST, "invalid_hold_id", FIELD_BROKE_ITS_RULE);
pub const INVALID_EXPIRES_IN: ErrorCode = replica(S::BAD_REQUEST, "invalid_expires_in", FIELD_BROKE_ITS_RULE);
pub const INVALID_LEGS: ErrorCode = replica(S::BAD_REQUEST, "invalid_legs", FIELD_BROKE_ITS_RULE);
pub const INVALID_MOVEMENT_ID: ErrorCode =
    replica(S::BAD_REQUEST, "invalid_movement_id", FIELD_BROKE_ITS_RULE);
pub const INVALID_TIME: ErrorCode = replica(S::BAD_REQUEST, "invalid_time", FIELD_BROKE_ITS_RULE);
pub const INVALID_KIND: ErrorCode = replica(S::BAD_REQUEST, "invalid_kind", FIELD_BROKE_ITS_RULE);
pub const INVALID_ORDER: ErrorCode = replica(S::BAD_REQUEST, "invalid_order", FIELD_BROKE_ITS_RULE);
pub const INVALID_EVENT_TYPE: ErrorCode = replica(S::BAD_REQUEST, "invalid_event_type", FIELD_BROKE_ITS_RULE);
pub const INVALID_WAIT: ErrorCode = replica(S::BAD_REQUEST, "invalid_wait", FIELD_BROKE_ITS_RULE);
pub const INVALID_MONITOR: ErrorCode = replica(S::BAD_REQUEST, "invalid_monitor", FIELD_BROKE_ITS_RULE);
pub const INVALID_LIMITS: ErrorCode = replica(S::BAD_REQUEST, "invalid_limits", FIELD_BROKE_ITS_RULE);
pub const INVALID_ENDPOINT_ID: ErrorCode =
    replica(S::BAD_REQUEST, "invalid_endpoint_id", FIELD_BROKE_ITS_RULE);
pub const SAME_WALLET: ErrorCode = replica(
    S::BAD_REQUEST,
    "same_wallet",
    "a transfer's `from` and `to` are the same wallet; nothing was applied",
);
pub const MALFORMED_JSON: ErrorCode = replica(S::BAD_REQUEST, "malformed_json", REQUEST_UNREADABLE);
pub const INVALID_BODY: ErrorCode = replica(S::BAD_REQUEST, "invalid_body", REQUEST_UNREADABLE);
pub const INVALID_BATCH: ErrorCode = replica(
    S::BAD_REQUEST,
    "invalid_batch",
    "a `POST /batches` that could not be read as a batch (`item` names the item at fault): not 1 to 1,000 \
     items, an unknown `op`, an item without an `idempotency_key` or with one used twice in the batch, an \
     item without the id its `op` needs, a field its route does not take or of the wrong type; nothing of \
     the batch was applied ([batches](batches.md))",
);
pub const INVALID_QUERY: ErrorCode = replica(S::BAD_REQUEST, "invalid_query", REQUEST_UNREADABLE);
pub const INVALID_PATH: ErrorCode = replica(S::BAD_REQUEST, "invalid_path", REQUEST_UNREADABLE);
pub const BAD_REQUEST: ErrorCode = nginx(
    S::BAD_REQUEST,
    "bad_request",
    "nginx could not read the request: a malformed request line or header, a header line over 8 KiB, \
     or plain HTTP sent to the HTTPS port",
);
pub const UNAUTHORIZED: ErrorCode = replica(
    S::UNAUTHORIZED,
    "unauthorized",
    "no bearer token, or an unknown one (`WWW-Authenticate` says so); nothing was read or stored",
);
pub const WALLET_NOT_FOUND: ErrorCode = replica(
    S::NOT_FOUND,
    "wallet_not_found",
    "no such wallet (for a transfer, `field` says which: `from` or `to`; for a movement, `leg` names \
     the leg)",
);
pub const NOT_FOUND: ErrorCode =
    both(S::NOT_FOUND, "not_found", "no such route (from nginx too, for `/metrics`)");
pub const WALLET_NOT_YET_OPEN: ErrorCode = replica(
    S::NOT_FOUND,
    "wallet_not_yet_open",
    "the wallet opened after the instant asked about: it had no balance then",
);
pub const TRANSFER_NOT_FOUND: ErrorCode =
    replica(S::NOT_FOUND, "transfer_not_found", "no transfer with this id");
pub const WEBHOOK_ENDPOINT_NOT_FOUND: ErrorCode =
    replica(S::NOT_FOUND, "webhook_endpoint_not_found", "no webhook endpoint of this caller's with this id");
pub const INVALID_WEBHOOK_URL: ErrorCode = replica(
    S::BAD_REQUEST,
    "invalid_webhook_url",
    "an endpoint's URL that is not a public http or https URL (a private, loopback or link-local address, unless the operator allows its host); nothing was changed",
);
pub const MONITOR_NOT_FOUND: ErrorCode =
    replica(S::NOT_FOUND, "monitor_not_found", "the wallet has no such monitor; nothing was changed");
pub const PAYMENT_NOT_FOUND: ErrorCode =
    replica(S::NOT_FOUND, "payment_not_found", "no `pay` entry of this wallet with this id");
pub const HOLD_NOT_FOUND: ErrorCode =
    replica(S::NOT_FOUND, "hold_not_found", "no hold with this id (or one on another caller's wallet)");
pub const MOVEMENT_NOT_FOUND: ErrorCode = replica(
    S::NOT_FOUND,
    "movement_not_found",
    "no movement with this id (or none of whose wallets is the caller's)",
);
pub const METHOD_NOT_ALLOWED: ErrorCode =
    both(S::METHOD_NOT_ALLOWED, "method_not_allowed", "wrong method for this path (from nginx for `TRACE`)");
pub const WALLET_EXISTS: ErrorCode = replica(S::CONFLICT, "wallet_exists", "the id is taken");
pub const HOLD_CAPTURED: ErrorCode = replica(S::CONFLICT, "hold_captured", HOLD_SETTLED);
pub const HOLD_VOIDED: ErrorCode = replica(S::CONFLICT, "hold_voided", HOLD_SETTLED);
pub const HOLD_EXPIRED: ErrorCode = replica(S::CONFLICT, "hold_expired", HOLD_SETTLED);
pub const MOVEMENT_NOT_HELD: ErrorCode = replica(
    S::CONFLICT,
    "movement_not_held",
    "the movement was posted, not placed as a hold: there is nothing to capture or void",
);
pub const MOVEMENT_NOT_CAPTURED: ErrorCode = replica(
    S::CONFLICT,
    "movement_not_captured",
    "the movement was placed as a hold and is held, voided or expired: it moved no money, so there is nothing to refund",
);
pub const HOLD_OF_MOVEMENT: ErrorCode = replica(
    S::CONFLICT,
    "hold_of_movement",
    "the hold reserves a leg of a held movement (`movement_id`): capture or void the movement as a whole",
);
pub const LEASE_LOST: ErrorCode = replica(
    S::CONFLICT,
    "lease_lost",
    "the replica lost the wallet's lease before committing; **nothing was applied**, retry",
);
pub const IDEMPOTENCY_KEY_IN_FLIGHT: ErrorCode = replica(
    S::CONFLICT,
    "idempotency_key_in_flight",
    "the first request with this key is still running; retry after `Retry-After` to get its response",
);
pub const PAYLOAD_TOO_LARGE: ErrorCode = both(
    S::PAYLOAD_TOO_LARGE,
    "payload_too_large",
    "body over 16 KiB (a `POST /batches` over 1 MiB); from nginx, before any replica sees it, over 64 KiB \
     (2 MiB for `/batches`)",
);
pub const URI_TOO_LONG: ErrorCode = nginx(S::URI_TOO_LONG, "uri_too_long", "a request line over 8 KiB");
pub const UNSUPPORTED_MEDIA_TYPE: ErrorCode =
    replica(S::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", "send `Content-Type: application/json`");
pub const INSUFFICIENT_FUNDS: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "insufficient_funds",
    "not enough money available; `balance` says how much there is, `available` how much of it holds do \
     not reserve (for a movement, `leg` names the leg, from 0, whose wallet that is); nothing was applied",
);
pub const CAPTURE_EXCEEDS_HOLD: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "capture_exceeds_hold",
    "the capture asks more than the hold holds (`held`); nothing was charged",
);
pub const TOO_MANY_MONITORS: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "too_many_monitors",
    "the wallet has as many monitors as it may (`detail` says how many); remove one first; nothing was changed",
);
pub const LIMIT_EXCEEDED: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "limit_exceeded",
    "the debit would pass one of the wallet's limits (`limit` names it, `left` is the most it allows now; for a velocity limit, `per` its window and `resets_at` when it ends); nothing was applied",
);
pub const LIMIT_BELOW_USED: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "limit_below_used",
    "the wallet already owes more than the new overdraft would allow, or a velocity window has taken more than its new limit (`limit` names it); nothing was changed",
);
pub const BALANCE_OVERFLOW: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "balance_overflow",
    "the deposit (or the transfer into `to`, or the refund) would overflow the balance",
);
pub const REFUND_EXCEEDS_PAYMENT: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "refund_exceeds_payment",
    "the refunds of this payment or transfer would add up to more than it; `refundable` says what is \
     left; nothing was applied",
);
pub const IDEMPOTENCY_KEY_REUSED: ErrorCode = replica(
    S::UNPROCESSABLE_ENTITY,
    "idempotency_key_reused",
    "this key was used for a different request; nothing was applied",
);
pub const RATE_LIMITED: ErrorCode = nginx(
    S::TOO_MANY_REQUESTS,
    "rate_limited",
    "this client address sent over 200 requests a second; retry after `Retry-After`",
);
pub const INTERNAL_ERROR: ErrorCode = both(
    S::INTERNAL_SERVER_ERROR,
    "internal_error",
    "a bug (in a replica or nginx); the detail is in the log under the request id, never in the response",
);
pub const NOT_IMPLEMENTED: ErrorCode = nginx(
    S::NOT_IMPLEMENTED,
    "not_implemented",
    "a `Transfer-Encoding` nginx does not implement; send the body with `Content-Length`",
);
pub const BAD_GATEWAY: ErrorCode = nginx(
    S::BAD_GATEWAY,
    "bad_gateway",
    "no replica answered: the ones tried refused the connection, or the replica failed while it had the \
     request, so a payment may have been applied; retry with the same `Idempotency-Key` to learn its outcome",
);
pub const LOCK_TIMEOUT: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "lock_timeout",
    "other payments held the wallet for the whole `LEASE_WAIT`; nothing was applied, retry after \
     `Retry-After`",
);
pub const OVERLOADED: ErrorCode = both(
    S::SERVICE_UNAVAILABLE,
    "overloaded",
    "no room for the request, so it was refused before any work (see [Overload](../operating/overload.md)): \
     the replica already handled `MAX_IN_FLIGHT` requests, or the wallet had `WALLET_QUEUE_LIMIT` payments \
     waiting on it, or (from nginx) every replica was at its connection limit or out of rotation; nothing \
     was applied, retry after `Retry-After`",
);
pub const DEPENDENCY_UNAVAILABLE: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "dependency_unavailable",
    "Redis or Postgres did not answer in time; nothing was applied, retry after `Retry-After`",
);
pub const REQUEST_TIMEOUT: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "request_timeout",
    "the request ran past `REQUEST_TIMEOUT`; retry with the same `Idempotency-Key` to learn its outcome",
);
pub const FENCE_EXHAUSTED: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "fence_exhausted",
    "the wallet's fencing token reached its largest value; nothing was applied, nor can be until an \
     operator resets it (see [Fence resets](../operating/fence-resets.md))",
);
pub const FENCE_IMPLAUSIBLE: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "fence_implausible",
    "the wallet's fence counter in Redis was moved more than 2^32 past the row's fence; nothing was \
     applied, nor can be until an operator deletes the counter (see [Fence resets](../operating/fence-resets.md))",
);
pub const OUTCOME_UNKNOWN: ErrorCode = replica(
    S::SERVICE_UNAVAILABLE,
    "outcome_unknown",
    "Postgres's connection broke while the commit was in flight: it may have been applied; retry with the \
     same `Idempotency-Key` to learn which",
);
pub const SERVICE_UNAVAILABLE: ErrorCode = nginx(
    S::SERVICE_UNAVAILABLE,
    "service_unavailable",
    "nginx had no replica to take the request; retry after `Retry-After`",
);
pub const GATEWAY_TIMEOUT: ErrorCode = nginx(
    S::GATEWAY_TIMEOUT,
    "gateway_timeout",
    "the replica did not answer within nginx's 10 s; a payment may have been applied, retry with the same \
     `Idempotency-Key` to learn its outcome",
);
pub const HTTP_VERSION_NOT_SUPPORTED: ErrorCode =
    nginx(S::HTTP_VERSION_NOT_SUPPORTED, "http_version_not_supported", "nginx speaks HTTP/1.x on this port");

/// Every code, in the order of `docs/api/errors.md`: by status, then as a caller meets them.
pub const ERROR_CODES: &[&ErrorCode] = &[
    &INVALID_AMOUNT,
    &INVALID_WALLET_ID,
    &INVALID_BALANCE,
    &INVALID_REFERENCE,
    &INVALID_METADATA,
    &INVALID_LIMIT,
    &INVALID_CURSOR,
    &INVALID_IDEMPOTENCY_KEY,
    &INVALID_TRANSFER_ID,
    &INVALID_PAYMENT_ID,
    &INVALID_HOLD_ID,
    &INVALID_EXPIRES_IN,
    &INVALID_LEGS,
    &INVALID_MOVEMENT_ID,
    &INVALID_TIME,
    &INVALID_KIND,
    &INVALID_ORDER,
    &INVALID_EVENT_TYPE,
    &INVALID_WAIT,
    &INVALID_MONITOR,
    &INVALID_LIMITS,
    &INVALID_ENDPOINT_ID,
    &SAME_WALLET,
    &MALFORMED_JSON,
    &INVALID_BODY,
    &INVALID_BATCH,
    &INVALID_QUERY,
    &INVALID_PATH,
    &BAD_REQUEST,
    &UNAUTHORIZED,
    &WALLET_NOT_FOUND,
    &NOT_FOUND,
    &WALLET_NOT_YET_OPEN,
    &TRANSFER_NOT_FOUND,
    &WEBHOOK_ENDPOINT_NOT_FOUND,
    &INVALID_WEBHOOK_URL,
    &MONITOR_NOT_FOUND,
    &PAYMENT_NOT_FOUND,
    &HOLD_NOT_FOUND,
    &MOVEMENT_NOT_FOUND,
    &METHOD_NOT_ALLOWED,
    &WALLET_EXISTS,
    &HOLD_CAPTURED,
    &HOLD_VOIDED,
    &HOLD_EXPIRED,
    &MOVEMENT_NOT_HELD,
    &MOVEMENT_NOT_CAPTURED,
    &HOLD_OF_MOVEMENT,
    &LEASE_LOST,
    &IDEMPOTENCY_KEY_IN_FLIGHT,
    &PAYLOAD_TOO_LARGE,
    &URI_TOO_LONG,
    &UNSUPPORTED_MEDIA_TYPE,
    &INSUFFICIENT_FUNDS,
    &CAPTURE_EXCEEDS_HOLD,
    &TOO_MANY_MONITORS,
    &LIMIT_EXCEEDED,
    &LIMIT_BELOW_USED,
    &BALANCE_OVERFLOW,
    &REFUND_EXCEEDS_PAYMENT,
    &IDEMPOTENCY_KEY_REUSED,
    &RATE_LIMITED,
    &INTERNAL_ERROR,
    &NOT_IMPLEMENTED,
    &BAD_GATEWAY,
    &LOCK_TIMEOUT,
    &OVERLOADED,
    &DEPENDENCY_UNAVAILABLE,
    &REQUEST_TIMEOUT,
    &FENCE_EXHAUSTED,
    &FENCE_IMPLAUSIBLE,
    &OUTCOME_UNKNOWN,
    &SERVICE_UNAVAILABLE,
    &GATEWAY_TIMEOUT,
    &HTTP_VERSION_NOT_SUPPORTED,
];

/// The code called `code`, if the API has one.
pub fn named(code: &str) -> Option<&'static ErrorCode> {
    ERROR_CODES.iter().copied().find(|known| known.code == code)
}

/// The table of `docs/api/errors.md`: one row per status and meaning, its codes in list order.
pub fn markdown_table() -> String {
    let mut table =
        String::from("| status | code | answered by | what it means for the caller |\n|---|---|---|---|\n");
    let mut rows: Vec<(&ErrorCode, Vec<&str>)> = Vec::new();
    for code in ERROR_CODES {
        match rows.last_mut() {
            Some((first, codes))
                if first.status == code.status
                    && first.meaning == code.meaning
                    && first.answered_by == code.answered_by =>
            {
                codes.push(code.code)
            }
            _ => rows.push((code, vec![code.code])),
        }
    }
    for (first, codes) in rows {
        let codes = codes.iter().map(|code| format!("`{code}`")).collect::<Vec<_>>().join(", ");
        table.push_str(&format!(
            "| {} | {codes} | {} | {} |\n",
            first.status.as_u16(),
            first.answered_by.describe(),
            first.meaning
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Field;

    #[test]
    fn every_code_is_listed_once() {
        for (at, code) in ERROR_CODES.iter().enumerate() {
            assert!(
                ERROR_CODES[..at].iter().all(|earlier| earlier.code != code.code),
                "{} is listed twice",
                code.code
            );
        }
    }

    #[test]
    fn every_fields_code_is_a_listed_400() {
        // Exhaustive, so that a new field fails to compile here until it is listed below.
        let _every_variant_listed = |field: Field| match field {
            Field::WalletId
            | Field::From
            | Field::To
            | Field::Payment
            | Field::TransferId
            | Field::HoldId
            | Field::ExpiresIn
            | Field::Amount
            | Field::Balance
            | Field::Reference
            | Field::Metadata
            | Field::Limit
            | Field::Before
            | Field::IdempotencyKey
            | Field::Legs
            | Field::MovementId
            | Field::At
            | Field::PeriodStart
            | Field::PeriodEnd
            | Field::Kind
            | Field::Order
            | Field::Cursor
            | Field::EventType
            | Field::Wait
            | Field::EndpointId
            | Field::Monitor
            | Field::Limits => (),
        };
        for field in [
            Field::WalletId,
            Field::From,
            Field::To,
            Field::Payment,
            Field::TransferId,
            Field::HoldId,
            Field::ExpiresIn,
            Field::Amount,
            Field::Balance,
            Field::Reference,
            Field::Metadata,
            Field::Limit,
            Field::Before,
            Field::IdempotencyKey,
            Field::Legs,
            Field::MovementId,
            Field::At,
            Field::PeriodStart,
            Field::PeriodEnd,
            Field::Kind,
            Field::Order,
            Field::Cursor,
            Field::EventType,
            Field::Wait,
            Field::EndpointId,
            Field::Monitor,
            Field::Limits,
        ] {
            let listed =
                named(field.code()).unwrap_or_else(|| panic!("{} is not in ERROR_CODES", field.code()));
            assert_eq!(listed.status, StatusCode::BAD_REQUEST, "{}", field.code());
        }
    }

    /// nginx's own problem bodies are written out in `nginx.conf`; each must be a listed code that
    /// nginx answers with, at its listed status, and each code listed as nginx's must be there.
    #[test]
    fn nginx_answers_only_with_listed_codes_at_their_status() {
        let conf = include_str!("../../../nginx.conf");
        let mut answered = Vec::new();
        for body in conf.split("'{\"type\":").skip(1) {
            let field = |name: &str| {
                let start = body.find(&format!("\"{name}\":")).map(|at| at + name.len() + 3)?;
                let rest = &body[start..];
                Some(rest[..rest.find([',', '}'])?].trim_matches('"').to_owned())
            };
            let (Some(code), Some(status)) = (field("code"), field("status")) else {
                panic!("a problem body in nginx.conf without a code or status: {body}")
            };
            let listed = named(&code).unwrap_or_else(|| panic!("nginx answers {code}, not in ERROR_CODES"));
            assert_eq!(listed.status.as_u16().to_string(), status, "{code}");
            assert_ne!(listed.answered_by, AnsweredBy::Replica, "nginx answers {code}");
            answered.push(code);
        }
        for code in ERROR_CODES.iter().filter(|code| code.answered_by != AnsweredBy::Replica) {
            assert!(answered.iter().any(|seen| seen == code.code), "nginx.conf never answers {}", code.code);
        }
    }

    /// Each status nginx answers itself (`error_page ... /_problem`) has its body in nginx.conf's
    /// map: of that status, its `type` ending in its code, with a title and a detail (494, nginx's
    /// "headers too large", goes out as a 400).
    #[test]
    fn each_status_nginx_answers_itself_has_its_problem_body() {
        let conf = include_str!("../../../nginx.conf");
        let statuses = conf
            .lines()
            .find_map(|line| line.trim().strip_prefix("error_page ")?.strip_suffix(" /_problem;"));
        for status in statuses.expect("nginx.conf sends its own errors to /_problem").split(' ') {
            if status == "494" {
                continue;
            }
            let body = conf
                .lines()
                .find_map(|line| line.trim().strip_prefix(&format!("{status} '"))?.strip_suffix("';"));
            let body = body.unwrap_or_else(|| panic!("no problem body for {status} in nginx.conf's map"));
            let problem: serde_json::Value = serde_json::from_str(body).expect("a problem body is JSON");
            let code = problem["code"].as_str().unwrap_or_default();
            assert_eq!(problem["status"].to_string(), status, "{body}");
            assert_eq!(problem["type"], format!("urn:walletlock:problem:{code}"), "{body}");
            for field in ["title", "detail"] {
                assert!(problem[field].as_str().is_some_and(|text| !text.is_empty()), "{field} of {body}");
            }
        }
    }
}
