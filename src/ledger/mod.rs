//! The fenced ledger store: every SQL statement walletlock runs against Postgres.
//!
//! A wallet row carries a `version` (one more per ledger entry) and a `fence` (the highest fencing
//! token any lease holder has written it with). A lease holder changes a balance in two steps (the
//! rounds of `group` do both in one statement):
//!
//! 1. [`raise_fence`] raises the row's fence to the holder's token and reads the balance and
//!    version, in one statement, and only if the token is higher than the row's fence. From the
//!    moment that commits, every holder with a lower token is refused, even before the new holder
//!    writes.
//! 2. [`commit`] writes the new balance with one conditional `UPDATE ... WHERE fence = $ours AND
//!    version = $read`, in the same transaction as the ledger entries. If another holder raised the
//!    fence or wrote since, it matches no row, nothing is applied, and the caller gets
//!    [`StoreError::LeaseLost`].
//!
//! Where fences come from: the lease layer issues them from a Redis counter, in the same script
//! that takes the lease. Redis can lose that counter (a restart without persistence, `FLUSHALL`, a
//! failover), after which it issues tokens at or below what this table has seen. Such a token is
//! refused by [`raise_fence`] like any stale one ([`StoreError::FenceBehind`] carries the row's fence);
//! the caller then asks the lease layer, with a token-checked script, to lift the counter above it.
//! Only the current lease holder can do that, so a stale holder stays refused, and a wallet is never
//! wedged by a counter that went backwards. We resynchronize rather than issue fences from Postgres
//! because a Redis-issued fence comes with the lease in one round trip and orders holders by when
//! they took the lease, not by when they reached the database: a holder paused between acquire and
//! its first statement is refused instead of overtaking the holder that replaced it.

pub mod audit;
pub mod books;
pub mod event;
pub mod group;
pub mod history;
pub mod hold;
pub mod idempotency;
pub mod schema;
pub mod shards;
pub mod storage;
pub mod transfer;
pub mod webhook;

use crate::domain::{EntryKind, EventType, Metadata, Rules};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("wallet not found")]
    WalletNotFound,
    #[error("wallet already exists")]
    WalletExists,
    /// The row's fence is already at least as high as ours.
    #[error("fence {ours} is not above the wallet's fence {seen}")]
    FenceBehind { ours: i64, seen: i64 },
    /// Another holder raised the row's fence or wrote the row since we read it: nothing was applied.
    #[error("a newer lease holder has fenced the wallet; nothing was applied")]
    LeaseLost,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// No connection to the node a write was to go to: nothing of it was sent.
    #[error("the database node to write on could not be reached: {0}")]
    Unreached(#[source] sqlx::Error),
}

/// Whether `err` is a unique violation of the constraint `name`. Under Citus the constraint is a
/// shard's, named after the table's with the shard id appended (`wallet_pkey_102008`), and the
/// coordinator passes the worker's error on without the constraint field: the message names it.
pub(crate) fn violates(err: &dyn sqlx::error::DatabaseError, name: &str) -> bool {
    let named = |constraint: &str| {
        constraint.strip_prefix(name).is_some_and(|rest| {
            rest.is_empty() || rest.trim_start_matches('_').bytes().all(|b| b.is_ascii_digit())
        })
    };
    err.code().as_deref() == Some("23505")
        && match err.constraint() {
            Some(constraint) => named(constraint),
            None => err.message().split('"').nth(1).is_some_and(named),
        }
}

/// A connection from `db`, its wait boxed. sqlx's `acquire` future is 14 KB, and awaited inline it
/// makes every future that holds it that large (each handler, task and round above it, copied
/// whole at each spawn and box), even one that rarely awaits it: call this where a caller's
/// future is held or copied often; `db.acquire()` elsewhere.
pub async fn acquire(db: &PgPool) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
    Box::pin(db.acquire()).await
}

/// A transaction on a connection from `db`, its wait boxed as [`acquire`]'s.
pub async fn begin(db: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    Box::pin(db.begin()).await
}

/// Whether Postgres answers a trivial query.
pub async fn ping(db: &PgPool) -> Result<(), StoreError> {
    sqlx::query("select 1").execute(db).await?;
    Ok(())
}

impl StoreError {
    /// Whether the connection broke or the server is going away, as opposed to Postgres answering
    /// with an error: a statement sent on it, a COMMIT say, may have run or not.
    pub fn is_connection_failure(&self) -> bool {
        matches!(self, StoreError::Database(err) if Self::is_connection_failure_of(err))
    }

