//! The SQL of movements that need more than one statement's view of the books: transfers between
//! two wallets, and refunds (back into the wallet a payment left, or a transfer undone).
//!
//! Each runs as one transaction of the caller's (see `crate::wallet::transfer`): [`lock_wallets`]
//! locks every wallet it touches in id order (`FOR UPDATE`, bounded by a local `lock_timeout`), so
//! two transactions over the same wallets never deadlock; what it reads is then the truth until
//! commit, and the rounds' one write ([`super::group::commit`]) writes each row conditionally on
//! the state read and its own lease's fence, with the entries and the idempotent response. The
//! transfer row goes in the same transaction, so a transfer is both legs and its record, or
//! nothing.

use super::group::FoundKey;
use super::idempotency::{KeyRef, ResponseRow};
use super::shards::{self, ShardMap};
use super::{Entry, StoreError, entry_columns};
use crate::domain::{EntryKind, Metadata, MovementStatus, Rules};
use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// A wallet row as locked by [`lock_wallets`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockedWallet {
    pub balance: i64,
    /// What its holds not yet settled reserve, expired ones included until released.
    pub held: i64,
    pub version: i64,
    /// The highest fence any holder has written the row with.
    pub fence: i64,
    pub owner: Option<String>,
    pub rules: Rules,
}

/// Locks the rows of `ids` in id order until the transaction ends, waiting at most `lock_timeout`
/// for a row another statement holds (then Postgres answers `55P03`, see
/// [`StoreError::is_lock_timeout`]). Wallets that do not exist are missing from the answer.
///
/// One statement per wallet: under Citus a `FOR UPDATE` must name rows of one shard, and the
/// wallets of a transfer may be on two workers. `SET LOCAL` rather than `set_config`: Citus passes
/// the former on to the workers whose rows the transaction locks (`citus.propagate_set_commands`,
/// see [`super::storage::Storage::prepare_session`]), where the waiting happens.
///
/// With its rows locked here, a later write of several wallets ([`super::group::commit`]) waits for no
/// row lock, so it needs no other guard against deadlock. Citus would add one: by default it
/// lets one statement writing several shards at a time touch a shard (a lock per shard on the
/// coordinator, held to commit), which made every transfer wait for any other whose wallets
/// shared a shard with it, past this `lock_timeout` under load. The transaction turns that off
/// (`citus.enable_deadlock_prevention`; one Postgres keeps it as an unused setting).
pub async fn lock_wallets(
    tx: &mut PgConnection,
    ids: &[&str],
    lock_timeout: Duration,
) -> Result<HashMap<String, LockedWallet>, StoreError> {
    let set = format!(
        "set local lock_timeout = '{}ms'; set local citus.enable_deadlock_prevention = off",
        lock_timeout.as_millis().max(1)
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(set)).execute(&mut *tx).await?;
    let mut ordered = ids.to_vec();
    ordered.sort_unstable();
    ordered.dedup();
    let mut rows = Vec::with_capacity(ordered.len());
    for id in ordered {
        let row = sqlx::query(
            // language=PostgreSQL
            "select id, balance, held, version, fence, owner, rules from wallet where id = $1 for update",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        rows.extend(row);
    }
    locked_rows(&rows)
}

/// Locks the rows of `ids` that no other transaction holds right now, in id order, until the
/// transaction ends, without waiting for any (`SKIP LOCKED`). Missing from the answer: wallets
/// that do not exist, and those another transaction holds.
///
/// Under Citus, with `shards` known, the wallets of each shard are locked by a statement of their
/// own, which Citus routes whole to the shard's node.
pub async fn lock_free_wallets(
    tx: &mut PgConnection,
    shards: Option<&ShardMap>,
    ids: &[&str],
) -> Result<HashMap<String, LockedWallet>, StoreError> {
    let mut locked = HashMap::with_capacity(ids.len());
    for ids in &shards::statements(shards, ids) {
        let rows = sqlx::query(
            // language=PostgreSQL
            "select id, balance, held, version, fence, owner, rules from wallet where id = any($1) order by id
             for update skip locked",
        )
        .bind(ids)
        .fetch_all(&mut *tx)
        .await?;
        locked.extend(locked_rows(&rows)?);
    }
    Ok(locked)
}

fn locked_rows(rows: &[sqlx::postgres::PgRow]) -> Result<HashMap<String, LockedWallet>, StoreError> {
    rows.iter()
        .map(|row| {
            let locked = LockedWallet {
                balance: row.try_get("balance")?,
                held: row.try_get("held")?,
                version: row.try_get("version")?,
                fence: row.try_get("fence")?,
                owner: row.try_get("owner")?,
                rules: row.try_get::<Json<Rules>, _>("rules")?.0,
            };
            Ok((row.try_get("id")?, locked))
        })
        .collect()
}

/// Money from one wallet to another, as stored: the transfer and its two legs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub id: Uuid,
    pub from: String,
    pub to: String,
    pub amount: i64,
    /// The caller's own note, if any.
    pub reference: Option<String>,
    pub metadata: Metadata,
    /// The transfer this one refunds (it moves money back from that one's `to` to its `from`).
    pub refund_of: Option<Uuid>,
    /// The `transfer_out` entry of `from`.
    pub from_entry: Entry,
    /// The `transfer_in` entry of `to`.
    pub to_entry: Entry,
    pub created_at: DateTime<Utc>,
}

