//! The group commit across wallets: the statements a replica runs per round of movements, two at
//! most, whatever the number of wallets and movements in the round (under Citus, where a round is
//! the wallets of one node, the write is a transaction of a few statements a shard instead: see
//! [`commit`]).
//!
//! 1. [`read`] reads the balance, version and fence of the wallets whose lease was just taken, and
//!    looks up the round's idempotency keys, in one statement that writes nothing (a key past its
//!    retention is deleted, which only makes it behave as new). A wallet whose row has seen the
//!    lease's fence or a higher one is [`ReadOutcome::FenceBehind`]: its fence counter went
//!    backwards, or the lease is stale, and the holder must lift it (or be refused) first. A round
//!    whose every wallet its holder already knows (from its last write, or the lease's note) need
//!    not read: its keys are then checked by the write itself (below). The read also brings the
//!    holds the round's captures and voids name, and the expired holds of the wallets whose
//!    movements need their amount (see `crate::wallet::batch`).
//! 2. [`commit`] writes every wallet of the round with its own compare-and-set, `UPDATE ... SET
//!    fence = $ours ... WHERE fence = $read AND version = $read AND balance = $read ...`, inserts
//!    the ledger entries, the holds placed and settled, the transfers and movements made and the
//!    stored idempotent responses of the wallets that matched (a movement's wallets are one group:
//!    all of them match, or none is written), and nothing of those that did not. One autocommit statement: one WAL flush for the round, and
//!    no transaction left open between statements, so a replica that stalls or is cut off
//!    mid-round holds no row lock. A key stored before fails it whole on the key's primary key,
//!    nothing written: the round reads the keys then, and writes again.
//!
//! The fence is raised by the write itself, not by the read: the compare-and-set applies a
//! holder's movements only to the very state it read, and raises the row's fence to its lease's in
//! the same statement, so once a newer holder has written, every write of an older one matches no
//! row (its fence or version moved) and is refused. A stale holder's write that comes first was
//! decided on the state it replaces, so nothing is lost either way; the newer holder's write then
//! finds the version moved and is refused, with nothing applied. This spares a payment a fence raise's
//! own row update, its row lock and its WAL records.
//!
//! The commit never waits for a row: it locks the round's wallet rows in id order with `SKIP
//! LOCKED` before touching them. A row locked by another statement belongs to another holder
//! writing it right now (a transfer, or a holder whose lease passed to another replica), so that
//! one wallet is left out of the round ([`Committed::busy`]) and the others go on: a stalled or
//! partitioned holder never holds up a round, and two rounds that share wallets never deadlock.

use super::event::{EventColumns, EventWrite};
use super::hold::Hold;
use super::idempotency::{KeyRef, ResponseRow};
use super::shards::{self, ShardKey, ShardMap, by_shard};
use super::storage::{Storage, Workers};
use super::transfer::{MovementRecord, Transfer};
use super::{Entry, StoreError, WalletRead};
use crate::domain::{EntryKind, FenceStanding, Metadata, Rules};
use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, QueryBuilder, Row};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use uuid::Uuid;

/// A wallet to read for the lease holding `fence`, which has `written` with it before (see
/// [`FenceStanding::of_holder`]).
#[derive(Debug, Clone, Copy)]
pub struct ToRead<'a> {
    pub id: &'a str,
    pub fence: i64,
    pub written: bool,
}

/// What the read found of one wallet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The wallet as it is, with what its holds reserve, the fence of its last writer (below the
    /// lease's) and its owner.
    Ready {
        wallet: WalletRead,
        held: i64,
        fence: i64,
        owner: Option<Arc<str>>,
        rules: Rules,
    },
    /// The row has seen this fence or a higher one (see [`StoreError::FenceBehind`]).
    FenceBehind {
        seen: i64,
    },
    /// The lease's fence is implausibly far above the row's `seen` (see
    /// [`crate::domain::MAX_FENCE_STEP`]): it must not be written.
    FenceImplausible {
        seen: i64,
    },
    NotFound,
}

/// A stored idempotency key, as [`read`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundKey {
    pub fingerprint: Vec<u8>,
    /// `None` while a request that claimed the key is still in flight (wallet creation claims
    /// keys before it runs).
    pub response: Option<ResponseRow>,
}

/// What [`read`] found: each wallet's outcome by id, each key still live by
/// `(caller, scope, key)`, and the holds asked for.
#[derive(Debug, Default)]
pub struct Found {
    pub wallets: HashMap<String, ReadOutcome>,
    pub keys: HashMap<(String, String, String), FoundKey>,
    pub holds: HashMap<Uuid, Hold>,
}

/// The holds a round reads: those its captures and voids name, and every hold still held that
/// expired by `now` of the wallets whose movements need their amount.
#[derive(Debug, Clone, Copy)]
pub struct HoldsToRead<'a> {
    pub ids: &'a [Uuid],
    pub expired_of: &'a [&'a str],
    pub now: DateTime<Utc>,
}

impl HoldsToRead<'_> {
    /// No hold to read.
    pub fn none() -> Self {
        HoldsToRead { ids: &[], expired_of: &[], now: Utc::now() }
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && self.expired_of.is_empty()
    }
}

