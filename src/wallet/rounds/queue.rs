//! Per-wallet queues on this replica, and the worker that serves each under one lease.
//!
//! Requests for one wallet line up here, first come first served, so only one of them (the
//! wallet's worker) contends for the lease in Redis, however many arrived at this replica. Once
//! the worker holds the lease, it hands what is queued to the replica's rounds
//! ([`super::group`]) in batches: up to [`MAX_BATCH`] movements at a time, for at most
//! [`MAX_HOLD`] per lease. The first batch starts from the note the lease's last holder left, or
//! reads the wallet; later ones write from what the last one left. It releases as soon as the queue
//! is empty, the hold is up, or another replica is waiting for the wallet, and leaves the wallet as
//! it knows it in the lease's note for the next holder; after a release that woke another replica
//! it lets that replica go first. A
//! request that waited longer than the lease wait without the worker getting the lease is answered
//! `lock_timeout`. A request whose client left is still applied in its turn: the client (or its
//! retry, with the same idempotency key) may still want to learn its outcome.
//!
//! While Redis cannot be reached, the worker serves the queue the same way without a lease, under
//! Postgres alone ([`crate::wallet::outage`]), and takes leases again once Redis answers.

use crate::lease::{self, Lease, LeaseError, Released};
use crate::telemetry::metrics::BATCH_SIZE;
use crate::wallet::decision::{Held, Op};
use crate::wallet::rounds::group::{Job, JobOutcome};
use crate::wallet::{Moved, WalletError, WalletId, Wallets, lease_name};
use futures::future::OptionFuture;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::Instrument;

/// The most movements one transaction applies.
pub const MAX_BATCH: usize = 64;
/// The longest a worker keeps the lease while its queue is not empty.
pub const MAX_HOLD: Duration = Duration::from_millis(100);

tokio::task_local! {
    /// Told once this task's movement is in its wallet's queue (see [`telling_when_queued`]).
    static ON_QUEUED: std::cell::Cell<Option<oneshot::Sender<()>>>;
}

/// Runs `work` (a request that may apply one wallet's movement), telling `queued` once that movement
/// is in its wallet's queue on this replica: a movement of the same wallet queued after that is
/// decided after it (a queue is first come, first served). Not told when the movement never
/// queues (a replayed key, a refusal before it, the tutorial's strategy): then only its answer
/// orders what follows.
pub async fn telling_when_queued<F: Future>(queued: oneshot::Sender<()>, work: F) -> F::Output {
    ON_QUEUED.scope(std::cell::Cell::new(Some(queued)), work).await
}

/// What a queued request learns: its result, how long it waited for its batch to start, and how
/// long its batch took in Postgres.
pub struct Reply {
    pub result: Result<Moved, WalletError>,
    pub waited: Duration,
    pub db: Duration,
}

pub(in crate::wallet) struct Pending {
    op: Op,
    enqueued: Instant,
    deadline: Instant,
    reply: oneshot::Sender<Reply>,
}

impl Pending {
    /// When it was queued and where its reply goes; and its op.
    pub(in crate::wallet) fn into_parts(self) -> ((Instant, oneshot::Sender<Reply>), Op) {
        ((self.enqueued, self.reply), self.op)
    }
}

/// A queued request: served by its deadline, or answered `lock_timeout`.
pub(in crate::wallet) trait Waiting {
    fn deadline(&self) -> Instant;
}

/// A kind of queue a wallet's worker serves ([`Wallets::serve`]): movements of the wallet
/// ([`Movements`]), or transfers into it ([`super::payee::Transfers`]).
pub(in crate::wallet) trait Lane {
    type Item: Waiting + Send;

    fn queues(wallets: &Wallets) -> &Queues<Self::Item>;

    /// The leases the wallet's next batch will want besides its own (a payee's payers), asked
    /// for in the same round trip as the wallet's own when the worker first asks for it: none by
    /// default.
    fn companions(_wallets: &Wallets, _id: &WalletId) -> Vec<String> {
        Vec::new()
    }

    /// Serves the wallet's queue while `lease` is held, with `companions` (those of
    /// [`Lane::companions`] taken with it); returns the note to leave the next holder.
    fn hold(
        wallets: &Wallets,
        id: &WalletId,
        lease: &mut Lease,
        companions: Vec<Lease>,
    ) -> impl Future<Output = Option<String>> + Send;

    /// Serves the wallet's queue without a lease, under Postgres alone (a Redis outage, see
    /// [`crate::wallet::outage`]), for at most [`MAX_HOLD`] or until the outage ends.
    fn hold_unleased(wallets: &Wallets, id: &WalletId) -> impl Future<Output = ()> + Send;

    /// Answers a request that waited its whole wait without the lease being had.
    fn give_up(item: Self::Item, err: WalletError);
}