    /// [`StoreError::is_connection_failure`], of the database error itself.
    pub fn is_connection_failure_of(err: &sqlx::Error) -> bool {
        match err {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            // Class 08: connection exception; 57P0x: the server is shutting down or starting.
            sqlx::Error::Database(db) => {
                db.code().is_some_and(|code| code.starts_with("08") || code.starts_with("57P0"))
                    || Self::is_citus_connection_failure(db.code().as_deref(), db.message())
            }
            _ => false,
        }
    }

    /// The errors Citus's coordinator raises without a connection-failure code when it lost a
    /// node under a statement (read off Citus 13.2's source). With the generic internal-error code
    /// (an `ereport` without an `errcode`):
    /// - its own postmaster died while the statement waited on a worker;
    /// - the worker of a transaction committed in one phase went away during that COMMIT (which
    ///   may have committed there or not);
    /// - a worker went away before or while the transaction was prepared for its two-phase commit,
    ///   or under every placement of a statement (the transaction is rolled back);
    /// - a worker's own connection-ending error, passed on without its code when it ended a COPY
    ///   (an `INSERT … SELECT` into a distributed table runs as one);
    /// - libpq's own words for a worker connection that broke under a statement, which Citus's
    ///   `ReportResultError` passes on with the generic code when the result carries none
    ///   ("server closed the connection unexpectedly", seen in a fresh-clone run's Citus test).
    ///
    /// And as an I/O error (58030), a COPY whose worker connection broke while it sent the rows
    /// or ended the COPY, or without a message.
    fn is_citus_connection_failure(code: Option<&str>, message: &str) -> bool {
        const INTERNAL_MESSAGES: [&str; 4] = [
            "postmaster was shut down, exiting",
            "terminating connection due to unexpected postmaster exit",
            "terminating connection due to administrator command",
            "terminating connection because of crash of another server process",
        ];
        const INTERNAL_PREFIXES: [&str; 8] = [
            "could not commit transaction for shard",
            "failed to prepare transaction",
            "failure on connection marked as essential",
            "execution cannot recover from multiple connection failures",
            "server closed the connection unexpectedly",
            "no connection to the server",
            "could not receive data from server",
            "could not send data to server",
        ];
        match code {
            Some("XX000") => {
                INTERNAL_MESSAGES.contains(&message)
                    || INTERNAL_PREFIXES.iter().any(|prefix| message.starts_with(prefix))
            }
            Some("58030") => {
                message.starts_with("failed to COPY to shard")
                    || message.starts_with("failed to complete COPY on")
            }
            _ => false,
        }
    }

    /// Whether the database could not be reached or is restarting, as opposed to a bug or a
    /// refused write: the caller may retry later.
    pub fn is_unavailable(&self) -> bool {
        if self.is_connection_failure() || matches!(self, StoreError::Unreached(_)) {
            return true;
        }
        let StoreError::Database(err) = self else { return false };
        match err {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| {
                // 53300: too many connections; 40001/40P01: serialization failure or deadlock;
                // 25P03/57014: the server ended the session idle in its transaction, or cancelled a
                // statement, past the replica's session bounds (`app::connect::SESSION_BOUNDS`): rolled
                // back, so nothing of it was applied.
                ["53300", "40001", "40P01", "25P03", "57014"].contains(&code.as_ref())
            }),
            _ => false,
        }
    }
}

/// One wallet as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Wallet {
    pub id: String,
    pub balance: i64,
    /// The balance less what the wallet's active holds reserve: what a payment, a transfer or a
    /// new hold may spend.
    pub available: i64,
    /// What the wallet's holds not yet settled reserve, expired ones included until a movement
    /// of the wallet releases them (`crate::wallet::decision`).
    pub held: i64,
    pub version: i64,
    pub fence: i64,
    /// The caller that opened it; `None` for a wallet opened before owners were recorded.
    pub owner: Option<String>,
    /// Its balance rules.
    #[sqlx(json)]
    pub rules: Rules,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One ledger entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: Uuid,
    pub wallet_id: String,
    pub kind: EntryKind,
    /// Minor units; an `open` entry's amount is the opening balance, which may be 0.
    pub amount: i64,
    /// The wallet's balance right after this entry.
    pub balance: i64,
    /// The wallet's version right after this entry (its position in the wallet's ledger).
    pub version: i64,
    /// The fencing token of the lease it was written under (0 for an `open` entry).
    pub fence: i64,
    /// The payment's reference, if it has one.
    pub reference: Option<String>,
    /// Its movement's metadata.
    pub metadata: Metadata,
    /// The transfer a `transfer_out` or `transfer_in` entry is a leg of.
    pub transfer_id: Option<Uuid>,
    /// The `pay` entry a `refund` entry returns money for.
    pub refund_of: Option<Uuid>,
    /// The hold a `pay` entry captured.
    pub hold_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
}