/// Reads `wallets`, looks up `keys` (deleting those past their retention: they behave as new) and
/// reads `holds`, in one statement. Wallets, keys and holds are looked up among those of the
/// round's wallets (`round`) only, so under Citus the wallets of one shard are one statement on
/// that shard's node (Citus routes a statement by the wallets it names, in every table it reads; an
/// empty list would name none): a capture naming another wallet's hold finds no hold.
///
/// Under Citus, with `shards` known, a round whose wallets are on several shards reads each
/// shard's in a statement of its own: a statement naming two shards would delete their expired
/// keys in two phases.
pub async fn read(
    conn: &mut PgConnection,
    shards: Option<&ShardMap>,
    wallets: &[ToRead<'_>],
    round: &[&str],
    keys: &[KeyRef<'_>],
    holds: HoldsToRead<'_>,
) -> Result<Found, StoreError> {
    let statements = shards::statements(shards, round);
    if let [round] = statements.as_slice() {
        return read_statement(conn, wallets, round, keys, holds).await;
    }
    let mut found = Found::default();
    for round in &statements {
        let of_round = |id: &str| round.contains(&id);
        let wallets: Vec<ToRead<'_>> = wallets.iter().copied().filter(|w| of_round(w.id)).collect();
        let keys: Vec<KeyRef<'_>> = keys.iter().copied().filter(|k| of_round(k.wallet)).collect();
        let expired_of: Vec<&str> = holds.expired_of.iter().copied().filter(|&id| of_round(id)).collect();
        let holds = HoldsToRead { expired_of: &expired_of, ..holds };
        let read = Box::pin(read_statement(&mut *conn, &wallets, round, &keys, holds)).await?;
        found.wallets.extend(read.wallets);
        found.keys.extend(read.keys);
        found.holds.extend(read.holds);
    }
    Ok(found)
}

/// [`read`] in one statement.
async fn read_statement(
    conn: &mut PgConnection,
    wallets: &[ToRead<'_>],
    round: &[&str],
    keys: &[KeyRef<'_>],
    holds: HoldsToRead<'_>,
) -> Result<Found, StoreError> {
    let ids: Vec<&str> = wallets.iter().map(|w| w.id).collect();
    let key_wallets: Vec<&str> = keys.iter().map(|k| k.wallet).collect();
    let callers: Vec<&str> = keys.iter().map(|k| k.caller).collect();
    let scopes: Vec<&str> = keys.iter().map(|k| k.scope).collect();
    let names: Vec<&str> = keys.iter().map(|k| k.key).collect();
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"with expired as (
               delete from idempotency_key k
               using unnest($8::text[], $2::text[], $3::text[], $4::text[])
                   as q(wallet_id, caller, scope, key)
               where k.wallet_id = q.wallet_id and k.caller = q.caller and k.scope = q.scope
                 and k.key = q.key
                 and k.expires_at < now() and k.wallet_id = any($9::text[])
           )
           select w.id as wallet_id, w.balance, w.held, w.version, w.fence, w.owner, w.rules,
                  null::text as caller, null::text as scope, null::text as key,
                  null::bytea as fingerprint, null::int2 as status, null::text as content_type,
                  null::bytea as body, null::uuid as hold_id, null::text as hold_wallet,
                  null::int8 as hold_amount, null::text as hold_status,
                  null::timestamptz as hold_expires_at, null::text as hold_reference,
                  null::timestamptz as hold_created_at, null::int8 as hold_fence,
                  null::uuid as hold_movement, null::jsonb as hold_metadata
           from wallet w
           where w.id = any($1::text[]) and w.id = any($9::text[])
           union all
           select null, null, null, null, null, null, null, k.caller, k.scope, k.key, k.fingerprint,
                  k.status, k.content_type, k.body, null, null, null, null, null, null, null, null,
                  null, null
           from idempotency_key k
           join unnest($8::text[], $2::text[], $3::text[], $4::text[]) as q(wallet_id, caller, scope, key)
             on k.wallet_id = q.wallet_id and k.caller = q.caller and k.scope = q.scope
                and k.key = q.key
           where k.expires_at >= now() and k.wallet_id = any($9::text[])
           union all
           select null, null, null, null, null, null, null, null, null, null, null, null, null, null,
                  h.id, h.wallet_id, h.amount, h.status, h.expires_at, h.reference, h.created_at,
                  h.fence, h.movement_id, h.metadata
           from hold h
           where h.id = any($5::uuid[]) and h.wallet_id = any($9::text[])
           union all
           select null, null, null, null, null, null, null, null, null, null, null, null, null, null,
                  h.id, h.wallet_id, h.amount, h.status, h.expires_at, h.reference, h.created_at,
                  h.fence, h.movement_id, h.metadata
           from hold h
           where h.wallet_id = any($6::text[]) and h.status = 'held' and h.expires_at <= $7
             and h.wallet_id = any($9::text[])"#,
    )
    .bind(&ids)
    .bind(&callers)
    .bind(&scopes)
    .bind(&names)
    .bind(holds.ids)
    .bind(holds.expired_of)
    .bind(holds.now)
    .bind(&key_wallets)
    .bind(round)
    .fetch_all(conn)
    .await?;

    let mut found = Found::default();
    // Each wallet row as it is: (balance and version, the fence of its last writer, its owner).
    let mut rows_read: HashMap<String, ReadOutcome> = HashMap::new();
    for row in rows {
        if let Some(id) = row.try_get::<Option<String>, _>("wallet_id")? {
            let wallet = WalletRead { balance: row.try_get("balance")?, version: row.try_get("version")? };
            let owner = row.try_get::<Option<&str>, _>("owner")?.map(Arc::from);
            let (held, fence) = (row.try_get("held")?, row.try_get("fence")?);
            let rules = row.try_get::<Json<Rules>, _>("rules")?.0;
            rows_read.insert(id, ReadOutcome::Ready { wallet, held, fence, owner, rules });
        } else if let Some(id) = row.try_get::<Option<Uuid>, _>("hold_id")? {
            let hold = Hold {
                id,
                wallet_id: row.try_get("hold_wallet")?,
                amount: row.try_get("hold_amount")?,
                captured: 0,
                status: row.try_get("hold_status")?,
                expires_at: row.try_get("hold_expires_at")?,
                reference: row.try_get("hold_reference")?,
                metadata: super::stored_metadata(&row, "hold_metadata")?,
                created_at: row.try_get("hold_created_at")?,
                settled_at: None,
                capture_entry: None,
                movement_id: row.try_get("hold_movement")?,
                fence: row.try_get("hold_fence")?,
            };
            found.holds.insert(id, hold);
        } else if let Some(caller) = row.try_get::<Option<String>, _>("caller")? {
            let response = ResponseRow::of_columns(
                row.try_get("status")?,
                row.try_get("content_type")?,
                row.try_get("body")?,
            );
            let at = (caller, row.try_get("scope")?, row.try_get("key")?);
            found.keys.insert(at, FoundKey { fingerprint: row.try_get("fingerprint")?, response });
        }
    }
    found.wallets = wallets
        .iter()
        .map(|wallet| {
            let outcome = match rows_read.get(wallet.id) {
                Some(ready @ &ReadOutcome::Ready { fence: seen, .. }) => {
                    match FenceStanding::of_holder(wallet.fence, wallet.written, seen) {
                        FenceStanding::Above => ready.clone(),
                        FenceStanding::Behind => ReadOutcome::FenceBehind { seen },
                        FenceStanding::Implausible => ReadOutcome::FenceImplausible { seen },
                    }
                }
                Some(other) => other.clone(),
                None => ReadOutcome::NotFound,
            };
            (wallet.id.to_owned(), outcome)
        })
        .collect();
    Ok(found)
}

/// One wallet's write in a [`commit`]: from the state the holder read (`read_balance`,
/// `read_held`, `read_version`, `owner`, and `read_fence`, the fence of the row's last writer) to
/// `version`, `balance` and `held`, under the lease holding `fence`. With no entries (`version ==
/// read_version`) it only checks that the wallet is still as read (and raises its fence), so
/// refusals are stored only from a state this holder owns.
///
/// The write matches only a row that is exactly as the holder believes, every field it decided on
/// included, so the state may come from anywhere (the lease's note, say): a wrong one moves nothing.
/// The wallets of one `group` (the legs of one movement) are written all or none.
///
/// Bound as the composite `wallet_write` (migration 0013): its fields in that type's order.
#[derive(Debug, Clone, Copy, sqlx::Encode)]
pub struct WalletWrite<'a> {
    pub id: &'a str,
    pub group: i32,
    pub fence: i64,
    pub read_fence: i64,
    pub read_version: i64,
    pub read_balance: i64,
    pub read_held: i64,
    pub owner: Option<&'a str>,
    pub balance: i64,
    pub held: i64,
    pub version: i64,
}

/// A hold's settlement in a [`commit`]: `captured` (with what it charged and its `pay` entry),
/// `voided` or `expired`, written with its wallet. Bound as the composite `hold_settled`.
#[derive(Debug, Clone, Copy, sqlx::Encode)]
pub struct Settlement<'a> {
    pub hold: Uuid,
    pub wallet_id: &'a str,
    pub status: crate::domain::HoldStatus,
    pub captured: i64,
    pub capture_entry: Option<Uuid>,
}

