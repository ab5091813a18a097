//! `POST /batches`: up to [`MAX_ITEMS`] movements of money in one request, each decided on its own
//! as its single route decides it, answered together in the batch's order.
//!
//! Each item runs through the single routes themselves: the batch synthesizes the item's request
//! (`POST` to its route's path, the batch's `Authorization`, the item's key as `Idempotency-Key`,
//! its fields as the JSON body) and sends it through [`Items`], a router of the movement routes,
//! in process. So an item is validated, keyed, decided, stored for its key and rendered exactly as
//! the single request would be, by the same code, and a retried batch replays each item by its
//! key. (The alternative, a batch path into the wallet service that skips the HTTP handlers, would
//! save each item a JSON parse and a render, but would be a second copy of every route's
//! validation and answer that must stay in step with the first.)
//!
//! The items of a batch run concurrently, so they join the replica's rounds with everything else
//! (group commit across wallets): up to [`MAX_CONCURRENT_ITEMS`] at once, each holding one of the
//! replica's `MAX_IN_FLIGHT` permits as a request would (the batch itself holds one, taken at its
//! arrival; it takes more for its items only from those free, at most half of them so that the
//! next arrival finds room, never waiting, and never sheds its own items for want of them: it runs
//! them in a smaller window instead). An item that has not
//! started by the batch's deadline is answered `503 overloaded` (nothing applied); one still running
//! then, `503 request_timeout` (retry with its key to learn its outcome), as a single request would.
//!
//! Items that name the same wallet are decided in the batch's order: an item starts only once every
//! earlier item naming one of its wallets has been answered, or, for a deposit or payment after a
//! deposit or payment of the same wallet, once the earlier one is in the wallet's queue on this
//! replica (first come, first served there, and decided together in one round). A capture, void or
//! refund named by its hold, movement or transfer does not say which wallets it moves, so it waits
//! for every item before it, and every item after it waits for it.
//!
//! What is refused whole (`400 invalid_batch`, with `item`, or `malformed_json`; nothing applied) is
//! what cannot be read as a batch of requests: see [`parse`] and `docs/api/batches.md`.

use super::ApiContext;
use super::error::codes;
use super::error::described::{NOT_JSON, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::{holds, movements, transfers, wallets};
use crate::idempotency::IdempotencyKey;
use crate::telemetry::metrics::{BATCH_ITEMS, REQUESTS_SHED};
use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::{Extension, Request, State},
    http::{HeaderValue, Method, header},
    response::{IntoResponse, Response},
};
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, oneshot, watch};
use tokio::time::{Instant, timeout_at};
use tower::ServiceExt;
use tracing::Instrument;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

/// The most items one batch holds.
pub const MAX_ITEMS: usize = 1000;
/// The largest `POST /batches` body, in bytes: 1,000 items of about 1 KiB each (nginx takes up to
/// 2 MiB on this route, so the replica explains a refusal between the two).
pub const BATCH_BODY_LIMIT: usize = 1024 * 1024;
/// The route's path.
pub const PATH: &str = "/batches";
/// How long past REQUEST_TIMEOUT a batch has to answer: its items are bounded by REQUEST_TIMEOUT
/// from the batch's start (as a single request is), and then every item's answer is rendered.
pub const ANSWER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
/// The most items of one batch running at once (each holding one of the replica's
/// `MAX_IN_FLIGHT` permits), so one batch leaves most of the replica's room to other requests.
pub const MAX_CONCURRENT_ITEMS: usize = 64;

/// The router the items run through: the movement routes with their token check and body limit,
/// but without the per-request shedding (the batch takes permits for its items), the timeout (the
/// batch bounds its items by its own deadline) or the request metrics (items are counted by
/// `walletlock_batch_items_total`, the batch by the request metrics).
#[derive(Debug, Clone)]
pub struct Items(pub Router);

/// The batch route, which runs its items through `items`.
pub fn router(items: Items) -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(batch)).layer(Extension(items))
}

/// What an item does, and the single route it runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemOp {
    Deposit,
    Pay,
    Transfer,
    Movement,
    Hold,
    Capture,
    Void,
    Refund,
}

impl ItemOp {
    const ALL: [ItemOp; 8] = [
        ItemOp::Deposit,
        ItemOp::Pay,
        ItemOp::Transfer,
        ItemOp::Movement,
        ItemOp::Hold,
        ItemOp::Capture,
        ItemOp::Void,
        ItemOp::Refund,
    ];

