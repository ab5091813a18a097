//! Webhook endpoints as stored, their place in the feed, the wallets waiting behind a failed
//! delivery, and the attempts (migration 0022). The dispatching itself is `crate::wallet`'s.

use super::StoreError;
use crate::domain::{EventCursor, EventType};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

/// An endpoint as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub id: Uuid,
    pub owner: String,
    pub url: String,
    /// Of these types only (every type, when empty).
    pub types: Vec<EventType>,
    /// Of these wallets only (every one of the owner's, when empty).
    pub wallet_ids: Vec<String>,
    pub secret: String,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    /// Every event up to here is delivered, or waits behind its wallet's failed one.
    pub after: EventCursor,
    /// The highest dispatcher lease that moved `after`.
    pub fence: i64,
    /// Since when it answers no delivery, if it does not.
    pub failing: Option<Failing>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for Endpoint {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        let types: Vec<String> = row.try_get("types")?;
        let types = types
            .iter()
            .map(|name| {
                EventType::parse(name)
                    .ok_or_else(|| sqlx::Error::Decode(format!("event type {name:?}").into()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Endpoint {
            id: row.try_get("id")?,
            owner: row.try_get("owner")?,
            url: row.try_get("url")?,
            types,
            wallet_ids: row.try_get("wallet_ids")?,
            secret: row.try_get("secret")?,
            enabled: row.try_get("enabled")?,
            disabled_reason: row.try_get("disabled_reason")?,
            after: EventCursor {
                position: row.try_get("after_position")?,
                wallet_id: row.try_get("after_wallet")?,
                seq: row.try_get("after_seq")?,
            },
            fence: row.try_get("fence")?,
            failing: match (row.try_get("failing_since")?, row.try_get("probe_at")?) {
                (Some(since), Some(probe_at)) => {
                    Some(Failing { since, probes: row.try_get("probes")?, probe_at })
                }
                _ => None,
            },
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
        })
    }
}

/// An endpoint that answers no delivery (migration 0023): since when, how many probes failed
/// since, and when the next one goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failing {
    pub since: DateTime<Utc>,
    pub probes: i32,
    pub probe_at: DateTime<Utc>,
}

/// What a pass learnt of whether its endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// It answers none (still, or from now).
    Failing(Failing),
    /// It answered a delivery again: every wallet waiting for it is due at once.
    Recovered,
}

/// What a caller sets of an endpoint.
#[derive(Debug, Clone)]
pub struct EndpointSpec {
    pub url: String,
    pub types: Vec<EventType>,
    pub wallet_ids: Vec<String>,
}

fn type_names(types: &[EventType]) -> Vec<&'static str> {
    types.iter().map(|kind| kind.as_str()).collect()
}

/// Registers an endpoint of `owner` that receives the events written from now on (after
/// `horizon`: see [`super::event`]).
pub async fn create(
    conn: &mut PgConnection,
    owner: &str,
    spec: &EndpointSpec,
    secret: &str,
    horizon: i64,
    enabled: bool,
) -> Result<Endpoint, StoreError> {
    Ok(sqlx::query_as(
        // language=PostgreSQL
        "insert into webhook_endpoint (id, owner, url, types, wallet_ids, secret, after_position, enabled)
         values ($1, $2, $3, $4, $5, $6, $7, $8) returning *",
    )
    .bind(Uuid::now_v7())
    .bind(owner)
    .bind(&spec.url)
    .bind(type_names(&spec.types))
    .bind(&spec.wallet_ids)
    .bind(secret)
    // Every event below the horizon was written before: the first to deliver is at or above it.
    .bind(horizon)
    .bind(enabled)
    .fetch_one(conn)
    .await?)
}

/// The endpoint, if it is `owner`'s (any caller's, without).
pub async fn find(
    conn: &mut PgConnection,
    id: Uuid,
    owner: Option<&str>,
) -> Result<Option<Endpoint>, StoreError> {
    Ok(sqlx::query_as("select * from webhook_endpoint where id = $1 and ($2::text is null or owner = $2)")
        .bind(id)
        .bind(owner)
        .fetch_optional(conn)
        .await?)
}

