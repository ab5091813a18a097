//! `walletlock audit`: checks that the books balance.
//!
//! For every wallet: its balance equals the signed sum of its ledger (`pay` and `transfer_out`
//! take money out, every other kind puts it in) and is not negative; its entries are numbered
//! 1..=version with no gap; each entry's balance follows from the one before; fences never go down
//! along the ledger, and the wallet's fence is at least the last one used; entry times never go
//! down along the ledger (the history's instants rely on it: `ledger::history`).
//! For every transfer: exactly two legs, a `transfer_out` of `from` and a `transfer_in` of `to`,
//! each of the transfer's amount. For every movement of many legs: every leg, one a wallet, summing
//! to zero (a held movement captured in part: the legs whose share was not nothing). Refunds never
//! add up to more than what they refund (a payment, a transfer, or each leg of a movement, which
//! its refunds move the other way), and a `refund` entry refunds a `pay` entry of its own wallet.
//! For the whole system: money is conserved, so the balances add up to the opening balances plus
//! deposits minus payments plus refunds of payments (transfers add nothing: their legs cancel).
//! For every wallet with holds: what it holds equals the sum of its holds still `held`, and is no
//! more than its balance (the available balance is never negative). A hold captured of more than
//! nothing has exactly one ledger entry, a `pay` of its wallet of what it captured (a held
//! movement's: a `transfer_out`); any other hold has none.
//! For every stored idempotent success: it points at exactly one ledger entry, the one its response
//! reports (for a transfer, one of its legs), in the scope it was made for, so no key was charged
//! twice or without a record; a hold placed or voided reports a hold of its wallet and no entry, a
//! capture its hold and the `pay` entry that charged it.
//! For every velocity limit: what its window counts (`rules.velocity[].used`) is what the ledger
//! says was debited in it (see `crate::domain::velocity`): the payments and the debit legs of
//! transfers and movements stamped in `[from, until)`, captures and refunds aside, and the holds
//! placed in it (all of one still held, what a captured one took, nothing of one voided or
//! expired), each debit once.

use super::StoreError;
use super::storage::Storage;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};

/// What an entry does to its wallet's balance, as SQL over the entry's `kind` and `amount`.
macro_rules! signed_amount {
    () => {
        "case when kind in ('pay', 'transfer_out') then -amount else amount end"
    };
}

/// What the audit looked at, and every problem it found.
#[derive(Debug, Default)]
pub struct Report {
    pub wallets: i64,
    pub entries: i64,
    pub transfers: i64,
    pub holds: i64,
    pub keys: i64,
    pub problems: Vec<String>,
}

