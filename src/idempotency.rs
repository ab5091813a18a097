//! Idempotency keys: a retried request is charged once.
//!
//! The lease makes two requests for one wallet run one after the other; it does not make a
//! retried payment one payment. A request may carry an `Idempotency-Key` (1 to 255 printable ASCII
//! characters). The first request with a key claims it and runs; its final response is stored in
//! the same Postgres transaction as the balance change, so there is never a charge without its
//! record nor a record without its charge. Later requests with the same key:
//!
//! - and the same request (method, path and body fingerprint): get the stored response again, byte
//!   for byte, and charge nothing;
//! - and a different request: are refused (`Begin::Reused`);
//! - while the first is still in flight: are refused at once (`Begin::InFlight`), never kept
//!   waiting. A claim left by a replica that died is taken over once it is older than any live
//!   request can be (`stale_after`); even if its request was only slow, the takeover is safe,
//!   because a response is stored only by the holder of the current claim, in the transaction that
//!   moves the money, so exactly one of them commits.
//!
//! Only deterministic outcomes are stored (a success, a refusal such as insufficient funds, a
//! wallet that already exists). A transient failure (the lease not obtained or lost, a dependency
//! down) gives the claim up, so a retry can still succeed.
//!
//! Keys are unique per caller (the authenticated API client) and within a scope: the wallet for its
//! movements, wallet creation for new wallets.
//! Stored responses are kept for the retention (24 h by default), then purged; an expired key
//! behaves as new.

use crate::domain::{Field, InvalidInput, WalletId};
use crate::ledger::StoreError;
use crate::ledger::group::FoundKey;
pub use crate::ledger::idempotency::KeySettings;
use crate::ledger::idempotency::{self as store, KeyRef, ResponseRow};
use crate::telemetry::metrics::{IDEMPOTENCY_CONFLICTS, IDEMPOTENT_REPLAYS};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

/// Registers the metrics recorded for idempotency keys at zero.
pub fn register_metrics() {
    metrics::counter!(IDEMPOTENT_REPLAYS.name).absolute(0);
    for reason in ["in_flight", "reused"] {
        metrics::counter!(IDEMPOTENCY_CONFLICTS.name, "reason" => reason).absolute(0);
    }
}

/// The value of an `Idempotency-Key` header: 1 to 255 printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(raw: &[u8]) -> Result<Self, InvalidInput> {
        let printable = raw.iter().all(|b| (0x20..=0x7e).contains(b));
        if (1..=255).contains(&raw.len()) && printable {
            // Printable ASCII is valid UTF-8.
            Ok(Self(String::from_utf8_lossy(raw).into_owned()))
        } else {
            Err(InvalidInput { field: Field::IdempotencyKey, rule: "1 to 255 printable ASCII characters" })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What a key is unique within: the caller who sent it, and the wallet it moves money on (or
/// wallet creation).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    caller: String,
    within: String,
    /// The wallet the key is stored with: the scope's wallet, or empty for a scope of no one
    /// wallet (migration 0010: those keys share one placement).
    wallet: String,
}

impl Scope {
    /// One caller's movements on one wallet.
    pub fn wallet(caller: &str, id: &WalletId) -> Self {
        Self { caller: caller.to_owned(), within: id.scope(), wallet: id.as_str().to_owned() }
    }

    /// One caller's transfers, and refunds of transfers: a transfer runs under two wallets' leases,
    /// so its key is unique across the caller's transfers rather than within one wallet.
    pub fn transfers(caller: &str) -> Self {
        Self { caller: caller.to_owned(), within: "transfers".to_owned(), wallet: String::new() }
    }

    /// One caller's wallet creations.
    pub fn wallet_creation(caller: &str) -> Self {
        Self { caller: caller.to_owned(), within: "wallets".to_owned(), wallet: String::new() }
    }

    pub fn at<'a>(&'a self, key: &'a IdempotencyKey) -> KeyRef<'a> {
        KeyRef { wallet: &self.wallet, caller: &self.caller, scope: &self.within, key: key.as_str() }
    }
}

/// SHA-256 over the method, the path and the body: what "the same request" means. A JSON body
/// counts by what it says, not how it is written: it is hashed in a canonical form (object keys
/// sorted, no white space), so a retry whose client rebuilt the body with other key order or
/// spacing is the same request. A body that is not JSON is hashed as it is.
pub fn fingerprint(method: &str, path: &str, body: &[u8]) -> [u8; 32] {
    let canonical =
        serde_json::from_slice::<serde_json::Value>(body).ok().map(|value| canonical_json(&value));
    let mut hash = Sha256::new();
    for part in [method.as_bytes(), b"\n", path.as_bytes(), b"\n", canonical.as_deref().unwrap_or(body)] {
        hash.update(part);
    }
    hash.finalize().into()
}

/// `value` as JSON with every object's keys sorted and no white space.
fn canonical_json(value: &serde_json::Value) -> Vec<u8> {
    fn sorted(value: &serde_json::Value) -> serde_json::Value {
        match value {
            serde_json::Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k.clone(), sorted(v))).collect())
            }
            serde_json::Value::Array(items) => serde_json::Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    serde_json::to_vec(&sorted(value)).unwrap_or_default()
}