/// `owner`'s endpoints, oldest first.
pub async fn list(conn: &mut PgConnection, owner: &str) -> Result<Vec<Endpoint>, StoreError> {
    Ok(sqlx::query_as("select * from webhook_endpoint where owner = $1 order by created_at, id")
        .bind(owner)
        .fetch_all(conn)
        .await?)
}

/// The endpoints to deliver to: every enabled one.
pub async fn enabled(conn: &mut PgConnection) -> Result<Vec<Endpoint>, StoreError> {
    Ok(sqlx::query_as("select * from webhook_endpoint where enabled order by id").fetch_all(conn).await?)
}

/// Sets what a caller sets of `owner`'s endpoint, and enables or disables it (a caller's
/// disabling has no reason; enabling clears the one the dispatcher gave, and gives the wallets
/// waiting for it a new retry period, from their next attempt, now).
pub async fn update(
    conn: &mut PgConnection,
    id: Uuid,
    owner: &str,
    spec: &EndpointSpec,
    enabled: bool,
) -> Result<Option<Endpoint>, StoreError> {
    if enabled {
        sqlx::query(
            "update webhook_pending p set first_failed_at = now(), next_attempt_at = now()
             from webhook_endpoint e
             where p.endpoint_id = $1 and e.id = p.endpoint_id and e.owner = $2 and not e.enabled",
        )
        .bind(id)
        .bind(owner)
        .execute(&mut *conn)
        .await?;
    }
    Ok(sqlx::query_as(
        // language=PostgreSQL
        "update webhook_endpoint set url = $3, types = $4, wallet_ids = $5, enabled = $6,
                disabled_reason = case when $6 then null else disabled_reason end,
                failing_since = case when $6 and not enabled then null else failing_since end,
                probe_at = case when $6 and not enabled then null else probe_at end,
                probes = case when $6 and not enabled then 0 else probes end, updated_at = now()
         where id = $1 and owner = $2 returning *",
    )
    .bind(id)
    .bind(owner)
    .bind(&spec.url)
    .bind(type_names(&spec.types))
    .bind(&spec.wallet_ids)
    .bind(enabled)
    .fetch_optional(conn)
    .await?)
}

/// Gives `owner`'s endpoint a new signing secret.
pub async fn rotate(
    conn: &mut PgConnection,
    id: Uuid,
    owner: &str,
    secret: &str,
) -> Result<Option<Endpoint>, StoreError> {
    Ok(sqlx::query_as(
        "update webhook_endpoint set secret = $3, updated_at = now() where id = $1 and owner = $2 returning *",
    )
    .bind(id)
    .bind(owner)
    .bind(secret)
    .fetch_optional(conn)
    .await?)
}

/// Deletes `owner`'s endpoint, with what waits for it and its attempts; whether there was one.
pub async fn delete(conn: &mut PgConnection, id: Uuid, owner: &str) -> Result<bool, StoreError> {
    let deleted = sqlx::query("delete from webhook_endpoint where id = $1 and owner = $2")
        .bind(id)
        .bind(owner)
        .execute(conn)
        .await?;
    Ok(deleted.rows_affected() == 1)
}

/// A wallet waiting behind its event `seq`, which the endpoint did not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub wallet_id: String,
    pub seq: i64,
    pub attempts: i32,
    pub first_failed_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    pub last_error: String,
}