pub async fn run(conn: &mut PgConnection) -> Result<Report, StoreError> {
    let mut report = Report::default();
    let storage = Storage::of(&mut *conn).await?;
    // One transaction, rolled back: the audit writes nothing that outlives it. Its checks compare
    // tables with each other, so they read the books as of one moment, while money moves: on one
    // Postgres a snapshot (taken by the first statement after this one).
    let mut tx = sqlx::Connection::begin(conn).await?;
    let conn: &mut PgConnection = &mut tx;
    if storage == Storage::OnePostgres {
        sqlx::raw_sql("set transaction isolation level repeatable read").execute(&mut *conn).await?;
    } else {
        // The checks that pair rows of two wallets (a transfer's legs, a key and the entry it
        // reports) join on something else than the wallet the tables are distributed by, which
        // Citus cannot run across workers. The audit reads every row anyway: it reads them once
        // into temporary tables on the coordinator, which shadow the distributed ones for the
        // rest of this session, and checks those as on one Postgres.
        // With their keys and indexes (LIKE ... INCLUDING ALL), which the checks' joins use.
        const TABLES: [&str; 9] = [
            "wallet",
            "ledger_entry",
            "transfer",
            "movement",
            "hold",
            "idempotency_key",
            "entry_rollup",
            "entry_rollup_until",
            "event",
        ];
        let schema: String = sqlx::query_scalar("select current_schema()").fetch_one(&mut *conn).await?;
        let table = |name: &str| format!(r#""{schema}".{name}"#);
        // Citus's workers have no snapshot in common, so the copy pauses the movements instead
        // and reads the tables as the last one left them: every writer holds a lock on the
        // coordinator until its commit on the workers has ended, on what it writes there (or,
        // writing a round on a worker's own connection, the advisory lock below). The locks are the coordinator's alone (Citus would also take them
        // on the workers, where writers paused here hold row locks: distributed deadlocks).
        // A movement's first lock is on its wallets' rows, and it writes other tables (an
        // expired key deleted) before it writes those rows: the wallets are locked against
        // that first lock (EXCLUSIVE, which plain reads pass), so the audit waits for every
        // movement under way whole and holds back the next before it has locked anything. The
        // other writers (keys claimed, rollups) write in the order of the rest.
        // One statement each, as psql sends them: with the three in one string the workers
        // were once seen taking the locks too, and deadlocking with the copy.
        // Movements queue behind a lock the audit waits for: it gives up (an error, nothing
        // checked) rather than pause them for longer than `lock_timeout`.
        sqlx::raw_sql("set local citus.enable_ddl_propagation = off; set local lock_timeout = '10s'")
            .execute(&mut *conn)
            .await?;
        // First the rounds written on the workers' own connections, which hold no lock on these
        // tables but a shared advisory lock until their commit there (`event::round_position`):
        // before the tables, in the order a round that goes through the coordinator takes them.
        sqlx::query("select pg_advisory_xact_lock($1, hashtext(current_schema()))")
            .bind(super::event::ROUNDS_LOCK)
            .execute(&mut *conn)
            .await?;
        let others = TABLES[1..].iter().map(|name| table(name)).collect::<Vec<_>>().join(", ");
        for lock in [
            format!("lock table {} in exclusive mode", table(TABLES[0])),
            format!("lock table {others} in share mode"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(lock)).execute(&mut *conn).await?;
        }
        for table_name in TABLES {
            let copy = format!(
                r#"create temporary table {name} (like {real} including all) on commit drop;
                   insert into pg_temp.{name} select * from {real}"#,
                name = table_name,
                real = table(table_name),
            );
            sqlx::raw_sql(sqlx::AssertSqlSafe(copy)).execute(&mut *conn).await?;
        }
    }

    let totals = sqlx::query(
        // language=PostgreSQL
        r#"select (select count(*) from wallet) as wallets,
                  (select count(*) from ledger_entry) as entries,
                  (select count(*) from transfer) as transfers,
                  (select count(*) from hold) as holds,
                  (select count(*) from idempotency_key where claim is null) as keys"#,
    )
    .fetch_one(&mut *conn)
    .await?;
    report.wallets = totals.try_get("wallets")?;
    report.entries = totals.try_get("entries")?;
    report.transfers = totals.try_get("transfers")?;
    report.holds = totals.try_get("holds")?;
    report.keys = totals.try_get("keys")?;

    wallets(conn, &mut report).await?;
    chains(conn, &mut report).await?;
    rollups(conn, &mut report).await?;
    transfers(conn, &mut report).await?;
    movements(conn, &mut report).await?;
    refunds(conn, &mut report).await?;
    holds(conn, &mut report).await?;
    conservation(conn, &mut report).await?;
    keys(conn, &mut report).await?;
    events(conn, &mut report).await?;
    velocity(conn, &mut report).await?;
    tx.rollback().await?;
    Ok(report)
}

async fn wallets(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        "select w.id, w.balance, w.version, w.fence,
                coalesce((w.rules ->> 'overdraft')::int8, 0) as overdraft,
                coalesce(sum(",
        signed_amount!(),
        "), 0)::int8 as ledger_sum,
                count(e.id) as entries,
                coalesce(max(e.seq), 0) as last_seq,
                coalesce(max(e.fence), 0) as last_fence
         from wallet w left join ledger_entry e on e.wallet_id = w.id
         group by w.id
         having w.balance <> coalesce(sum(",
        signed_amount!(),
        "), 0)
             or w.balance < -coalesce((w.rules ->> 'overdraft')::int8, 0)
             or w.version <> count(e.id)
             or count(e.id) <> coalesce(max(e.seq), 0)
             or w.fence < coalesce(max(e.fence), 0)
         order by w.id"
    ))
    .fetch_all(&mut *conn)
    .await?;
    for w in rows {
        let id: String = w.try_get("id")?;
        let (balance, version, fence): (i64, i64, i64) =
            (w.try_get("balance")?, w.try_get("version")?, w.try_get("fence")?);
        let (ledger_sum, entries, last_seq, last_fence): (i64, i64, i64, i64) = (
            w.try_get("ledger_sum")?,
            w.try_get("entries")?,
            w.try_get("last_seq")?,
            w.try_get("last_fence")?,
        );
        if balance != ledger_sum {
            report
                .problems
                .push(format!("wallet {id}: balance {balance} but its ledger sums to {ledger_sum}"));
        }
        let overdraft: i64 = w.try_get("overdraft")?;
        if balance < -overdraft {
            report
                .problems
                .push(format!("wallet {id}: balance {balance} below its overdraft of {overdraft}"));
        }
        if version != entries || entries != last_seq {
            report.problems.push(format!(
                "wallet {id}: version {version} but {entries} ledger entries numbered up to {last_seq}"
            ));
        }
        if fence < last_fence {
            report.problems.push(format!("wallet {id}: fence {fence} below its ledger's fence {last_fence}"));
        }
    }
    Ok(())
}

async fn chains(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        "select wallet_id, seq, kind, amount, balance_after, fence, previous_balance, previous_fence,
                created_at, previous_time
         from (select e.*,
                      lag(balance_after) over w as previous_balance,
                      lag(fence) over w as previous_fence,
                      lag(created_at) over w as previous_time
               from ledger_entry e
               window w as (partition by wallet_id order by seq)) chained
         where (kind = 'open' and (seq <> 1 or balance_after <> amount))
            or (kind <> 'open' and balance_after is distinct from previous_balance + ",
        signed_amount!(),
        ")
            or fence < previous_fence
            or created_at < previous_time
         order by wallet_id, seq"
    ))
    .fetch_all(&mut *conn)
    .await?;
    for e in rows {
        let (wallet, seq, kind): (String, i64, String) =
            (e.try_get("wallet_id")?, e.try_get("seq")?, e.try_get("kind")?);
        let (amount, balance_after, fence): (i64, i64, i64) =
            (e.try_get("amount")?, e.try_get("balance_after")?, e.try_get("fence")?);
        let previous_balance: Option<i64> = e.try_get("previous_balance")?;
        let previous_fence: Option<i64> = e.try_get("previous_fence")?;
        let (time, previous_time): (DateTime<Utc>, Option<DateTime<Utc>>) =
            (e.try_get("created_at")?, e.try_get("previous_time")?);
        report.problems.push(match (previous_fence, previous_time) {
            (Some(previous), _) if fence < previous => {
                format!("wallet {wallet} entry {seq}: fence {fence} below the previous entry's {previous}")
            }
            (_, Some(previous)) if time < previous => format!(
                "wallet {wallet} entry {seq}: written at {time}, before the previous entry ({previous}): \
                 the replicas' clocks disagree"
            ),
            _ => format!(
                "wallet {wallet} entry {seq}: {kind} of {amount} leaves {balance_after}, which does not follow \
                 from the previous balance {previous_balance:?}"
            ),
        });
    }
    Ok(())
}

/// Each wallet's rollups (`ledger::history`'s, which statements read) are what its entries add
/// up to, hour by hour and kind by kind, for every hour before how far they go: none missing,
/// none off, none beyond.
async fn rollups(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        "with actual as (
             select e.wallet_id, date_trunc('hour', e.created_at) as hour, e.kind,
                    count(*) as count, sum(e.amount)::int8 as amount
             from ledger_entry e join entry_rollup_until u on u.wallet_id = e.wallet_id
             where e.created_at < u.until
             group by 1, 2, 3
         )
         select coalesce(a.wallet_id, r.wallet_id) as wallet_id, coalesce(a.hour, r.hour) as hour,
                coalesce(a.kind, r.kind) as kind, a.count as entries, a.amount as entries_amount,
                r.count as rolled, r.amount as rolled_amount
         from actual a full join entry_rollup r
           on r.wallet_id = a.wallet_id and r.hour = a.hour and r.kind = a.kind
         where (a.count, a.amount) is distinct from (r.count, r.amount)
         order by 1, 2, 3",
    )
    .fetch_all(&mut *conn)
    .await?;
    for row in rows {
        let (wallet, hour, kind): (String, DateTime<Utc>, String) =
            (row.try_get("wallet_id")?, row.try_get("hour")?, row.try_get("kind")?);
        let entries: (Option<i64>, Option<i64>) = (row.try_get("entries")?, row.try_get("entries_amount")?);
        let rolled: (Option<i64>, Option<i64>) = (row.try_get("rolled")?, row.try_get("rolled_amount")?);
        report.problems.push(format!(
            "wallet {wallet} hour {hour} {kind}: rolled up as {rolled:?} (entries, amount), but its entries make {entries:?}"
        ));
    }
    Ok(())
}

