//! Idempotency keys at the HTTP edge: claim or replay before running, render the outcome the same
//! way whether it is sent now or replayed later (see [`crate::idempotency`]).

use super::ApiContext;
use super::bodies::{
    EntryBody, HoldReceipt, LimitsBody, MonitorsBody, MovementBody, TransferBody, WalletBody,
};
use super::error::ApiError;
use crate::domain::{Access, Movement, WalletId};
use crate::idempotency::{self, Begin, Claim, IdempotencyKey, Keyed, Prior, Scope, StoredResponse};
use crate::telemetry::metrics::{IDEMPOTENCY_CONFLICTS, IDEMPOTENT_REPLAYS};
use crate::wallet::{
    AlreadyExists, Entry, LegRefusal, Moved, MovementOutcome, MovementRecord, MovementRecordOutcome,
    OpenOutcome, RefundOutcome, Refusal, Transfer, TransferOutcome, WalletError,
};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// What identifies a request for its idempotency key: the key itself (if sent), and what "the
/// same request" compares.
#[derive(Debug)]
pub struct KeyedRequest<'a> {
    pub key: Option<IdempotencyKey>,
    pub path: &'a str,
    pub body: &'a [u8],
}

/// For a POST with a key: claims it (`Ok(Some(claim))`), or answers at once with the stored
/// response or a conflict (`Err(response)`). Without a key: `Ok(None)`.
pub async fn begin(
    ctx: &ApiContext,
    scope: Scope,
    request: KeyedRequest<'_>,
) -> Result<Option<Claim>, Response> {
    let Some(key) = request.key else { return Ok(None) };
    let fingerprint = idempotency::fingerprint("POST", request.path, request.body);
    match ctx.wallets.begin_keyed(scope, key, fingerprint).await {
        Ok(Begin::Proceed(claim)) => Ok(Some(claim)),
        Ok(Begin::Replay(stored)) => Err(prior_response(Prior::Replay(stored))),
        Ok(Begin::Reused) => Err(prior_response(Prior::Reused)),
        Ok(Begin::InFlight) => Err(prior_response(Prior::InFlight)),
        Err(err) => Err(ApiError::Wallet(err).into_response()),
    }
}

/// For a movement with a key: the key, its scope and the request's fingerprint, for the wallet's
/// lease holder to look up and store (see [`crate::idempotency::Keyed`]). Without a key: `None`.
pub fn keyed<T>(
    scope: Scope,
    request: KeyedRequest<'_>,
    render: fn(&T) -> StoredResponse,
) -> Option<Keyed<T>> {
    let key = request.key?;
    let fingerprint = idempotency::fingerprint("POST", request.path, request.body);
    Some(Keyed { scope, key, fingerprint, render })
}

/// The answer to a request whose key was used before.
fn prior_response(prior: Prior) -> Response {
    match prior {
        Prior::Replay(stored) => {
            metrics::counter!(IDEMPOTENT_REPLAYS.name).increment(1);
            tracing::Span::current().record("outcome", "replayed");
            let mut response = stored.into_response();
            response.headers_mut().insert(IDEMPOTENT_REPLAYED.clone(), HeaderValue::from_static("true"));
            response
        }
        Prior::Reused => {
            metrics::counter!(IDEMPOTENCY_CONFLICTS.name, "reason" => "reused").increment(1);
            ApiError::IdempotencyKeyReused.into_response()
        }
        Prior::InFlight => {
            metrics::counter!(IDEMPOTENCY_CONFLICTS.name, "reason" => "in_flight").increment(1);
            ApiError::IdempotencyKeyInFlight.into_response()
        }
    }
}

fn json(status: StatusCode, value: &impl Serialize) -> StoredResponse {
    StoredResponse {
        status: status.as_u16(),
        content_type: "application/json".to_owned(),
        body: serde_json::to_vec(value).unwrap_or_default(),
    }
}

/// A movement's response: a deposit's or payment's ledger entry, a hold captured (with its `pay`
/// entry) or voided, or the refusal. A hold placed is [`render_created`].
pub fn render_movement(outcome: &MovementOutcome) -> StoredResponse {
    render_moved(StatusCode::OK, outcome)
}

/// A response of what a movement made (a hold placed, a monitor set): `201` and it, or the refusal.
pub fn render_created(outcome: &MovementOutcome) -> StoredResponse {
    render_moved(StatusCode::CREATED, outcome)
}

fn render_moved(status: StatusCode, outcome: &MovementOutcome) -> StoredResponse {
    match outcome {
        Ok(Moved::Entry(entry)) => json(status, &EntryBody::from(entry.clone())),
        Ok(Moved::Hold { hold, entry }) => json(
            status,
            &HoldReceipt { hold: hold.clone().into(), entry: entry.clone().map(EntryBody::from) },
        ),
        Ok(Moved::Released) => json(status, &serde_json::json!({})),
        Ok(Moved::Monitors(monitors)) => json(status, &MonitorsBody { monitors: monitors.list().to_vec() }),
        Ok(Moved::Limits { rules, at }) => json(status, &LimitsBody::of(rules, *at)),
        Err(refusal) => ApiError::Wallet(WalletError::Refused(*refusal)).render(),
    }
}

