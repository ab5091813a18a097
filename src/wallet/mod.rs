//! Wallets: opening them, reading them, and moving money under the wallet's lease with a fenced
//! commit.
//!
//! This is where the lease and the ledger meet, and the only place that does. Movements of money
//! run as: take the wallet's lease (waiting up to the configured wait), start its watchdog, start
//! from the wallet as the lease's note says the last holder left it or read the wallet row
//! (balance, version, fence, owner), decide, commit conditionally on all of that while raising the
//! row's fence to the lease's, release leaving the wallet as written in the note (a transfer raises
//! the fence of its two rows first, inside its transaction). It never touches Redis commands or
//! SQL itself: those live in [`crate::lease`] and [`crate::ledger`].
//!
//! Two ways to wait for a busy wallet ([`Strategy`]): the default queues the requests for one
//! wallet on this replica behind a single worker that applies them in batches under one lease
//! (`queue`); the tutorial's way has every request take the lease on its own (`tutorial`), kept as
//! the benchmark's baseline.
//!
//! While Redis cannot be reached ([`RedisOutage::Postgres`]), the same queues are served under
//! Postgres alone, each batch's row locked in its transaction (`outage`, `unleased`).

mod decision;
mod group;
mod holds;
mod outage;
mod payee;
mod queue;
mod transfer;
mod unleased;

pub use crate::domain::{
    Access, Amount, Field, HoldLife, InvalidInput, Movement, Parties, Refusal, SameWallet, WalletId,
};
pub use outage::RedisOutage;
pub use queue::{MAX_BATCH, MAX_HOLD};
pub use transfer::{Between, Refund, RefundOutcome, TransferOutcome};