/// The wallets waiting for `endpoint`.
pub async fn pending(conn: &mut PgConnection, endpoint: Uuid) -> Result<Vec<Pending>, StoreError> {
    let rows = sqlx::query("select * from webhook_pending where endpoint_id = $1 order by wallet_id")
        .bind(endpoint)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Pending {
                wallet_id: row.try_get("wallet_id")?,
                seq: row.try_get("seq")?,
                attempts: row.try_get("attempts")?,
                first_failed_at: row.try_get("first_failed_at")?,
                next_attempt_at: row.try_get("next_attempt_at")?,
                last_error: row.try_get("last_error")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// One delivery attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub event_id: String,
    pub attempted_at: DateTime<Utc>,
    /// The HTTP status the endpoint answered; none when it did not (a timeout, a refused
    /// connection).
    pub status: Option<i16>,
    pub latency_ms: i32,
    pub error: Option<String>,
}

/// The latest `limit` attempts of `endpoint`, newest first.
pub async fn attempts(
    conn: &mut PgConnection,
    endpoint: Uuid,
    limit: i64,
) -> Result<Vec<Attempt>, StoreError> {
    let rows = sqlx::query(
        "select * from webhook_attempt where endpoint_id = $1 order by attempted_at desc limit $2",
    )
    .bind(endpoint)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(Attempt {
                event_id: row.try_get("event_id")?,
                attempted_at: row.try_get("attempted_at")?,
                status: row.try_get("status")?,
                latency_ms: row.try_get("latency_ms")?,
                error: row.try_get("error")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// What a dispatcher's pass did, to be written at once: where the endpoint is now, the wallets
/// that now wait (or wait on, with one more attempt), those that caught up, and the attempts.
#[derive(Debug, Default)]
pub struct PassWrite {
    pub after: Option<EventCursor>,
    pub pending: Vec<Pending>,
    pub caught_up: Vec<String>,
    pub attempts: Vec<Attempt>,
    /// Why the endpoint is disabled now (it kept failing past the retry period).
    pub disable: Option<String>,
    pub health: Option<Health>,
}

impl PassWrite {
    /// Whether the pass moved nothing and learnt nothing (no event, no attempt): then it needs no
    /// write.
    pub fn is_empty(&self) -> bool {
        self.after.is_none()
            && self.pending.is_empty()
            && self.caught_up.is_empty()
            && self.attempts.is_empty()
            && self.disable.is_none()
            && self.health.is_none()
    }
}

/// Writes a pass of the dispatcher holding the endpoint's lease with `fence`, which found it at
/// `was` (its `after`): nothing if another dispatcher moved it since (its fence or its place), and
/// then `Ok(false)`. A fence below the endpoint's is another holder's turn passed: refused too.
pub async fn finish_pass(
    conn: &mut PgConnection,
    endpoint: Uuid,
    fence: i64,
    was: &EventCursor,
    pass: &PassWrite,
) -> Result<bool, StoreError> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    let after = pass.after.as_ref().unwrap_or(was);
    let failing = match pass.health {
        Some(Health::Failing(failing)) => Some(failing),
        _ => None,
    };
    let moved = sqlx::query(
        // language=PostgreSQL
        "update webhook_endpoint
         set after_position = $5, after_wallet = $6, after_seq = $7, fence = $2,
             enabled = enabled and $8::text is null,
             disabled_reason = coalesce($8, disabled_reason),
             updated_at = case when $8::text is null then updated_at else now() end,
             failing_since = case $10 when 'failing' then $11 when 'recovered' then null else failing_since end,
             probes = case $10 when 'failing' then $12 when 'recovered' then 0 else probes end,
             probe_at = case $10 when 'failing' then $13 when 'recovered' then null else probe_at end
         where id = $1 and fence <= $2 and after_position = $3 and after_wallet = $4 and after_seq = $9",
    )
    .bind(endpoint)
    .bind(fence)
    .bind(was.position)
    .bind(&was.wallet_id)
    .bind(after.position)
    .bind(&after.wallet_id)
    .bind(after.seq)
    .bind(pass.disable.as_deref())
    .bind(was.seq)
    .bind(match pass.health {
        Some(Health::Failing(_)) => Some("failing"),
        Some(Health::Recovered) => Some("recovered"),
        None => None,
    })
    .bind(failing.map(|f| f.since))
    .bind(failing.map_or(0, |f| f.probes))
    .bind(failing.map(|f| f.probe_at))
    .execute(&mut *tx)
    .await?;
    if moved.rows_affected() != 1 {
        return Ok(false);
    }
    if pass.health == Some(Health::Recovered) {
        // Before this pass's own waiting wallets are written, which keep their own times.
        sqlx::query(
            "update webhook_pending set next_attempt_at = now() where endpoint_id = $1 and next_attempt_at > now()",
        )
        .bind(endpoint)
        .execute(&mut *tx)
        .await?;
    }
    if !pass.pending.is_empty() {
        let column = |f: fn(&Pending) -> String| pass.pending.iter().map(f).collect::<Vec<_>>();
        sqlx::query(
            // language=PostgreSQL
            "insert into webhook_pending
                 (endpoint_id, wallet_id, seq, attempts, first_failed_at, next_attempt_at, last_error)
             select $1, p.* from unnest($2::text[], $3::int8[], $4::int4[], $5::timestamptz[],
                                        $6::timestamptz[], $7::text[])
                 as p(wallet_id, seq, attempts, first_failed_at, next_attempt_at, last_error)
             on conflict (endpoint_id, wallet_id) do update
             set seq = excluded.seq, attempts = excluded.attempts, first_failed_at = excluded.first_failed_at,
                 next_attempt_at = excluded.next_attempt_at, last_error = excluded.last_error",
        )
        .bind(endpoint)
        .bind(column(|p| p.wallet_id.clone()))
        .bind(pass.pending.iter().map(|p| p.seq).collect::<Vec<_>>())
        .bind(pass.pending.iter().map(|p| p.attempts).collect::<Vec<_>>())
        .bind(pass.pending.iter().map(|p| p.first_failed_at).collect::<Vec<_>>())
        .bind(pass.pending.iter().map(|p| p.next_attempt_at).collect::<Vec<_>>())
        .bind(column(|p| p.last_error.clone()))
        .execute(&mut *tx)
        .await?;
    }
    if !pass.caught_up.is_empty() {
        sqlx::query("delete from webhook_pending where endpoint_id = $1 and wallet_id = any($2)")
            .bind(endpoint)
            .bind(&pass.caught_up)
            .execute(&mut *tx)
            .await?;
    }
    if !pass.attempts.is_empty() {
        let attempts = &pass.attempts;
        sqlx::query(
            // language=PostgreSQL
            "insert into webhook_attempt (endpoint_id, attempted_at, event_id, status, latency_ms, error)
             select $1, a.* from unnest($2::timestamptz[], $3::text[], $4::int2[], $5::int4[], $6::text[])
                 as a(attempted_at, event_id, status, latency_ms, error)",
        )
        .bind(endpoint)
        .bind(attempts.iter().map(|a| a.attempted_at).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.event_id.clone()).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.status).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.latency_ms).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.error.clone()).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Takes the endpoint's lock for this connection's session, if no other session has it: what keeps
/// dispatchers out of each other's way while Redis is out. Held by no transaction, so it holds back
/// no reader of the feed; it ends with the session, if the replica dies.
pub async fn try_lock_endpoint(conn: &mut PgConnection, id: Uuid) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar("select pg_try_advisory_lock(hashtext('webhook_endpoint'), hashtext($1::text))")
        .bind(id.to_string())
        .fetch_one(conn)
        .await?)
}