/// The deposits and payments of a wallet, written by the rounds.
pub(in crate::wallet) struct Movements;

impl Lane for Movements {
    type Item = Pending;

    fn queues(wallets: &Wallets) -> &Queues<Pending> {
        &wallets.queues
    }

    async fn hold(wallets: &Wallets, id: &WalletId, lease: &mut Lease, _: Vec<Lease>) -> Option<String> {
        let note = lease.take_note().and_then(|note| Held::from_note(&note, lease.fence()));
        wallets.hold(id, lease, note).await.map(|known| known.to_note())
    }

    async fn hold_unleased(wallets: &Wallets, id: &WalletId) {
        wallets.hold_unleased(id).await;
    }

    fn give_up(item: Pending, err: WalletError) {
        answer(item, Err(err), Duration::ZERO);
    }
}

impl Waiting for Pending {
    fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// The queues of this replica, one a wallet: of movements ([`Pending`]), or of transfers into a
/// payee ([`super::payee`]). A wallet has an entry exactly while its worker runs.
#[derive(Debug)]
pub(in crate::wallet) struct Queues<P = Pending> {
    /// Guarded by a std mutex: held only to push or pop, never across an `.await`.
    inner: Arc<Mutex<HashMap<WalletId, VecDeque<P>>>>,
}

impl<P> Clone for Queues<P> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<P> Default for Queues<P> {
    fn default() -> Self {
        Self { inner: Arc::default() }
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("op", &self.op).finish_non_exhaustive()
    }
}

impl<P: Waiting> Queues<P> {
    /// Queues `pending`; true if the wallet had no worker, so the caller must start one. A wallet
    /// with `limit` requests waiting (its batch being written aside) takes no more: the request is
    /// refused [`WalletError::Overloaded`] before anything is done, so a flood on one wallet holds
    /// a bounded queue in memory.
    pub(in crate::wallet) fn push(
        &self,
        id: &WalletId,
        pending: P,
        limit: usize,
    ) -> Result<bool, WalletError> {
        let mut queues = self.inner.lock().expect("queues lock");
        match queues.get_mut(id) {
            Some(queue) if queue.len() >= limit => Err(WalletError::Overloaded),
            Some(queue) => {
                queue.push_back(pending);
                Ok(false)
            }
            None => {
                queues.insert(id.clone(), VecDeque::from([pending]));
                Ok(true)
            }
        }
    }

    /// The earliest deadline among the queued requests; `None`, and the wallet's entry is
    /// removed (its worker retires), once nothing is queued. Decided under the lock, so a request
    /// queued meanwhile either is seen here or starts a new worker.
    pub(in crate::wallet) fn earliest_deadline(&self, id: &WalletId) -> Option<Instant> {
        let mut queues = self.inner.lock().expect("queues lock");
        let earliest = queues.get(id).and_then(|queue| queue.iter().map(Waiting::deadline).min());
        if earliest.is_none() {
            queues.remove(id);
        }
        earliest
    }

    /// What `f` makes of each of the first `max` requests of the queue, left in it.
    pub(in crate::wallet) fn peek<T>(&self, id: &WalletId, max: usize, f: impl Fn(&P) -> T) -> Vec<T> {
        let queues = self.inner.lock().expect("queues lock");
        queues.get(id).map_or_else(Vec::new, |queue| queue.iter().take(max).map(f).collect())
    }

    /// Up to `max` requests from the front of the queue.
    pub(in crate::wallet) fn take(&self, id: &WalletId, max: usize) -> Vec<P> {
        let mut queues = self.inner.lock().expect("queues lock");
        let Some(queue) = queues.get_mut(id) else { return Vec::new() };
        let n = queue.len().min(max);
        queue.drain(..n).collect()
    }

    /// Every queued request whose deadline has passed.
    pub(in crate::wallet) fn take_expired(&self, id: &WalletId, now: Instant) -> Vec<P> {
        let mut queues = self.inner.lock().expect("queues lock");
        let Some(queue) = queues.get_mut(id) else { return Vec::new() };
        let (expired, live): (VecDeque<P>, VecDeque<P>) =
            std::mem::take(queue).into_iter().partition(|p| p.deadline() <= now);
        *queue = live;
        expired.into()
    }

