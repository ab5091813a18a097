//! A wallet's queue served without a lease, under Postgres alone, during a Redis outage (see
//! [`super::outage`]).
//!
//! Each batch is one transaction: lock the wallet's row (`FOR UPDATE`, waiting at most
//! [`ROW_LOCK_TIMEOUT`] for a statement or transaction that holds it), read the batch's keys and
//! holds (after the lock, so they are as the row's last writer left them), decide exactly as under
//! a lease ([`batch::decide`]), write with the rounds' compare-and-set on the row as locked, and
//! commit. The row's lock is what makes writers on several replicas take turns: batches across
//! replicas queue in Postgres, as they would in Redis. The row's fence is left as it was, so it
//! keeps ordering the leases that come after the outage.

use super::batch::{self, Held, Known, Op};
use super::group::{self, round_time};
use super::outage::{Path, count_path};
use super::queue::{MAX_BATCH, MAX_HOLD, Reply};
use super::transfer::ROW_LOCK_TIMEOUT;
use super::{Moved, WalletError, WalletId, Wallets};
use crate::ledger::group::{self as store, GroupWrite, HoldsToRead};
use crate::ledger::idempotency::KeyRef;
use crate::ledger::transfer::lock_wallets;
use std::sync::Arc;
use std::time::Instant;
use uuid::Uuid;

/// Why one transaction of a batch did not end with each op's result.
enum Failed {
    /// Another writer stored one of the batch's keys first: nothing was written; read again.
    KeyConflict,
    Wallet(WalletError),
}

impl<E: Into<WalletError>> From<E> for Failed {
    fn from(err: E) -> Self {
        Failed::Wallet(err.into())
    }
}

impl Wallets {
    /// Serves the wallet's queue under Postgres alone, batch after batch, for at most
    /// [`MAX_HOLD`], or until the outage ends.
    pub(super) async fn hold_unleased(&self, id: &WalletId) {
        let since = Instant::now();
        loop {
            let batch = self.queues.take(id, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            let started = Instant::now();
            let (waiters, ops): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|pending| pending.into_parts()).unzip();
            metrics::histogram!(crate::telemetry::metrics::BATCH_SIZE).record(ops.len() as f64);
            let results = self.write_unleased(id, &ops).await;
            count_path(Path::PostgresOnly, &results);
            let db = started.elapsed();
            for ((enqueued, reply), result) in waiters.into_iter().zip(results) {
                let waited = enqueued.elapsed().saturating_sub(db);
                let _ = reply.send(Reply { result, waited, db });
            }
            if since.elapsed() >= MAX_HOLD || !self.outage.is_active() {
                return;
            }
        }
    }

    /// Applies `ops` to wallet `id` in one transaction under its row's lock; each op's result.
    async fn write_unleased(&self, id: &WalletId, ops: &[Op]) -> Vec<Result<Moved, WalletError>> {
        let mut first_attempt = true;
        loop {
            match self.attempt_unleased(id, ops).await {
                Ok(results) => return results,
                Err(Failed::KeyConflict) if first_attempt => first_attempt = false,
                Err(Failed::KeyConflict) => {
                    let err = WalletError::internal("an idempotency key conflicted twice");
                    return ops.iter().map(|_| Err(err.clone())).collect();
                }
                Err(Failed::Wallet(err)) => return ops.iter().map(|_| Err(err.clone())).collect(),
            }
        }
    }

    async fn attempt_unleased(
        &self,
        id: &WalletId,
        ops: &[Op],
    ) -> Result<Vec<Result<Moved, WalletError>>, Failed> {
        let mut tx = Box::pin(self.db.begin()).await?;
        let locked = Box::pin(lock_wallets(&mut tx, &[id.as_str()], ROW_LOCK_TIMEOUT)).await?;
        let Some(row) = locked.get(id.as_str()) else {
            return Ok(ops.iter().map(|_| Err(WalletError::NotFound)).collect());
        };
        let held = Held {
            balance: row.balance,
            held: row.held,
            version: row.version,
            fence: row.fence,
            owner: row.owner.as_deref().map(Arc::from),
            from_note: false,
        };
        let keys: Vec<KeyRef<'_>> = ops.iter().filter_map(|op| op.key.as_ref().map(|key| key.at())).collect();
        let hold_ids: Vec<Uuid> = ops.iter().filter_map(Op::settles).collect();
        let mut expired_read = false;
        let (plan, now) = loop {
            let now = round_time();
            let expired_of = if expired_read { vec![id.as_str()] } else { Vec::new() };
            let holds = HoldsToRead { ids: &hold_ids, expired_of: &expired_of, now };
            let found = if keys.is_empty() && holds.is_empty() {
                store::Found::default()
            } else {
                Box::pin(store::read(&mut tx, &[], &keys, holds)).await?
            };
            let known = Known { keys: &found.keys, holds: &found.holds, expired_read, now };
            // The row's own fence: a write under Postgres alone leaves it as it is.
            let plan = batch::decide(id, held.fence, &held, ops, known);
            if plan.needs_expired && !expired_read {
                expired_read = true;
                continue;
            }
            break (plan, now);
        };
        if plan.runs() {
            let mut write = GroupWrite::default();
            group::add_wallet(&mut write, id, held.fence, &held, ops, &plan);
            let retention = self.keys.settings().retention;
            let committed = match Box::pin(store::commit(&mut tx, &write, now, retention)).await {
                Ok(committed) => committed,
                Err(err) if err.is_key_conflict() => return Err(Failed::KeyConflict),
                Err(err) => return Err(err.into()),
            };
            if !committed.moved.contains(id.as_str()) {
                // The row is locked by this transaction: nobody else can have written it.
                return Err(WalletError::internal("a row locked for a write did not match it").into());
            }
        }
        if let Err(err) = super::commit(tx).await {
            return Ok(plan.results(Err(&err)));
        }
        Ok(plan.results(Ok(true)))
    }
}