use crate::idempotency::{self, KeySettings, Keyed, Prior, Receipt};
use crate::lease::{Lease, LeaseClient, LeaseError};
use crate::ledger::hold::Hold;
use crate::ledger::storage::KnownStorage;
use crate::ledger::{self, Entry, StoreError, Wallet};
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// Describes the metrics this module records (see `crate::telemetry::metrics`), and registers the
/// common ones at zero.
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        "walletlock_movements_total",
        "Deposits, payments, and holds placed, captured and voided, by kind and outcome."
    );
    transfer::describe_metrics();
    outage::describe_metrics();
    for kind in ["pay", "deposit", "hold", "capture", "void"] {
        for outcome in
            ["accepted", "insufficient_funds", "lock_timeout", "overloaded", "lease_lost", "unavailable"]
        {
            metrics::counter!("walletlock_movements_total", "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
    for kind in ["capture", "void"] {
        for outcome in ["hold_captured", "hold_voided", "hold_expired"] {
            metrics::counter!("walletlock_movements_total", "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
    describe_counter!(
        "walletlock_wallet_busy_total",
        "Writes that found the wallet's row locked by another statement (a transfer, a holder that lost its lease), and tried again."
    );
    metrics::counter!("walletlock_wallet_busy_total").absolute(0);
    describe_counter!(
        "walletlock_fence_refusals_total",
        "Fence raises or commits the fence refused: the lease was lost."
    );
    metrics::counter!("walletlock_fence_refusals_total").absolute(0);
    describe_counter!(
        "walletlock_lease_note_stale_total",
        "Batches begun from the lease's note that found the wallet's row otherwise, and were read and run again."
    );
    metrics::counter!("walletlock_lease_note_stale_total").absolute(0);
    describe_histogram!(
        crate::telemetry::metrics::BATCH_SIZE,
        "Movements of one wallet per group commit (under one lease)."
    );
    describe_histogram!(
        crate::telemetry::metrics::ROUND_WALLETS,
        "Wallets written per round (one statement, one WAL flush)."
    );
    describe_histogram!(
        "walletlock_pg_pool_acquire_wait_seconds",
        Unit::Seconds,
        "Wait for a Postgres connection from the pool."
    );
    // `crate::http` describes the shed counter; this module records its `wallet_queue` reason.
    metrics::counter!(crate::telemetry::metrics::REQUESTS_SHED, "reason" => "wallet_queue").absolute(0);
    // Sampled at scrape time by [`Wallets::sample_pool_metrics`].
    for (name, help) in [
        ("walletlock_pg_pool_connections", "Postgres pool connections, idle and in use."),
        ("walletlock_pg_pool_max_connections", "Postgres pool size limit (PG_POOL_SIZE)."),
        ("walletlock_redis_pool_connections", "Redis pool connections, idle and in use."),
        ("walletlock_redis_pool_max_connections", "Redis pool size limit (REDIS_POOL_SIZE)."),
        ("walletlock_redis_pool_waiting", "Requests waiting for a Redis connection."),
    ] {
        metrics::describe_gauge!(name, help);
    }
}

/// The cause of a failure, shared by every request of a round or batch that it failed.
pub type SharedError = Arc<dyn std::error::Error + Send + Sync>;

/// Why a wallet operation did not happen. Every variant but [`WalletError::OutcomeUnknown`] means
/// nothing was applied. Cloning shares the cause: one failed round answers many requests.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WalletError {
    #[error("wallet not found")]
    NotFound,
    /// One of a transfer's wallets does not exist; `field` says which ([`Field::From`] or
    /// [`Field::To`]).
    #[error("the {} wallet does not exist", .field.name())]
    PartyNotFound { field: Field },
    #[error("transfer not found")]
    TransferNotFound,
    /// No `pay` entry of the wallet has this id.
    #[error("payment not found")]
    PaymentNotFound,
    /// No hold has this id (or its wallet is one the caller may not use).
    #[error("hold not found")]
    HoldNotFound,
    #[error("wallet already exists")]
    Exists,
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Another holder kept the wallet's lease for the whole wait.
    #[error("the wallet's lease was not obtained within {waited:?}")]
    LockTimeout { waited: Duration },
    /// The wallet already had as many movements queued on this replica as its queue holds
    /// (`WALLET_QUEUE_LIMIT`): this one was not queued, nothing was applied.
    #[error("the wallet's queue on this replica is full; nothing was applied")]
    Overloaded,
    /// Our lease expired or passed to another holder before the commit, which was refused.
    #[error("the wallet's lease was lost before the commit; nothing was applied")]
    LeaseLost,
    /// The wallet's row has seen the largest fence there is: no lease can write it until an
    /// operator resets its fence (README, "When a fence reaches the top").
    #[error("the wallet's fence is at its top; an operator must reset it")]
    FenceExhausted(#[source] Arc<LeaseError>),
    /// The lease's fence is more than [`crate::domain::MAX_FENCE_STEP`] above the fence of the
    /// wallet's row: the wallet's fence counter in Redis was moved from outside. Nothing was
    /// written, so the row keeps its fences; an operator deletes the counter (README, "When a
    /// fence counter is moved from outside"), and the next lease lifts it above the row's.
    #[error("the lease's fence {fence} is implausibly far above the wallet's {seen}; nothing was applied")]
    FenceImplausible { fence: i64, seen: i64 },
    /// Redis or Postgres could not be reached in time.
    #[error("{dependency} unavailable")]
    Unavailable { dependency: &'static str, source: SharedError },
    /// The connection to Postgres failed while a commit was in flight: it may or may not have
    /// happened. The only variant that does not mean "nothing was applied"; a retry with the same
    /// idempotency key learns which.
    #[error("the commit's outcome is unknown")]
    OutcomeUnknown(#[source] Arc<sqlx::Error>),
    /// The request's idempotency key was taken over by a retry while this request ran (it was
    /// presumed dead); the retry runs it, this one applied nothing.
    #[error("the idempotency key was taken over by another request; nothing was applied")]
    KeyTakenOver,
    /// The request's idempotency key was used before: it did not run again.
    #[error("the idempotency key was used before; nothing was applied again")]
    AlreadyRan(Prior),
    #[error(transparent)]
    Internal(SharedError),
}

impl WalletError {
    /// A bug, described by `what`.
    pub fn internal(what: &str) -> Self {
        WalletError::Internal(Arc::from(Box::<dyn std::error::Error + Send + Sync>::from(what)))
    }

    /// [`WalletError::FenceImplausible`] for wallet `id`, logged: it needs an operator.
    pub(crate) fn fence_implausible(id: &WalletId, fence: i64, seen: i64) -> Self {
        tracing::error!(
            wallet = %id,
            fence,
            seen,
            lease = %lease_name(id),
            "a lease's fence is implausibly far above the wallet's: its Redis fence counter was moved from outside; delete the counter"
        );
        WalletError::FenceImplausible { fence, seen }
    }

    /// The `outcome` label of `walletlock_movements_total`.
    fn outcome(&self) -> &'static str {
        match self {
            WalletError::NotFound | WalletError::PartyNotFound { .. } => "not_found",
            WalletError::TransferNotFound | WalletError::PaymentNotFound | WalletError::HoldNotFound => {
                "not_found"
            }
            WalletError::Exists => "exists",
            WalletError::Refused(refusal) => refusal.code(),
            WalletError::LockTimeout { .. } => "lock_timeout",
            WalletError::Overloaded => "overloaded",
            WalletError::LeaseLost => "lease_lost",
            WalletError::FenceExhausted(_) => "fence_exhausted",
            WalletError::FenceImplausible { .. } => "fence_implausible",
            WalletError::Unavailable { .. } => "unavailable",
            WalletError::OutcomeUnknown(_) => "unknown",
            WalletError::KeyTakenOver => "key_taken_over",
            WalletError::AlreadyRan(Prior::Replay(_)) => "replayed",
            WalletError::AlreadyRan(_) => "key_conflict",
            WalletError::Internal(_) => "error",
        }
    }

    /// Whether the outcome is stored for an idempotency key: deterministic refusals are (a retry
    /// would be refused the same way); failures that a retry might not meet are not.
    fn is_stored(&self) -> bool {
        matches!(self, WalletError::Refused(_) | WalletError::Exists | WalletError::KeyTakenOver)
    }
}

/// What a movement did: the ledger entry of a deposit or payment; the hold placed, captured (with
/// its `pay` entry) or voided; the expired holds released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    Entry(Entry),
    Hold { hold: Hold, entry: Option<Entry> },
    Released,
}

impl Moved {
    /// The ledger entry it wrote, if any.
    pub fn entry(&self) -> Option<&Entry> {
        match self {
            Moved::Entry(entry) | Moved::Hold { entry: Some(entry), .. } => Some(entry),
            _ => None,
        }
    }
}

/// How a movement ended, as stored for its idempotency key.
pub type MovementOutcome = Result<Moved, Refusal>;

/// A wallet creation refused because the id is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlreadyExists;

/// How a wallet creation ended, as stored for its idempotency key.
pub type OpenOutcome = Result<Wallet, AlreadyExists>;

impl From<StoreError> for WalletError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::WalletNotFound => WalletError::NotFound,
            StoreError::WalletExists => WalletError::Exists,
            StoreError::LeaseLost | StoreError::FenceBehind { .. } => WalletError::LeaseLost,
            err if err.is_lock_timeout() => WalletError::LockTimeout { waited: transfer::ROW_LOCK_TIMEOUT },
            err if err.is_unavailable() => {
                WalletError::Unavailable { dependency: "postgres", source: Arc::new(err) }
            }
            err => WalletError::Internal(Arc::new(err)),
        }
    }
}

impl From<sqlx::Error> for WalletError {
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

impl From<LeaseError> for WalletError {
    fn from(err: LeaseError) -> Self {
        match err {
            LeaseError::NotObtained { waited, .. } => WalletError::LockTimeout { waited },
            LeaseError::NotHeld { .. } => WalletError::LeaseLost,
            err @ LeaseError::FenceExhausted { .. } => WalletError::FenceExhausted(Arc::new(err)),
            LeaseError::Unavailable(failure) => {
                WalletError::Unavailable { dependency: "redis", source: Arc::new(failure) }
            }
        }
    }
}

/// The default bound on one wallet's queue on one replica (`WALLET_QUEUE_LIMIT`): two full batches
/// and then some, served well within a lease wait.
pub const DEFAULT_QUEUE_LIMIT: usize = 128;

/// How requests wait for a busy wallet (the setting `LEASE_STRATEGY`, hence `clap::ValueEnum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Strategy {
    /// Requests for one wallet queue on this replica; one worker takes the lease for all of them
    /// and applies them in batches (group commit).
    Queue,
    /// Every request takes the lease itself and applies its movement alone: the tutorial's lock.
    Tutorial,
}

/// The wallet service. Cheap to clone: one reference count, shared by every request, worker and
/// round of the replica (a clone per request of a struct of a dozen shared handles measured 2% of
/// a replica's CPU under spread payments).
#[derive(Debug, Clone)]
pub struct Wallets(Arc<Shared>);

impl std::ops::Deref for Wallets {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`Wallets`] shares: pools, queues, rounds and the task tracker.
#[derive(Debug, Clone)]
pub struct Shared {
    db: PgPool,
    leases: LeaseClient,
    strategy: Strategy,
    /// The per-wallet queues of this replica (used by [`Strategy::Queue`]).
    queues: queue::Queues,
    /// The queues of transfers into each payee on this replica (used by [`Strategy::Queue`]).
    payees: queue::Queues<payee::Queued>,
    /// The most movements one wallet may have queued on this replica; one more is
    /// [`WalletError::Overloaded`].
    queue_limit: usize,
    /// Where every movement is written, in rounds across wallets.
    rounds: group::Rounds,
    /// How long the responses of transfers and refunds are kept for their idempotency keys (the
    /// rounds keep their own copy for deposits and payments).
    keys: idempotency::Keys,
    /// Whether this replica is in a Redis outage, moving money under Postgres alone.
    outage: Arc<outage::Outage>,
    /// Where movements are written during an outage, in rounds across wallets.
    unleased: unleased::UnleasedRounds,
    /// Where the tables live (one Postgres, or Citus), learnt from the database.
    storage: KnownStorage,
    /// Every movement in progress, every wallet worker and every round runs as a task on this
    /// tracker, so it finishes (commit or roll back, then release) even if the request that
    /// started it is dropped, and so shutdown can wait for all of them.
    in_flight: TaskTracker,
}

impl Wallets {
    /// The service over `db` and `leases`, with the default key retention (see
    /// [`Wallets::with_keys`]). Call within a Tokio runtime: it starts the replica's rounds.
    pub fn new(db: PgPool, leases: LeaseClient) -> Self {
        let in_flight = TaskTracker::new();
        let storage = KnownStorage::default();
        let keys = idempotency::Keys::new(db.clone(), KeySettings::default());
        let rounds = group::Rounds::start(
            db.clone(),
            round_settings(&leases, keys.settings().retention),
            storage.clone(),
            in_flight.clone(),
        );
        let unleased = unleased::UnleasedRounds::start(
            db.clone(),
            keys.settings().retention,
            storage.clone(),
            in_flight.clone(),
        );
        Self(Arc::new(Shared {
            db,
            leases,
            strategy: Strategy::Queue,
            queues: queue::Queues::default(),
            payees: queue::Queues::default(),
            queue_limit: DEFAULT_QUEUE_LIMIT,
            rounds,
            keys,
            outage: Arc::new(outage::Outage::new(RedisOutage::Refuse)),
            unleased,
            storage,
            in_flight,
        }))
    }

    /// Bounds each wallet's queue on this replica at `limit` movements (at least 1).
    pub fn with_queue_limit(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.0).queue_limit = limit.max(1);
        self
    }

    /// What movements do while Redis cannot be reached (the default here: refuse). The lease
    /// client should fail fast ([`crate::lease::LeaseSettings::fail_fast`]) with
    /// [`RedisOutage::Postgres`], or each worker waits out its lease wait before going on.
    pub fn with_redis_outage(mut self, policy: RedisOutage) -> Self {
        Arc::make_mut(&mut self.0).outage = Arc::new(outage::Outage::new(policy));
        self
    }

    /// What movements do while Redis cannot be reached, and whether this replica is in an outage
    /// now (moving money under Postgres alone).
    pub fn redis_outage(&self) -> (RedisOutage, bool) {
        (self.outage.policy(), self.outage.is_active())
    }

    pub fn with_strategy(mut self, strategy: Strategy) -> Self {
        Arc::make_mut(&mut self.0).strategy = strategy;
        self
    }

    /// Stores movements' responses for `keys.retention`.
    pub fn with_keys(mut self, keys: KeySettings) -> Self {
        let settings = round_settings(&self.leases, keys.retention);
        let service = Arc::make_mut(&mut self.0);
        service.rounds = group::Rounds::start(
            service.db.clone(),
            settings,
            service.storage.clone(),
            service.in_flight.clone(),
        );
        service.unleased = unleased::UnleasedRounds::start(
            service.db.clone(),
            keys.retention,
            service.storage.clone(),
            service.in_flight.clone(),
        );
        service.keys = idempotency::Keys::new(service.db.clone(), keys);
        self
    }

    /// Deletes the stored responses of idempotency keys past their retention; how many.
    pub async fn purge_expired_keys(&self) -> Result<u64, StoreError> {
        self.keys.purge_expired().await
    }

    /// Closes the Postgres pool: after [`Wallets::drain`], at shutdown.
    pub async fn close(&self) {
        self.db.close().await;
    }

    /// Whether Redis and Postgres each answer within `limit`: (redis, postgres). In a Redis
    /// outage Redis is not asked: the outage's own probe ends it once Redis serves leases again.
    pub async fn dependencies_answer(&self, limit: Duration) -> (bool, bool) {
        let in_outage = self.outage.is_active();
        let (redis, postgres) = tokio::join!(
            async {
                !in_outage && matches!(tokio::time::timeout(limit, self.leases.ping()).await, Ok(Ok(())))
            },
            tokio::time::timeout(limit, ledger::ping(&self.db)),
        );
        (redis, matches!(postgres, Ok(Ok(()))))
    }

    /// Sets the gauges of both connection pools to what they hold now.
    pub fn sample_pool_metrics(&self) {
        let idle = self.db.num_idle() as f64;
        metrics::gauge!("walletlock_pg_pool_connections", "state" => "idle").set(idle);
        metrics::gauge!("walletlock_pg_pool_connections", "state" => "in_use")
            .set(f64::from(self.db.size()) - idle);
        metrics::gauge!("walletlock_pg_pool_max_connections")
            .set(f64::from(self.db.options().get_max_connections()));
        let redis = self.leases.pool().status();
        metrics::gauge!("walletlock_redis_pool_connections", "state" => "idle").set(redis.available as f64);
        metrics::gauge!("walletlock_redis_pool_connections", "state" => "in_use")
            .set(redis.size.saturating_sub(redis.available) as f64);
        metrics::gauge!("walletlock_redis_pool_max_connections").set(redis.max_size as f64);
        metrics::gauge!("walletlock_redis_pool_waiting").set(redis.waiting as f64);
    }

    /// Claims `key` for a request that stores its outcome after it ran (wallet creation), or
    /// finds what an earlier request with it left (see [`idempotency::Keys::begin`]).
    pub async fn begin_keyed(
        &self,
        scope: idempotency::Scope,
        key: idempotency::IdempotencyKey,
        fingerprint: [u8; 32],
    ) -> Result<idempotency::Begin, WalletError> {
        Ok(self.keys.begin(scope, key, fingerprint).await?)
    }

    /// Opens a wallet owned by `owner` (a caller) with an opening balance (recorded as its `open`
    /// entry). With a receipt, the outcome is stored for its idempotency key in the same
    /// transaction.
    pub async fn open(
        &self,
        owner: &str,
        id: &WalletId,
        balance: i64,
        receipt: Option<Receipt<OpenOutcome>>,
    ) -> Result<Wallet, WalletError> {
        let (this, id, owner) = (self.clone(), id.clone(), owner.to_owned());
        self.run_to_end(receipt.as_ref().map(|r| r.claim.clone()), async move {
            let mut tx = this.db.begin().await?;
            match ledger::create_wallet(&mut tx, id.as_str(), &owner, balance).await {
                Ok((wallet, open)) => {
                    if let Some(receipt) = &receipt
                        && !idempotency::complete(&mut tx, receipt, &Ok(wallet.clone()), Some(open.id))
                            .await?
                    {
                        return Err(WalletError::KeyTakenOver);
                    }
                    commit(tx).await?;
                    this.leave_note(&id, &wallet);
                    Ok(wallet)
                }
                Err(StoreError::WalletExists) => {
                    drop(tx);
                    if let Some(receipt) = &receipt {
                        let mut tx = this.db.begin().await?;
                        if !idempotency::complete(&mut tx, receipt, &Err(AlreadyExists), None).await? {
                            return Err(WalletError::KeyTakenOver);
                        }
                        tx.commit().await?;
                    }
                    Err(WalletError::Exists)
                }
                Err(err) => Err(err.into()),
            }
        })
        .await
    }

    /// Leaves the wallet just opened, as it is, in its lease's note, so that its first payment need
    /// not read it (see [`queue`]), in the background: opening a wallet does not wait for Redis or
    /// fail without it. The note is only advice, checked by the first write that uses it.
    fn leave_note(&self, id: &WalletId, wallet: &Wallet) {
        let opened = decision::Held {
            balance: wallet.balance,
            held: wallet.held,
            version: wallet.version,
            fence: wallet.fence,
            owner: wallet.owner.as_deref().map(Arc::from),
            from_note: false,
        };
        let (leases, name, note) = (self.leases.clone(), lease_name(id), opened.to_note());
        self.in_flight.spawn(async move {
            if let Err(err) = leases.leave_note(&name, &note).await {
                tracing::debug!(lease = %name, error = %err, "no note left for the new wallet; its first payment reads it");
            }
        });
    }

    /// The wallet, if `access` may use it: to a caller that may not, it does not exist.
    pub async fn get(&self, access: &Access, id: &WalletId) -> Result<Wallet, WalletError> {
        let mut conn = self.connection().await?;
        ledger::find_wallet(&mut conn, id.as_str())
            .await?
            .filter(|wallet| access.may_use(wallet.owner.as_deref()))
            .ok_or(WalletError::NotFound)
    }

    /// A page of the wallet's ledger, newest first, below version `before`, if `access` may use
    /// the wallet.
    pub async fn history(
        &self,
        access: &Access,
        id: &WalletId,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<Entry>, WalletError> {
        let mut conn = self.connection().await?;
        let visible = ledger::find_wallet(&mut conn, id.as_str())
            .await?
            .is_some_and(|wallet| access.may_use(wallet.owner.as_deref()));
        if !visible {
            return Err(WalletError::NotFound);
        }
        Ok(ledger::entries_page(&mut conn, id.as_str(), before, limit).await?)
    }

    /// Applies a movement for `access` under the wallet's lease with a fenced commit. With a key,
    /// the key is looked up first by the lease holder: a key used before answers
    /// [`WalletError::AlreadyRan`] and applies nothing; a new key's outcome is stored in the
    /// statement that moves the money. A wallet `access` may not use is [`WalletError::NotFound`],
    /// decided by the lease holder from the row it read, with nothing applied.
    pub async fn apply(
        &self,
        access: &Access,
        id: &WalletId,
        movement: Movement,
        key: Option<Keyed<MovementOutcome>>,
    ) -> Result<Moved, WalletError> {
        let kind = movement.kind();
        let op = decision::Op { movement, access: access.clone(), key };
        let result = match self.strategy {
            Strategy::Queue => {
                let reply = self.apply_queued(id, op).await;
                let span = tracing::Span::current();
                span.record("lease_wait_ms", reply.waited.as_secs_f64() * 1e3);
                span.record("db_ms", reply.db.as_secs_f64() * 1e3);
                reply.result
            }
            Strategy::Tutorial => {
                let (this, id) = (self.clone(), id.clone());
                // Boxed: it is 13 KB, and unboxed it made every request's future that large,
                // whichever strategy runs.
                Box::pin(self.run_to_end(None, async move { this.apply_alone(&id, op).await })).await
            }
        };
        let outcome = result.as_ref().map_or_else(WalletError::outcome, |_| "accepted");
        metrics::counter!("walletlock_movements_total", "kind" => kind, "outcome" => outcome).increment(1);
        if matches!(result, Err(WalletError::LeaseLost)) {
            metrics::counter!("walletlock_fence_refusals_total").increment(1);
        }
        if matches!(result, Err(WalletError::Overloaded)) {
            metrics::counter!(crate::telemetry::metrics::REQUESTS_SHED, "reason" => "wallet_queue")
                .increment(1);
        }
        result
    }

    /// A pooled Postgres connection, its wait measured.
    async fn connection(&self) -> Result<PoolConnection<sqlx::Postgres>, WalletError> {
        let waiting = Instant::now();
        let conn = self.db.acquire().await?;
        metrics::histogram!("walletlock_pg_pool_acquire_wait_seconds").record(waiting.elapsed());
        Ok(conn)
    }

    /// Runs `work` as its own task, so that it finishes (commit or roll back, release its lease,
    /// store or give up its idempotency claim) even if the caller is dropped because the client
    /// hung up. A claim whose outcome is not stored is given up, so a retry runs.
    async fn run_to_end<T: Send + 'static>(
        &self,
        claim: Option<idempotency::Claim>,
        work: impl Future<Output = Result<T, WalletError>> + Send + 'static,
    ) -> Result<T, WalletError> {
        let keys = self.keys.clone();
        // The task logs and records timings into the request's span, even after the request ended.
        let task = self.in_flight.spawn(
            async move {
                let outcome = work.await;
                if let (Some(claim), Err(err)) = (&claim, &outcome)
                    && !err.is_stored()
                {
                    keys.abandon(claim).await;
                }
                outcome
            }
            .instrument(tracing::Span::current()),
        );
        task.await.map_err(|join| WalletError::Internal(Arc::new(join)))?
    }

    /// Waits until every movement in progress has finished, up to `limit`. Call after the server
    /// stopped taking requests.
    pub async fn drain(&self, limit: Duration) -> bool {
        self.in_flight.close();
        tokio::time::timeout(limit, self.in_flight.wait()).await.is_ok()
    }

    /// The tutorial's way: this request takes the lease itself, has its movement written alone
    /// under it, and releases.
    async fn apply_alone(&self, id: &WalletId, op: decision::Op) -> Result<Moved, WalletError> {
        let mut lease = self.leases.acquire(&lease_name(id)).await?;
        tracing::Span::current().record("lease_wait_ms", lease.waited().as_secs_f64() * 1e3);
        lease.keep_alive();
        let started = Instant::now();
        let outcome = self.write_alone(&mut lease, id, op).await;
        tracing::Span::current().record("db_ms", started.elapsed().as_secs_f64() * 1e3);
        // Release on every outcome, so the next holder does not wait out our TTL. A lease found
        // already gone changes nothing: the fence has decided by now.
        if let Err(err) = lease.release().await {
            tracing::debug!(wallet = %id, error = %err, "release found the lease gone");
        }
        outcome
    }

    async fn write_alone(
        &self,
        lease: &mut Lease,
        id: &WalletId,
        mut op: decision::Op,
    ) -> Result<Moved, WalletError> {
        // After one resynchronization our fence is above every fence the row has seen, unless
        // another holder raised the fence meanwhile, which only a lost lease lets happen.
        let mut resynced = false;
        loop {
            if lease.is_lost() {
                return Err(WalletError::LeaseLost);
            }
            let job = group::Job { id: id.clone(), fence: lease.fence(), held: None, ops: vec![op] };
            match self.rounds.run(job).await {
                group::JobOutcome::Done { mut results, .. } => return results.remove(0),
                group::JobOutcome::FenceBehind { .. } if resynced => return Err(WalletError::LeaseLost),
                group::JobOutcome::FenceBehind { seen, mut ops } => {
                    lease.advance_fence(seen).await?;
                    resynced = true;
                    op = ops.remove(0);
                }
                group::JobOutcome::Busy { mut ops } => {
                    tokio::time::sleep(BUSY_PAUSE).await;
                    op = ops.remove(0);
                }
                // Not from a job that reads its wallet, as this one does; run it again all the same.
                group::JobOutcome::Stale { mut ops } => op = ops.remove(0),
            }
        }
    }
}

/// The rounds give up a statement left unanswered for one lease TTL: by then the lease would have
/// expired without its watchdog, and the wallet is better in another holder's hands.
fn round_settings(leases: &LeaseClient, retention: Duration) -> group::RoundSettings {
    group::RoundSettings { retention, answer_within: leases.settings().ttl.get() }
}

/// How long a holder that found its wallet's row busy waits before it tries again (while its
/// lease lasts: a holder that stays busy longer has lost the wallet to the one writing it).
const BUSY_PAUSE: Duration = Duration::from_millis(10);

/// A failed write: one whose connection broke may have happened or not, which is
/// [`WalletError::OutcomeUnknown`], never "unavailable, nothing applied".
fn commit_failure(err: StoreError) -> WalletError {
    match err {
        StoreError::Database(err) if StoreError::is_connection_failure_of(&err) => {
            WalletError::OutcomeUnknown(Arc::new(err))
        }
        err => err.into(),
    }
}

/// Commits `tx`. A commit whose connection failed may have happened or not: that is
/// [`WalletError::OutcomeUnknown`], never "unavailable, nothing applied".
pub(crate) async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), WalletError> {
    tx.commit().await.map_err(|err| commit_failure(err.into()))
}

/// The lease that guards a wallet's balance.
pub fn lease_name(id: &WalletId) -> String {
    id.scope()
}

/// Raises the wallet's fence to the lease's. If the row has seen our fence or a higher one, either
/// we are a stale holder (then the token-checked resynchronization refuses us too) or Redis lost
/// the fence counter, which is lifted above what the row has seen before raising the row's fence again.
pub async fn raise_fence(
    conn: &mut sqlx::PgConnection,
    lease: &mut Lease,
    id: &WalletId,
) -> Result<ledger::WalletRead, WalletError> {
    // Two rounds: after one resynchronization our fence is above every fence the row has seen,
    // unless another holder raised the fence meanwhile, which only a holder that lost its lease lets happen.
    for _ in 0..2 {
        match ledger::raise_fence(conn, id.as_str(), lease.fence()).await {
            Err(StoreError::FenceBehind { seen, .. }) => {
                lease.advance_fence(seen).await?;
            }
            other => return Ok(other?),
        }
    }
    Err(WalletError::LeaseLost)
}