    pub(in crate::wallet) fn is_empty(&self, id: &WalletId) -> bool {
        self.inner.lock().expect("queues lock").get(id).is_none_or(VecDeque::is_empty)
    }
}

impl Wallets {
    /// Queues a movement for its wallet's worker (starting one if none runs) and waits for it.
    pub(in crate::wallet) async fn apply_queued(&self, id: &WalletId, op: Op) -> Reply {
        let (reply, answer) = oneshot::channel();
        let enqueued = Instant::now();
        let deadline = enqueued + self.leases.settings().wait;
        let new_worker =
            match self.queues.push(id, Pending { op, enqueued, deadline, reply }, self.queue_limit) {
                Ok(new_worker) => new_worker,
                Err(refused) => {
                    return Reply { result: Err(refused), waited: Duration::ZERO, db: Duration::ZERO };
                }
            };
        if let Ok(Some(queued)) = ON_QUEUED.try_with(std::cell::Cell::take) {
            let _ = queued.send(());
        }
        if new_worker {
            let (this, id) = (self.clone(), id.clone());
            let span = tracing::info_span!("wallet_worker", wallet_id = %id);
            self.in_flight.spawn(async move { this.serve::<Movements>(&id).await }.instrument(span));
        }
        answer.await.unwrap_or_else(|_| {
            // The worker ended without answering: it panicked. Nothing of this request was
            // written, or it was and its key replays it.
            let result = Err(WalletError::internal("the wallet's worker stopped"));
            Reply { result, waited: enqueued.elapsed(), db: Duration::ZERO }
        })
    }

    /// The wallet's worker for the queue of lane `L`: takes the lease, has the queue served under
    /// it, releases; until the queue is empty.
    pub(in crate::wallet) async fn serve<L: Lane>(&self, id: &WalletId) {
        let name = lease_name(id);
        let mut yield_first = false;
        while let Some(deadline) = L::queues(self).earliest_deadline(id) {
            if self.outage.is_active() {
                Box::pin(L::hold_unleased(self, id)).await;
                continue;
            }
            // Each step's future is boxed: unboxed, the worker's task held the largest of them
            // (13 KB), copied whole at its spawn.
            let acquired = if yield_first {
                Box::pin(self.leases.acquire_after_others(&name, deadline))
                    .await
                    .map(|lease| (lease, Vec::new()))
            } else {
                Box::pin(self.acquire_with_companions(&name, L::companions(self, id), deadline)).await
            };
            let (mut lease, companions) = match acquired {
                Ok(acquired) => acquired,
                // Redis is unreachable, not busy: go on under Postgres alone, if so configured.
                Err(LeaseError::Unavailable(failure)) if self.outage.enter(&failure, &self.leases, &name) => {
                    continue;
                }
                Err(err) => {
                    // Those who waited their whole wait give up; the others keep their place.
                    let failure = WalletError::from(err);
                    for item in L::queues(self).take_expired(id, Instant::now()) {
                        L::give_up(item, failure.clone());
                    }
                    yield_first = false;
                    continue;
                }
            };
            lease.keep_alive();
            let released = match Box::pin(L::hold(self, id, &mut lease, companions)).await {
                Some(note) => Box::pin(lease.release_with_note(&note)).await,
                None => Box::pin(lease.release()).await,
            };
            yield_first = match released {
                Ok(Released { contended }) => contended,
                Err(LeaseError::NotHeld { .. }) => false,
                Err(err) => {
                    tracing::debug!(wallet = %id, error = %err, "release failed; the lease will expire");
                    false
                }
            };
        }
    }

    /// The lease on `name`, waiting until `deadline`, and those of `companions` that were free.
    /// Each is asked once, all in one round trip, without waiting; if `name`'s is busy, the others
    /// are given back and `name`'s is waited for alone. So a worker never waits for its lease
    /// while it holds others (taken outside the order [`crate::lease::LeaseClient::acquire_all`]
    /// keeps): their release, under way meanwhile, waits for nothing and closes no cycle.
    async fn acquire_with_companions(
        &self,
        name: &str,
        companions: Vec<String>,
        deadline: Instant,
    ) -> Result<(Lease, Vec<Lease>), LeaseError> {
        if companions.is_empty() {
            return self.leases.acquire_until(name, deadline).await.map(|lease| (lease, Vec::new()));
        }
        let names: Vec<&str> = companions.iter().map(String::as_str).filter(|other| *other != name).collect();
        let (own, others) = tokio::join!(self.leases.try_acquire(name), self.leases.try_acquire_each(&names));
        let mut taken: Vec<Lease> = others.into_iter().filter_map(|other| other.ok().flatten()).collect();
        for lease in &mut taken {
            lease.keep_alive();
        }
        if let Ok(Some(lease)) = own {
            return Ok((lease, taken));
        }
        if !taken.is_empty() {
            self.in_flight.spawn(lease::release_all(taken));
        }
        own?;
        self.leases.acquire_until(name, deadline).await.map(|lease| (lease, Vec::new()))
    }