    fn as_str(self) -> &'static str {
        match self {
            ItemOp::Deposit => "deposit",
            ItemOp::Pay => "pay",
            ItemOp::Transfer => "transfer",
            ItemOp::Movement => "movement",
            ItemOp::Hold => "hold",
            ItemOp::Capture => "capture",
            ItemOp::Void => "void",
            ItemOp::Refund => "refund",
        }
    }

    fn parse(name: &str) -> Option<ItemOp> {
        Self::ALL.into_iter().find(|op| op.as_str() == name)
    }
}

/// The wallets an item moves money of, as far as the item itself says.
#[derive(Debug, PartialEq, Eq)]
enum Touches {
    Wallets(Vec<String>),
    /// Named by a hold, movement or transfer: any wallet.
    Unknown,
}

/// One item, read: the request it runs as.
#[derive(Debug)]
struct Item {
    op: ItemOp,
    key: HeaderValue,
    path: String,
    /// The JSON body; none for a route that takes none (a void), or that may be sent without one
    /// (a movement's capture or refund) when the item has no field for it.
    body: Option<Bytes>,
    touches: Touches,
}

// ---- The document's view of a batch. The batch is read by `parse`, field by field, so that each
// item's own fields reach its route as they came; these types describe it.

/// Up to 1,000 movements, each decided on its own as its single route decides it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct NewBatch {
    /// 1 to 1,000 items, each with its own `idempotency_key` (unique in the batch).
    #[schema(min_items = 1, max_items = 1000)]
    items: Vec<BatchItem>,
}

/// An item: `op`, its `idempotency_key`, the ids its route names in its path, and its route's body
/// fields beside them.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "op", rename_all = "snake_case")]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
enum BatchItem {
    /// `POST /wallets/{wallet_id}/deposit`.
    Deposit(DepositItem),
    /// `POST /wallets/{wallet_id}/pay`.
    Pay(PayItem),
    /// `POST /transfers`.
    Transfer(TransferItem),
    /// `POST /movements`.
    Movement(MovementItem),
    /// `POST /wallets/{wallet_id}/holds`.
    Hold(HoldItem),
    /// `POST /holds/{hold_id}/capture` or `POST /movements/{movement_id}/capture`.
    Capture(CaptureItem),
    /// `POST /holds/{hold_id}/void` or `POST /movements/{movement_id}/void`.
    Void(VoidItem),
    /// `POST /wallets/{wallet_id}/refunds`, `POST /transfers/{transfer_id}/refund` or
    /// `POST /movements/{movement_id}/refund`.
    Refund(RefundItem),
}

/// The item's `Idempotency-Key`: required, 1 to 255 printable ASCII characters, no leading or
/// trailing space, unique in the batch.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(
    value_type = String,
    min_length = 1,
    max_length = 255,
    pattern = "^[\\x21-\\x7E]([\\x20-\\x7E]{0,253}[\\x21-\\x7E])?$",
    example = "payroll-2026-11-0001"
)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct ItemKey(String);

macro_rules! wallet_item {
    ($(#[$doc:meta])* $name:ident, $fields:ty) => {
        $(#[$doc])*
        #[derive(Debug, Deserialize, ToSchema)]
        #[allow(dead_code, reason = "the document's description of what `parse` reads")]
        struct $name {
            #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
            wallet_id: String,
            idempotency_key: ItemKey,
            #[serde(flatten)]
            fields: $fields,
        }
    };
}

wallet_item!(
    /// A deposit: the wallet, and the fields of `POST /wallets/{id}/deposit`.
    DepositItem,
    wallets::Deposit
);
wallet_item!(
    /// A payment: the wallet, and the fields of `POST /wallets/{id}/pay`.
    PayItem,
    wallets::Pay
);
wallet_item!(
    /// A hold placed: the wallet, and the fields of `POST /wallets/{id}/holds`.
    HoldItem,
    holds::PlaceHold
);

/// A transfer: the fields of `POST /transfers`.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct TransferItem {
    idempotency_key: ItemKey,
    #[serde(flatten)]
    fields: transfers::NewTransfer,
}

/// A movement: the fields of `POST /movements`.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct MovementItem {
    idempotency_key: ItemKey,
    #[serde(flatten)]
    fields: movements::NewMovement,
}

/// A capture: of a hold (`hold_id`) or of a held movement (`movement_id`), exactly one of them,
/// with the route's `amount`.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct CaptureItem {
    #[schema(nullable = false)]
    hold_id: Option<uuid::Uuid>,
    #[schema(nullable = false)]
    movement_id: Option<uuid::Uuid>,
    idempotency_key: ItemKey,
    /// Minor units; without it, all of it.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
}

/// A void: of a hold (`hold_id`) or of a held movement (`movement_id`), exactly one of them; no
/// other field.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct VoidItem {
    #[schema(nullable = false)]
    hold_id: Option<uuid::Uuid>,
    #[schema(nullable = false)]
    movement_id: Option<uuid::Uuid>,
    idempotency_key: ItemKey,
}

