//! The SQL behind idempotency keys (see [`crate::idempotency`] for what they mean).

use super::StoreError;
use sqlx::PgConnection;
use std::time::Duration;
use uuid::Uuid;

/// How long keys live and when an in-flight one counts as abandoned.
#[derive(Debug, Clone, Copy)]
pub struct KeySettings {
    /// How long a stored response is replayed before the key is purged.
    pub retention: Duration,
    /// How long a claim may stay in flight before a retry may take the key over.
    pub stale_after: Duration,
}

impl Default for KeySettings {
    /// A day of retention; a claim stale after 10 s (the defaults of `walletlock serve`).
    fn default() -> Self {
        Self { retention: Duration::from_secs(24 * 3600), stale_after: Duration::from_secs(10) }
    }
}

/// Where a key lives: the caller who sent it, what it is unique within (a wallet, or wallet
/// creation), and the key itself.
#[derive(Debug, Clone, Copy)]
pub struct KeyRef<'a> {
    /// The wallet the key is stored with (`wallet_id`): the wallet of a `wallet:<id>` scope, or
    /// empty for a key whose request is not scoped to one wallet (migration 0010).
    pub wallet: &'a str,
    pub caller: &'a str,
    pub scope: &'a str,
    pub key: &'a str,
}

/// The response a key's row holds once its request is done: the HTTP status, content type and
/// body, as [`complete`] stored them (what they mean is `crate::idempotency`'s `StoredResponse`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseRow {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl ResponseRow {
    /// The response of a row's nullable columns: `None` while the key's request is in flight.
    pub(crate) fn of_columns(
        status: Option<i16>,
        content_type: Option<String>,
        body: Option<Vec<u8>>,
    ) -> Option<Self> {
        match (status, content_type, body) {
            (Some(status), Some(content_type), Some(body)) => {
                Some(ResponseRow { status: status as u16, content_type, body })
            }
            _ => None,
        }
    }
}

/// A key as stored.
#[derive(Debug)]
pub struct KeyRow {
    pub fingerprint: Vec<u8>,
    /// The in-flight request's token; `None` once a response is stored.
    pub claim: Option<Uuid>,
    pub response: Option<ResponseRow>,
    /// Past its retention: it behaves as a new key.
    pub expired: bool,
    /// In flight for longer than any live request can be: its replica died.
    pub stale: bool,
}

/// Claims a new key for the request holding `claim`. False if the key already exists.
pub async fn insert_claim(
    conn: &mut PgConnection,
    at: KeyRef<'_>,
    fingerprint: &[u8],
    claim: Uuid,
    retention: Duration,
) -> Result<bool, StoreError> {
    let inserted = sqlx::query_scalar!(
        // language=PostgreSQL
        r#"insert into idempotency_key (wallet_id, caller, scope, key, fingerprint, claim, expires_at)
           values ($7, $6, $1, $2, $3, $4, now() + make_interval(secs => $5))
           on conflict (wallet_id, caller, scope, key) do nothing
           returning true as "inserted!""#,
        at.scope,
        at.key,
        fingerprint,
        claim,
        retention.as_secs_f64(),
        at.caller,
        at.wallet,
    )
    .fetch_optional(conn)
    .await?;
    Ok(inserted.is_some())
}

pub async fn find(
    conn: &mut PgConnection,
    at: KeyRef<'_>,
    stale_after: Duration,
) -> Result<Option<KeyRow>, StoreError> {
    let row = sqlx::query!(
        // language=PostgreSQL
        r#"select fingerprint, claim, status, content_type, body,
                  expires_at < now() as "expired!",
                  claimed_at < now() - make_interval(secs => $3) as "stale!"
           from idempotency_key where wallet_id = $5 and scope = $1 and key = $2 and caller = $4"#,
        at.scope,
        at.key,
        stale_after.as_secs_f64(),
        at.caller,
        at.wallet,
    )
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|row| KeyRow {
        fingerprint: row.fingerprint,
        claim: row.claim,
        response: ResponseRow::of_columns(row.status, row.content_type, row.body),
        expired: row.expired,
        stale: row.stale,
    }))
}

