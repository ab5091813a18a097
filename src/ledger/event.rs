//! Events as stored: each written by the statement or transaction that moved the money
//! ([`super::group::commit`], [`super::create_wallet`], [`super::commit`]), and read in order by
//! the feed.
//!
//! # The feed's order, and why a reader sees each event exactly once
//! An event's `position` is the id of the transaction that wrote it (`pg_current_xact_id()`),
//! raised to its wallet's previous event's position when that one is higher, so along a wallet it
//! never goes down. The feed reads events in `(position, wallet_id, seq)` order, and only those
//! whose position is below the *horizon*: the oldest transaction id still running when the page is
//! read (`pg_snapshot_xmin`). Below it every transaction has ended, so every event there is
//! committed and visible, or was never written; and any event still to come is written by a
//! transaction running now or later, whose id, and so its event's position, is at or above the
//! horizon. A reader that asks for the events after the last one it saw therefore misses none and
//! sees none twice, and sees each wallet's events in their order. A transaction ids never repeat:
//! `xid8` counts the wraparounds.
//!
//! Under Citus the position is the coordinator's transaction id, taken in a transaction there
//! ([`transaction_position`]), and the horizon the coordinator's: a round's transaction on its
//! worker commits before that one ends, whether Citus commits it (one-phase commit: the worker in
//! its pre-commit step) or the replica does, on its own connection to the worker, before it ends
//! the coordinator's ([`super::group::commit`]).

use super::hold::Hold;
use super::{Entry, StoreError};
use crate::domain::{EventCursor, EventType, HoldStatus, Monitor, Monitors};
use crate::telemetry::metrics::EVENTS_WRITTEN;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

/// An event to write with its movement: what happened to `wallet_id`, and the entry or hold it is
/// about. Its number in the wallet's events is given by the write, in the order written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventWrite {
    pub wallet_id: String,
    pub kind: EventType,
    pub entry_id: Option<Uuid>,
    pub hold_id: Option<Uuid>,
    /// The amount of the monitor a balance event crossed.
    pub monitor: Option<i64>,
}

impl EventWrite {
    /// The event of `entry`, a leg between wallets of which is `between` (see
    /// [`EventType::of_entry`]).
    pub fn of_entry(entry: &Entry, between: EventType) -> Self {
        EventWrite {
            wallet_id: entry.wallet_id.clone(),
            kind: EventType::of_entry(entry.kind, entry.hold_id.is_some(), between),
            entry_id: Some(entry.id),
            hold_id: entry.hold_id,
            monitor: None,
        }
    }

    /// The events of the monitors `entry` crossed, taking its wallet's balance from `before`: each
    /// with the entry, after the entry's own event.
    pub fn of_crossings<'m>(
        entry: &'m Entry,
        monitors: &'m Monitors,
        before: i64,
    ) -> impl Iterator<Item = EventWrite> + 'm {
        monitors.crossed(before, entry.balance).map(|monitor| EventWrite {
            wallet_id: entry.wallet_id.clone(),
            kind: monitor.event(),
            entry_id: Some(entry.id),
            hold_id: None,
            monitor: Some(monitor.amount()),
        })
    }

    /// The event of hold `hold` of `wallet_id`, placed or settled without an entry.
    pub fn of_hold(wallet_id: &str, hold: Uuid, status: HoldStatus) -> Self {
        EventWrite {
            wallet_id: wallet_id.to_owned(),
            kind: EventType::of_settled(status),
            entry_id: None,
            hold_id: Some(hold),
            monitor: None,
        }
    }
}

/// Counts `events`, committed, by type.
pub(super) fn count_written<'e>(events: impl IntoIterator<Item = &'e EventWrite>) {
    let mut by_type = [0u64; EventType::ALL.len()];
    for event in events {
        by_type[EventType::ALL.iter().position(|kind| *kind == event.kind).unwrap_or_default()] += 1;
    }
    for (kind, count) in EventType::ALL.iter().zip(by_type).filter(|(_, count)| *count > 0) {
        metrics::counter!(EVENTS_WRITTEN.name, "type" => kind.as_str()).increment(count);
    }
}

/// The events of a write, as the arrays its statement takes (`unnest`), in order.
#[derive(Debug, Default)]
pub(super) struct EventColumns<'a> {
    pub wallets: Vec<&'a str>,
    pub kinds: Vec<&'static str>,
    pub entries: Vec<Option<Uuid>>,
    pub holds: Vec<Option<Uuid>>,
    pub monitors: Vec<Option<i64>>,
}

