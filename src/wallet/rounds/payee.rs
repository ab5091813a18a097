//! Transfers into one payee, gathered on this replica and committed together.
//!
//! A merchant's wallet paid by thousands of payers would otherwise take every transfer into it on
//! its one lease, one transaction each. Here transfers line up by payee, as deposits and payments
//! line up by wallet ([`super::queue`]): the payee's worker takes the payee's lease and, while it
//! holds it, takes what is queued in batches of up to [`MAX_BATCH`], for at most [`MAX_HOLD`] per
//! lease, and hands the lease over after a batch when another replica waits for it.
//!
//! For each batch it asks for each payer's lease once, without waiting: it holds the payee's lease
//! already, which may come after a payer's in the order [`crate::lease::LeaseClient::acquire_all`]
//! keeps, and a holder that does not wait closes no cycle. The transfers whose payers it got are
//! decided and written together ([`Wallets::commit_under`]: the replica's rounds on one Postgres,
//! a transaction of their own under Citus, and under Postgres alone too); the others take the path
//! of a transfer alone (both leases in order), once the batch's leases are released. A key sent
//! twice in one batch (a client's retry racing its first try) runs once: the second is answered
//! with the first's response. Each batch starts from what is known of its wallets (the payee as
//! the last batch left it, each payer as its lease's note says: see `docs/design/notes.md`), and
//! the leases go back with notes of what they wrote.

use crate::idempotency::Keyed;
use crate::lease::{self, Lease};
use crate::ledger::transfer::Transfer;
use crate::telemetry::metrics::{PAYEE_BATCH, PAYEE_BATCH_ALONE};
use crate::wallet::decision::Held;
use crate::wallet::decision::LegsOp;
use crate::wallet::outage::{Path, count_path};
use crate::wallet::rounds::queue::{Lane, MAX_BATCH, MAX_HOLD, Queues, Waiting};
use crate::wallet::transfer::{Done, TransferOutcome, count_outcome, known_from_notes, with_notes};
use crate::wallet::{Access, Between, WalletError, WalletId, Wallets, lease_name};
use futures::future::OptionFuture;
use std::collections::HashMap;
use std::time::Instant;
use tokio::sync::oneshot;
use tracing::Instrument;

/// A transfer waiting for its payee's worker.
pub(in crate::wallet) struct Queued {
    access: Access,
    between: Between,
    key: Option<Keyed<TransferOutcome>>,
    deadline: Instant,
    reply: oneshot::Sender<Result<Transfer, WalletError>>,
}

impl Waiting for Queued {
    fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued").field("between", &self.between).finish_non_exhaustive()
    }
}

impl Queued {
    fn answer(self, result: Result<Transfer, WalletError>) {
        count_outcome("transfer", &result);
        let _ = self.reply.send(result);
    }

    /// The same transfer, as the rounds decide it, and where its answer goes.
    fn into_op(self) -> (LegsOp, oneshot::Sender<Result<Transfer, WalletError>>) {
        let Between { parties, amount, reference, metadata } = self.between;
        (
            LegsOp::Transfer { access: self.access, parties, amount, reference, metadata, key: self.key },
            self.reply,
        )
    }
}

/// The transfers into a payee, committed in batches under its lease.
pub(in crate::wallet) struct Transfers;

impl Lane for Transfers {
    type Item = Queued;

    fn queues(wallets: &Wallets) -> &Queues<Queued> {
        &wallets.payees
    }

    /// The payers of the first batch: their leases come in the round trip that takes the payee's.
    fn companions(wallets: &Wallets, payee: &WalletId) -> Vec<String> {
        let mut names =
            wallets.payees.peek(payee, MAX_BATCH, |queued| lease_name(&queued.between.parties.from));
        names.sort_unstable();
        names.dedup();
        names
    }

    async fn hold(
        wallets: &Wallets,
        payee: &WalletId,
        lease: &mut Lease,
        payers: Vec<Lease>,
    ) -> Option<String> {
        let note = lease.take_note().and_then(|note| Held::from_note(&note, lease.fence()));
        wallets.hold_payee(payee, lease, note, payers).await.map(|known| known.to_note())
    }