/// Replaces an expired key, or a claim left stale by a replica that died, with a fresh claim.
/// Only if the row is still as the caller saw it (`seen_claim`), so two requests cannot both take
/// it over. True if taken.
pub async fn take_over(
    conn: &mut PgConnection,
    at: KeyRef<'_>,
    fingerprint: &[u8],
    claim: Uuid,
    seen_claim: Option<Uuid>,
    settings: KeySettings,
) -> Result<bool, StoreError> {
    let taken = sqlx::query_scalar!(
        // language=PostgreSQL
        r#"update idempotency_key
           set fingerprint = $3, claim = $4, claimed_at = now(), status = null, content_type = null,
               body = null, entry_id = null, created_at = now(),
               expires_at = now() + make_interval(secs => $6)
           where wallet_id = $9 and scope = $1 and key = $2 and caller = $8
             and (expires_at < now()
                  or (claim = $5 and claimed_at < now() - make_interval(secs => $7)))
           returning true as "taken!""#,
        at.scope,
        at.key,
        fingerprint,
        claim,
        seen_claim,
        settings.retention.as_secs_f64(),
        settings.stale_after.as_secs_f64(),
        at.caller,
        at.wallet,
    )
    .fetch_optional(conn)
    .await?;
    Ok(taken.is_some())
}

/// Stores the response of the request holding the claim (its `status`, `content_type` and
/// `body`), in the caller's transaction (the one that made what the response tells). False if the claim is no longer that request's: another
/// took it over, and the caller must roll back.
///
/// One key by its whole primary key, so every plan is one index probe. (A batched form, joined
/// to `unnest` and filtered by `wallet_id = any(...)` for Citus, was given a generic plan that
/// merge-joined every key of the wallet: every creation's key has the wallet `''`, and after
/// 134,000 creations a completion read them all, 267 ms on average, until the pool ran dry.)
pub async fn complete(
    tx: &mut PgConnection,
    at: KeyRef<'_>,
    claim: Uuid,
    status: u16,
    content_type: &str,
    body: &[u8],
    entry_id: Option<Uuid>,
) -> Result<bool, StoreError> {
    let done = sqlx::query!(
        // language=PostgreSQL
        r#"update idempotency_key
           set claim = null, status = $6, content_type = $7, body = $8, entry_id = $9
           where wallet_id = $1 and caller = $2 and scope = $3 and key = $4 and claim = $5"#,
        at.wallet,
        at.caller,
        at.scope,
        at.key,
        claim,
        status as i16,
        content_type,
        body,
        entry_id,
    )
    .execute(tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives up a claim whose request failed in a way worth retrying, so the retry runs.
pub async fn abandon(conn: &mut PgConnection, at: KeyRef<'_>, claim: Uuid) -> Result<(), StoreError> {
    sqlx::query!(
        // language=PostgreSQL
        r#"delete from idempotency_key
           where wallet_id = $5 and caller = $1 and scope = $2 and key = $3 and claim = $4"#,
        at.caller,
        at.scope,
        at.key,
        claim,
        at.wallet,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Deletes up to `batch` keys past their retention; returns how many. By key, not by `ctid`, and
/// without row locks, so a distributed table (Citus) runs it too: the keys found are deleted on
/// their shards.
pub async fn purge_expired(conn: &mut PgConnection, batch: i64) -> Result<u64, StoreError> {
    let purged = sqlx::query!(
        // language=PostgreSQL
        r#"delete from idempotency_key k
           using (select wallet_id, caller, scope, key from idempotency_key
                  where expires_at < now() limit $1) as old
           where k.wallet_id = old.wallet_id and k.caller = old.caller and k.scope = old.scope
             and k.key = old.key and k.expires_at < now()"#,
        batch,
    )
    .execute(conn)
    .await?;
    Ok(purged.rows_affected())
}