impl<'a> EventColumns<'a> {
    pub fn of<'e: 'a>(events: impl IntoIterator<Item = &'e EventWrite>) -> Self {
        let mut columns = EventColumns::default();
        for event in events {
            columns.wallets.push(&event.wallet_id);
            columns.kinds.push(event.kind.as_str());
            columns.entries.push(event.entry_id);
            columns.holds.push(event.hold_id);
            columns.monitors.push(event.monitor);
        }
        columns
    }
}

/// One event as the feed reads it, with what it is about as of the event: the entry, or the hold
/// as the event left it (a `hold.placed` event shows the hold held, whatever became of it since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub cursor: EventCursor,
    pub kind: EventType,
    pub created_at: DateTime<Utc>,
    pub entry: Option<Entry>,
    pub hold: Option<Hold>,
    /// The monitor a balance event crossed.
    pub monitor: Option<Monitor>,
}

impl StoredEvent {
    pub fn wallet_id(&self) -> &str {
        &self.cursor.wallet_id
    }

    pub fn seq(&self) -> i64 {
        self.cursor.seq
    }
}

/// Which events to read: those after `after` (from the first, without) and up to `until` (if
/// given), of the wallets of `owner` (every wallet's, without), of these types (every type, when
/// empty), of one wallet, or of these wallets (every wallet, when empty).
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub after: Option<EventCursor>,
    pub until: Option<EventCursor>,
    pub owner: Option<String>,
    pub types: Vec<EventType>,
    pub wallet_id: Option<String>,
    pub wallets: Vec<String>,
    pub limit: i64,
}

/// The feed's horizon now: every event below it is committed (see the module doc).
pub async fn horizon(conn: &mut PgConnection) -> Result<i64, StoreError> {
    // language=PostgreSQL
    Ok(sqlx::query_scalar("select pg_snapshot_xmin(pg_current_snapshot())::text::int8")
        .fetch_one(conn)
        .await?)
}

/// The key of the advisory lock by which [`super::audit`] pauses the rounds written on Citus's
/// workers (with the schema's hash: each schema's books apart).
pub(super) const ROUNDS_LOCK: i32 = 0x5741_4c4c;

/// [`transaction_position`] for a round under Citus, which also takes [`ROUNDS_LOCK`] shared
/// until the transaction ends: a round written on its worker's own connection takes no lock on the
/// coordinator's tables, which is what the audit pauses the other writers by.
pub(super) async fn round_position(conn: &mut PgConnection) -> Result<i64, StoreError> {
    // language=PostgreSQL
    Ok(sqlx::query_scalar(
        "select pg_current_xact_id()::text::int8 from pg_advisory_xact_lock_shared($1, hashtext(current_schema()))",
    )
    .bind(ROUNDS_LOCK)
    .fetch_one(conn)
    .await?)
}

/// The position of the events a transaction writes whose statements cannot take it themselves
/// (under Citus, where a statement runs on a worker, or before the wallet's row exists): the id of
/// the caller's transaction, on the node that coordinates it (see the module doc).
pub(super) async fn transaction_position(conn: &mut PgConnection) -> Result<i64, StoreError> {
    // language=PostgreSQL
    Ok(sqlx::query_scalar("select pg_current_xact_id()::text::int8").fetch_one(conn).await?)
}