    async fn hold_unleased(wallets: &Wallets, payee: &WalletId) {
        wallets.hold_payee_unleased(payee).await;
    }

    fn give_up(item: Queued, err: WalletError) {
        item.answer(Err(err));
    }
}

/// Answers each transfer of a batch, by where its answer goes: with its own result, or every one
/// with the failure of the batch.
fn answer_each(
    replies: Vec<oneshot::Sender<Result<Transfer, WalletError>>>,
    outcome: Result<Vec<Result<Done, WalletError>>, WalletError>,
    path: Path,
) {
    let results: Vec<Result<Transfer, WalletError>> = match outcome {
        Ok(results) => results.into_iter().map(|result| result.and_then(Done::into_transfer)).collect(),
        Err(err) => replies.iter().map(|_| Err(err.clone())).collect(),
    };
    count_path(path, &results);
    for (reply, result) in replies.into_iter().zip(results) {
        count_outcome("transfer", &result);
        let _ = reply.send(result);
    }
}

impl Wallets {
    /// Queues a transfer for its payee's worker (starting one if none runs) and waits for it.
    pub(in crate::wallet) async fn transfer_queued(
        &self,
        access: &Access,
        between: Between,
        key: Option<Keyed<TransferOutcome>>,
    ) -> Result<Transfer, WalletError> {
        let (reply, answer) = oneshot::channel();
        let payee = between.parties.to.clone();
        let deadline = Instant::now() + self.leases.settings().wait;
        let queued = Queued { access: access.clone(), between, key, deadline, reply };
        if self.payees.push(&payee, queued, self.queue_limit)? {
            let this = self.clone();
            let span = tracing::info_span!("payee_worker", wallet_id = %payee);
            self.in_flight.spawn(async move { this.serve::<Transfers>(&payee).await }.instrument(span));
        }
        // The worker ended without answering: it panicked. Nothing of this transfer was written,
        // or it was and its key replays it.
        answer.await.unwrap_or_else(|_| Err(WalletError::internal("the payee's worker stopped")))
    }

    /// Serves the payee's queue while holding its lease, batch after batch, starting from `note`
    /// if the last holder left one, the first batch with the leases of `payers` taken already.
    /// Returns the payee as the last batch left it, for the next holder's note (`None`: not known).
    async fn hold_payee(
        &self,
        payee: &WalletId,
        lease: &mut Lease,
        note: Option<Held>,
        mut payers: Vec<Lease>,
    ) -> Option<Held> {
        let held_since = Instant::now();
        let mut known = note;
        loop {
            let batch = self.payees.take(payee, MAX_BATCH);
            if batch.is_empty() || lease.is_lost() {
                lease::release_all(std::mem::take(&mut payers)).await;
            }
            if batch.is_empty() {
                return known;
            }
            if lease.is_lost() {
                for queued in batch {
                    queued.answer(Err(WalletError::LeaseLost));
                }
                return None;
            }
            metrics::histogram!(PAYEE_BATCH.name).record(batch.len() as f64);
            // Asked while the batch is written (see the wallets' worker, `queue`).
            let contention: OptionFuture<_> =
                (!self.payees.is_empty(payee)).then(|| lease.contention()).into();
            let (after, contended) = tokio::join!(
                self.run_batch(payee, lease, batch, known.take(), std::mem::take(&mut payers)),
                contention
            );
            known = after;
            if held_since.elapsed() >= MAX_HOLD || self.payees.is_empty(payee) {
                return known;
            }
            // Another replica waits for this payee: hand the lease over after each batch.
            let contended = match contended {
                Some(contended) => contended,
                None => lease.contended().await,
            };
            if contended.unwrap_or(true) {
                return known;
            }
        }
    }