/// Each transfer has exactly its two legs, of its amount, on its wallets.
async fn transfers(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select t.id::text as id, count(e.id) as legs,
                  count(e.id) filter (where e.kind = 'transfer_out' and e.wallet_id = t.from_wallet
                                        and e.amount = t.amount) as outs,
                  count(e.id) filter (where e.kind = 'transfer_in' and e.wallet_id = t.to_wallet
                                        and e.amount = t.amount) as ins
           from transfer t left join ledger_entry e on e.transfer_id = t.id
           group by t.from_wallet, t.id
           having count(e.id) <> 2
               or count(e.id) filter (where e.kind = 'transfer_out' and e.wallet_id = t.from_wallet
                                        and e.amount = t.amount) <> 1
               or count(e.id) filter (where e.kind = 'transfer_in' and e.wallet_id = t.to_wallet
                                        and e.amount = t.amount) <> 1
           order by t.id"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for t in rows {
        let (id, legs, outs, ins): (String, i64, i64, i64) =
            (t.try_get("id")?, t.try_get("legs")?, t.try_get("outs")?, t.try_get("ins")?);
        report.problems.push(format!(
            "transfer {id}: {legs} ledger legs, {outs} matching transfer_out and {ins} matching transfer_in \
             (want exactly one of each, of its amount, on its wallets)"
        ));
    }
    Ok(())
}

