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
//! keeps, and a holder that does not wait closes no cycle. The transfers whose payers it got ride
//! the replica's rounds as one job (on one Postgres; under Citus and under Postgres alone they are
//! one transaction, [`Wallets::commit_batch`]); the others take the path of a transfer alone (both
//! leases in order), once the batch's leases are released.

use super::decision::{LegsOp, wallets_of};
use super::outage::{Path, count_path};
use super::queue::{Lane, MAX_BATCH, MAX_HOLD, Queues, Waiting};
use super::transfer::Done;
use super::transfer::{
    Attempt, Failure, Fences, ROW_LOCK_TIMEOUT, Side, TransferOutcome, Work, count_outcome, key_write,
    plan_transfer,
};
use super::{Access, Between, Field, WalletError, WalletId, Wallets, lease_name};
use crate::idempotency::{Keyed, Prior};
use crate::lease::{self, Lease};
use crate::ledger::Entry;
use crate::ledger::group::{GroupWrite, KeyWrite};
use crate::ledger::idempotency::StoredResponse;
use crate::ledger::storage::Storage;
use crate::ledger::transfer::{self as store, LockedWallet, Transfer};
use std::collections::{HashMap, HashSet};
use std::time::Instant;
use tokio::sync::oneshot;
use tracing::Instrument;

/// A transfer waiting for its payee's worker.
pub(super) struct Queued {
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
        let Between { parties, amount, reference } = self.between;
        (LegsOp::Transfer { access: self.access, parties, amount, reference, key: self.key }, self.reply)
    }

    /// The same transfer, as a transaction of its own under both leases.
    fn alone(self) -> (Work, oneshot::Sender<Result<Transfer, WalletError>>) {
        let (op, reply) = self.into_op();
        (Work::Between(op), reply)
    }
}

/// The transfers into a payee, committed in batches under its lease.
pub(super) struct Transfers;

impl Lane for Transfers {
    type Item = Queued;

    fn queues(wallets: &Wallets) -> &Queues<Queued> {
        &wallets.payees
    }

    /// No note: the next holder of the payee's lease reads its row.
    async fn hold(wallets: &Wallets, payee: &WalletId, lease: &mut Lease) -> Option<String> {
        wallets.hold_payee(payee, lease).await;
        None
    }

    async fn hold_unleased(wallets: &Wallets, payee: &WalletId) {
        wallets.hold_payee_unleased(payee).await;
    }

    fn give_up(item: Queued, err: WalletError) {
        item.answer(Err(err));
    }
}

/// What one transaction made of each transfer of a batch, in the batch's order.
type BatchResults = Vec<Result<Transfer, WalletError>>;

/// Answers each transfer of a batch committed by `path` with its own result, or every one with
/// the failure of the batch's transaction.
fn answer_batch(transfers: Vec<Queued>, outcome: Result<BatchResults, WalletError>, path: Path) {
    match outcome {
        Ok(results) => {
            count_path(path, &results);
            for (queued, result) in transfers.into_iter().zip(results) {
                queued.answer(result);
            }
        }
        Err(err) => {
            for queued in transfers {
                queued.answer(Err(err.clone()));
            }
        }
    }
}

/// Answers each transfer of a batch, by where its answer goes, as [`answer_batch`] does.
fn answer_each(
    replies: Vec<oneshot::Sender<Result<Transfer, WalletError>>>,
    outcome: Result<BatchResults, WalletError>,
    path: Path,
) {
    let results = match outcome {
        Ok(results) => {
            count_path(path, &results);
            results
        }
        Err(err) => replies.iter().map(|_| Err(err.clone())).collect(),
    };
    for (reply, result) in replies.into_iter().zip(results) {
        count_outcome("transfer", &result);
        let _ = reply.send(result);
    }
}

/// Transfers into `payee`, committed together by [`Wallets::commit_batch`].
struct PayeeBatch<'a> {
    payee: &'a WalletId,
    transfers: &'a [Queued],
}

impl Attempt for PayeeBatch<'_> {
    type Output = BatchResults;

    fn attempt(
        &self,
        wallets: &Wallets,
        fences: &Fences,
    ) -> impl Future<Output = Result<BatchResults, Failure>> + Send {
        wallets.commit_batch(self.payee, self.transfers, fences)
    }
}

