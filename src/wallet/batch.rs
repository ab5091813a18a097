//! The fenced group commit: a batch of movements applied under one held lease, in one Postgres
//! transaction, with one conditional UPDATE of the wallet row.
//!
//! Each movement is still decided on its own, in arrival order, against the balance the previous
//! ones left: a payment that does not fit is refused alone, the rest go through. Each accepted
//! movement gets its own ledger entry, each keyed one its stored response, all in the transaction
//! whose `UPDATE wallet ... WHERE fence = $ours AND version = $read` decides whether any of it
//! happens. A hot wallet then costs one commit per batch instead of one per payment.

use super::{MovementOutcome, WalletError, WalletId};
use crate::idempotency::{self, Receipt};
use crate::ledger::{self, Entry, EntryKind, NewEntry};
use crate::wallet::{Movement, Refusal};
use sqlx::PgConnection;
use std::collections::HashSet;
use uuid::Uuid;

/// One movement to apply, with its idempotency receipt if the request had a key.
#[derive(Debug)]
pub struct Op {
    pub movement: Movement,
    pub receipt: Option<Receipt<MovementOutcome>>,
}

/// The wallet as the lease holder last claimed or wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub balance: i64,
    pub version: i64,
}

/// How one op fared inside the batch, before the commit.
enum Decision {
    /// Its ledger entry is the n-th of the batch.
    Accepted(usize),
    Refused(Refusal),
    /// Its idempotency key was taken over by a retry: it does not run here.
    TakenOver,
}

/// Applies `ops` under the lease holding `fence`, from `held`. On success returns one result per
/// op and moves `held` to the new balance and version. On failure (`LeaseLost` when the fence or
/// version moved, or a database error) nothing of the batch is applied.
pub async fn apply(
    conn: &mut PgConnection,
    id: &WalletId,
    fence: i64,
    held: &mut Held,
    ops: &[Op],
) -> Result<Vec<Result<Entry, WalletError>>, WalletError> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    match decide_and_write(&mut tx, id, fence, held, ops).await {
        Ok((results, after)) => {
            crate::failpoint::hit("before_commit");
            super::commit(tx).await?;
            crate::failpoint::hit("after_commit");
            *held = after;
            Ok(results)
        }
        Err(err) => {
            // Roll back now, not when the connection is next used: the transaction holds row
            // locks (the wallet's, its keys') that the answers to this batch's requests need.
            let _ = tx.rollback().await;
            Err(err)
        }
    }
}

/// The body of [`apply`], inside its transaction: returns the results and the wallet after them.
async fn decide_and_write(
    tx: &mut PgConnection,
    id: &WalletId,
    fence: i64,
    held: &Held,
    ops: &[Op],
) -> Result<(Vec<Result<Entry, WalletError>>, Held), WalletError> {
    // The keys still ours, locked for this transaction: a retry cannot take one over before we
    // commit, and a key already taken over does not run here.
    let claims: Vec<&idempotency::Claim> =
        ops.iter().filter_map(|op| op.receipt.as_ref().map(|r| &r.claim)).collect();
    let owned: HashSet<Uuid> =
        if claims.is_empty() { HashSet::new() } else { idempotency::lock_claims(tx, &claims).await? };

    let mut balance = held.balance;
    let mut entries = Vec::new();
    let decisions: Vec<Decision> = ops
        .iter()
        .map(|op| {
            if op.receipt.as_ref().is_some_and(|receipt| !owned.contains(&receipt.claim.token)) {
                return Decision::TakenOver;
            }
            match op.movement.apply_to(balance) {
                Ok(after) => {
                    balance = after;
                    let (kind, reference) = match &op.movement {
                        Movement::Deposit { .. } => (EntryKind::Deposit, None),
                        Movement::Pay { reference, .. } => (EntryKind::Pay, reference.clone()),
                    };
                    let amount = op.movement.amount().get();
                    entries.push(NewEntry {
                        id: Uuid::new_v4(),
                        kind,
                        amount,
                        balance_after: after,
                        reference,
                    });
                    Decision::Accepted(entries.len() - 1)
                }
                Err(refusal) => Decision::Refused(refusal),
            }
        })
        .collect();

    // The one fenced conditional UPDATE, and the entries; refused if another holder moved in.
    let written = ledger::commit(tx, id.as_str(), fence, held.version, &entries).await?;

    let mut results = Vec::with_capacity(ops.len());
    let mut outcomes = Vec::with_capacity(ops.len());
    for decision in decisions {
        let outcome: MovementOutcome = match decision {
            Decision::Accepted(n) => Ok(written[n].clone()),
            Decision::Refused(refusal) => Err(refusal),
            Decision::TakenOver => {
                results.push(Err(WalletError::KeyTakenOver));
                outcomes.push(None);
                continue;
            }
        };
        results.push(outcome.clone().map_err(WalletError::Refused));
        outcomes.push(Some(outcome));
    }
    // Every key that runs here stores its outcome, all in one statement.
    let to_store: Vec<_> = ops
        .iter()
        .zip(&outcomes)
        .filter_map(|(op, outcome)| {
            let (receipt, outcome) = (op.receipt.as_ref()?, outcome.as_ref()?);
            Some((receipt, outcome, outcome.as_ref().ok().map(|entry| entry.id)))
        })
        .collect();
    let expected = to_store.len();
    // The rows are locked by this transaction and were ours: storing cannot be refused.
    if idempotency::complete_all(tx, to_store).await? != expected {
        return Err(WalletError::Internal(anyhow::anyhow!("an idempotency key locked by this batch moved")));
    }
    Ok((results, Held { balance, version: held.version + written.len() as i64 }))
}