/// A transfer, how much of it has been refunded so far, and the owners of its two wallets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundTransfer {
    pub transfer: Transfer,
    pub refunded: i64,
    pub owners: [Option<String>; 2],
}

/// The transfer `id`, with its legs and what its refunds add up to.
pub async fn find_transfer(conn: &mut PgConnection, id: Uuid) -> Result<Option<FoundTransfer>, StoreError> {
    // Statements of their own, not subqueries of one: the transfer, its refunds and its two
    // wallets may each be on another Citus worker, and Citus runs no correlated subquery across
    // workers.
    let Some(row) = sqlx::query(
        // language=PostgreSQL
        r#"select id, from_wallet, to_wallet, amount, reference, refund_of, created_at, metadata
           from transfer where id = $1"#,
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let refunded = refunded_of_transfer(conn, id).await?;
    let (from, to): (String, String) = (row.try_get("from_wallet")?, row.try_get("to_wallet")?);
    let owned: HashMap<String, Option<String>> =
        sqlx::query_as("select id, owner from wallet where id = any($1)")
            .bind([from.as_str(), to.as_str()])
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect();
    let owner = |wallet: &str| owned.get(wallet).cloned().flatten();
    let legs: Vec<Entry> = sqlx::query_as(concat!(
        // language=PostgreSQL
        "select ",
        entry_columns!(),
        " from ledger_entry where transfer_id = $1"
    ))
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    let leg = |kind: EntryKind| {
        legs.iter().find(|e| e.kind == kind).cloned().ok_or_else(|| {
            StoreError::Database(sqlx::Error::Decode(
                format!("transfer {id} has no {} leg", kind.as_str()).into(),
            ))
        })
    };
    let transfer = Transfer {
        id: row.try_get("id")?,
        from: from.clone(),
        to: to.clone(),
        amount: row.try_get("amount")?,
        reference: row.try_get("reference")?,
        metadata: super::stored_metadata(&row, "metadata")?,
        refund_of: row.try_get("refund_of")?,
        from_entry: leg(EntryKind::TransferOut)?,
        to_entry: leg(EntryKind::TransferIn)?,
        created_at: row.try_get("created_at")?,
    };
    let owners = [owner(&from), owner(&to)];
    Ok(Some(FoundTransfer { transfer, refunded, owners }))
}

/// What the refunds of transfer `id` add up to. Call with both of its wallets locked: every refund
/// of it locks them too, so the sum cannot change until this transaction ends.
pub async fn refunded_of_transfer(tx: &mut PgConnection, id: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        // language=PostgreSQL
        "select coalesce(sum(amount), 0)::int8 from transfer where refund_of = $1",
    )
    .bind(id)
    .fetch_one(tx)
    .await?)
}