/// A refund: of a payment (`wallet_id` and `payment`), of a transfer (`transfer_id`) or of a
/// movement (`movement_id`), exactly one of the three, with its route's `amount` and `metadata`.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code, reason = "the document's description of what `parse` reads")]
struct RefundItem {
    #[schema(nullable = false, pattern = "^[A-Za-z0-9_-]{1,64}$")]
    wallet_id: Option<String>,
    /// With `wallet_id`: the id of a `pay` entry of that wallet.
    #[schema(nullable = false, format = Uuid)]
    payment: Option<String>,
    #[schema(nullable = false)]
    transfer_id: Option<uuid::Uuid>,
    #[schema(nullable = false)]
    movement_id: Option<uuid::Uuid>,
    idempotency_key: ItemKey,
    /// Minor units; without it, all that is left to refund.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 500)]
    amount: Option<i64>,
    /// Your own key-value pairs (see `Metadata`).
    #[schema(value_type = Option<crate::domain::Metadata>)]
    metadata: Option<Map<String, Value>>,
}

/// Every item's outcome, in the batch's order.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAnswer {
    items: Vec<ItemAnswer>,
}

/// One item's outcome: the status and body its single route answers (or answered, replayed).
#[derive(Debug, Serialize, ToSchema)]
pub struct ItemAnswer {
    /// The HTTP status the item's route answered.
    #[schema(minimum = 200, maximum = 599, example = 200)]
    status: u16,
    /// The body the item's route answered: what it made, or the problem document of its refusal.
    /// Kept as the route rendered it, not parsed and written again.
    #[schema(value_type = Object)]
    body: Box<RawValue>,
    /// `true` when the answer was replayed for the item's `idempotency_key` (the route's
    /// `Idempotent-Replayed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    replayed: Option<bool>,
    /// Seconds to wait before retrying the item (the route's `Retry-After`), with a `503` or a
    /// `409 idempotency_key_in_flight`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 1)]
    retry_after: Option<u64>,
}

