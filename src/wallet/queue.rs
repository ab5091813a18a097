//! Per-wallet queues on this replica, and the worker that serves each under one lease.
//!
//! Requests for one wallet line up here, first come first served, so only one of them (the
//! wallet's worker) contends for the lease in Redis, however many arrived at this replica. Once
//! the worker holds the lease and has claimed the wallet, it applies what is queued in batches
//! ([`super::batch`]): up to [`MAX_BATCH`] movements per transaction, for at most [`MAX_HOLD`] per
//! lease. It releases as soon as the queue is empty, the hold is up, or another replica is waiting
//! for the wallet; after a release that woke another replica it lets that replica go first. A
//! request that waited longer than the lease wait without the worker getting the lease is answered
//! `lock_timeout`. A request whose client left is still applied in its turn: the client (or its
//! retry, with the same idempotency key) may still want to learn its outcome.

use super::batch::{self, Held, Op};
use super::{WalletError, WalletId, Wallets, claim, lease_name};
use crate::idempotency;
use crate::lease::{LeaseError, Released};
use crate::ledger::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::Instrument;

/// The most movements one transaction applies.
pub const MAX_BATCH: usize = 64;
/// The longest a worker keeps the lease while its queue is not empty.
pub const MAX_HOLD: Duration = Duration::from_millis(100);

/// What a queued request learns: its result, how long it waited for its batch to start, and how
/// long its batch took in Postgres.
pub struct Reply {
    pub result: Result<Entry, WalletError>,
    pub waited: Duration,
    pub db: Duration,
}

struct Pending {
    op: Op,
    enqueued: Instant,
    deadline: Instant,
    reply: oneshot::Sender<Reply>,
}

/// The queues of this replica. A wallet has an entry exactly while its worker runs.
#[derive(Debug, Clone, Default)]
pub struct Queues {
    /// Guarded by a std mutex: held only to push or pop, never across an `.await`.
    inner: Arc<Mutex<HashMap<WalletId, VecDeque<Pending>>>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("op", &self.op).finish_non_exhaustive()
    }
}

impl Queues {
    /// Queues `pending`; true if the wallet had no worker, so the caller must start one.
    fn push(&self, id: &WalletId, pending: Pending) -> bool {
        let mut queues = self.inner.lock().expect("queues lock");
        match queues.get_mut(id) {
            Some(queue) => {
                queue.push_back(pending);
                false
            }
            None => {
                queues.insert(id.clone(), VecDeque::from([pending]));
                true
            }
        }
    }

    /// The earliest deadline among the queued requests; `None`, and the wallet's entry is
    /// removed (its worker retires), once nothing is queued. Decided under the lock, so a request
    /// queued meanwhile either is seen here or starts a new worker.
    fn earliest_deadline(&self, id: &WalletId) -> Option<Instant> {
        let mut queues = self.inner.lock().expect("queues lock");
        let earliest = queues.get(id).and_then(|queue| queue.iter().map(|p| p.deadline).min());
        if earliest.is_none() {
            queues.remove(id);
        }
        earliest
    }

    /// Up to `max` requests from the front of the queue.
    fn take(&self, id: &WalletId, max: usize) -> Vec<Pending> {
        let mut queues = self.inner.lock().expect("queues lock");
        let Some(queue) = queues.get_mut(id) else { return Vec::new() };
        let n = queue.len().min(max);
        queue.drain(..n).collect()
    }

    /// Every queued request whose deadline has passed.
    fn take_expired(&self, id: &WalletId, now: Instant) -> Vec<Pending> {
        let mut queues = self.inner.lock().expect("queues lock");
        let Some(queue) = queues.get_mut(id) else { return Vec::new() };
        let (expired, live): (VecDeque<Pending>, VecDeque<Pending>) =
            std::mem::take(queue).into_iter().partition(|p| p.deadline <= now);
        *queue = live;
        expired.into()
    }

    /// Everything queued.
    fn take_all(&self, id: &WalletId) -> Vec<Pending> {
        self.take(id, usize::MAX)
    }

    fn is_empty(&self, id: &WalletId) -> bool {
        self.inner.lock().expect("queues lock").get(id).is_none_or(VecDeque::is_empty)
    }
}

impl Wallets {
    /// Queues a movement for its wallet's worker (starting one if none runs) and waits for it.
    pub(super) async fn apply_queued(&self, id: &WalletId, op: Op) -> Reply {
        let (reply, answer) = oneshot::channel();
        let enqueued = Instant::now();
        let deadline = enqueued + self.leases.settings().wait;
        let claim = op.receipt.as_ref().map(|r| r.claim.clone());
        if self.queues.push(id, Pending { op, enqueued, deadline, reply }) {
            let (this, id) = (self.clone(), id.clone());
            let span = tracing::info_span!("wallet_worker", wallet_id = %id);
            self.in_flight.spawn(async move { this.serve(&id).await }.instrument(span));
        }
        match answer.await {
            Ok(reply) => reply,
            // The worker ended without answering: it panicked. The key goes back for a retry.
            Err(_) => {
                if let Some(claim) = claim {
                    idempotency::abandon(&self.db, &claim).await;
                }
                let result = Err(WalletError::Internal(anyhow::anyhow!("the wallet's worker stopped")));
                Reply { result, waited: enqueued.elapsed(), db: Duration::ZERO }
            }
        }
    }