/// The columns [`Entry`]'s `FromRow` reads, as a literal for `concat!`.
macro_rules! entry_columns {
    () => {
        "id, wallet_id, seq, kind, amount, balance_after, fence, reference, metadata, transfer_id, refund_of, \
         hold_id, created_at"
    };
}
pub(crate) use entry_columns;

impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for Entry {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(Entry {
            id: row.try_get("id")?,
            wallet_id: row.try_get("wallet_id")?,
            kind: row.try_get("kind")?,
            amount: row.try_get("amount")?,
            balance: row.try_get("balance_after")?,
            version: row.try_get("seq")?,
            fence: row.try_get("fence")?,
            reference: row.try_get("reference")?,
            metadata: stored_metadata(row, "metadata")?,
            transfer_id: row.try_get("transfer_id")?,
            refund_of: row.try_get("refund_of")?,
            hold_id: row.try_get("hold_id")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

/// The metadata in `column` of `row` (`jsonb`, null when there is none).
pub(crate) fn stored_metadata(row: &sqlx::postgres::PgRow, column: &str) -> Result<Metadata, sqlx::Error> {
    let stored: Option<sqlx::types::Json<std::collections::BTreeMap<String, String>>> =
        row.try_get(column)?;
    Ok(Metadata::stored(stored.map(|json| json.0)))
}

/// An entry as the statements that write only `open`, `deposit` and `pay` entries return it.
struct WrittenEntry {
    id: Uuid,
    wallet_id: String,
    seq: i64,
    kind: EntryKind,
    amount: i64,
    balance_after: i64,
    fence: i64,
    reference: Option<String>,
    created_at: DateTime<Utc>,
}

impl TryFrom<WrittenEntry> for Entry {
    type Error = sqlx::Error;

    fn try_from(row: WrittenEntry) -> Result<Self, Self::Error> {
        Ok(Entry {
            id: row.id,
            wallet_id: row.wallet_id,
            kind: row.kind,
            amount: row.amount,
            balance: row.balance_after,
            version: row.seq,
            fence: row.fence,
            reference: row.reference,
            metadata: Metadata::default(),
            transfer_id: None,
            refund_of: None,
            hold_id: None,
            created_at: row.created_at,
        })
    }
}

/// An entry to append in [`commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEntry {
    pub id: Uuid,
    pub kind: EntryKind,
    pub amount: i64,
    pub balance_after: i64,
    pub reference: Option<String>,
}

/// A new ledger entry's id. Time-ordered (UUIDv7): each insert into the ledger's primary key (and
/// into the stored responses' `entry_id` index) lands at the right edge of the index, on pages
/// already in memory and already logged since the last checkpoint, where a random id would touch
/// a page anywhere in the index and often write it whole to the WAL.
pub fn new_entry_id() -> Uuid {
    Uuid::now_v7()
}

/// The time of entries written now, at Postgres's precision (microseconds), so a response rendered
/// before the write says exactly what the ledger stores.
pub fn entry_time() -> DateTime<Utc> {
    use chrono::{DurationRound, TimeDelta};
    let now = Utc::now();
    now.duration_trunc(TimeDelta::microseconds(1)).unwrap_or(now)
}

/// A wallet's balance and version, as a holder read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalletRead {
    pub balance: i64,
    pub version: i64,
}

/// Creates a wallet owned by `owner` with an opening balance, its `open` entry and (`with_event`)
/// its first event, in the caller's transaction (which the event's position is taken from: see
/// [`event`]), so that from its first moment the wallet's balance equals the sum of its ledger. No
/// lease is needed: a new row has no other writer, and its primary key refuses a second creation.
pub async fn create_wallet(
    conn: &mut PgConnection,
    id: &str,
    owner: &str,
    balance: i64,
    with_event: bool,
) -> Result<(Wallet, Entry), StoreError> {
    // A new wallet has no holds: all of its balance is available. (Said here rather than by
    // `find_wallet`'s subquery on `hold`, which Citus cannot plan in an INSERT's RETURNING.)
    let position = event::transaction_position(&mut *conn).await?;
    let wallet = sqlx::query_as::<_, Wallet>(
        // language=PostgreSQL
        "insert into wallet (id, balance, version, owner, event_seq, event_position) \
         values ($1, $2, 1, $3, $5, $4::text::xid8) \
         returning id, balance, held, version, fence, owner, rules, created_at, updated_at, balance as available",
    )
    .bind(id)
    .bind(balance)
    .bind(owner)
    .bind(position.to_string())
    .bind(i64::from(with_event))
    .fetch_one(&mut *conn)
    .await
    .map_err(|err| match &err {
        sqlx::Error::Database(db) if violates(db.as_ref(), "wallet_pkey") => StoreError::WalletExists,
        _ => StoreError::Database(err),
    })?;
    let open = sqlx::query_as!(
        WrittenEntry,
        // language=PostgreSQL
        r#"insert into ledger_entry (id, wallet_id, seq, kind, amount, balance_after, fence)
           values ($1, $2, 1, 'open', $3, $3, 0)
           returning id, wallet_id, seq, kind as "kind: EntryKind", amount, balance_after, fence, reference,
                     created_at"#,
        new_entry_id(),
        id,
        balance,
    )
    .fetch_one(&mut *conn)
    .await?;
    if !with_event {
        return Ok((wallet, open.try_into()?));
    }
    // Its first event, at the position the wallet's row took.
    sqlx::query(
        // language=PostgreSQL
        "insert into event (wallet_id, seq, position, type, entry_id, created_at)
         select id, 1, event_position, $3, $2, $4 from wallet where id = $1",
    )
    .bind(id)
    .bind(open.id)
    .bind(EventType::WalletOpened.as_str())
    .bind(open.created_at)
    .execute(&mut *conn)
    .await?;
    Ok((wallet, open.try_into()?))
}

/// The wallet, with its available balance: the balance and its overdraft less the holds still
/// held and not expired (a wallet that holds nothing, most, needs no look at its holds).
pub async fn find_wallet(conn: &mut PgConnection, id: &str) -> Result<Option<Wallet>, StoreError> {
    // The holds are those of `$1`, not of `wallet.id`: Citus routes a statement to one shard by
    // its parameters, and sent the correlated form to all 32.
    Ok(sqlx::query_as(
        // language=PostgreSQL
        "select id, balance, held, version, fence, owner, rules, created_at, updated_at,
                balance + coalesce((rules ->> 'overdraft')::int8, 0) - case when held = 0 then 0 else (
                    select coalesce(sum(h.amount), 0)::int8 from hold h
                    where h.wallet_id = $1 and h.status = 'held' and h.expires_at > now()
                ) end as available
         from wallet where id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Raises the wallet's fence to `fence`, the holder's, and reads its balance and version.
///
/// Succeeds only if `fence` is strictly above the row's fence: a token equal to the row's was
/// issued twice (the counter went backwards) and must not let two holders in.
pub async fn raise_fence(conn: &mut PgConnection, id: &str, fence: i64) -> Result<WalletRead, StoreError> {
    let read = sqlx::query_as!(
        WalletRead,
        // language=PostgreSQL
        "update wallet set fence = $2 where id = $1 and fence < $2 returning balance, version",
        id,
        fence,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(read) = read {
        return Ok(read);
    }
    // language=PostgreSQL
    match sqlx::query_scalar!("select fence from wallet where id = $1", id).fetch_optional(conn).await? {
        Some(seen) => Err(StoreError::FenceBehind { ours: fence, seen }),
        None => Err(StoreError::WalletNotFound),
    }
}

/// Applies `entries` to a wallet fenced with `fence` at `read_version`: one statement, in the
/// caller's transaction, whose conditional UPDATE of the balance decides whether its entries are
/// inserted. The wallet's new balance is the last
/// entry's `balance_after`; its new version is `read_version` plus the number of entries.
///
/// If the row's fence or version moved since the caller read it, nothing is written and the result
/// is [`StoreError::LeaseLost`]; the caller must roll back. With no entries, only the check is made
/// (and the row locked), so refusals are answered from a state this holder still owns.
pub async fn commit(
    tx: &mut PgConnection,
    id: &str,
    fence: i64,
    read_version: i64,
    entries: &[NewEntry],
) -> Result<Vec<Entry>, StoreError> {
    let Some(last) = entries.last() else {
        let still_ours = sqlx::query_scalar!(
            // language=PostgreSQL
            "select id from wallet where id = $1 and fence = $2 and version = $3 for update",
            id,
            fence,
            read_version,
        )
        .fetch_optional(&mut *tx)
        .await?;
        return match still_ours {
            Some(_) => Ok(Vec::new()),
            None => Err(StoreError::LeaseLost),
        };
    };
    let ids: Vec<Uuid> = entries.iter().map(|e| e.id).collect();
    let seqs: Vec<i64> = (1..=entries.len() as i64).map(|n| read_version + n).collect();
    let kinds: Vec<&str> = entries.iter().map(|e| e.kind.as_str()).collect();
    let amounts: Vec<i64> = entries.iter().map(|e| e.amount).collect();
    let balances: Vec<i64> = entries.iter().map(|e| e.balance_after).collect();
    let references: Vec<Option<&str>> = entries.iter().map(|e| e.reference.as_deref()).collect();
    // One statement: the conditional UPDATE, and the entries only if it matched.
    let rows = sqlx::query_as!(
        WrittenEntry,
        // language=PostgreSQL
        r#"with moved as (
               update wallet set balance = $4, version = $5, updated_at = now()
               where id = $1 and fence = $2 and version = $3
               returning id
           )
           insert into ledger_entry (id, wallet_id, seq, kind, amount, balance_after, fence, reference)
           select e.id, moved.id, e.seq, e.kind, e.amount, e.balance_after, $2, e.reference
           from moved,
                unnest($6::uuid[], $7::int8[], $8::text[], $9::int8[], $10::int8[], $11::text[])
                    as e(id, seq, kind, amount, balance_after, reference)
           returning id, wallet_id, seq, kind as "kind: EntryKind", amount, balance_after, fence, reference,
                     created_at"#,
        id,
        fence,
        read_version,
        last.balance_after,
        read_version + entries.len() as i64,
        &ids,
        &seqs,
        &kinds as &[&str],
        &amounts,
        &balances,
        &references as &[Option<&str>],
    )
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Err(StoreError::LeaseLost);
    }
    let mut written = rows.into_iter().map(Entry::try_from).collect::<Result<Vec<_>, _>>()?;
    written.sort_by_key(|entry| entry.version);
    // Their events, numbered after the wallet's last (the row is locked by the write above).
    let events: Vec<&str> = written
        .iter()
        .map(|entry| EventType::of_entry(entry.kind, false, EventType::PaymentAccepted).as_str())
        .collect();
    let position = event::transaction_position(&mut *tx).await?;
    sqlx::query(
        // language=PostgreSQL
        r#"with w as (
               update wallet set event_seq = event_seq + cardinality($2::uuid[]),
                                 event_position = greatest(event_position, $5::text::xid8)
               where id = $1
               returning event_seq - cardinality($2::uuid[]) as last, event_position
           )
           insert into event (wallet_id, seq, position, type, entry_id, created_at)
           select $1, w.last + e.n, w.event_position, e.type, e.entry_id, $4
           from w, unnest($2::uuid[], $3::text[]) with ordinality as e(entry_id, type, n)"#,
    )
    .bind(id)
    .bind(written.iter().map(|entry| entry.id).collect::<Vec<_>>())
    .bind(&events)
    .bind(written[0].created_at)
    .bind(position.to_string())
    .execute(&mut *tx)
    .await?;
    Ok(written)
}

/// A page of a wallet's entries, newest first: those with a version below `before` (all, when
/// `None`), at most `limit`.
pub async fn entries_page(
    conn: &mut PgConnection,
    id: &str,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<Entry>, StoreError> {
    Ok(sqlx::query_as(concat!(
        // language=PostgreSQL
        "select ",
        entry_columns!(),
        " from ledger_entry
         where wallet_id = $1 and seq < coalesce($2, 9223372036854775807)
         order by seq desc
         limit $3"
    ))
    .bind(id)
    .bind(before)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::StoreError;

    #[test]
    fn a_node_lost_under_citus_is_a_connection_failure_whatever_words_it_comes_in() {
        let lost = |code, message| StoreError::is_citus_connection_failure(Some(code), message);
        assert!(lost("XX000", "terminating connection due to administrator command"));
        assert!(lost("XX000", "could not commit transaction for shard 102008 on any active node"));
        assert!(lost(
            "XX000",
            "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally"
        ));
        assert!(lost("XX000", "could not receive data from server: Connection reset by peer"));
        assert!(lost("58030", "failed to COPY to shard 102009 on localhost:9701"));
        // The same words under another code, or other words under the generic one, are not.
        assert!(!lost("23505", "server closed the connection unexpectedly"));
        assert!(!lost("XX000", "cache lookup failed for type 1234"));
        assert!(!StoreError::is_citus_connection_failure(None, "server closed the connection unexpectedly"));
    }
}