/// A response to store for an idempotency key (its `status`, `content_type` and `body`), with
/// the wallet whose write it depends on.
#[derive(Debug, Clone, Copy)]
pub struct KeyWrite<'a> {
    pub wallet_id: &'a str,
    pub at: KeyRef<'a>,
    pub fingerprint: &'a [u8],
    pub status: u16,
    pub content_type: &'a str,
    pub body: &'a [u8],
    pub entry_id: Option<Uuid>,
}

/// Everything one round writes.
#[derive(Debug, Default)]
pub struct GroupWrite<'a> {
    pub wallets: Vec<WalletWrite<'a>>,
    /// The ledger entries to append, each with its wallet, version (its `seq`), fence and time
    /// (every entry of a round has the round's time).
    pub entries: Vec<&'a Entry>,
    pub keys: Vec<KeyWrite<'a>>,
    /// Holds placed (each with its wallet, amount, expiry, reference and fence).
    pub placed: Vec<&'a Hold>,
    pub settled: Vec<Settlement<'a>>,
    /// Transfers and movements of many legs made (each written with its first wallet's write).
    pub transfers: Vec<&'a Transfer>,
    pub movements: Vec<&'a MovementRecord>,
    /// What happened to each wallet, in the order it happened: numbered after the wallet's last
    /// event by the write itself, so the decision needs no count of them.
    pub events: Vec<&'a EventWrite>,
    /// The wallets whose rules the write changes, with what they become.
    pub rules: Vec<(&'a str, &'a Rules)>,
    /// Each of `wallets`' rules as read, which its row must still have (beside the composite
    /// `wallet_write`, which a replica of an earlier release binds as it was).
    pub read_rules: Vec<&'a Rules>,
}

impl<'a> GroupWrite<'a> {
    /// A write of `wallets`, each read with no rules, and nothing else yet.
    pub fn of(wallets: Vec<WalletWrite<'a>>) -> Self {
        let read_rules = vec![&NO_RULES; wallets.len()];
        GroupWrite { wallets, read_rules, ..GroupWrite::default() }
    }
}

static NO_RULES: Rules = Rules::NONE;

/// What a [`commit`] did, by wallet id.
#[derive(Debug, Default)]
pub struct Committed {
    /// The wallets whose write matched: their entries and keys are written.
    pub moved: HashSet<String>,
    /// The wallets whose row another statement had locked right then: nothing of them was
    /// written, and they may be tried again while the lease lasts. A wallet in neither set was
    /// written by another holder since this one read it (or is of a group one of whose wallets
    /// was): nothing of it was written.
    pub busy: HashSet<String>,
}

/// An entry as the composite `entry_write` binds it.
#[derive(sqlx::Encode)]
struct EntryWriteRow<'a> {
    id: Uuid,
    wallet_id: &'a str,
    seq: i64,
    kind: EntryKind,
    amount: i64,
    balance_after: i64,
    fence: i64,
    reference: Option<&'a str>,
    hold_id: Option<Uuid>,
    transfer_id: Option<Uuid>,
    refund_of: Option<Uuid>,
}

impl<'a> From<&'a Entry> for EntryWriteRow<'a> {
    fn from(e: &'a Entry) -> Self {
        EntryWriteRow {
            id: e.id,
            wallet_id: &e.wallet_id,
            seq: e.version,
            kind: e.kind,
            amount: e.amount,
            balance_after: e.balance,
            fence: e.fence,
            reference: e.reference.as_deref(),
            hold_id: e.hold_id,
            transfer_id: e.transfer_id,
            refund_of: e.refund_of,
        }
    }
}

/// A hold placed, as the composite `hold_placed` binds it.
#[derive(sqlx::Encode)]
struct PlacedRow<'a> {
    id: Uuid,
    wallet_id: &'a str,
    amount: i64,
    expires_at: DateTime<Utc>,
    reference: Option<&'a str>,
    fence: i64,
    movement_id: Option<Uuid>,
}

/// A transfer, as the composite `transfer_write` binds it (migration 0015).
#[derive(sqlx::Encode)]
struct TransferWriteRow<'a> {
    id: Uuid,
    from_wallet: &'a str,
    to_wallet: &'a str,
    amount: i64,
    reference: Option<&'a str>,
    refund_of: Option<Uuid>,
}