/// The `pay` entry `id` of wallet `wallet`. A payment never changes, so it may be read before
/// the wallet's lease is taken; what its refunds add up to is read under it
/// ([`refunded_of_payment`]).
pub async fn find_payment(
    conn: &mut PgConnection,
    wallet: &str,
    id: Uuid,
) -> Result<Option<Entry>, StoreError> {
    Ok(sqlx::query_as::<_, Entry>(concat!(
        // language=PostgreSQL
        "select ",
        entry_columns!(),
        " from ledger_entry where id = $1 and wallet_id = $2 and kind = 'pay'"
    ))
    .bind(id)
    .bind(wallet)
    .fetch_optional(conn)
    .await?)
}

/// What the refunds of payment `id` of wallet `wallet` add up to. Call with the wallet locked (or
/// under its lease, the write fenced): every refund of the payment locks it too, so the sum cannot
/// change until this transaction ends.
pub async fn refunded_of_payment(tx: &mut PgConnection, wallet: &str, id: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        // language=PostgreSQL
        "select coalesce(sum(amount), 0)::int8 from ledger_entry where wallet_id = $1 and refund_of = $2",
    )
    .bind(wallet)
    .bind(id)
    .fetch_one(tx)
    .await?)
}

/// What the refunds of movement `id` gave back, by wallet. Call with its wallets locked, as for
/// [`refunded_of_transfer`]. Two statements: the refunds live with their first legs' wallets, and
/// their legs with each of theirs (a join of the two would cross Citus workers).
pub async fn refunded_of_movement(
    tx: &mut PgConnection,
    id: Uuid,
) -> Result<HashMap<String, i64>, StoreError> {
    let refunds: Vec<Uuid> = sqlx::query_scalar(
        // language=PostgreSQL
        "select id from movement where refund_of = $1",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await?;
    if refunds.is_empty() {
        return Ok(HashMap::new());
    }
    Ok(sqlx::query_as(
        // language=PostgreSQL
        "select wallet_id, sum(amount)::int8 from ledger_entry where transfer_id = any($1) group by wallet_id",
    )
    .bind(&refunds)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect())
}

/// The key at `at`, if stored and within its retention (one past it is deleted: it behaves as new).
pub async fn find_key(tx: &mut PgConnection, at: KeyRef<'_>) -> Result<Option<FoundKey>, StoreError> {
    let row = sqlx::query(
        // language=PostgreSQL
        r#"with expired as (
               delete from idempotency_key
               where wallet_id = $4 and caller = $1 and scope = $2 and key = $3 and expires_at < now()
           )
           select fingerprint, status, content_type, body from idempotency_key
           where wallet_id = $4 and caller = $1 and scope = $2 and key = $3 and expires_at >= now()"#,
    )
    .bind(at.caller)
    .bind(at.scope)
    .bind(at.key)
    .bind(at.wallet)
    .fetch_optional(tx)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let response =
        ResponseRow::of_columns(row.try_get("status")?, row.try_get("content_type")?, row.try_get("body")?);
    Ok(Some(FoundKey { fingerprint: row.try_get("fingerprint")?, response }))
}

impl StoreError {
    /// A row stayed locked by another statement for the whole `lock_timeout` (`55P03`).
    pub fn is_lock_timeout(&self) -> bool {
        matches!(self, StoreError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
    }
}

/// Money between 2 to 16 wallets at once, as stored: the movement and its legs, in the order the
/// request listed them (migration 0014); for one placed as a hold, what it reserves (0016).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovementRecord {
    pub id: Uuid,
    /// The caller's own note, if any.
    pub reference: Option<String>,
    pub metadata: Metadata,
    pub status: MovementStatus,
    /// One entry a leg: a `transfer_out` of each wallet it takes from, a `transfer_in` of each it
    /// pays into, each with the wallet's balance after it. Empty while a held movement is not
    /// captured.
    pub legs: Vec<Entry>,
    /// For a movement placed as a hold: its legs as asked and the hold of each debit.
    pub hold: Option<MovementHold>,
    /// The movement this one refunds (every leg of that one back, in part or whole).
    pub refund_of: Option<Uuid>,
    pub created_at: DateTime<Utc>,
}

impl MovementRecord {
    /// The wallet the movement lives with: its first leg's.
    pub fn first_wallet(&self) -> &str {
        match &self.hold {
            Some(hold) => hold.legs.first().map(|leg| leg.wallet_id.as_str()),
            None => self.legs.first().map(|leg| leg.wallet_id.as_str()),
        }
        .unwrap_or_default()
    }
}