    /// The wallet's worker: takes the lease, applies the queue in batches, releases; until the
    /// queue is empty.
    async fn serve(&self, id: &WalletId) {
        let name = lease_name(id);
        let mut yield_first = false;
        while let Some(deadline) = self.queues.earliest_deadline(id) {
            let acquired = if yield_first {
                self.leases.acquire_after_others(&name, deadline).await
            } else {
                self.leases.acquire_until(&name, deadline).await
            };
            let mut lease = match acquired {
                Ok(lease) => lease,
                Err(err) => {
                    // Those who waited their whole wait give up; the others keep their place.
                    let failure = WalletError::from(err);
                    for pending in self.queues.take_expired(id, Instant::now()) {
                        self.answer(pending, Err(copy(&failure)), Duration::ZERO).await;
                    }
                    yield_first = false;
                    continue;
                }
            };
            lease.keep_alive();
            self.hold(id, &mut lease).await;
            yield_first = match lease.release().await {
                Ok(Released { contended }) => contended,
                Err(LeaseError::NotHeld { .. }) => false,
                Err(err) => {
                    tracing::debug!(wallet = %id, error = %err, "release failed; the lease will expire");
                    false
                }
            };
        }
    }

    /// Serves the queue while holding the lease: claim the wallet, then batches.
    async fn hold(&self, id: &WalletId, lease: &mut crate::lease::Lease) {
        let held_since = Instant::now();
        let mut conn = match self.connection().await {
            Ok(conn) => conn,
            Err(err) => return self.fail_all(id, err).await,
        };
        let lost = lease.lost();
        let claimed = tokio::select! {
            biased;
            () = lost => Err(WalletError::LeaseLost),
            claimed = claim(&mut conn, lease, id) => claimed,
        };
        let mut held = match claimed {
            Ok(claimed) => Held { balance: claimed.balance, version: claimed.version },
            Err(err) => return self.fail_all(id, err).await,
        };
        loop {
            let batch = self.queues.take(id, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            let started = Instant::now();
            let (pendings, ops): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|p| {
                    let Pending { op, enqueued, deadline, reply } = p;
                    ((enqueued, deadline, reply), op)
                })
                .unzip();
            metrics::histogram!(crate::telemetry::metrics::BATCH_SIZE).record(ops.len() as f64);
            let outcome = if lease.is_lost() {
                Err(WalletError::LeaseLost)
            } else {
                batch::apply(&mut conn, id, lease.fence(), &mut held, &ops).await
            };
            let db = started.elapsed();
            let failed = outcome.is_err();
            let results: Vec<Result<Entry, WalletError>> = match outcome {
                Ok(results) => results,
                // Nothing of the batch was applied: every request in it gets the same answer.
                Err(err) => ops.iter().map(|_| Err(copy(&err))).collect(),
            };
            for (((enqueued, deadline, reply), op), result) in pendings.into_iter().zip(ops).zip(results) {
                self.answer(Pending { op, enqueued, deadline, reply }, result, db).await;
            }
            if failed || held_since.elapsed() >= MAX_HOLD || self.queues.is_empty(id) {
                return;
            }
            // Another replica waits for this wallet: hand the lease over after each batch.
            if lease.contended().await.unwrap_or(true) {
                return;
            }
        }
    }

    /// Fails everything queued with `err` (the wallet is missing, or a dependency is down).
    async fn fail_all(&self, id: &WalletId, err: WalletError) {
        for pending in self.queues.take_all(id) {
            self.answer(pending, Err(copy(&err)), Duration::ZERO).await;
        }
    }

    /// Sends a request its result; a key whose outcome is not stored is given back first, so the
    /// client's retry runs.
    async fn answer(&self, pending: Pending, result: Result<Entry, WalletError>, db: Duration) {
        if let (Some(receipt), Err(err)) = (&pending.op.receipt, &result)
            && !err.is_stored()
        {
            idempotency::abandon(&self.db, &receipt.claim).await;
        }
        let waited = pending.enqueued.elapsed().saturating_sub(db);
        let _ = pending.reply.send(Reply { result, waited, db });
    }
}

/// The same error for another request of a failed batch.
fn copy(err: &WalletError) -> WalletError {
    match err {
        WalletError::NotFound => WalletError::NotFound,
        WalletError::Exists => WalletError::Exists,
        WalletError::Refused(refusal) => WalletError::Refused(*refusal),
        WalletError::LockTimeout { waited } => WalletError::LockTimeout { waited: *waited },
        WalletError::LeaseLost => WalletError::LeaseLost,
        WalletError::KeyTakenOver => WalletError::KeyTakenOver,
        WalletError::Unavailable { dependency, source } => {
            WalletError::Unavailable { dependency, source: anyhow::anyhow!("{source:#}") }
        }
        WalletError::OutcomeUnknown(source) => {
            WalletError::OutcomeUnknown(sqlx::Error::Protocol(source.to_string()))
        }
        WalletError::Internal(source) => WalletError::Internal(anyhow::anyhow!("{source:#}")),
    }
}