pub async fn unlock_endpoint(conn: &mut PgConnection, id: Uuid) -> Result<(), StoreError> {
    sqlx::query("select pg_advisory_unlock(hashtext('webhook_endpoint'), hashtext($1::text))")
        .bind(id.to_string())
        .execute(conn)
        .await?;
    Ok(())
}

/// Deletes the attempts older than `before`; how many.
pub async fn purge_attempts(conn: &mut PgConnection, before: DateTime<Utc>) -> Result<u64, StoreError> {
    let purged =
        sqlx::query("delete from webhook_attempt where attempted_at < $1").bind(before).execute(conn).await?;
    Ok(purged.rows_affected())
}

/// Moves `owner`'s endpoint back to `after`, if that is before where it is (see
/// `crate::wallet::Wallets::replay_endpoint`); the endpoint either way.
pub async fn replay(
    conn: &mut PgConnection,
    id: Uuid,
    owner: &str,
    after: &EventCursor,
) -> Result<Option<Endpoint>, StoreError> {
    Ok(sqlx::query_as(
        // language=PostgreSQL
        "update webhook_endpoint
         set (after_position, after_wallet, after_seq, updated_at) =
             (select case when back then $3 else after_position end,
                     case when back then $4 else after_wallet end,
                     case when back then $5 else after_seq end, now()
              from (select (after_position, after_wallet, after_seq) > ($3::int8, $4::text, $5::int8) as back) b)
         where id = $1 and owner = $2 returning *",
    )
    .bind(id)
    .bind(owner)
    .bind(after.position)
    .bind(&after.wallet_id)
    .bind(after.seq)
    .fetch_optional(conn)
    .await?)
}