    /// Serves the queue while holding the lease: batch after batch, each written by a round,
    /// starting from `note` if the last holder left one. Returns the wallet as the last batch left
    /// it, for the next holder's note; `None` when that is not known (a write failed or was
    /// refused, the lease was lost).
    async fn hold(&self, id: &WalletId, lease: &mut Lease, note: Option<Held>) -> Option<Held> {
        let held_since = Instant::now();
        let mut held = note;
        // A batch whose read found the fence behind runs again after the fence is lifted (up to
        // `MOST_LIFTS` times).
        let mut again: Option<Vec<Pending>> = None;
        let mut lifts = 0;
        loop {
            let batch = again.take().unwrap_or_else(|| self.queues.take(id, MAX_BATCH));
            if batch.is_empty() {
                return held;
            }
            if lease.is_lost() {
                return fail(batch, &WalletError::LeaseLost);
            }
            let started = Instant::now();
            let (waiters, ops): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|Pending { op, enqueued, deadline, reply }| ((enqueued, deadline, reply), op))
                .unzip();
            metrics::histogram!(BATCH_SIZE.name).record(ops.len() as f64);
            let job = Job { id: id.clone(), fence: lease.fence(), held: held.clone(), ops };
            let rejoin =
                |waiters: Vec<(Instant, Instant, oneshot::Sender<Reply>)>, ops: Vec<Op>| -> Vec<Pending> {
                    waiters
                        .into_iter()
                        .zip(ops)
                        .map(|((enqueued, deadline, reply), op)| Pending { op, enqueued, deadline, reply })
                        .collect()
                };
            // With more queued behind this batch, whether another replica waits for the wallet is
            // asked while the batch is written, not after it: one Redis round trip less between
            // batches of a busy wallet.
            let contention: OptionFuture<_> = (!self.queues.is_empty(id)).then(|| lease.contention()).into();
            let (outcome, contended) = tokio::join!(self.rounds.run(job), contention);
            match outcome {
                JobOutcome::FenceBehind { seen, ops } => {
                    let batch = rejoin(waiters, ops);
                    lifts += 1;
                    if lifts > crate::wallet::MOST_LIFTS {
                        return fail(batch, &WalletError::LeaseLost);
                    }
                    if let Err(err) = lease.advance_fence(seen).await {
                        return fail(batch, &err.into());
                    }
                    again = Some(batch);
                    continue;
                }
                JobOutcome::Stale { ops } => {
                    // The row was written since (without a note being left, or under Postgres
                    // alone by a replica that cannot reach Redis): read it and run the batch
                    // again, while the wait lasts.
                    let batch = rejoin(waiters, ops);
                    let waited = held_since.elapsed();
                    if waited >= self.leases.settings().wait {
                        return fail(batch, &WalletError::LockTimeout { waited });
                    }
                    held = None;
                    again = Some(batch);
                    continue;
                }
                JobOutcome::Busy { ops } => {
                    // Until the lease is lost (checked above) the wallet is ours; the busy row
                    // belongs to a holder that lost it, and frees when its statement ends. A row
                    // held longer than a lease wait is someone else's (an operator's session).
                    let batch = rejoin(waiters, ops);
                    let waited = held_since.elapsed();
                    if waited >= self.leases.settings().wait {
                        return fail(batch, &WalletError::LockTimeout { waited });
                    }
                    again = Some(batch);
                    tokio::time::sleep(super::group::BUSY_PAUSE).await;
                    continue;
                }
                JobOutcome::Done { held: after, results } => {
                    let db = started.elapsed();
                    crate::wallet::outage::count_path(crate::wallet::outage::Path::Lease, &results);
                    for ((enqueued, _, reply), result) in waiters.into_iter().zip(results) {
                        let waited = enqueued.elapsed().saturating_sub(db);
                        let _ = reply.send(Reply { result, waited, db });
                    }
                    match after {
                        Some(after) => held = Some(after),
                        None => return None,
                    }
                }
            }
            if held_since.elapsed() >= MAX_HOLD || self.queues.is_empty(id) {
                return held;
            }
            // Another replica waits for this wallet: hand the lease over after each batch.
            let contended = match contended {
                Some(contended) => contended,
                None => lease.contended().await,
            };
            if contended.unwrap_or(true) {
                return held;
            }
        }
    }
}

/// Sends a request its result.
fn answer(pending: Pending, result: Result<Moved, WalletError>, db: Duration) {
    let waited = pending.enqueued.elapsed().saturating_sub(db);
    let _ = pending.reply.send(Reply { result, waited, db });
}

/// Answers every request of `batch` with `err`: none of it was written. The wallet's state is then
/// not known for the next holder's note: `None`.
fn fail(batch: Vec<Pending>, err: &WalletError) -> Option<Held> {
    for pending in batch {
        answer(pending, Err(err.clone()), Duration::ZERO);
    }
    None
}