/// What a held movement reserves, and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovementHold {
    pub expires_at: DateTime<Utc>,
    /// Every leg as asked, in order.
    pub legs: Vec<HeldLeg>,
}

/// One leg of a held movement: its wallet, its amount (negative out of the wallet), and for a
/// debit the hold that reserves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLeg {
    pub wallet_id: String,
    pub amount: i64,
    pub hold_id: Option<Uuid>,
}

/// A movement, and the owners of its wallets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundMovement {
    pub movement: MovementRecord,
    pub owners: Vec<Option<String>>,
}

/// The movement `id`, with its legs in the order it was made, as it stands at `now`.
pub async fn find_movement(
    conn: &mut PgConnection,
    id: Uuid,
    now: DateTime<Utc>,
) -> Result<Option<FoundMovement>, StoreError> {
    // Statements of their own, as for a transfer (see `find_transfer`): its legs and wallets may
    // be on several Citus workers.
    let Some(row) = sqlx::query(
        // language=PostgreSQL
        r#"select id, reference, created_at, expires_at, leg_wallets, leg_amounts, refund_of, metadata
           from movement where id = $1"#,
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let legs: Vec<Entry> = sqlx::query_as(concat!(
        // language=PostgreSQL
        "select ",
        entry_columns!(),
        " from ledger_entry where transfer_id = $1 order by id"
    ))
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    let expires_at: Option<DateTime<Utc>> = row.try_get("expires_at")?;
    let (hold, status) = match expires_at {
        None => (None, MovementStatus::Posted),
        Some(expires_at) => {
            let wallets: Vec<String> = row.try_get("leg_wallets")?;
            let amounts: Vec<i64> = row.try_get("leg_amounts")?;
            let holds: Vec<(Uuid, String, crate::domain::HoldStatus)> = sqlx::query_as(
                // language=PostgreSQL
                "select id, wallet_id, status from hold where movement_id = $1 and wallet_id = any($2)",
            )
            .bind(id)
            .bind(&wallets)
            .fetch_all(&mut *conn)
            .await?;
            let status = held_status(holds.iter().map(|(_, _, status)| *status), expires_at, now);
            let legs = wallets
                .into_iter()
                .zip(amounts)
                .map(|(wallet_id, amount)| {
                    let hold_id = holds.iter().find(|(_, w, _)| *w == wallet_id).map(|(id, _, _)| *id);
                    HeldLeg { wallet_id, amount, hold_id }
                })
                .collect();
            (Some(MovementHold { expires_at, legs }), status)
        }
    };
    let mut wallets: Vec<&str> = legs.iter().map(|leg| leg.wallet_id.as_str()).collect();
    if let Some(hold) = &hold {
        wallets = hold.legs.iter().map(|leg| leg.wallet_id.as_str()).collect();
    }
    let owners: Vec<Option<String>> = sqlx::query_scalar("select owner from wallet where id = any($1)")
        .bind(&wallets)
        .fetch_all(&mut *conn)
        .await?;
    let movement = MovementRecord {
        id: row.try_get("id")?,
        reference: row.try_get("reference")?,
        metadata: super::stored_metadata(&row, "metadata")?,
        status,
        legs,
        hold,
        refund_of: row.try_get("refund_of")?,
        created_at: row.try_get("created_at")?,
    };
    Ok(Some(FoundMovement { movement, owners }))
}

/// Where a held movement stands, from its holds' statuses: they settle together, so one that is
/// settled says how; all still held past `expires_at` count as expired.
pub fn held_status(
    holds: impl IntoIterator<Item = crate::domain::HoldStatus>,
    expires_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> MovementStatus {
    use crate::domain::HoldStatus;
    let settled = holds.into_iter().find(|status| *status != HoldStatus::Held);
    match settled {
        Some(HoldStatus::Captured) => MovementStatus::Captured,
        Some(HoldStatus::Voided) => MovementStatus::Voided,
        Some(HoldStatus::Expired) => MovementStatus::Expired,
        Some(HoldStatus::Held) | None if expires_at <= now => MovementStatus::Expired,
        Some(HoldStatus::Held) | None => MovementStatus::Held,
    }
}
