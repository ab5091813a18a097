//! A wallet's history: its entries in a range of time or versions, filtered and paged either
//! way; its balance as of an instant; a statement of a period. Each touches one wallet (every
//! SQL statement names its `wallet_id`, so Citus routes it to that wallet's shard), takes no
//! lock a movement waits for, and writes nothing but a statement's rollups of hours that are
//! over (see [`statement`]).
//!
//! Time and versions agree along a wallet's ledger: an entry's time is taken by its writer under
//! the wallet's lease (or its row's lock), after the entry before it was committed, so times
//! never go down along the ledger while the replicas' clocks agree (`walletlock audit` reports
//! an entry timed before the one it follows). Everything here is then defined by one function
//! of an instant, "the last entry written at or before it" (`version_at!`), and a period `[from, to)`
//! is the versions after the last entry before `from` up to the last entry before `to`: a
//! statement's closing is the next period's opening, and its totals are exactly the entries
//! between the two.

use super::{Entry, StoreError, entry_columns};
use crate::domain::{EntryKind, Metadata};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Row};

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
    /// Entries whose metadata has each of these keys at its value (all, when empty).
    pub metadata: Metadata,
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
                   and ($8::jsonb is null or metadata @> $8)
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
        .bind(filter.metadata.pairs().map(sqlx::types::Json))
        .fetch_all(conn)
        .await?)
}

/// Every entry `filter` selects after `filter.after`, `filter.limit` at a time (an export's
/// reads): each chunk read on a connection of `db` taken for that read alone, so a slow reader
/// holds none between chunks. Ends after a short chunk, or after an error.
pub fn chunks(
    db: PgPool,
    id: String,
    filter: EntryFilter,
) -> impl futures::Stream<Item = Result<Vec<Entry>, StoreError>> + Send + 'static {
    futures::stream::try_unfold((db, id, filter, true), |(db, id, mut filter, more)| async move {
        if !more {
            return Ok(None);
        }
        let chunk = entries(&mut *db.acquire().await?, &id, &filter).await?;
        let more = chunk.len() as i64 == filter.limit;
        filter.after = chunk.last().map(|last| last.version).or(filter.after);
        Ok(Some((chunk, (db, id, filter, more))))
    })
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

/// How long after an hour ends its entries are final: no round still running can have taken its
/// time in that hour (a round commits within its lease, seconds, or is fenced out), so the
/// hour's rollup never changes once written. Generous, for replicas' clocks that disagree a little.
pub const ROLLUP_FINAL_AFTER: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

const HOUR: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// `at`, rounded down to its hour.
fn hour_of(at: DateTime<Utc>) -> DateTime<Utc> {
    use chrono::DurationRound;
    at.duration_trunc(HOUR).unwrap_or(at)
}