    /// Serves the payee's queue under Postgres alone (a Redis outage), batch after batch, each one
    /// transaction with its wallets' rows locked, for at most [`MAX_HOLD`] or until the outage ends.
    async fn hold_payee_unleased(&self, payee: &WalletId) {
        let since = Instant::now();
        loop {
            let batch = self.payees.take(payee, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            metrics::histogram!(PAYEE_BATCH.name).record(batch.len() as f64);
            let (ops, replies): (Vec<LegsOp>, Vec<_>) = batch.into_iter().map(Queued::into_op).unzip();
            let outcome = self.commit_unleased(&ops).await;
            answer_each(replies, outcome, Path::PostgresOnly);
            if since.elapsed() >= MAX_HOLD || !self.outage.is_active() {
                return;
            }
        }
    }

    /// One batch into `payee` under its `lease`, starting from the payee as `known` (if known)
    /// and the payers' leases in `taken`: the other payers' leases asked for once each, those
    /// transfers decided and written together, the rest sent on alone. Returns the payee as the
    /// batch left it (`None`: not known).
    async fn run_batch(
        &self,
        payee: &WalletId,
        lease: &mut Lease,
        batch: Vec<Queued>,
        known_payee: Option<Held>,
        taken: Vec<Lease>,
    ) -> Option<Held> {
        let mut names: Vec<String> =
            batch.iter().map(|queued| lease_name(&queued.between.parties.from)).collect();
        names.sort_unstable();
        names.dedup();
        // The leases taken already that this batch wants, the others given back.
        let (mut payer_leases, unwanted): (Vec<Lease>, Vec<Lease>) = taken
            .into_iter()
            .partition(|payer| names.binary_search_by(|name| name.as_str().cmp(payer.name())).is_ok());
        if !unwanted.is_empty() {
            self.in_flight.spawn(lease::release_all(unwanted));
        }
        let mut standing: HashMap<String, Result<bool, WalletError>> =
            payer_leases.iter().map(|payer| (payer.name().to_owned(), Ok(true))).collect();
        names.retain(|name| !standing.contains_key(name));
        let asked = self.leases.try_acquire_each(&names.iter().map(String::as_str).collect::<Vec<_>>()).await;
        // Each other payer's lease as asked: taken, busy (`None`), or the failure that answers its
        // transfers.
        for (name, asked) in names.into_iter().zip(asked) {
            let taken = match asked {
                Ok(Some(mut payer)) => {
                    payer.keep_alive();
                    payer_leases.push(payer);
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(err) => Err(err.into()),
            };
            standing.insert(name, taken);
        }
        let (mut ready, mut alone) = (Vec::new(), Vec::new());
        for queued in batch {
            match &standing[&lease_name(&queued.between.parties.from)] {
                Ok(true) => ready.push(queued),
                Ok(false) => alone.push(queued),
                Err(err) => queued.answer(Err(err.clone())),
            }
        }
        let payers: Vec<WalletId> = ready.iter().map(|queued| queued.between.parties.from.clone()).collect();
        let mut known = known_from_notes(&mut payer_leases, &payers);
        if let Some(held) = known_payee {
            known.insert(payee.clone(), held);
        }
        if !ready.is_empty() {
            crate::failpoint::hit("transfer_leases_held");
            let mut leases: Vec<&mut Lease> = payer_leases.iter_mut().collect();
            leases.push(lease);
            let (ops, replies): (Vec<LegsOp>, Vec<_>) = ready.into_iter().map(Queued::into_op).unzip();
            let outcome = self.commit_under(&mut leases, ops, &mut known).await;
            if outcome.is_err() {
                known.clear();
            }
            answer_each(replies, outcome, Path::Lease);
        }
        let known_payee = known.remove(payee);
        // The payers' leases are let go while the worker goes on with its next batch.
        self.in_flight.spawn(lease::release_all_with_notes(with_notes(payer_leases, &known)));
        metrics::counter!(PAYEE_BATCH_ALONE.name).increment(alone.len() as u64);
        for queued in alone {
            let (op, reply) = queued.into_op();
            let this = self.clone();
            self.in_flight.spawn(async move {
                let result = this.under_leases(op).await.and_then(Done::into_transfer);
                count_outcome("transfer", &result);
                let _ = reply.send(result);
            });
        }
        known_payee
    }
}