/// A response as the HTTP layer rendered and sent it, to be sent again, byte for byte, on a retry
/// with its key. The store keeps its parts in the key's row ([`ResponseRow`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl From<ResponseRow> for StoredResponse {
    fn from(ResponseRow { status, content_type, body }: ResponseRow) -> Self {
        StoredResponse { status, content_type, body }
    }
}

/// A claim on a key, held by the one request that runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub scope: Scope,
    pub key: IdempotencyKey,
    pub token: Uuid,
}

impl Claim {
    fn at(&self) -> KeyRef<'_> {
        self.scope.at(&self.key)
    }
}

/// What a request with a key should do.
#[derive(Debug)]
pub enum Begin {
    /// The key is ours: run, then store the response with [`Receipt`].
    Proceed(Claim),
    /// The same request already ran: send this again.
    Replay(StoredResponse),
    /// The key was used for a different request.
    Reused,
    /// The first request with this key is still running.
    InFlight,
}

/// The idempotency keys of requests that store their outcome after they ran (wallet creation):
/// claimed ahead, given up after a transient failure, purged past their retention. (Movements'
/// keys are looked up and stored by their lease holder, in the transaction that moves the money:
/// [`Keyed`].)
#[derive(Debug, Clone)]
pub struct Keys {
    db: PgPool,
    settings: KeySettings,
}

impl Keys {
    pub fn new(db: PgPool, settings: KeySettings) -> Self {
        Self { db, settings }
    }

    pub fn settings(&self) -> KeySettings {
        self.settings
    }

    /// Claims `key` in `scope` for a request with `fingerprint`, or says why not.
    pub async fn begin(
        &self,
        scope: Scope,
        key: IdempotencyKey,
        fingerprint: [u8; 32],
    ) -> Result<Begin, StoreError> {
        begin(&self.db, self.settings, scope, key, fingerprint).await
    }

    /// Gives the claim up after a transient failure, so a retry runs. A failure to do so is only
    /// logged: the claim then counts as abandoned after `stale_after`.
    pub async fn abandon(&self, claim: &Claim) {
        let outcome = async {
            let mut conn = crate::ledger::acquire(&self.db).await?;
            store::abandon(&mut conn, claim.at(), claim.token).await
        };
        if let Err(err) = outcome.await {
            tracing::warn!(error = %err, scope = claim.at().scope, "could not release an idempotency key; it frees itself when stale");
        }
    }