/// A movement of many legs, as the composite `movement_write` binds it: it lives with its first
/// leg's wallet. A held movement keeps its expiry and its legs as asked (migration 0016).
#[derive(sqlx::Encode)]
struct MovementWriteRow<'a> {
    id: Uuid,
    wallet_id: &'a str,
    legs: i16,
    reference: Option<&'a str>,
    expires_at: Option<DateTime<Utc>>,
    leg_wallets: Option<Vec<&'a str>>,
    leg_amounts: Option<Vec<i64>>,
    refund_of: Option<Uuid>,
}

impl<'a> From<&'a Transfer> for TransferWriteRow<'a> {
    fn from(t: &'a Transfer) -> Self {
        TransferWriteRow {
            id: t.id,
            from_wallet: &t.from,
            to_wallet: &t.to,
            amount: t.amount,
            reference: t.reference.as_deref(),
            refund_of: t.refund_of,
        }
    }
}

impl<'a> From<&'a MovementRecord> for MovementWriteRow<'a> {
    fn from(m: &'a MovementRecord) -> Self {
        let held = m.hold.as_ref();
        MovementWriteRow {
            id: m.id,
            wallet_id: m.first_wallet(),
            legs: held.map_or(m.legs.len(), |h| h.legs.len()) as i16,
            reference: m.reference.as_deref(),
            expires_at: held.map(|h| h.expires_at),
            leg_wallets: held.map(|h| h.legs.iter().map(|leg| leg.wallet_id.as_str()).collect()),
            leg_amounts: held.map(|h| h.legs.iter().map(|leg| leg.amount).collect()),
            refund_of: m.refund_of,
        }
    }
}

/// A key's response, as the composite `key_write` binds it.
#[derive(sqlx::Encode)]
struct KeyWriteRow<'a> {
    depends_on: &'a str,
    wallet_id: &'a str,
    caller: &'a str,
    scope: &'a str,
    key: &'a str,
    fingerprint: &'a [u8],
    status: i16,
    content_type: &'a str,
    body: &'a [u8],
    entry_id: Option<Uuid>,
}