impl Wallets {
    /// Queues a transfer for its payee's worker (starting one if none runs) and waits for it.
    pub(super) async fn transfer_queued(
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

    /// Serves the payee's queue while holding its lease, batch after batch.
    async fn hold_payee(&self, payee: &WalletId, lease: &mut Lease) {
        let held_since = Instant::now();
        loop {
            let batch = self.payees.take(payee, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            if lease.is_lost() {
                for queued in batch {
                    queued.answer(Err(WalletError::LeaseLost));
                }
                return;
            }
            metrics::histogram!(crate::telemetry::metrics::PAYEE_BATCH).record(batch.len() as f64);
            self.run_batch(payee, lease, batch).await;
            if held_since.elapsed() >= MAX_HOLD || self.payees.is_empty(payee) {
                return;
            }
            // Another replica waits for this payee: hand the lease over after each batch.
            if lease.contended().await.unwrap_or(true) {
                return;
            }
        }
    }

    /// Serves the payee's queue under Postgres alone (a Redis outage), batch after batch, each one
    /// transaction with its wallets' rows locked, for at most [`MAX_HOLD`] or until the outage ends.
    async fn hold_payee_unleased(&self, payee: &WalletId) {
        let since = Instant::now();
        loop {
            let mut batch = self.payees.take(payee, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            metrics::histogram!(crate::telemetry::metrics::PAYEE_BATCH).record(batch.len() as f64);
            // A key sent twice at once is stored once: the second goes in the next batch, and
            // finds the first's outcome.
            let mut keys = HashSet::new();
            let (ready, later): (Vec<Queued>, Vec<Queued>) = batch.drain(..).partition(|queued| {
                queued.key.as_ref().is_none_or(|key| keys.insert((key.scope.clone(), key.key.clone())))
            });
            for transfers in [ready, later].into_iter().filter(|batch| !batch.is_empty()) {
                let outcome = self.commit_unleased(&PayeeBatch { payee, transfers: &transfers }).await;
                answer_batch(transfers, outcome, Path::PostgresOnly);
            }
            if since.elapsed() >= MAX_HOLD || !self.outage.is_active() {
                return;
            }
        }
    }

    /// One batch under the payee's `lease`: the payers' leases asked for once each, those
    /// transfers committed together, the rest sent on alone.
    async fn run_batch(&self, payee: &WalletId, lease: &mut Lease, batch: Vec<Queued>) {
        let mut payer_leases: Vec<Lease> = Vec::new();
        let (mut ready, mut alone) = (Vec::new(), Vec::new());
        let mut keys = HashSet::new();
        for queued in batch {
            // A key sent twice at once (a client's retry racing its first try) is stored once:
            // the second waits for the first's outcome on its own path.
            if let Some(key) = &queued.key
                && !keys.insert((key.scope.clone(), key.key.clone()))
            {
                alone.push(queued);
                continue;
            }
            let name = lease_name(&queued.between.parties.from);
            if payer_leases.iter().any(|held| held.name() == name) {
                ready.push(queued);
                continue;
            }
            match self.leases.try_acquire(&name).await {
                Ok(Some(mut payer)) => {
                    payer.keep_alive();
                    payer_leases.push(payer);
                    ready.push(queued);
                }
                Ok(None) => alone.push(queued),
                Err(err) => queued.answer(Err(err.into())),
            }
        }
        if !ready.is_empty() {
            crate::failpoint::hit("transfer_leases_held");
            let mut leases: Vec<&mut Lease> = payer_leases.iter_mut().collect();
            leases.push(lease);
            match self.storage.of(&self.db).await {
                // On one Postgres the batch rides the replica's rounds, as one group of wallets.
                Ok(Storage::OnePostgres) => {
                    let (ops, replies): (Vec<LegsOp>, Vec<_>) =
                        ready.into_iter().map(Queued::into_op).unzip();
                    let wallets = wallets_of(&ops);
                    let outcome = self.run_between(&mut leases, wallets, ops).await.map(|results| {
                        results.into_iter().map(|result| result.and_then(Done::into_transfer)).collect()
                    });
                    answer_each(replies, outcome, Path::Lease);
                }
                Ok(_) => {
                    let outcome =
                        self.commit_retrying(&mut leases, &PayeeBatch { payee, transfers: &ready }).await;
                    answer_batch(ready, outcome, Path::Lease);
                }
                Err(err) => answer_batch(ready, Err(err.into()), Path::Lease),
            }
        }
        lease::release_all(payer_leases).await;
        metrics::counter!("walletlock_payee_batch_alone_total").increment(alone.len() as u64);
        for queued in alone {
            let (work, reply) = queued.alone();
            let this = self.clone();
            self.in_flight.spawn(async move {
                let result = this.under_leases(work).await.and_then(super::transfer::Done::into_transfer);
                count_outcome("transfer", &result);
                let _ = reply.send(result);
            });
        }
    }

    /// One transaction for the transfers of `batch`, all into `payee`: the payee's and payers'
    /// rows locked in id order, every fence checked, then each transfer decided in turn from what
    /// the ones before it left (a payer paying twice pays from its new balance), its key looked up
    /// and its outcome stored; each wallet is written once, conditionally on its lease's fence and
    /// the version read. A transfer refused on its merits, or whose wallet is missing, answers for
    /// itself; the others commit.
    async fn commit_batch(
        &self,
        payee: &WalletId,
        batch: &[Queued],
        fences: &Fences,
    ) -> Result<BatchResults, Failure> {
        // Every wallet of the batch, by id.
        let wallets: HashMap<&str, &WalletId> = batch
            .iter()
            .map(|q| &q.between.parties.from)
            .chain([payee])
            .map(|id| (id.as_str(), id))
            .collect();
        let mut ids: Vec<&str> = wallets.keys().copied().collect();
        ids.sort_unstable();
        let mut tx = self.db.begin().await?;
        let locked = store::lock_wallets(&mut tx, &ids, ROW_LOCK_TIMEOUT).await?;
        // The fence each locked wallet's write carries, by wallet id.
        let mut fence_by_id: HashMap<&str, i64> = HashMap::new();
        for (id, row) in &locked {
            let wallet = wallets[id.as_str()];
            fence_by_id.insert(wallet.as_str(), fences.for_row(wallet, row.fence)?);
        }
        let fence_of = |id: &str| fence_by_id.get(id).copied().unwrap_or_default();
        // Each wallet as the transfers decided so far leave it.
        let mut rows: HashMap<String, LockedWallet> = locked.clone();
        let now = crate::ledger::entry_time();
        let mut results = Vec::with_capacity(batch.len());
        let mut transfers: Vec<Transfer> = Vec::new();
        // The response of each keyed transfer decided, and the entry it reports.
        let mut responses: Vec<(&Queued, StoredResponse, Option<uuid::Uuid>)> = Vec::new();
        for queued in batch {
            let Between { parties, amount, reference } = &queued.between;
            let from =
                rows.get(parties.from.as_str()).filter(|row| queued.access.may_use(row.owner.as_deref()));
            let to =
                rows.get(parties.to.as_str()).filter(|row| queued.access.may_pay_into(row.owner.as_deref()));
            let (Some(_), Some(_)) = (from, to) else {
                let field = if from.is_none() { Field::From } else { Field::To };
                results.push(Err(WalletError::PartyNotFound { field }));
                continue;
            };
            if let Some(key) = &queued.key
                && let Some(found) = store::find_key(&mut tx, key.at()).await?
            {
                results.push(Err(WalletError::AlreadyRan(Prior::of(&found, &key.fingerprint))));
                continue;
            }
            if let Some(payer) = rows.get_mut(parties.from.as_str()) {
                super::transfer::release_if_short(&mut tx, payer, &parties.from, *amount, now).await?;
            }
            let (from, to) = (&rows[parties.from.as_str()], &rows[parties.to.as_str()]);
            let sides: [Side<'_>; 2] = [
                (&parties.from, from, fence_of(parties.from.as_str())),
                (&parties.to, to, fence_of(parties.to.as_str())),
            ];
            let outcome = plan_transfer(sides[0], sides[1], *amount, reference.clone(), None, now);
            if let Ok(transfer) = &outcome {
                for (id, entry) in [(&parties.from, &transfer.from_entry), (&parties.to, &transfer.to_entry)]
                {
                    let row = rows.get_mut(id.as_str()).expect("locked above");
                    (row.balance, row.version) = (entry.balance, entry.version);
                }
                transfers.push(transfer.clone());
            }
            if let Some(key) = &queued.key {
                responses.push((
                    queued,
                    (key.render)(&outcome),
                    outcome.as_ref().ok().map(|t| t.from_entry.id),
                ));
            }
            results.push(outcome.map_err(WalletError::Refused));
        }
        let legs: Vec<&Entry> = transfers.iter().flat_map(|t| [&t.from_entry, &t.to_entry]).collect();
        // Every key's response depends on the payee's write, so the payee is written first.
        let keys: Vec<KeyWrite<'_>> = responses
            .iter()
            .flat_map(|(queued, response, entry)| {
                key_write(payee, queued.key.as_ref(), Some(response), *entry)
            })
            .collect();
        // Each row as the write finds it: as locked, but for the holds `release_if_short` released.
        let as_found: HashMap<&str, LockedWallet> = locked
            .iter()
            .map(|(id, row)| (id.as_str(), LockedWallet { held: rows[id.as_str()].held, ..row.clone() }))
            .collect();
        let mut sides: Vec<Side<'_>> =
            as_found.iter().map(|(id, row)| (wallets[id], row, fence_of(id))).collect();
        sides.sort_by_key(|(id, _, _)| *id != payee);
        let write =
            GroupWrite { entries: legs, keys, transfers: transfers.iter().collect(), ..Default::default() };
        self.write_locked(&mut tx, &sides, write, now).await?;
        crate::failpoint::hit("before_commit");
        super::commit(tx).await?;
        crate::failpoint::hit("after_commit");
        Ok(results)
    }
}