/// A payment refund's response: its `refund` entry, or the refusal.
pub fn render_entry(outcome: &RefundOutcome) -> StoredResponse {
    match outcome {
        Ok(entry) => json(StatusCode::OK, &EntryBody::from(entry.clone())),
        Err(refusal) => ApiError::Wallet(WalletError::Refused(*refusal)).render(),
    }
}

/// A transfer's (or a refund of one's) response: the transfer, or the refusal.
pub fn render_transfer(outcome: &TransferOutcome) -> StoredResponse {
    match outcome {
        Ok(transfer) => json(StatusCode::OK, &TransferBody::from(transfer.clone())),
        Err(refusal) => ApiError::Wallet(WalletError::Refused(*refusal)).render(),
    }
}

/// A movement of many legs' response: the movement (`201`), or the leg it was refused at.
pub fn render_movement_record(outcome: &MovementRecordOutcome) -> StoredResponse {
    match outcome {
        Ok(movement) => json(StatusCode::CREATED, &MovementBody::from(movement.clone())),
        Err(LegRefusal { leg, refusal }) => {
            ApiError::Wallet(WalletError::LegRefused { leg: *leg, refusal: *refusal }).render()
        }
    }
}

/// The stored response of a held movement's capture or void: the movement (200), or the refusal.
pub fn render_movement_settled(outcome: &MovementRecordOutcome) -> StoredResponse {
    match outcome {
        Ok(movement) => json(StatusCode::OK, &MovementBody::from(movement.clone())),
        Err(_) => render_movement_record(outcome),
    }
}

/// The live response for a movement of many legs (rendered by `render`, [`render_movement_record`]
/// or [`render_movement_settled`]), exactly as a replay of it would be.
pub fn movement_record_response(
    result: Result<MovementRecord, WalletError>,
    render: fn(&MovementRecordOutcome) -> StoredResponse,
) -> Response {
    let outcome: MovementRecordOutcome = match result {
        Ok(movement) => Ok(movement),
        Err(WalletError::LegRefused { leg, refusal }) => Err(LegRefusal { leg, refusal }),
        Err(WalletError::AlreadyRan(prior)) => return prior_response(prior),
        Err(err) => return ApiError::Wallet(err).into_response(),
    };
    if let Err(LegRefusal { refusal, .. }) = &outcome {
        tracing::Span::current().record("outcome", refusal.code());
    }
    render(&outcome).into_response()
}

/// A wallet creation's response: the wallet, or the conflict.
pub fn render_open(outcome: &OpenOutcome) -> StoredResponse {
    match outcome {
        Ok(wallet) => json(StatusCode::CREATED, &WalletBody::from(wallet.clone())),
        Err(AlreadyExists) => ApiError::Wallet(WalletError::Exists).render(),
    }
}

/// Runs a validated movement of wallet `id` in its queue, honouring its idempotency key, and
/// answers it as `render` does (and a replay of it would).
pub async fn apply_movement(
    ctx: &ApiContext,
    access: &Access,
    id: &WalletId,
    movement: Movement,
    keyed: KeyedRequest<'_>,
    render: fn(&MovementOutcome) -> StoredResponse,
) -> Response {
    let key = self::keyed(Scope::wallet(&access.caller, id), keyed, render);
    let result = ctx.wallets.apply(access, id, movement, key).await;
    if let Some(entry) = result.as_ref().ok().and_then(Moved::entry) {
        tracing::Span::current().record("fence", entry.fence);
    }
    movement_response(result, render)
}

/// The live response for a movement, rendered by `render` exactly as a replay of it would be.
pub fn movement_response(
    result: Result<Moved, WalletError>,
    render: fn(&MovementOutcome) -> StoredResponse,
) -> Response {
    outcome_response(result, render)
}

/// The live response for a payment refund, rendered exactly as a replay of it would be.
pub fn entry_response(result: Result<Entry, WalletError>) -> Response {
    outcome_response(result, render_entry)
}

/// The live response for a transfer, rendered exactly as a replay of it would be.
pub fn transfer_response(result: Result<Transfer, WalletError>) -> Response {
    outcome_response(result, render_transfer)
}

/// The live response for an outcome stored under idempotency keys: what `render` stores, or the
/// prior use of the key, or the failure (which is not stored).
fn outcome_response<T>(
    result: Result<T, WalletError>,
    render: fn(&Result<T, Refusal>) -> StoredResponse,
) -> Response {
    let outcome: Result<T, Refusal> = match result {
        Ok(done) => Ok(done),
        Err(WalletError::Refused(refusal)) => Err(refusal),
        Err(WalletError::AlreadyRan(prior)) => return prior_response(prior),
        Err(err) => return ApiError::Wallet(err).into_response(),
    };
    if let Err(refusal) = &outcome {
        tracing::Span::current().record("outcome", refusal.code());
    }
    render(&outcome).into_response()
}