/// The statement of the wallet over `[from, to)`, as of `now`: its totals by kind are those of
/// the rolled-up hours that lie wholly inside the period, plus the entries of its ragged ends,
/// summed one by one. Rolls up the wallet's hours that ended final before `now` first, if they
/// are not yet.
pub async fn statement(
    conn: &mut PgConnection,
    id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Statement, StoreError> {
    let rolled = roll_up(conn, id, hour_of(to.min(now - ROLLUP_FINAL_AFTER))).await?;
    // The entries before `first` and from `last` on are summed one by one (two plain ranges of
    // the time index, whatever the plan), the hours between from their rollups.
    let (first, last) = rolled_span(from, to, rolled);
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        "with bounds as (
             select coalesce(",
        version_at!("$2", "<"),
        ", 0) as opening, coalesce(",
        version_at!("$3", "<"),
        ", 0) as closing
         ),
         totals as (
             select kind, sum(count)::int8 as count, sum(amount)::int8 as amount from (
                 select kind, count, amount from entry_rollup
                 where wallet_id = $1 and hour >= $4 and hour < $5
                 union all
                 select kind, 1, amount from ledger_entry
                 where wallet_id = $1 and created_at >= $2 and created_at < least($3, $4)
                 union all
                 select kind, 1, amount from ledger_entry
                 where wallet_id = $1 and created_at >= greatest($2, $5) and created_at < $3
             ) parts
             group by kind
         )
         select b.opening, b.closing,
                coalesce((select balance_after from ledger_entry
                          where wallet_id = $1 and seq = b.opening), 0) as opening_balance,
                coalesce((select balance_after from ledger_entry
                          where wallet_id = $1 and seq = b.closing), 0) as closing_balance,
                t.kind, t.count, t.amount
         from bounds b left join totals t on true
         order by t.kind"
    ))
    .bind(id)
    .bind(from)
    .bind(to)
    .bind(first)
    .bind(last)
    .fetch_all(conn)
    .await?;
    // `bounds` is one row, joined with each kind's totals (or with nulls when there are none).
    let first_row = rows.first().ok_or(StoreError::Database(sqlx::Error::RowNotFound))?;
    let mut statement = Statement {
        opening_balance: first_row.try_get("opening_balance")?,
        opening_version: first_row.try_get("opening")?,
        closing_balance: first_row.try_get("closing_balance")?,
        closing_version: first_row.try_get("closing")?,
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

/// At most about this many entries are rolled up in one transaction, and a statement spends at
/// most [`ROLLUP_BUDGET`] rolling up before it sums the rest entry by entry: a long history that
/// was never rolled up is rolled over a few statements, none of them past its timeout.
const ROLLUP_CHUNK: i64 = 10_000;
const ROLLUP_BUDGET: std::time::Duration = std::time::Duration::from_millis(300);

/// Rolls up the wallet's hours before `until` (an hour's start) that are not yet, a chunk of
/// hours a transaction, within [`ROLLUP_BUDGET`]; how far its rollups go then (none yet: `None`). One statement of a
/// wallet rolls up at a time (a transaction-scoped advisory lock, tried, never waited for): the
/// others sum what is not rolled up yet. An hour's totals are final, so a row is written once.
async fn roll_up(
    conn: &mut PgConnection,
    id: &str,
    until: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let mut rolled = rolled_until(&mut *conn, id).await?;
    let started = std::time::Instant::now();
    while rolled.is_none_or(|rolled| rolled < until) && started.elapsed() < ROLLUP_BUDGET {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let ours: bool =
            sqlx::query_scalar("select pg_try_advisory_xact_lock(hashtext('entry_rollup'), hashtext($1))")
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
        if !ours {
            break;
        }
        rolled = rolled_until(&mut tx, id).await?;
        if rolled.is_some_and(|rolled| rolled >= until) {
            break;
        }
        // The chunk ends at the hour after its last entry (or at `until`).
        let last: Option<DateTime<Utc>> = sqlx::query_scalar(
            // language=PostgreSQL
            "select created_at from ledger_entry
             where wallet_id = $1 and created_at >= coalesce($2, '-infinity') and created_at < $3
             order by created_at offset $4 limit 1",
        )
        .bind(id)
        .bind(rolled)
        .bind(until)
        .bind(ROLLUP_CHUNK - 1)
        .fetch_optional(&mut *tx)
        .await?;
        let to = last.map_or(until, |last| (hour_of(last) + HOUR).min(until));
        sqlx::query(
            // language=PostgreSQL
            "insert into entry_rollup (wallet_id, hour, kind, count, amount)
             select wallet_id, date_trunc('hour', created_at), kind, count(*), sum(amount)
             from ledger_entry
             where wallet_id = $1 and created_at >= coalesce($2, '-infinity') and created_at < $3
             group by wallet_id, date_trunc('hour', created_at), kind
             on conflict do nothing",
        )
        .bind(id)
        .bind(rolled)
        .bind(to)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            // language=PostgreSQL
            "insert into entry_rollup_until (wallet_id, until) values ($1, $2)
             on conflict (wallet_id) do update set until = greatest(entry_rollup_until.until, excluded.until)",
        )
        .bind(id)
        .bind(to)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        rolled = Some(to);
    }
    Ok(rolled)
}

/// The whole hours of `[from, to)` that are rolled up (all before `rolled`): `[first, last)`,
/// empty (`first == last`) when none. `[from, first)`, `[first, last)` and `[last, to)`, each
/// clipped to the period, cover it once.
fn rolled_span(
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    rolled: Option<DateTime<Utc>>,
) -> (DateTime<Utc>, DateTime<Utc>) {
    let first = if hour_of(from) == from { from } else { hour_of(from) + HOUR };
    let last = rolled.map_or(first, |rolled| hour_of(to).min(rolled).max(first));
    (first, last)
}

/// How far the wallet's rollups go, if it has any.
async fn rolled_until(conn: &mut PgConnection, id: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
    Ok(sqlx::query_scalar("select until from entry_rollup_until where wallet_id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;

    proptest::proptest! {
        /// Every instant of a period is summed once: from the entries before the rolled span,
        /// from the span's rollups (whole hours, all rolled, inside the period), or from the
        /// entries after it.
        #[test]
        fn a_period_is_its_ragged_ends_and_its_rolled_hours_once(
            from_s in 0..400_000_i64,
            length_s in 1..400_000_i64,
            probe_s in 0..800_000_i64,
            rolled_h in proptest::option::of(0..250_i64),
        ) {
            let base: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
            let (from, to) = (base + TimeDelta::seconds(from_s), base + TimeDelta::seconds(from_s + length_s));
            let rolled = rolled_h.map(|h| base + TimeDelta::hours(h));
            let (first, last) = rolled_span(from, to, rolled);
            proptest::prop_assert!(first <= last);
            if first < last {
                proptest::prop_assert!(from <= first && last <= to, "the span lies inside the period");
                proptest::prop_assert!(hour_of(first) == first && hour_of(last) == last, "whole hours");
                proptest::prop_assert!(rolled.is_some_and(|rolled| last <= rolled), "only rolled hours");
            }
            let at = base + TimeDelta::seconds(probe_s);
            let before = at >= from && at < to.min(first);
            let within = at >= first && at < last;
            let after = at >= from.max(last) && at < to;
            let inside = at >= from && at < to;
            proptest::prop_assert_eq!(u8::from(before) + u8::from(within) + u8::from(after), u8::from(inside));
        }
    }

    #[test]
    fn hours_round_down() {
        let at: DateTime<Utc> = "2026-12-04T21:59:59.999999Z".parse().unwrap();
        assert_eq!(hour_of(at), "2026-12-04T21:00:00Z".parse::<DateTime<Utc>>().unwrap());
        let on_the_hour: DateTime<Utc> = "2026-12-04T21:00:00Z".parse().unwrap();
        assert_eq!(hour_of(on_the_hour), on_the_hour);
    }
}