/// Declares that `$ty` binds as the composite type `$name` (and arrays of it as `$name[]`), which
/// migration 0013 creates: sqlx resolves the name once per connection.
macro_rules! composite {
    ($ty:ty, $name:literal) => {
        impl sqlx::Type<sqlx::Postgres> for $ty {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                sqlx::postgres::PgTypeInfo::with_name($name)
            }
        }
        impl sqlx::postgres::PgHasArrayType for $ty {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                sqlx::postgres::PgTypeInfo::array_of($name)
            }
        }
    };
}
composite!(WalletWrite<'_>, "wallet_write");
composite!(Settlement<'_>, "hold_settled");
composite!(EntryWriteRow<'_>, "entry_write");
composite!(PlacedRow<'_>, "hold_placed");
composite!(KeyWriteRow<'_>, "key_write");
composite!(TransferWriteRow<'_>, "transfer_write");
composite!(MovementWriteRow<'_>, "movement_write");

/// The compare-and-set of every wallet write, on one Postgres and under Citus alike: the row `l`
/// as locked is exactly the state `b` was decided from.
const MATCHES_AS_READ: &str = "l.fence = b.read_fence and l.version = b.read_version \
     and l.balance = b.read_balance and l.held = b.read_held and l.owner is not distinct from b.owner \
     and l.rules = b.read_rules";

/// [`commit`]'s statement on one Postgres: the wallets' compare-and-set, then whatever the wallets
/// that matched bring. `{holds}` is the holds' two CTEs and `{movements}` the transfers' and
/// movements', each or nothing for a round without them (nearly every round has neither):
/// Postgres plans, opens and locks every relation a statement names, whether or not a row goes
/// there (with holds, 10 relation locks a round; without, 6).
fn commit_statement(with_holds: bool, with_movements: bool) -> String {
    // language=PostgreSQL
    let holds = r#"
           placed as (
               insert into hold (id, wallet_id, amount, expires_at, reference, fence, created_at,
                                 movement_id, metadata)
               select p.id, p.wallet_id, p.amount, p.expires_at, p.reference, p.fence, $6,
                      p.movement_id, ($11::jsonb[])[p.ordinality]
               from unnest($3::hold_placed[]) with ordinality as p
               where p.wallet_id in (select id from moved)
           ),
           settled as (
               update hold h set status = s.status, captured = s.captured,
                                 capture_entry = s.capture_entry, settled_at = $6
               from unnest($4::hold_settled[]) as s
               where h.id = s.id and h.wallet_id = s.wallet_id
                 and s.wallet_id in (select id from moved)
           ),"#;
    // A movement's wallets are one group, written all or none: its first wallet stands for it.
    // language=PostgreSQL
    let movements = r#"
           transfers as (
               insert into transfer (id, from_wallet, to_wallet, amount, reference, refund_of,
                                     created_at, metadata)
               select t.id, t.from_wallet, t.to_wallet, t.amount, t.reference, t.refund_of, $6,
                      ($12::jsonb[])[t.ordinality]
               from unnest($8::transfer_write[]) with ordinality as t
               where t.from_wallet in (select id from moved)
           ),
           movements as (
               insert into movement (id, wallet_id, legs, reference, created_at, expires_at,
                                     leg_wallets, leg_amounts, refund_of, metadata)
               select v.id, v.wallet_id, v.legs, v.reference, $6, v.expires_at, v.leg_wallets,
                      v.leg_amounts, v.refund_of, ($13::jsonb[])[v.ordinality]
               from unnest($9::movement_write[]) with ordinality as v
               where v.wallet_id in (select id from moved)
           ),"#;
    // language=PostgreSQL
    format!(
        r#"with b as (
               -- The rules as read beside each wallet's write (migration 0024).
               select w.*, ($21::jsonb[])[w.ordinality] as read_rules
               from unnest($1::wallet_write[]) with ordinality as w
           ),
           locked as (
               select id, fence, version, balance, held, owner, rules from wallet
               where id = any(array(select id from b)) order by id for update skip locked
           ),
           matched as (
               select b.grp from b left join locked l on l.id = b.id
               group by b.grp
               having bool_and(l.id is not null and {MATCHES_AS_READ})
           ),
           ev as (
               select v.wallet_id, v.type, v.entry_id, v.hold_id, v.monitor,
                      row_number() over (partition by v.wallet_id order by v.n) as nth
               from unnest($14::text[], $15::text[], $16::uuid[], $17::uuid[], $18::int8[]) with ordinality
                   as v(wallet_id, type, entry_id, hold_id, monitor, n)
           ),
           -- Joined, not a subquery a wallet: that scans `ev` once per wallet, quadratic in a round.
           ev_count as (select wallet_id, count(*) as n from ev group by wallet_id),
           moved as (
               update wallet w set balance = b.balance, version = b.version, fence = b.fence,
                                   held = b.held, updated_at = now(),
                                   rules = coalesce(
                                       (select m.rules from unnest($19::text[], $20::jsonb[])
                                            as m(wallet_id, rules) where m.wallet_id = w.id),
                                       w.rules),
                                   event_seq = w.event_seq + coalesce(c.n, 0),
                                   event_position = greatest(w.event_position, pg_current_xact_id())
               from b left join ev_count c on c.wallet_id = b.id
               where w.id = b.id and b.grp in (select grp from matched)
               returning w.id, w.event_seq - coalesce(c.n, 0) as seq_before, w.event_position
           ),
           events as (
               insert into event (wallet_id, seq, position, type, entry_id, hold_id, monitor, created_at)
               select ev.wallet_id, m.seq_before + ev.nth, m.event_position, ev.type,
                      ev.entry_id, ev.hold_id, ev.monitor, $6
               from ev join moved m on m.id = ev.wallet_id
           ),{holds}{movements}
           entries as (
               insert into ledger_entry
                   (id, wallet_id, seq, kind, amount, balance_after, fence, reference, hold_id,
                    transfer_id, refund_of, created_at, metadata)
               select e.id, e.wallet_id, e.seq, e.kind, e.amount, e.balance_after, e.fence,
                      e.reference, e.hold_id, e.transfer_id, e.refund_of, $6,
                      ($10::jsonb[])[e.ordinality]
               from unnest($2::entry_write[]) with ordinality as e
               where e.wallet_id in (select id from moved)
           ),
           keys as (
               insert into idempotency_key (wallet_id, caller, scope, key, fingerprint, status,
                                            content_type, body, entry_id, expires_at)
               select k.wallet_id, k.caller, k.scope, k.key, k.fingerprint, k.status,
                      k.content_type, k.body, k.entry_id, now() + make_interval(secs => $7)
               from unnest($5::key_write[]) as k
               where k.depends_on in (select id from moved)
           )
           select id, true as moved from moved
           union all
           select b.id, false from b where b.id not in (select id from locked)"#,
        holds = if with_holds { holds } else { "" },
        movements = if with_movements { movements } else { "" },
    )
}

/// [`commit_statement`] of each kind of round, by `with_holds + 2 * with_movements`.
static COMMITS: LazyLock<[String; 4]> = LazyLock::new(|| {
    [(false, false), (true, false), (false, true), (true, true)]
        .map(|(holds, movements)| commit_statement(holds, movements))
});

/// Writes a round in one statement (see the module doc).
///
/// Fails whole, nothing written, with a unique violation on `idempotency_key` if another holder
/// stored one of the round's keys after [`read`] looked (only a holder that lost its lease lets
/// that happen): read again and replay it.
///
/// Under Citus, with `workers`, a round whose wallets the map places on one worker is written on
/// that worker's own connection (see [`commit_routed`]); without, through `conn`, as inside a
/// transaction that holds the wallets' rows.
pub async fn commit(
    conn: &mut PgConnection,
    storage: Storage,
    shards: Option<&ShardMap>,
    workers: Option<&Workers>,
    write: &GroupWrite<'_>,
    created_at: DateTime<Utc>,
    retention: Duration,
) -> Result<Committed, StoreError> {
    if storage == Storage::Citus {
        let routed = Routed { shards, write, created_at, retention, direct: false };
        return Box::pin(commit_routed(conn, workers, routed)).await;
    }
    assert_eq!(write.read_rules.len(), write.wallets.len(), "each wallet's rules as read, beside it");
    let with_holds = !(write.placed.is_empty() && write.settled.is_empty());
    let with_movements = !(write.transfers.is_empty() && write.movements.is_empty());
    let statement = COMMITS[usize::from(with_holds) + 2 * usize::from(with_movements)].as_str();
    let entries: Vec<EntryWriteRow<'_>> = write.entries.iter().map(|&e| e.into()).collect();
    let placed: Vec<PlacedRow<'_>> = write
        .placed
        .iter()
        .map(|h| PlacedRow {
            id: h.id,
            wallet_id: &h.wallet_id,
            amount: h.amount,
            expires_at: h.expires_at,
            reference: h.reference.as_deref(),
            fence: h.fence,
            movement_id: h.movement_id,
        })
        .collect();
    let keys: Vec<KeyWriteRow<'_>> = write.keys.iter().map(key_row).collect();
    let transfers: Vec<TransferWriteRow<'_>> = write.transfers.iter().map(|&t| t.into()).collect();
    let movements: Vec<MovementWriteRow<'_>> = write.movements.iter().map(|&m| m.into()).collect();
    let events = EventColumns::of(write.events.iter().copied());
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(&write.wallets)
        .bind(&entries)
        .bind(&placed)
        .bind(&write.settled)
        .bind(&keys)
        .bind(created_at)
        .bind(retention.as_secs_f64())
        .bind(&transfers)
        .bind(&movements)
        .bind(beside(&write.entries, |e| &e.metadata))
        .bind(beside(&write.placed, |h| &h.metadata))
        .bind(beside(&write.transfers, |t| &t.metadata))
        .bind(beside(&write.movements, |m| &m.metadata))
        .bind(&events.wallets)
        .bind(&events.kinds)
        .bind(&events.entries)
        .bind(&events.holds)
        .bind(&events.monitors)
        .bind(write.rules.iter().map(|(id, _)| *id).collect::<Vec<_>>())
        .bind(write.rules.iter().map(|(_, rules)| Json(*rules)).collect::<Vec<_>>())
        .bind(write.read_rules.iter().map(|rules| Json(*rules)).collect::<Vec<_>>())
        .fetch_all(conn)
        .await?;
    let mut committed = Committed::default();
    for row in rows {
        let id: String = row.try_get("id")?;
        if row.try_get::<bool, _>("moved")? {
            committed.moved.insert(id);
        } else {
            committed.busy.insert(id);
        }
    }
    super::event::count_written(
        write.events.iter().copied().filter(|e| committed.moved.contains(&e.wallet_id)),
    );
    Ok(committed)
}

/// The metadata of each of `rows`, in order, as the `jsonb[]` that goes beside their composite
/// array in [`commit`]'s statement (read by each row's position): none at all when no row has any,
/// as in a round of payments without it.
/// Beside the composite types, not in them: a replica of an earlier release still binds those as
/// they were while a release's migration runs (migration 0020).
fn beside<'a, T>(
    rows: &[&'a T],
    metadata: impl Fn(&'a T) -> &'a Metadata,
) -> Vec<Option<Json<&'a BTreeMap<String, String>>>> {
    if rows.iter().all(|&row| metadata(row).is_empty()) {
        return Vec::new();
    }
    rows.iter().map(|&row| metadata(row).pairs().map(Json)).collect()
}

fn key_row<'a>(k: &KeyWrite<'a>) -> KeyWriteRow<'a> {
    KeyWriteRow {
        depends_on: k.wallet_id,
        wallet_id: k.at.wallet,
        caller: k.at.caller,
        scope: k.at.scope,
        key: k.at.key,
        fingerprint: k.fingerprint,
        status: k.status as i16,
        content_type: k.content_type,
        body: k.body,
        entry_id: k.entry_id,
    }
}

impl StoreError {
    /// Another holder stored one of the round's idempotency keys first (see [`commit`]).
    pub fn is_key_conflict(&self) -> bool {
        matches!(self, StoreError::Database(sqlx::Error::Database(db))
            if super::violates(db.as_ref(), "idempotency_key_pkey"))
    }
}

/// [`commit`] under Citus: the same writes, as one transaction whose every statement Citus routes
/// to one shard (the wallets of a round are on one node, see `crate::wallet::rounds`), so the
/// round commits on that node alone, without two-phase commit. The one-statement commit would not
/// do: Citus plans its writable CTEs apart and ships their results to every node, and a statement
/// that names two shards commits in two phases. So each table's rows go in one statement per
/// shard ([`ShardMap::key`]: one per wallet where the map does not know its shard).
/// Each wallet's row is locked (`SKIP LOCKED`: a busy row is left out, as in [`commit`]) and
/// written with the same compare-and-set ([`MATCHES_AS_READ`]); the entries, holds and keys follow
/// for the wallets that matched, and a key stored meanwhile fails the transaction whole, as it
/// fails [`commit`]'s statement. A group (a movement's wallets) with a wallet that did not match
/// leaves the transaction rolled back, nothing written, so the legs of a movement are written all
/// or none here too.
///
/// The events' position is a transaction id of the coordinator's, held open until the round has
/// committed (see [`super::event`]). With `workers`, a round the map places on one worker is
/// written there, on a connection of its own ([`Routed::on_worker`]), and the coordinator's
/// transaction only takes the position and ends after it, rolled back (it wrote nothing);
/// otherwise the round's statements run in the coordinator's transaction, which Citus commits on
/// the worker before its own.
async fn commit_routed(
    conn: &mut PgConnection,
    workers: Option<&Workers>,
    routed: Routed<'_, '_>,
) -> Result<Committed, StoreError> {
    let mut coordinator = sqlx::Connection::begin(&mut *conn).await?;
    // Only a round that may be written on a worker takes the audit's lock: it comes from the
    // rounds, on a connection that holds no lock yet, so it takes that lock before any table's,
    // as the audit does. A caller inside its own transaction (rows locked first) must not.
    let position = match workers {
        Some(_) => super::event::round_position(&mut coordinator).await?,
        None => super::event::transaction_position(&mut coordinator).await?,
    };
    if let Some(committed) = routed.on_worker(workers, position).await? {
        if let Err(err) = coordinator.rollback().await {
            // The round is committed; the position's transaction ends with its connection.
            tracing::warn!(error = %err, "ending the transaction of a round's event position failed");
        }
        return Ok(routed.counted(committed));
    }
    let committed = routed.write_in(&mut coordinator, position).await?;
    if committed.moved.is_empty() {
        coordinator.rollback().await?;
    } else {
        coordinator.commit().await?;
    }
    Ok(routed.counted(committed))
}

/// What [`commit_routed`] writes.
#[derive(Clone, Copy)]
struct Routed<'m, 'w> {
    shards: Option<&'m ShardMap>,
    write: &'m GroupWrite<'w>,
    created_at: DateTime<Utc>,
    retention: Duration,
    /// On the worker's own connection: the statements name the shards' tables.
    direct: bool,
}

impl Routed<'_, '_> {
    /// The round written in a transaction on a connection straight to the worker that holds every
    /// wallet of it, on the shards' own tables: `None`, nothing written, where it cannot be (the
    /// map places the wallets on several nodes or does not know them, the worker does not answer
    /// this replica, or a shard is no longer there), and the coordinator's route takes the round.
    ///
    /// Writing a shard's table bypasses Citus, and with it the lock by which Citus keeps writes
    /// off a shard while it moves or splits it: an exclusive lock on the shard's metadata, taken
    /// on every node before the move's last catch-up (`BlockWritesToShardList`). So the
    /// transaction first takes that lock in share mode, as Citus's own writes do, and checks the
    /// shards are still placed on this worker (`walletlock_shards_here`, made by
    /// [`super::schema::migrate`]); a move waits for the round, or the round for the move and
    /// then finds its shards gone.
    async fn on_worker(
        self,
        workers: Option<&Workers>,
        position: i64,
    ) -> Result<Option<Committed>, StoreError> {
        let Some((map, workers)) = self.shards.zip(workers) else { return Ok(None) };
        let Some(node) = map.node_of_all(self.write.wallets.iter().map(|w| w.id)) else { return Ok(None) };
        let Some(address) = map.address(node) else { return Ok(None) };
        let mut conn = match super::acquire(&workers.pool(address)).await {
            Ok(conn) => conn,
            Err(err) => {
                tracing::debug!(error = %err, "no connection to a worker; the round goes through the coordinator");
                return Ok(None);
            }
        };
        let shards: Vec<i64> = by_shard(self.write.wallets.iter(), |w| ShardMap::key(self.shards, w.id))
            .into_keys()
            .filter_map(|key| match key {
                ShardKey::Shard(shard) => Some(shard),
                ShardKey::Wallet(_) => None,
            })
            .collect();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let here = sqlx::query_scalar("select walletlock_shards_here($1, $2)")
            .bind(&shards)
            .bind(node)
            .fetch_one(&mut *tx)
            .await;
        let here: bool = match here {
            Err(sqlx::Error::Database(err)) if matches!(err.code().as_deref(), Some("42883" | "42501")) => {
                // No such function, or not the app role's (a schema `walletlock migrate` of an
                // earlier release made, or a role not granted it): the coordinator's route.
                tracing::warn!(error = %err, "a round cannot check its shards on its worker; run walletlock migrate");
                false
            }
            here => here?,
        };
        if !here {
            tx.rollback().await?;
            return Ok(None);
        }
        let committed = Routed { direct: true, ..self }.write_in(&mut tx, position).await?;
        if committed.moved.is_empty() {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
        Ok(Some(committed))
    }

    /// `committed`, once its events are counted.
    fn counted(&self, committed: Committed) -> Committed {
        let written = self.write.events.iter().copied().filter(|e| committed.moved.contains(&e.wallet_id));
        super::event::count_written(written);
        committed
    }

    /// Runs the round's statements in `tx`, its events at `position`. Nothing moved (a group
    /// written in part, or no wallet matched): the caller rolls `tx` back.
    async fn write_in(&self, tx: &mut PgConnection, position: i64) -> Result<Committed, StoreError> {
        let Routed { shards, write, created_at, retention, direct } = *self;
        let table = |key: &ShardKey<'_>, name: &str| -> String {
            match (direct, key, shards) {
                (true, ShardKey::Shard(shard), Some(map)) => {
                    map.shard_table(*shard, name).unwrap_or_else(|| name.to_owned())
                }
                _ => name.to_owned(),
            }
        };
        // The wallets' compare-and-set on `wallet`, the distributed table or one shard's own.
        let write_wallets = |wallet: &str| {
            // language=PostgreSQL
            format!(
                r#"with locked as (
                   select id, fence, version, balance, held, owner, rules from {wallet}
                   where id = any($1::text[]) order by id for update skip locked
               ),
               b as (
                   select * from unnest($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[],
                                        $6::int8[], $7::text[], $8::int8[], $9::int8[], $10::int8[],
                                        $11::int8[], $12::jsonb[], $13::jsonb[])
                       as b(id, fence, read_fence, read_version, read_balance, read_held, owner,
                            balance, held, version, events, rules, read_rules)
               ),
               moved as (
                   update {wallet} w set balance = b.balance, version = b.version, fence = b.fence,
                                       held = b.held, updated_at = now(),
                                       rules = coalesce(b.rules, w.rules),
                                       event_seq = w.event_seq + b.events,
                                       event_position = greatest(w.event_position, $14::text::xid8)
                   from locked l, b
                   where w.id = l.id and w.id = b.id and w.id = any($1::text[]) and {MATCHES_AS_READ}
                   returning w.id, w.event_seq, w.event_position::text::int8 as event_position
               )
               select b.id, exists (select from locked l where l.id = b.id) as locked,
                      m.id is not null as moved, m.event_seq, m.event_position
               from b left join moved m on m.id = b.id"#
            )
        };
        let mut committed = Committed::default();
        // Each moved wallet's last event number before this write, and the position of its events.
        let mut numbered: HashMap<&str, (i64, i64)> = HashMap::new();
        let wallets: Vec<(&WalletWrite, &Rules)> =
            write.wallets.iter().zip(write.read_rules.iter().copied()).collect();
        for (key, wallets) in by_shard(wallets, |(w, _)| ShardMap::key(shards, w.id)) {
            let statement = write_wallets(&table(&key, "wallet"));
            let events = |id: &str| write.events.iter().filter(|e| e.wallet_id == id).count() as i64;
            let column =
                |field: fn(&WalletWrite) -> i64| wallets.iter().map(|(w, _)| field(w)).collect::<Vec<_>>();
            let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
                .bind(wallets.iter().map(|(w, _)| w.id).collect::<Vec<_>>())
                .bind(column(|w| w.fence))
                .bind(column(|w| w.read_fence))
                .bind(column(|w| w.read_version))
                .bind(column(|w| w.read_balance))
                .bind(column(|w| w.read_held))
                .bind(wallets.iter().map(|(w, _)| w.owner).collect::<Vec<_>>())
                .bind(column(|w| w.balance))
                .bind(column(|w| w.held))
                .bind(column(|w| w.version))
                .bind(wallets.iter().map(|(w, _)| events(w.id)).collect::<Vec<_>>())
                .bind(
                    wallets
                        .iter()
                        .map(|(w, _)| {
                            write.rules.iter().find(|(id, _)| *id == w.id).map(|(_, rules)| Json(*rules))
                        })
                        .collect::<Vec<_>>(),
                )
                .bind(wallets.iter().map(|(_, read_rules)| Json(*read_rules)).collect::<Vec<_>>())
                .bind(position.to_string())
                .fetch_all(&mut *tx)
                .await?;
            for row in rows {
                let id: &str = row.try_get("id")?;
                let Some(&(w, _)) = wallets.iter().find(|(w, _)| w.id == id) else { continue };
                if row.try_get("moved")? {
                    let last: i64 = row.try_get("event_seq")?;
                    numbered.insert(w.id, (last - events(w.id), row.try_get("event_position")?));
                    committed.moved.insert(w.id.to_owned());
                } else if !row.try_get::<bool, _>("locked")? {
                    committed.busy.insert(w.id.to_owned());
                }
            }
        }
        let unmatched: HashSet<i32> =
            write.wallets.iter().filter(|w| !committed.moved.contains(w.id)).map(|w| w.group).collect();
        if write.wallets.iter().any(|w| committed.moved.contains(w.id) && unmatched.contains(&w.group)) {
            // A group written in part: nothing of the round is written, and every wallet is tried again.
            committed.moved.clear();
            return Ok(committed);
        }
        let moved = |wallet: &str| committed.moved.contains(wallet);
        // Rows go in as a multi-row VALUES: Citus routes that to the wallet's shard, where an
        // INSERT ... SELECT would go through the coordinator as a COPY, which Citus always commits in
        // two phases.
        let entries = write.entries.iter().copied().filter(|e| moved(&e.wallet_id));
        for (key, entries) in by_shard(entries, |e| ShardMap::key(shards, &e.wallet_id)) {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "ledger_entry"))
                    + "(id, wallet_id, seq, kind, amount, balance_after, fence, reference, \
             hold_id, transfer_id, refund_of, created_at, metadata) ",
            );
            insert.push_values(&entries, |mut row, e| {
                row.push_bind(e.id).push_bind(&e.wallet_id).push_bind(e.version).push_bind(e.kind);
                row.push_bind(e.amount).push_bind(e.balance).push_bind(e.fence).push_bind(&e.reference);
                row.push_bind(e.hold_id)
                    .push_bind(e.transfer_id)
                    .push_bind(e.refund_of)
                    .push_bind(created_at);
                row.push_bind(e.metadata.pairs().map(Json));
            });
            insert.build().execute(&mut *tx).await?;
        }
        let placed = write.placed.iter().copied().filter(|h| moved(&h.wallet_id));
        for (key, placed) in by_shard(placed, |h| ShardMap::key(shards, &h.wallet_id)) {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "hold"))
                    + "(id, wallet_id, amount, expires_at, reference, fence, created_at, movement_id, \
             metadata) ",
            );
            insert.push_values(&placed, |mut row, h| {
                row.push_bind(h.id).push_bind(&h.wallet_id).push_bind(h.amount).push_bind(h.expires_at);
                row.push_bind(&h.reference).push_bind(h.fence).push_bind(created_at).push_bind(h.movement_id);
                row.push_bind(h.metadata.pairs().map(Json));
            });
            insert.build().execute(&mut *tx).await?;
        }
        let settled = write.settled.iter().filter(|s| moved(s.wallet_id));
        for (_, settled) in by_shard(settled, |s| ShardMap::key(shards, s.wallet_id)) {
            let wallets: Vec<&str> = settled.iter().map(|s| s.wallet_id).collect();
            sqlx::query(
                // language=PostgreSQL
                r#"update hold h set status = s.status, captured = s.captured,
                                 capture_entry = s.capture_entry, settled_at = $6
               from unnest($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::uuid[])
                   as s(id, wallet_id, status, captured, capture_entry)
               where h.wallet_id = any($7::text[]) and h.id = s.id and h.wallet_id = s.wallet_id"#,
            )
            .bind(settled.iter().map(|s| s.hold).collect::<Vec<_>>())
            .bind(settled.iter().map(|s| s.wallet_id).collect::<Vec<_>>())
            .bind(settled.iter().map(|s| s.status.as_str()).collect::<Vec<_>>())
            .bind(settled.iter().map(|s| s.captured).collect::<Vec<_>>())
            .bind(settled.iter().map(|s| s.capture_entry).collect::<Vec<_>>())
            .bind(created_at)
            .bind(&wallets)
            .execute(&mut *tx)
            .await?;
        }
        let transfers = write.transfers.iter().copied().filter(|t| moved(&t.from));
        for (key, transfers) in by_shard(transfers, |t| ShardMap::key(shards, &t.from)) {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "transfer"))
                    + "(id, from_wallet, to_wallet, amount, reference, refund_of, created_at, \
             metadata) ",
            );
            insert.push_values(&transfers, |mut row, t| {
                row.push_bind(t.id).push_bind(&t.from).push_bind(&t.to).push_bind(t.amount);
                row.push_bind(&t.reference).push_bind(t.refund_of).push_bind(created_at);
                row.push_bind(t.metadata.pairs().map(Json));
            });
            insert.build().execute(&mut *tx).await?;
        }
        let movements = write
            .movements
            .iter()
            .map(|&m| (MovementWriteRow::from(m), &m.metadata))
            .filter(|(m, _)| moved(m.wallet_id));
        for (key, movements) in by_shard(movements, |(m, _)| ShardMap::key(shards, m.wallet_id)) {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "movement"))
                    + "(id, wallet_id, legs, reference, created_at, expires_at, leg_wallets, \
             leg_amounts, refund_of, metadata) ",
            );
            insert.push_values(&movements, |mut row, (m, metadata)| {
                row.push_bind(m.id).push_bind(m.wallet_id).push_bind(m.legs).push_bind(m.reference);
                row.push_bind(created_at).push_bind(m.expires_at).push_bind(&m.leg_wallets);
                row.push_bind(&m.leg_amounts).push_bind(m.refund_of).push_bind(metadata.pairs().map(Json));
            });
            insert.build().execute(&mut *tx).await?;
        }
        let events: Vec<(&EventWrite, i64, i64)> = write
            .events
            .iter()
            .filter_map(|&event| {
                let (last, position) = numbered.get_mut(event.wallet_id.as_str())?;
                *last += 1;
                Some((event, *last, *position))
            })
            .collect();
        for (key, events) in by_shard(events.iter(), |(event, _, _)| ShardMap::key(shards, &event.wallet_id))
        {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "event"))
                    + "(wallet_id, seq, position, type, entry_id, hold_id, monitor, created_at) ",
            );
            insert.push_values(&events, |mut row, (event, seq, position)| {
                row.push_bind(&event.wallet_id).push_bind(*seq);
                row.push_bind(position.to_string()).push_unseparated("::text::xid8");
                row.push_bind(event.kind.as_str()).push_bind(event.entry_id).push_bind(event.hold_id);
                row.push_bind(event.monitor).push_bind(created_at);
            });
            insert.build().execute(&mut *tx).await?;
        }
        let keys = write.keys.iter().filter(|k| moved(k.wallet_id));
        for (key, keys) in by_shard(keys, |k| ShardMap::key(shards, k.at.wallet)) {
            let mut insert = QueryBuilder::new(
                format!("insert into {} ", table(&key, "idempotency_key"))
                    + "(wallet_id, caller, scope, key, fingerprint, status, content_type, \
             body, entry_id, expires_at) ",
            );
            insert.push_values(&keys, |mut row, k| {
                row.push_bind(k.at.wallet).push_bind(k.at.caller).push_bind(k.at.scope).push_bind(k.at.key);
                row.push_bind(k.fingerprint).push_bind(k.status as i16);
                row.push_bind(k.content_type).push_bind(k.body);
                row.push_bind(k.entry_id)
                    .push("now() + make_interval(secs => ")
                    .push_bind_unseparated(retention.as_secs_f64())
                    .push_unseparated(")");
            });
            insert.build().execute(&mut *tx).await?;
        }
        Ok(committed)
    }
}
