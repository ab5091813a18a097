//! A wallet's history: its entries in a range of time or versions, filtered and paged either
//! way; its balance as of an instant; a statement of a period. Reads only, of one wallet each
//! (every statement names its `wallet_id`, so Citus routes it to that wallet's shard).
//!
//! Time and versions agree along a wallet's ledger: an entry's time is taken by its writer under
//! the wallet's lease (or its row's lock), after the entry before it was committed, so times
//! never go down along the ledger while the replicas' clocks agree (`walletlock audit` reports
//! an entry timed before the one it follows). Everything here is then defined by one function
//! of an instant, [`version_at`]'s "the last entry at or before it", and a period `[from, to)`
//! is the versions after the last entry before `from` up to the last entry before `to`: a
//! statement's closing is the next period's opening, and its totals are exactly the entries
//! between the two.

use super::{Entry, StoreError, entry_columns};
use crate::domain::EntryKind;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};

/// Which way a page runs along the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    /// Oldest first.
    #[default]
    Asc,
    /// Newest first.
    Desc,
}

/// Which entries of a wallet to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryFilter {
    /// Entries written at or after this instant.
    pub from: Option<DateTime<Utc>>,
    /// Entries written before this instant.
    pub to: Option<DateTime<Utc>>,
    /// Entries of these kinds (all, when empty).
    pub kinds: Vec<EntryKind>,
    /// Entries with this reference.
    pub reference: Option<String>,
    pub order: Order,
    /// Entries past this version, in `order` (the last version of the previous page).
    pub after: Option<i64>,
    pub limit: i64,
}

/// A wallet as of an instant: the last entry written at or before it, and what its holds
/// reserved then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BalanceAt {
    pub entry: Entry,
    /// Holds placed by then, neither settled nor expired by then.
    pub held: i64,
}

/// A wallet over the period `[from, to)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// The balance and version as of just before `from` (0 and 0 before the wallet opened).
    pub opening_balance: i64,
    pub opening_version: i64,
    /// As of just before `to`.
    pub closing_balance: i64,
    pub closing_version: i64,
    /// For each kind with entries in the period: how many, and their amounts summed.
    pub totals: Vec<KindTotal>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindTotal {
    pub kind: EntryKind,
    pub count: i64,
    pub amount: i64,
}

/// The version of the last entry written before `at` (or at it, when `inclusive`), as SQL
/// over `$1` (the wallet) and the instant's parameter; null before the wallet opened.
macro_rules! version_at {
    ($at:literal, "<=") => {
        concat!(
            "(select seq from ledger_entry where wallet_id = $1 and created_at <= ",
            $at,
            " order by created_at desc, seq desc limit 1)"
        )
    };
    ($at:literal, "<") => {
        concat!(
            "(select seq from ledger_entry where wallet_id = $1 and created_at < ",
            $at,
            " order by created_at desc, seq desc limit 1)"
        )
    };
}

/// A page of the wallet's entries that `filter` selects.
pub async fn entries(
    conn: &mut PgConnection,
    id: &str,
    filter: &EntryFilter,
) -> Result<Vec<Entry>, StoreError> {
    // The period's versions, then the filters within them; in order of version, from the cursor.
    macro_rules! page {
        ($cursor:literal, $order:literal) => {
            concat!(
                // language=PostgreSQL
                "select ",
                entry_columns!(),
                " from ledger_entry
                 where wallet_id = $1
                   and seq > case when $2::timestamptz is null then 0 else coalesce(",
                version_at!("$2", "<"),
                ", 0) end
                   and seq <= case when $3::timestamptz is null then 9223372036854775807 else coalesce(",
                version_at!("$3", "<"),
                ", 0) end
                   and (cardinality($4::text[]) = 0 or kind = any($4))
                   and ($5::text is null or reference = $5)
                   and ",
                $cursor,
                " order by seq ",
                $order,
                " limit $7"
            )
        };
    }
    let sql = match filter.order {
        Order::Asc => page!("seq > coalesce($6, 0)", "asc"),
        Order::Desc => page!("seq < coalesce($6, 9223372036854775807)", "desc"),
    };
    let kinds: Vec<&str> = filter.kinds.iter().map(|kind| kind.as_str()).collect();
    Ok(sqlx::query_as(sql)
        .bind(id)
        .bind(filter.from)
        .bind(filter.to)
        .bind(kinds)
        .bind(filter.reference.as_deref())
        .bind(filter.after)
        .bind(filter.limit)
        .fetch_all(conn)
        .await?)
}

/// The wallet as of `at`; `None` if it had no entry by then (it opened later).
pub async fn balance_at(
    conn: &mut PgConnection,
    id: &str,
    at: DateTime<Utc>,
) -> Result<Option<BalanceAt>, StoreError> {
    let row = sqlx::query(concat!(
        // language=PostgreSQL
        "select ",
        entry_columns!(),
        ", (select coalesce(sum(h.amount), 0)::int8 from hold h
             where h.wallet_id = $1 and h.created_at <= $2 and h.expires_at > $2
               and (h.settled_at is null or h.settled_at > $2)) as held_then
         from ledger_entry
         where wallet_id = $1 and seq = ",
        version_at!("$2", "<=")
    ))
    .bind(id)
    .bind(at)
    .fetch_optional(conn)
    .await?;
    row.map(|row| {
        let entry = <Entry as sqlx::FromRow<_>>::from_row(&row)?;
        Ok(BalanceAt { entry, held: row.try_get("held_then")? })
    })
    .transpose()
}

/// The statement of the wallet over `[from, to)`.
pub async fn statement(
    conn: &mut PgConnection,
    id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Statement, StoreError> {
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        "with bounds as (
             select coalesce(",
        version_at!("$2", "<"),
        ", 0) as opening, coalesce(",
        version_at!("$3", "<"),
        ", 0) as closing
         )
         select b.opening, b.closing,
                coalesce((select balance_after from ledger_entry
                          where wallet_id = $1 and seq = b.opening), 0) as opening_balance,
                coalesce((select balance_after from ledger_entry
                          where wallet_id = $1 and seq = b.closing), 0) as closing_balance,
                t.kind, t.count, t.amount
         from bounds b
         left join lateral (
             select kind, count(*) as count, sum(amount)::int8 as amount from ledger_entry
             where wallet_id = $1 and seq > b.opening and seq <= b.closing
             group by kind
         ) t on true
         order by t.kind"
    ))
    .bind(id)
    .bind(from)
    .bind(to)
    .fetch_all(conn)
    .await?;
    // `bounds` is one row, joined with each kind's totals (or with nulls when there are none).
    let first = rows.first().ok_or(StoreError::Database(sqlx::Error::RowNotFound))?;
    let mut statement = Statement {
        opening_balance: first.try_get("opening_balance")?,
        opening_version: first.try_get("opening")?,
        closing_balance: first.try_get("closing_balance")?,
        closing_version: first.try_get("closing")?,
        totals: Vec::new(),
    };
    for row in &rows {
        if let Some(kind) = row.try_get::<Option<EntryKind>, _>("kind")? {
            statement.totals.push(KindTotal {
                kind,
                count: row.try_get("count")?,
                amount: row.try_get("amount")?,
            });
        }
    }
    Ok(statement)
}