/// The events `filter` selects, below `horizon`, in the feed's order (see the module doc). A
/// wallet's events are in the order of their numbers (its positions never go down), so the
/// events of one wallet are read by number, along its key.
pub async fn page(
    conn: &mut PgConnection,
    filter: &EventFilter,
    horizon: i64,
) -> Result<Vec<StoredEvent>, StoreError> {
    // The entry's columns as `Entry` reads them (`entry_columns!`), of `le`.
    const SELECTED: &str = concat!(
        "select e.wallet_id as event_wallet, e.seq as event_seq, e.position::text::int8 as event_position,
                e.type as event_type, e.created_at as event_created_at, e.hold_id as event_hold,
                e.monitor as event_monitor,
                le.id, le.wallet_id, le.seq, le.kind, le.amount, le.balance_after, le.fence, le.reference,
                le.metadata, le.transfer_id, le.refund_of, le.hold_id, le.created_at",
        " from event e
         join wallet w on w.id = e.wallet_id
         left join ledger_entry le on le.wallet_id = e.wallet_id and le.id = e.entry_id
         where (e.position, e.wallet_id, e.seq) > ($1::text::xid8, $2, $3)
           and e.position < $4::text::xid8
           and ($5::text is null or w.owner = $5)
           and (cardinality($6::text[]) = 0 or e.type = any($6))
           and (cardinality($10::text[]) = 0 or e.wallet_id = any($10))
           and ($11::text is null or (e.position, e.wallet_id, e.seq) <= ($11::text::xid8, $12, $13))"
    );
    static ALL_WALLETS: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("{SELECTED} order by e.position, e.wallet_id, e.seq limit $7"));
    static ONE_WALLET: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("{SELECTED} and e.wallet_id = $8 and e.seq > $9 order by e.seq limit $7")
    });
    let after = filter.after.clone().unwrap_or(EventCursor { position: 0, wallet_id: String::new(), seq: 0 });
    let statement = if filter.wallet_id.is_some() { &ONE_WALLET } else { &ALL_WALLETS };
    let types: Vec<&str> = filter.types.iter().map(|kind| kind.as_str()).collect();
    // The events of one wallet after a cursor of the same wallet are those of higher numbers; a
    // cursor of another wallet says nothing of this one's numbers.
    let after_seq = match &filter.wallet_id {
        Some(wallet) if *wallet == after.wallet_id => after.seq,
        _ => 0,
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
        .bind(after.position.to_string())
        .bind(&after.wallet_id)
        .bind(after.seq)
        .bind(horizon.to_string())
        .bind(filter.owner.as_deref())
        .bind(&types)
        .bind(filter.limit)
        .bind(filter.wallet_id.as_deref())
        .bind(after_seq)
        .bind(&filter.wallets)
        .bind(filter.until.as_ref().map(|until| until.position.to_string()))
        .bind(filter.until.as_ref().map(|until| until.wallet_id.as_str()))
        .bind(filter.until.as_ref().map(|until| until.seq))
        .fetch_all(&mut *conn)
        .await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut hold_of: Vec<(usize, String, Uuid)> = Vec::new();
    for row in rows {
        let name: String = row.try_get("event_type")?;
        let kind = EventType::parse(&name)
            .ok_or_else(|| sqlx::Error::Decode(format!("an event of unknown type {name:?}").into()))?;
        let cursor = EventCursor {
            position: row.try_get("event_position")?,
            wallet_id: row.try_get("event_wallet")?,
            seq: row.try_get("event_seq")?,
        };
        let entry = match row.try_get::<Option<Uuid>, _>("id")? {
            Some(_) => Some(sqlx::FromRow::from_row(&row)?),
            None => None,
        };
        if let Some(hold) = row.try_get::<Option<Uuid>, _>("event_hold")? {
            hold_of.push((events.len(), cursor.wallet_id.clone(), hold));
        }
        let monitor = match (kind, row.try_get::<Option<i64>, _>("event_monitor")?) {
            (EventType::BalanceBelow, Some(amount)) => Some(Monitor::Below(amount)),
            (EventType::BalanceAbove, Some(amount)) => Some(Monitor::Above(amount)),
            _ => None,
        };
        events.push(StoredEvent {
            cursor,
            kind,
            created_at: row.try_get("event_created_at")?,
            entry,
            hold: None,
            monitor,
        });
    }
    if !hold_of.is_empty() {
        let wallets: Vec<&str> = hold_of.iter().map(|(_, wallet, _)| wallet.as_str()).collect();
        let ids: Vec<Uuid> = hold_of.iter().map(|(_, _, id)| *id).collect();
        let holds: Vec<Hold> = sqlx::query_as(
            // language=PostgreSQL
            "select * from hold where wallet_id = any($1) and id = any($2)",
        )
        .bind(&wallets)
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await?;
        for (n, _, id) in hold_of {
            let event = &mut events[n];
            event.hold = holds.iter().find(|hold| hold.id == id).map(|hold| as_at(hold, event.kind));
        }
    }
    Ok(events)
}

/// `hold` as an event of `kind` left it: placed, it was held; settled, as it was settled.
fn as_at(hold: &Hold, kind: EventType) -> Hold {
    match kind {
        EventType::HoldPlaced => Hold {
            status: HoldStatus::Held,
            captured: 0,
            settled_at: None,
            capture_entry: None,
            ..hold.clone()
        },
        _ => hold.clone(),
    }
}