/// Runs up to 1,000 movements in one request: each item as its single route would run it, with its
/// own `idempotency_key`, under the same leases, fences and idempotency; items naming the same
/// wallet are decided in the batch's order. The answer lists every item's outcome in order; a batch
/// retried whole replays each item by its key. A batch that cannot be read is refused whole, with
/// nothing applied.
#[utoipa::path(
    post,
    path = "/batches",
    tag = "batches",
    security(("bearer" = [])),
    request_body(content = NewBatch, content_type = "application/json"),
    responses(
        (status = 200, description = "Every item's status and body, in the batch's order", body = BatchAnswer),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_batch` (with `item` when one item is at fault: not 1 to 1,000 items, an \
                           unknown `op`, a missing or repeated `idempotency_key`, a missing id, a field its \
                           route does not take or of the wrong type), `malformed_json`, \
                           `invalid_idempotency_key` (a batch takes no `Idempotency-Key` of its own); \
                           nothing applied"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 413, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`payload_too_large`: the body is over 1 MiB"),
        (status = 415, description = NOT_JSON, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`overloaded` (the replica had no room for the batch; nothing applied), \
                           `request_timeout`: retry after `Retry-After`",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn batch(
    State(ctx): State<ApiContext>,
    Extension(items): Extension<Items>,
    request: Request,
) -> Result<Response, ApiError> {
    let keyed = request.headers().contains_key("idempotency-key");
    let json = super::extract::is_json(request.headers().get(header::CONTENT_TYPE));
    let authorization = request.headers().get(header::AUTHORIZATION).cloned();
    // The body is read before the headers are judged (see `discard_body`).
    let raw = read_body(request.into_body()).await?;
    if keyed {
        return Err(ApiError::BadRequest {
            code: &codes::INVALID_IDEMPOTENCY_KEY,
            detail: "a batch takes no Idempotency-Key: each item carries its own `idempotency_key`".into(),
        });
    }
    if !json {
        return Err(ApiError::UnsupportedMediaType(
            "send the body as JSON, with Content-Type: application/json".into(),
        ));
    }
    let batch = parse(&raw)?;
    let answers = run(&ctx, &items.0, authorization, batch).await;
    Ok(Json(BatchAnswer { items: answers }).into_response())
}

/// Reads a batch's body to its end, keeping none of it, before it is refused unread. nginx
/// buffers a body this large in a file and sends it after the headers: a replica that answered
/// and closed the connection first would make nginx's write fail, and nginx would answer `502`
/// (or pass the refusal on cut short) and take the replica out of rotation for a second
/// (`max_fails=1`). Read and dropped, it costs the replica no memory.
pub async fn discard_body(body: Body) {
    drain(body.into_data_stream()).await;
}

/// Reads and drops what is left of a body: up to [`DRAINED_AT_MOST`] bytes, for a second at most.
async fn drain(mut chunks: axum::body::BodyDataStream) {
    use futures::StreamExt;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        let mut read = 0;
        while let Some(Ok(chunk)) = chunks.next().await {
            read += chunk.len();
            if read > DRAINED_AT_MOST {
                break;
            }
        }
    })
    .await;
}

/// The most of a body [`drain`] reads: what nginx lets through on this route (nginx.conf's
/// `client_max_body_size 2m`).
const DRAINED_AT_MOST: usize = 2 * 1024 * 1024;

/// A batch's body: up to [`BATCH_BODY_LIMIT`] bytes, or `payload_too_large` once the rest of a
/// larger one has been read and dropped (see [`discard_body`]: answered mid-body, the refusal
/// could reach the client cut short).
async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    use futures::StreamExt;
    let mut chunks = body.into_data_stream();
    let mut read = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|err| ApiError::BadRequest {
            code: &codes::INVALID_BODY,
            detail: format!("the body could not be read: {err}"),
        })?;
        if read.len() + chunk.len() > BATCH_BODY_LIMIT {
            drain(chunks).await;
            return Err(ApiError::PayloadTooLarge { limit: BATCH_BODY_LIMIT });
        }
        read.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(read))
}

fn invalid(item: Option<usize>, detail: impl Into<String>) -> ApiError {
    ApiError::InvalidBatch { item, detail: detail.into() }
}

/// Reads a batch, or refuses it whole: what cannot be read as a batch of requests is
/// `invalid_batch` (not JSON is `malformed_json`): the body not `{"items": [...]}` with 1 to
/// [`MAX_ITEMS`] items; an item not an object, without a known `op`, without an `idempotency_key`
/// (or with one that is not a key, or one an earlier item has); without the id its route names in
/// its path (or with it not a string); or with a field its route does not take, a field twice, or a
/// field of the wrong JSON type (what the single route refuses as `invalid_body`).
///
/// Everything else is the item's route's to answer, per item: a value that breaks its rule (an
/// amount of 0, a malformed wallet id, a reference too long), and every refusal.
fn parse(raw: &[u8]) -> Result<Vec<Item>, ApiError> {
    let root = match serde_json::from_slice::<Strict>(raw) {
        Ok(Strict(root)) => root,
        Err(err) if err.is_syntax() || err.is_eof() => {
            return Err(ApiError::BadRequest { code: &codes::MALFORMED_JSON, detail: err.to_string() });
        }
        Err(err) => return Err(invalid(None, err.to_string())),
    };
    let Value::Object(mut root) = root else {
        return Err(invalid(None, "a batch is an object: {\"items\": [...]}"));
    };
    let Some(items) = root.shift_remove("items") else {
        return Err(invalid(None, "`items` is missing"));
    };
    if let Some(field) = root.keys().next() {
        return Err(invalid(None, format!("unknown field `{field}`: a batch has only `items`")));
    }
    let Value::Array(items) = items else {
        return Err(invalid(None, "`items` is an array of items"));
    };
    if items.is_empty() || items.len() > MAX_ITEMS {
        return Err(invalid(None, format!("a batch has 1 to {MAX_ITEMS} items, not {}", items.len())));
    }
    let mut keys = HashSet::with_capacity(items.len());
    let mut read = Vec::with_capacity(items.len());
    for (at, item) in items.into_iter().enumerate() {
        let item = parse_item(item).map_err(|detail| invalid(Some(at), detail))?;
        if !keys.insert(item.key.clone()) {
            return Err(invalid(
                Some(at),
                "its `idempotency_key` is an earlier item's: each item has its own",
            ));
        }
        read.push(item);
    }
    Ok(read)
}

/// Reads one item into the request it runs as; the error says what is wrong with it.
fn parse_item(item: Value) -> Result<Item, String> {
    let Value::Object(mut fields) = item else {
        return Err("an item is an object: `op`, `idempotency_key` and its route's fields".into());
    };
    let op = match fields.shift_remove("op") {
        Some(Value::String(name)) => ItemOp::parse(&name).ok_or_else(|| {
            let known: Vec<&str> = ItemOp::ALL.iter().map(|op| op.as_str()).collect();
            format!("unknown `op` {name:?}: one of {}", known.join(", "))
        })?,
        Some(_) => return Err("`op` is a string".into()),
        None => return Err("`op` is missing".into()),
    };
    let key = match fields.shift_remove("idempotency_key") {
        Some(Value::String(key)) => {
            let parsed = IdempotencyKey::parse(key.as_bytes()).ok().filter(|_| key.trim() == key);
            parsed.and_then(|key| HeaderValue::from_str(key.as_str()).ok()).ok_or(
                "`idempotency_key` is 1 to 255 printable ASCII characters, no leading or trailing space",
            )?
        }
        Some(_) => return Err("`idempotency_key` is a string".into()),
        None => return Err("`idempotency_key` is missing: every item carries its own".into()),
    };
    let (path, body, touches) = match op {
        ItemOp::Deposit | ItemOp::Pay | ItemOp::Hold => {
            let wallet = take_id(&mut fields, "wallet_id")?.ok_or("`wallet_id` is missing")?;
            let route = match op {
                ItemOp::Deposit => check::<wallets::Deposit>(&fields, "deposit")?,
                ItemOp::Pay => check::<wallets::Pay>(&fields, "pay")?,
                _ => check::<holds::PlaceHold>(&fields, "holds")?,
            };
            (format!("/wallets/{}/{route}", segment(&wallet)), json(&fields), Touches::Wallets(vec![wallet]))
        }
        ItemOp::Transfer => {
            check::<transfers::NewTransfer>(&fields, "")?;
            let parties = ["from", "to"].iter().filter_map(|name| fields.get(*name)?.as_str());
            let touches = Touches::Wallets(parties.map(str::to_owned).collect());
            ("/transfers".to_owned(), json(&fields), touches)
        }
        ItemOp::Movement => {
            check::<movements::NewMovement>(&fields, "")?;
            let legs = fields.get("legs").and_then(Value::as_array).into_iter().flatten();
            let wallets = legs.filter_map(|leg| leg.get("wallet_id")?.as_str()).map(str::to_owned);
            ("/movements".to_owned(), json(&fields), Touches::Wallets(wallets.collect()))
        }
        ItemOp::Capture | ItemOp::Void => {
            let hold = take_id(&mut fields, "hold_id")?;
            let movement = take_id(&mut fields, "movement_id")?;
            let verb = op.as_str();
            if op == ItemOp::Void
                && let Some(field) = fields.keys().next()
            {
                return Err(format!("unknown field `{field}`: a void takes only `hold_id` or `movement_id`"));
            }
            match (hold, movement) {
                (Some(hold), None) => {
                    // `POST /holds/{id}/capture` reads a body always; a void, none.
                    let body = if op == ItemOp::Capture {
                        check::<holds::Capture>(&fields, "")?;
                        json(&fields)
                    } else {
                        None
                    };
                    (format!("/holds/{}/{verb}", segment(&hold)), body, Touches::Unknown)
                }
                (None, Some(movement)) => {
                    if op == ItemOp::Capture {
                        check::<movements::PartOf>(&fields, "")?;
                    }
                    (
                        format!("/movements/{}/{verb}", segment(&movement)),
                        optional_json(&fields),
                        Touches::Unknown,
                    )
                }
                _ => return Err(format!("a {verb} names exactly one of `hold_id` and `movement_id`")),
            }
        }
        ItemOp::Refund => {
            let wallet = take_id(&mut fields, "wallet_id")?;
            let transfer = take_id(&mut fields, "transfer_id")?;
            let movement = take_id(&mut fields, "movement_id")?;
            match (wallet, transfer, movement) {
                (Some(wallet), None, None) => {
                    check::<transfers::PaymentRefund>(&fields, "")?;
                    let path = format!("/wallets/{}/refunds", segment(&wallet));
                    (path, json(&fields), Touches::Wallets(vec![wallet]))
                }
                (None, Some(transfer), None) => {
                    check::<transfers::TransferRefund>(&fields, "")?;
                    (format!("/transfers/{}/refund", segment(&transfer)), json(&fields), Touches::Unknown)
                }
                (None, None, Some(movement)) => {
                    check::<movements::MovementRefund>(&fields, "")?;
                    let path = format!("/movements/{}/refund", segment(&movement));
                    (path, optional_json(&fields), Touches::Unknown)
                }
                _ => {
                    return Err("a refund names exactly one of `wallet_id` (with `payment`), `transfer_id` \
                                and `movement_id`"
                        .into());
                }
            }
        }
    };
    Ok(Item { op, key, path, body, touches })
}

/// Takes the id field `name` out of the item's fields: a non-empty string, or absent.
fn take_id(fields: &mut Map<String, Value>, name: &str) -> Result<Option<String>, String> {
    match fields.shift_remove(name) {
        Some(Value::String(id)) if !id.is_empty() => Ok(Some(id)),
        Some(_) => Err(format!("`{name}` is a non-empty string")),
        None => Ok(None),
    }
}

/// Whether the item's body fields are what route body `T` takes (fields, their JSON types); the
/// rules of their values are the route's to check. Answers `route`, for the caller's convenience.
fn check<T: DeserializeOwned>(
    fields: &Map<String, Value>,
    route: &'static str,
) -> Result<&'static str, String> {
    T::deserialize(fields).map(|_| route).map_err(|err| err.to_string())
}

fn json(fields: &Map<String, Value>) -> Option<Bytes> {
    Some(Bytes::from(serde_json::to_vec(fields).expect("a JSON map serializes")))
}

/// No body for a route that may go without one, when the item has no field for it.
fn optional_json(fields: &Map<String, Value>) -> Option<Bytes> {
    if fields.is_empty() { None } else { json(fields) }
}

/// An id as a path segment: percent-encoded but for the characters ids are made of, so that a
/// malformed id reaches its route as it was sent, which refuses it as the single route would
/// (`invalid_wallet_id`, `invalid_hold_id`, ...), and never as another path.
fn segment(id: &str) -> String {
    let mut encoded = String::with_capacity(id.len());
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// How far an item has gone: what a later item of the same wallet waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Waiting,
    /// In its wallet's queue on this replica (a deposit or payment).
    Queued,
    Answered,
}

impl Item {
    /// The one wallet whose queue this item joins (`crate::wallet::telling_when_queued`): a
    /// deposit or a payment.
    fn queue(&self) -> Option<&str> {
        match (&self.op, &self.touches) {
            (ItemOp::Deposit | ItemOp::Pay, Touches::Wallets(wallets)) if wallets.len() == 1 => {
                Some(&wallets[0])
            }
            _ => None,
        }
    }
}

/// For each item, the earlier items it waits for, and how far: the last earlier item naming each of
/// its wallets, and the last item whose wallets are unknown; an item whose wallets are unknown
/// waits for every earlier item (through the last of each wallet, and the one before it whose were
/// unknown). Each until answered, but a deposit or payment after one of the same wallet, until that
/// one is queued.
fn dependencies(items: &[Item]) -> Vec<Vec<(usize, Stage)>> {
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut barrier: Option<usize> = None;
    let mut all = Vec::with_capacity(items.len());
    for (at, item) in items.iter().enumerate() {
        let mut deps: Vec<usize> = barrier.into_iter().collect();
        match &item.touches {
            Touches::Wallets(wallets) => {
                deps.extend(wallets.iter().filter_map(|wallet| last.get(wallet.as_str()).copied()));
                for wallet in wallets {
                    last.insert(wallet, at);
                }
            }
            Touches::Unknown => {
                deps.extend(last.drain().map(|(_, item)| item));
                barrier = Some(at);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        let same_queue = |earlier: usize| item.queue().is_some() && item.queue() == items[earlier].queue();
        all.push(
            deps.into_iter()
                .map(|earlier| (earlier, if same_queue(earlier) { Stage::Queued } else { Stage::Answered }))
                .collect(),
        );
    }
    all
}

/// Up to `want` of the replica's in-flight permits, of those free now (none is waited for).
fn free_permits(in_flight: &std::sync::Arc<Semaphore>, want: usize) -> Option<OwnedSemaphorePermit> {
    let mut want = want.min(in_flight.available_permits());
    while want > 0 {
        match in_flight.clone().try_acquire_many_owned(u32::try_from(want).unwrap_or(u32::MAX)) {
            Ok(permits) => return Some(permits),
            Err(TryAcquireError::Closed) => return None,
            Err(TryAcquireError::NoPermits) => want = (want - 1).min(in_flight.available_permits()),
        }
    }
    None
}

/// Runs every item, concurrently but for the order [`dependencies`] asks, and answers each.
async fn run(
    ctx: &ApiContext,
    router: &Router,
    authorization: Option<HeaderValue>,
    items: Vec<Item>,
) -> Vec<ItemAnswer> {
    // Each item is bounded as a single request is; the batch as a whole has ANSWER_GRACE more
    // (`super::bounded_and_draining`) to answer them all.
    let deadline = Instant::now() + ctx.request_timeout;
    // The batch holds one permit already (taken at its arrival); the rest of its window is what
    // is free now.
    // At most half of what is free, so that the next batch to arrive finds room too.
    let want = (items.len().min(MAX_CONCURRENT_ITEMS) - 1).min(ctx.in_flight.available_permits() / 2);
    let extra = free_permits(&ctx.in_flight, want);
    let window = Semaphore::new(1 + extra.as_ref().map_or(0, OwnedSemaphorePermit::num_permits));
    let waits = dependencies(&items);
    let stages: Vec<watch::Sender<Stage>> = items.iter().map(|_| watch::channel(Stage::Waiting).0).collect();
    // What every item not started by the deadline is answered, rendered once: a batch at its
    // deadline may have hundreds of them, and should answer them all at once.
    let not_started = answer(item_error(ApiError::Overloaded)).await;
    let not_started = &not_started;
    let runs = items.iter().enumerate().map(|(at, item)| {
        let (window, waits, stages, authorization) = (&window, &waits[at], &stages, &authorization);
        async move {
            let answer = async {
                for &(earlier, stage) in waits {
                    let mut reached = stages[earlier].subscribe();
                    if timeout_at(deadline, reached.wait_for(|reached| *reached >= stage)).await.is_err() {
                        return shed(not_started);
                    }
                }
                if Instant::now() >= deadline {
                    return shed(not_started);
                }
                let Ok(Ok(_slot)) = timeout_at(deadline, window.acquire()).await else {
                    return shed(not_started);
                };
                let span = super::movement_span!("item", item = at, op = item.op.as_str(),);
                let request = synthesize(item, authorization.as_ref());
                let (queued, told) = oneshot::channel();
                let run = crate::wallet::telling_when_queued(queued, router.clone().oneshot(request));
                let queued = async {
                    if told.await.is_ok() {
                        // Before its answer: the stage moves on to Answered only once `run` is done.
                        stages[at].send_replace(Stage::Queued);
                    }
                    std::future::pending().await
                };
                let ran = tokio::select! {
                    ran = timeout_at(deadline, run.instrument(span)) => ran,
                    never = queued => never,
                };
                match ran {
                    Ok(Ok(response)) => answer(response).await,
                    Ok(Err(never)) => match never {},
                    // Still running: what a single request past REQUEST_TIMEOUT is answered (the
                    // movement runs on to its end; its key tells its outcome).
                    Err(_) => answer(item_error(ApiError::Timeout(ctx.request_timeout))).await,
                }
            }
            .await;
            stages[at].send_replace(Stage::Answered);
            metrics::counter!(BATCH_ITEMS.name, "op" => item.op.as_str(), "status" => answer.status.to_string())
                .increment(1);
            answer
        }
    });
    let answers = futures::future::join_all(runs).await;
    drop(extra);
    answers
}

/// The answer to an item that did not start by the batch's deadline (`overloaded`): nothing was
/// applied.
fn shed(overloaded: &ItemAnswer) -> ItemAnswer {
    metrics::counter!(REQUESTS_SHED.name, "reason" => "in_flight").increment(1);
    ItemAnswer { body: overloaded.body.clone(), ..*overloaded }
}

/// An item's error response, rendered outside the batch's span: rendering records the outcome on
/// the current span, and the batch's own is its answer's, not each item's (recorded once an item,
/// the batch's log line grew by a field for each).
fn item_error(err: ApiError) -> Response {
    tracing::Span::none().in_scope(|| err.into_response())
}

/// The item's request, as a client would send it to its single route.
fn synthesize(item: &Item, authorization: Option<&HeaderValue>) -> Request {
    let mut request = Request::new(item.body.clone().map_or_else(Body::empty, Body::from));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = item.path.parse().expect("an item's path is made of encoded segments");
    let headers = request.headers_mut();
    if let Some(authorization) = authorization {
        headers.insert(header::AUTHORIZATION, authorization.clone());
    }
    headers.insert("idempotency-key", item.key.clone());
    if item.body.is_some() {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    request
}

/// An item's route's response, as the batch lists it.
async fn answer(response: Response) -> ItemAnswer {
    let status = response.status().as_u16();
    let headers = response.headers();
    let replayed = headers.get("idempotent-replayed").is_some_and(|value| value == "true").then_some(true);
    let retry_after =
        headers.get(header::RETRY_AFTER).and_then(|value| value.to_str().ok()).and_then(|v| v.parse().ok());
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap_or_default();
    // Every route answers JSON; anything else would be listed as a string.
    let body = String::from_utf8(bytes.to_vec())
        .ok()
        .and_then(|text| RawValue::from_string(text).ok())
        .unwrap_or_else(|| {
            let text = serde_json::to_string(&String::from_utf8_lossy(&bytes)).expect("a string serializes");
            RawValue::from_string(text).expect("a JSON string is JSON")
        });
    ItemAnswer { status, body, replayed, retry_after }
}

/// A JSON value that refuses an object with a field twice, at any depth (as the single routes'
/// bodies do, through their types), which `serde_json::Value` would take as its last.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut values = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_ITEMS));
        while let Some(Strict(value)) = seq.next_element()? {
            values.push(value);
        }
        Ok(Value::Array(values))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(value: Value) -> Result<Item, String> {
        parse_item(value)
    }

    #[test]
    fn items_become_their_single_routes_requests() {
        let pay = item(serde_json::json!({"op": "pay", "wallet_id": "alice", "amount": 5,
                                          "reference": "r", "idempotency_key": "k1"}))
        .unwrap();
        assert_eq!(pay.path, "/wallets/alice/pay");
        assert_eq!(pay.body.as_deref(), Some(&br#"{"amount":5,"reference":"r"}"#[..]));
        assert_eq!(pay.touches, Touches::Wallets(vec!["alice".into()]));
        let id = "9a1f4bd2-6c11-4a52-9d6e-0b0d3a9f2e11";
        let void =
            item(serde_json::json!({"op": "void", "movement_id": id, "idempotency_key": "k"})).unwrap();
        assert_eq!((void.path.as_str(), void.body.is_none()), (&*format!("/movements/{id}/void"), true));
        let capture =
            item(serde_json::json!({"op": "capture", "hold_id": id, "idempotency_key": "k"})).unwrap();
        assert_eq!(
            capture.body.as_deref(),
            Some(&b"{}"[..]),
            "POST /holds/{{id}}/capture reads a body always"
        );
        let bad = item(
            serde_json::json!({"op": "pay", "wallet_id": "a/../b", "amount": 1, "idempotency_key": "k"}),
        );
        assert_eq!(bad.unwrap().path, "/wallets/a%2F%2E%2E%2Fb/pay", "a malformed id stays one segment");
    }

    #[test]
    fn what_cannot_be_read_is_refused() {
        for (bad, why) in [
            (serde_json::json!({"op": "pay", "wallet_id": "a", "amount": 1}), "missing"),
            (
                serde_json::json!({"op": "send", "wallet_id": "a", "amount": 1, "idempotency_key": "k"}),
                "unknown",
            ),
            (
                serde_json::json!({"op": "pay", "wallet_id": "a", "amount": "1", "idempotency_key": "k"}),
                "invalid",
            ),
            (
                serde_json::json!({"op": "pay", "wallet_id": "a", "amount": 1, "to": "b", "idempotency_key": "k"}),
                "unknown",
            ),
            (serde_json::json!({"op": "pay", "amount": 1, "idempotency_key": "k"}), "missing"),
            (
                serde_json::json!({"op": "void", "hold_id": "x", "amount": 1, "idempotency_key": "k"}),
                "unknown",
            ),
            (
                serde_json::json!({"op": "refund", "transfer_id": "x", "movement_id": "y", "idempotency_key": "k"}),
                "exactly one",
            ),
            (
                serde_json::json!({"op": "pay", "wallet_id": "a", "amount": 1, "idempotency_key": " k"}),
                "no leading",
            ),
        ] {
            let err = item(bad.clone()).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert!(parse(br#"{"items": [{"op": "pay", "op": "pay"}]}"#).is_err(), "a field twice");
    }

    #[test]
    fn items_wait_for_earlier_items_on_their_wallets_and_for_unknown_ones() {
        let on = |wallets: &[&str]| Item {
            op: ItemOp::Pay,
            key: HeaderValue::from_static("k"),
            path: String::new(),
            body: None,
            touches: Touches::Wallets(wallets.iter().map(|w| w.to_string()).collect()),
        };
        let unknown = Item { touches: Touches::Unknown, ..on(&[]) };
        let items =
            [on(&["a"]), on(&["b"]), on(&["a", "c"]), on(&["d", "d"]), unknown, on(&["e"]), on(&["a"])];
        let waits: Vec<Vec<usize>> = dependencies(&items)
            .into_iter()
            .map(|deps| deps.into_iter().map(|(at, _)| at).collect())
            .collect();
        assert_eq!(waits, vec![vec![], vec![], vec![0], vec![], vec![1, 2, 3], vec![4], vec![4]]);
    }

    #[test]
    fn a_payment_after_one_of_its_wallet_waits_until_that_one_is_queued_and_others_until_answered() {
        let item = |op: ItemOp, wallets: &[&str]| Item {
            op,
            key: HeaderValue::from_static("k"),
            path: String::new(),
            body: None,
            touches: Touches::Wallets(wallets.iter().map(|w| w.to_string()).collect()),
        };
        let items = [
            item(ItemOp::Pay, &["a"]),
            item(ItemOp::Deposit, &["a"]),
            item(ItemOp::Hold, &["a"]),
            item(ItemOp::Pay, &["a"]),
            item(ItemOp::Transfer, &["a", "b"]),
            item(ItemOp::Pay, &["b"]),
        ];
        let waits = dependencies(&items);
        let expected = [
            vec![],
            vec![(0, Stage::Queued)],
            vec![(1, Stage::Answered)],
            vec![(2, Stage::Answered)],
            vec![(3, Stage::Answered)],
            vec![(4, Stage::Answered)],
        ];
        assert_eq!(waits, expected);
    }
}