/// Each movement of many legs has as many legs as it says, one a wallet, its own wallet's among
/// them, and they sum to zero; a held movement has none until captured, then at most as many as it
/// says (a capture of part of it writes the legs whose share is not nothing).
async fn movements(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        "select m.id::text as id, m.legs::int8 as said, count(e.id) as legs,
                coalesce(sum(",
        signed_amount!(),
        "), 0)::int8 as net
         from movement m left join ledger_entry e on e.transfer_id = m.id
         group by m.wallet_id, m.id, m.legs, m.expires_at
         having coalesce(sum(",
        signed_amount!(),
        "), 0) <> 0
             or count(distinct e.wallet_id) <> count(e.id)
             or count(e.id) filter (where e.kind not in ('transfer_out', 'transfer_in')) <> 0
             or count(e.id) > m.legs
             or (m.expires_at is null
                 and (count(e.id) <> m.legs or count(e.id) filter (where e.wallet_id = m.wallet_id) <> 1))
         order by m.id"
    ))
    .fetch_all(&mut *conn)
    .await?;
    for m in rows {
        let (id, said, legs, net): (String, i64, i64, i64) =
            (m.try_get("id")?, m.try_get("said")?, m.try_get("legs")?, m.try_get("net")?);
        report.problems.push(format!(
            "movement {id}: {legs} ledger legs of the {said} it has, summing to {net} (want every leg, \
             one a wallet, its first wallet's among them, summing to 0)"
        ));
    }
    held_movements(conn, report).await
}

/// Each held movement has one hold a debit leg, and its holds settle together: all captured (and
/// then its legs have their entries, two at least) or none (and no leg has one).
async fn held_movements(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    // Statements of their own: under Citus a movement, its holds and its entries live with
    // different wallets.
    let held: Vec<(uuid::Uuid, Vec<i64>, i64, i64)> = sqlx::query_as(
        // language=PostgreSQL
        r#"select m.id, m.leg_amounts, count(h.id), count(h.id) filter (where h.status = 'captured')
           from movement m left join hold h on h.movement_id = m.id
           where m.expires_at is not null
           group by m.wallet_id, m.id, m.leg_amounts"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<uuid::Uuid> = held.iter().map(|(id, ..)| *id).collect();
    let entries: std::collections::HashMap<uuid::Uuid, i64> = sqlx::query_as(
        // language=PostgreSQL
        "select transfer_id, count(*) from ledger_entry where transfer_id = any($1) group by transfer_id",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .collect();
    for (id, amounts, holds, captured) in held {
        let debits = amounts.iter().filter(|amount| **amount < 0).count() as i64;
        let written = entries.get(&id).copied().unwrap_or(0);
        let settled_together = captured == 0 || captured == holds;
        let entries_follow =
            if captured > 0 { (2..=amounts.len() as i64).contains(&written) } else { written == 0 };
        if holds != debits || !settled_together || !entries_follow {
            report.problems.push(format!(
                "held movement {id}: {holds} holds for {debits} debit legs, {captured} captured, {written} \
                 ledger legs (want one hold a debit, captured all or none, the legs' entries once captured)"
            ));
        }
    }
    Ok(())
}

/// Refunds never add up to more than what they refund (a movement's: on each of its legs, which
/// they move the other way); a payment's refunds return money to the wallet it left.
async fn refunds(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select 'transfer' as what, t.id::text as id, t.amount, sum(r.amount)::int8 as refunded
           from transfer t join transfer r on r.refund_of = t.id
           group by t.from_wallet, t.id having sum(r.amount) > t.amount
           union all
           select 'payment', p.id::text, p.amount, sum(r.amount)::int8
           from ledger_entry p join ledger_entry r on r.refund_of = p.id
           group by p.wallet_id, p.id having sum(r.amount) > p.amount
           union all
           select 'movement', m.refund_of::text, coalesce(o.amount, 0), sum(r.amount)::int8
           from movement m join ledger_entry r on r.transfer_id = m.id
           left join ledger_entry o on o.transfer_id = m.refund_of and o.wallet_id = r.wallet_id
           where m.refund_of is not null
           group by m.refund_of, r.wallet_id, o.amount, o.kind
           having o.amount is null or sum(r.amount) > o.amount or bool_or(r.kind = o.kind)
           union all
           select 'refund entry', r.id::text, r.amount, null
           from ledger_entry r left join ledger_entry p on p.id = r.refund_of
           where r.kind = 'refund' and (p.id is null or p.kind <> 'pay' or p.wallet_id <> r.wallet_id)
           order by 1, 2"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for r in rows {
        let (what, id, amount): (String, String, i64) =
            (r.try_get("what")?, r.try_get("id")?, r.try_get("amount")?);
        report.problems.push(match r.try_get::<Option<i64>, _>("refunded")? {
            Some(refunded) => {
                let on = if what == "movement" {
                    " on one leg (or move it the same way, or another wallet)"
                } else {
                    ""
                };
                format!("{what} {id}: its refunds add up to {refunded}{on}, more than its {amount}")
            }
            None => format!("{what} {id}: does not refund a payment of its own wallet"),
        });
    }
    Ok(())
}

/// What each wallet holds is the sum of its holds still held, within its balance; a captured hold
/// has exactly its one `pay` entry, any other hold none.
async fn holds(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select w.id, w.balance + coalesce((w.rules ->> 'overdraft')::int8, 0) as balance, w.held,
                  coalesce(a.active, 0)::int8 as active
           from wallet w
           left join (select wallet_id, sum(amount) as active from hold where status = 'held'
                      group by wallet_id) a on a.wallet_id = w.id
           where w.held > w.balance + coalesce((w.rules ->> 'overdraft')::int8, 0)
              or w.held <> coalesce(a.active, 0)
           order by w.id"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for w in rows {
        let id: String = w.try_get("id")?;
        let (balance, held, active): (i64, i64, i64) =
            (w.try_get("balance")?, w.try_get("held")?, w.try_get("active")?);
        if held != active {
            report
                .problems
                .push(format!("wallet {id}: holds {held} but its active holds add up to {active}"));
        }
        if held > balance {
            report.problems.push(format!(
                "wallet {id}: holds {held} of {balance} (balance and overdraft): available is negative"
            ));
        }
    }
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select h.id::text as id, h.status, h.captured, count(e.id) as entries,
                  count(e.id) filter (where e.kind = case when h.movement_id is null then 'pay' else 'transfer_out' end
                                        and e.wallet_id = h.wallet_id
                                        and e.amount = h.captured and e.id = h.capture_entry) as matching
           from hold h left join ledger_entry e on e.hold_id = h.id
           group by h.wallet_id, h.id, h.movement_id
           having count(e.id) <> case when h.status = 'captured' and h.captured > 0 then 1 else 0 end
               or count(e.id) filter (where e.kind = case when h.movement_id is null then 'pay' else 'transfer_out' end
                                        and e.wallet_id = h.wallet_id
                                        and e.amount = h.captured and e.id = h.capture_entry)
                  <> case when h.status = 'captured' and h.captured > 0 then 1 else 0 end
           order by h.id"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for h in rows {
        let (id, status): (String, String) = (h.try_get("id")?, h.try_get("status")?);
        let (captured, entries, matching): (i64, i64, i64) =
            (h.try_get("captured")?, h.try_get("entries")?, h.try_get("matching")?);
        report.problems.push(format!(
            "hold {id} ({status}, captured {captured}): {entries} ledger entries, {matching} the `pay` (or a \
             held movement's `transfer_out`) of its capture (want one for a captured hold, none otherwise)"
        ));
    }
    Ok(())
}

/// Every wallet's events are numbered 1..=its `event_seq` with no gap, their positions never go
/// down along it, and each names an entry or hold of its own wallet. Since its first event, each
/// of a wallet's entries has exactly one event of its own naming it (besides the balance events of
/// the monitors it crossed, each of which it did cross), and each hold has its `hold.placed` and,
/// settled without an entry (voided, expired, or captured of nothing), one event of that. (A
/// wallet's entries and holds from before its first event predate events: migration 0021.)
async fn events(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select w.id, w.event_seq, count(e.seq) as events, coalesce(max(e.seq), 0) as last
           from wallet w left join event e on e.wallet_id = w.id
           group by w.id
           having w.event_seq <> count(e.seq) or count(e.seq) <> coalesce(max(e.seq), 0)
           order by w.id"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for w in rows {
        let id: String = w.try_get("id")?;
        let (numbered, events, last): (i64, i64, i64) =
            (w.try_get("event_seq")?, w.try_get("events")?, w.try_get("last")?);
        report
            .problems
            .push(format!("wallet {id}: event_seq {numbered} but {events} events numbered up to {last}"));
    }
    let rows = sqlx::query(concat!(
        // language=PostgreSQL
        r#"with since as (select wallet_id, min(created_at) as first from event group by wallet_id),
           problem as (
               select e.wallet_id, e.seq, 'event ' || e.seq || ': its position is below the previous event''s' as what
               from (select *, lag(position) over (partition by wallet_id order by seq) as previous
                     from event) e
               where e.position < e.previous
               union all
               select e.wallet_id, e.seq, 'event ' || e.seq || ': names no entry or hold of its wallet'
               from event e
               where (e.entry_id is null and e.hold_id is null)
                  or (e.entry_id is not null and not exists (
                          select from ledger_entry l where l.wallet_id = e.wallet_id and l.id = e.entry_id))
                  or (e.hold_id is not null and not exists (
                          select from hold h where h.wallet_id = e.wallet_id and h.id = e.hold_id))
               union all
               select l.wallet_id, l.seq, 'entry ' || l.seq || ': ' || count(e.seq) || ' events name it'
               from ledger_entry l join since s on s.wallet_id = l.wallet_id and l.created_at >= s.first
               left join event e on e.wallet_id = l.wallet_id and e.entry_id = l.id and e.monitor is null
               group by l.wallet_id, l.seq
               having count(e.seq) <> 1
               union all
               select e.wallet_id, e.seq, 'event ' || e.seq || ': ' || e.type || ' of ' || e.monitor
                      || ', which its entry did not cross'
               from event e join ledger_entry l on l.wallet_id = e.wallet_id and l.id = e.entry_id
               cross join lateral (select l.balance_after - ("#,
        signed_amount!(),
        r#") as before) b
               where e.monitor is not null and not coalesce(case e.type
                   when 'wallet.balance_below' then b.before >= e.monitor and l.balance_after < e.monitor
                   when 'wallet.balance_above' then b.before <= e.monitor and l.balance_after > e.monitor
               end, false)
               union all
               select h.wallet_id, null::int8, 'hold ' || h.id || ' (' || h.status || ') with '
                      || count(e.seq) filter (where e.type = 'hold.placed') || ' hold.placed and '
                      || count(e.seq) filter (where e.type <> 'hold.placed' and e.entry_id is null)
                      || ' settlement events'
               from hold h join since s on s.wallet_id = h.wallet_id and h.created_at >= s.first
               left join event e on e.wallet_id = h.wallet_id and e.hold_id = h.id
               group by h.wallet_id, h.id, h.status, h.capture_entry
               having count(e.seq) filter (where e.type = 'hold.placed') <> 1
                   or count(e.seq) filter (where e.type <> 'hold.placed' and e.entry_id is null)
                      <> case when h.status = 'held' or h.capture_entry is not null then 0 else 1 end
           )
           select wallet_id, seq, what from problem order by wallet_id, seq limit 100"#,
    ))
    .fetch_all(&mut *conn)
    .await?;
    for row in rows {
        let (wallet, what): (String, String) = (row.try_get("wallet_id")?, row.try_get("what")?);
        report.problems.push(format!("wallet {wallet} {what}"));
    }
    Ok(())
}

/// The balances add up to what came in and went out of the system; transfers move money inside it.
async fn conservation(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let row = sqlx::query(
        // language=PostgreSQL
        r#"select (select coalesce(sum(balance), 0) from wallet)::int8 as balances,
                  coalesce(sum(amount) filter (where kind in ('open', 'deposit', 'refund')), 0)::int8
                      - coalesce(sum(amount) filter (where kind = 'pay'), 0)::int8 as external,
                  coalesce(sum(amount) filter (where kind = 'transfer_out'), 0)::int8 as transferred_out,
                  coalesce(sum(amount) filter (where kind = 'transfer_in'), 0)::int8 as transferred_in
           from ledger_entry"#,
    )
    .fetch_one(&mut *conn)
    .await?;
    let (balances, external): (i64, i64) = (row.try_get("balances")?, row.try_get("external")?);
    let (out, into): (i64, i64) = (row.try_get("transferred_out")?, row.try_get("transferred_in")?);
    if balances != external {
        report.problems.push(format!(
            "money not conserved: the balances add up to {balances}, but opening balances plus deposits minus \
             payments plus refunds are {external}"
        ));
    }
    if out != into {
        report.problems.push(format!("money not conserved: transfers took out {out} but put in {into}"));
    }
    Ok(())
}

async fn keys(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"select k.scope, k.key, k.status, k.entry_id, e.wallet_id as ledger_wallet,
                  convert_from(k.body, 'UTF8')::jsonb ->> 'id' as reported_id
           from idempotency_key k left join ledger_entry e on e.id = k.entry_id
           where k.claim is null and k.status between 200 and 299
             and (
               -- No entry: only a hold placed or voided answers without one, and it reports a
               -- hold of the scope's wallet (looked up by its key; the CASE casts only a uuid);
               -- or a monitor set or removed, or limits set, which report the wallet's monitors
               -- or limits.
               (e.id is null
                and not (k.scope like $1 || '%'
                         and convert_from(k.body, 'UTF8')::jsonb ?| array['monitors', 'overdraft']
                         and convert_from(k.body, 'UTF8')::jsonb ->> 'id' is null)
                and not exists (
                   select 1 from hold h
                   where h.id = case when convert_from(k.body, 'UTF8')::jsonb ->> 'id'
                                          ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                                     then (convert_from(k.body, 'UTF8')::jsonb ->> 'id')::uuid end
                     and k.scope = $1 || h.wallet_id
                     and convert_from(k.body, 'UTF8')::jsonb -> 'entry' is null)
                and not exists (
                   -- Nor a held movement placed or voided, reporting the movement (its key, or
                   -- its key's alias in a wallet it takes money out of).
                   select 1 from movement m
                   where m.id = case when convert_from(k.body, 'UTF8')::jsonb ->> 'id'
                                          ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                                     then (convert_from(k.body, 'UTF8')::jsonb ->> 'id')::uuid end
                     and (k.scope = 'transfers' or k.scope like $1 || '%') and m.expires_at is not null))
               -- A capture: it reports its hold, and the `pay` entry that charged it (a held
               -- movement's capture reports the movement, as below).
               or (e.hold_id is not null and e.kind = 'pay'
                   and (convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.hold_id::text
                        or convert_from(k.body, 'UTF8')::jsonb -> 'entry' ->> 'id' is distinct from e.id::text
                        or k.scope <> $1 || e.wallet_id))
               -- A deposit, payment or refund: it reports its entry, of the scope's wallet.
               or (e.id is not null and e.hold_id is null and e.transfer_id is null and k.scope like $1 || '%'
                   and (convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.id::text
                        or k.scope <> $1 || e.wallet_id))
               -- A movement between wallets' key aliased in a wallet it takes money out of: it
               -- reports the movement of its entry, which has a leg of the scope's wallet.
               or (e.transfer_id is not null and k.scope like $1 || '%'
                   and (convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.transfer_id::text
                        -- (By the wallet first: the index is (wallet_id, transfer_id).)
                        or not exists (select 1 from ledger_entry l
                                       where l.wallet_id = substr(k.scope, length($1) + 1)
                                         and l.transfer_id = e.transfer_id)))
               or (k.scope = 'wallets'
                   and convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.wallet_id)
               or (k.scope = 'transfers' and e.id is not null
                   and convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.transfer_id::text))
           order by k.scope, k.key"#,
    )
    .bind(crate::domain::WALLET_SCOPE_PREFIX)
    .fetch_all(&mut *conn)
    .await?;
    for k in rows {
        let (scope, key, status): (String, String, i16) =
            (k.try_get("scope")?, k.try_get("key")?, k.try_get("status")?);
        let entry: Option<uuid::Uuid> = k.try_get("entry_id")?;
        let reported: Option<String> = k.try_get("reported_id")?;
        let wallet: Option<String> = k.try_get("ledger_wallet")?;
        report.problems.push(match entry {
            None => format!("idempotency key {key:?} in {scope}: a stored {status} with no ledger entry"),
            Some(entry) => format!(
                "idempotency key {key:?} in {scope}: its response reports {reported:?} but it records entry {entry} \
                 of wallet {wallet:?}"
            ),
        });
    }
    Ok(())
}

async fn velocity(conn: &mut PgConnection, report: &mut Report) -> Result<(), StoreError> {
    let rows = sqlx::query(
        // language=PostgreSQL
        r#"with counted as (
               select w.id as wallet_id, v.n, v.limit_ ->> 'per' as per,
                      (v.limit_ -> 'used' ->> 'from')::timestamptz as from_at,
                      (v.limit_ -> 'used' ->> 'until')::timestamptz as until_at,
                      (v.limit_ -> 'used' ->> 'amount')::int8 as amount,
                      (v.limit_ -> 'used' ->> 'count')::int8 as times
               from wallet w
               cross join lateral jsonb_array_elements(w.rules -> 'velocity') with ordinality as v(limit_, n)
               where jsonb_typeof(w.rules -> 'velocity') = 'array'
           ), debited as (
               select c.wallet_id, c.n, sum(e.amount)::int8 as amount, count(*) as times
               from counted c
               join ledger_entry e on e.wallet_id = c.wallet_id
                                  and e.created_at >= c.from_at and e.created_at < c.until_at
               where e.hold_id is null
                 and (e.kind = 'pay'
                      or e.kind = 'transfer_out'
                         and not exists (select from transfer t where t.id = e.transfer_id and t.refund_of is not null)
                         and not exists (select from movement m where m.id = e.transfer_id and m.refund_of is not null))
               group by c.wallet_id, c.n
           ), reserved as (
               select c.wallet_id, c.n,
                      sum(case h.status when 'held' then h.amount when 'captured' then h.captured else 0 end)::int8
                          as amount,
                      count(*) filter (where h.status in ('held', 'captured')) as times
               from counted c
               join hold h on h.wallet_id = c.wallet_id and h.created_at >= c.from_at and h.created_at < c.until_at
               group by c.wallet_id, c.n
           )
           select c.wallet_id, c.per, c.from_at, c.amount, c.times,
                  (coalesce(d.amount, 0) + coalesce(r.amount, 0))::int8 as found_amount,
                  (coalesce(d.times, 0) + coalesce(r.times, 0))::int8 as found_times
           from counted c
           left join debited d on d.wallet_id = c.wallet_id and d.n = c.n
           left join reserved r on r.wallet_id = c.wallet_id and r.n = c.n
           where c.amount <> coalesce(d.amount, 0) + coalesce(r.amount, 0)
              or c.times <> coalesce(d.times, 0) + coalesce(r.times, 0)
           order by c.wallet_id, c.n"#,
    )
    .fetch_all(&mut *conn)
    .await?;
    for w in rows {
        let (id, per): (String, String) = (w.try_get("wallet_id")?, w.try_get("per")?);
        let from: DateTime<Utc> = w.try_get("from_at")?;
        let (amount, times): (i64, i64) = (w.try_get("amount")?, w.try_get("times")?);
        let (found_amount, found_times): (i64, i64) = (w.try_get("found_amount")?, w.try_get("found_times")?);
        report.problems.push(format!(
            "wallet {id}: its velocity limit per {per} counts {amount} in {times} debits from {from}, \
             but the ledger has {found_amount} in {found_times}"
        ));
    }
    Ok(())
}