    /// Deletes keys past their retention, in batches, until none is left; how many.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        const BATCH: i64 = 1_000;
        let mut conn = self.db.acquire().await?;
        let mut total = 0;
        loop {
            let purged = store::purge_expired(&mut conn, BATCH).await?;
            total += purged;
            if purged < BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

async fn begin(
    db: &PgPool,
    settings: KeySettings,
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: [u8; 32],
) -> Result<Begin, StoreError> {
    // Every keyed request that claims its key first (an opening, a capture, a void, a refund).
    let mut conn = crate::ledger::acquire(db).await?;
    let claim = Claim { scope, key, token: Uuid::new_v4() };
    let at = claim.at();
    // A row can vanish (purged) or change (taken over) between our reads; a few rounds settle it.
    for _ in 0..3 {
        if store::insert_claim(&mut conn, at, &fingerprint, claim.token, settings.retention).await? {
            return Ok(Begin::Proceed(claim));
        }
        let Some(row) = store::find(&mut conn, at, settings.stale_after).await? else {
            continue;
        };
        let replaceable = row.expired || (row.claim.is_some() && row.stale && row.fingerprint == fingerprint);
        if replaceable {
            if store::take_over(&mut conn, at, &fingerprint, claim.token, row.claim, settings).await? {
                if !row.expired {
                    tracing::warn!(scope = at.scope, "took over an idempotency key abandoned in flight");
                }
                return Ok(Begin::Proceed(claim));
            }
            continue;
        }
        return Ok(if row.fingerprint != fingerprint {
            Begin::Reused
        } else {
            match row.response {
                Some(response) => Begin::Replay(response.into()),
                None => Begin::InFlight,
            }
        });
    }
    Ok(Begin::InFlight)
}

/// Handed to the wallet service with a claim: how to render the outcome as the response to store.
/// The same function renders the live response, so a replay is byte for byte what was sent.
#[derive(Debug)]
pub struct Receipt<T> {
    pub claim: Claim,
    pub render: fn(&T) -> StoredResponse,
}

/// A movement's key, carried to the wallet's lease holder, which looks it up, runs the movement
/// only if the key is new, and stores the rendered outcome in the statement that moves the money.
/// The lease makes one wallet's movements take turns, so a duplicate is found there: no claim is
/// written ahead of the movement, and a duplicate of a request still queued waits for it and gets
/// its response (see `crate::wallet`).
#[derive(Debug, Clone)]
pub struct Keyed<T> {
    pub scope: Scope,
    pub key: IdempotencyKey,
    pub fingerprint: [u8; 32],
    pub render: fn(&T) -> StoredResponse,
}

impl<T> Keyed<T> {
    pub fn at(&self) -> KeyRef<'_> {
        self.scope.at(&self.key)
    }
}

/// Why a keyed request did not run: its key had already been used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prior {
    /// The same request ran before: send its response again.
    Replay(StoredResponse),
    /// The key was used for a different request.
    Reused,
    /// A request that claimed the key ahead of running is still in flight.
    InFlight,
}

impl Prior {
    /// What a stored key says about a request with `fingerprint`.
    pub fn of(found: &FoundKey, fingerprint: &[u8]) -> Self {
        match &found.response {
            _ if found.fingerprint != fingerprint => Prior::Reused,
            Some(response) => Prior::Replay(response.clone().into()),
            None => Prior::InFlight,
        }
    }
}

/// Stores the rendered outcome for `claim` in `tx`. False if the claim was taken over (the caller
/// must roll back: the other request will run).
pub async fn complete<T>(
    tx: &mut sqlx::PgConnection,
    receipt: &Receipt<T>,
    outcome: &T,
    entry_id: Option<Uuid>,
) -> Result<bool, StoreError> {
    let StoredResponse { status, content_type, body } = (receipt.render)(outcome);
    store::complete(tx, receipt.claim.at(), receipt.claim.token, status, &content_type, &body, entry_id).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_to_255_printable_ascii_characters() {
        assert!(IdempotencyKey::parse(b"a").is_ok());
        assert!(IdempotencyKey::parse(b"pay 2026-11-30 #7 ~").is_ok());
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
        for bad in
            [&b""[..], &[b'k'; 256], b"tab\there", b"new\nline", b"nul\0", "caf\u{e9}".as_bytes(), b"\x7f"]
        {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_fingerprint_tells_requests_apart() {
        let base = fingerprint("POST", "/wallets/a/pay", br#"{"amount":10}"#);
        assert_eq!(base, fingerprint("POST", "/wallets/a/pay", br#"{"amount":10}"#));
        assert_ne!(base, fingerprint("POST", "/wallets/a/pay", br#"{"amount":11}"#));
        assert_ne!(base, fingerprint("POST", "/wallets/b/pay", br#"{"amount":10}"#));
        assert_ne!(base, fingerprint("POST", "/wallets/a/deposit", br#"{"amount":10}"#));
    }

    #[test]
    fn a_json_body_counts_by_what_it_says_not_how_it_is_written() {
        let base = fingerprint("POST", "/wallets/a/pay", br#"{"amount":10,"reference":"r"}"#);
        assert_eq!(base, fingerprint("POST", "/wallets/a/pay", br#"{ "reference": "r",  "amount": 10 }"#));
        assert_ne!(base, fingerprint("POST", "/wallets/a/pay", br#"{"amount":10,"reference":"s"}"#));
        assert_ne!(base, fingerprint("POST", "/wallets/a/pay", br#"{"amount":10}"#));
    }
}
