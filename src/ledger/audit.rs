//! `walletlock audit`: checks that the books balance.
//!
//! For every wallet: its balance equals the signed sum of its ledger and is not negative; its
//! entries are numbered 1..=version with no gap; each entry's balance follows from the one before;
//! fences never go down along the ledger, and the wallet's fence is at least the last one used.
//! For every stored idempotent success: it points at exactly one ledger entry, the one its response
//! reports, in the scope it was made for, so no key was charged twice or without a record.

use super::StoreError;
use sqlx::PgConnection;

/// What the audit looked at, and every problem it found.
#[derive(Debug, Default)]
pub struct Report {
    pub wallets: i64,
    pub entries: i64,
    pub keys: i64,
    pub problems: Vec<String>,
}

pub async fn run(conn: &mut PgConnection) -> Result<Report, StoreError> {
    let mut report = Report::default();

    let totals = sqlx::query!(
        // language=PostgreSQL
        r#"select (select count(*) from wallet) as "wallets!",
                  (select count(*) from ledger_entry) as "entries!",
                  (select count(*) from idempotency_key where claim is null) as "keys!""#
    )
    .fetch_one(&mut *conn)
    .await?;
    (report.wallets, report.entries, report.keys) = (totals.wallets, totals.entries, totals.keys);

    let wallets = sqlx::query!(
        // language=PostgreSQL
        r#"select w.id, w.balance, w.version, w.fence,
                  coalesce(sum(case e.kind when 'pay' then -e.amount else e.amount end), 0)::int8 as "ledger_sum!",
                  count(e.id) as "entries!",
                  coalesce(max(e.seq), 0) as "last_seq!",
                  coalesce(max(e.fence), 0) as "last_fence!"
           from wallet w left join ledger_entry e on e.wallet_id = w.id
           group by w.id
           having w.balance <> coalesce(sum(case e.kind when 'pay' then -e.amount else e.amount end), 0)
               or w.balance < 0
               or w.version <> count(e.id)
               or count(e.id) <> coalesce(max(e.seq), 0)
               or w.fence < coalesce(max(e.fence), 0)
           order by w.id"#
    )
    .fetch_all(&mut *conn)
    .await?;
    for w in wallets {
        if w.balance != w.ledger_sum {
            report.problems.push(format!(
                "wallet {}: balance {} but its ledger sums to {}",
                w.id, w.balance, w.ledger_sum
            ));
        }
        if w.balance < 0 {
            report.problems.push(format!("wallet {}: negative balance {}", w.id, w.balance));
        }
        if w.version != w.entries || w.entries != w.last_seq {
            report.problems.push(format!(
                "wallet {}: version {} but {} ledger entries numbered up to {}",
                w.id, w.version, w.entries, w.last_seq
            ));
        }
        if w.fence < w.last_fence {
            report.problems.push(format!(
                "wallet {}: fence {} below its ledger's fence {}",
                w.id, w.fence, w.last_fence
            ));
        }
    }

    let entries = sqlx::query!(
        // language=PostgreSQL
        r#"select wallet_id as "wallet_id!", seq as "seq!", kind as "kind!", amount as "amount!",
                  balance_after as "balance_after!", fence as "fence!",
                  previous_balance, previous_fence
           from (select e.*,
                        lag(balance_after) over w as previous_balance,
                        lag(fence) over w as previous_fence
                 from ledger_entry e
                 window w as (partition by wallet_id order by seq)) chained
           where (kind = 'open' and (seq <> 1 or balance_after <> amount))
              or (kind <> 'open' and balance_after is distinct from
                    previous_balance + case kind when 'pay' then -amount else amount end)
              or fence < previous_fence
           order by wallet_id, seq"#
    )
    .fetch_all(&mut *conn)
    .await?;
    for e in entries {
        if e.previous_fence.is_some_and(|previous| e.fence < previous) {
            report.problems.push(format!(
                "wallet {} entry {}: fence {} below the previous entry's {}",
                e.wallet_id,
                e.seq,
                e.fence,
                e.previous_fence.unwrap_or_default()
            ));
        } else {
            report.problems.push(format!(
                "wallet {} entry {}: {} of {} leaves {}, which does not follow from the previous balance {:?}",
                e.wallet_id, e.seq, e.kind, e.amount, e.balance_after, e.previous_balance
            ));
        }
    }

    let keys = sqlx::query!(
        // language=PostgreSQL
        r#"select k.scope as "scope!", k.key as "key!", k.status as "status!", k.entry_id,
                  e.wallet_id as "ledger_wallet?",
                  convert_from(k.body, 'UTF8')::jsonb ->> 'id' as reported_id
           from idempotency_key k left join ledger_entry e on e.id = k.entry_id
           where k.claim is null and k.status between 200 and 299
             and (e.id is null
                  or (k.scope like 'wallet:%'
                      and (convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.id::text
                           or k.scope <> 'wallet:' || e.wallet_id))
                  or (k.scope = 'wallets'
                      and convert_from(k.body, 'UTF8')::jsonb ->> 'id' is distinct from e.wallet_id))
           order by k.scope, k.key"#
    )
    .fetch_all(&mut *conn)
    .await?;
    for k in keys {
        report.problems.push(match k.entry_id {
            None => format!("idempotency key {:?} in {}: a stored {} with no ledger entry", k.key, k.scope, k.status),
            Some(entry) => format!(
                "idempotency key {:?} in {}: its response reports {:?} but it records entry {entry} of wallet {:?}",
                k.key, k.scope, k.reported_id, k.ledger_wallet
            ),
        });
    }
    Ok(report)
}
