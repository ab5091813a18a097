//! Wallets: opening them, reading them, and moving money under the wallet's lease with a fenced
//! commit.
//!
//! This is where the lease and the ledger meet, and the only place that does. Movements of money
//! run as: take the wallet's lease (waiting up to the configured wait), start its watchdog, start
//! from the wallet as the lease's note says the last holder left it or read the wallet row
//! (balance, version, fence, owner), decide, commit conditionally on all of that while raising the
//! row's fence to the lease's, release leaving the wallet as written in the note. It never touches
//! Redis commands or SQL itself: those live in [`crate::lease`] and [`crate::ledger`].
//!
//! The files, by what they do:
//! - queueing and rounds: `queue` (each wallet's requests behind one worker, which holds the
//!   lease), `group` (the rounds that write every worker's batch, many wallets per statement),
//!   `payee` (transfers queued by the wallet they pay into);
//! - the decision: `decision` (every movement of a round decided, with no I/O), `holds`;
//! - money between wallets: `transfer` (transfers and refunds, each under its wallets' leases);
//! - outage: `outage` (when Redis cannot be reached), `unleased` (the rounds under Postgres alone);
//! - the tutorial's strategy ([`Strategy::Tutorial`]): `tutorial`;
//! - around them: `open` (opening and reading wallets), `error`, `instruments` (metrics).

mod decision;
mod error;
mod group;
mod holds;
mod instruments;
mod open;
mod outage;
mod payee;
mod queue;
mod transfer;
mod tutorial;
mod unleased;

pub use crate::domain::{
    Access, Amount, Field, HoldLife, InvalidInput, LegRefusal, Legs, Movement, Parties, Refusal, SameWallet,
    WalletId,
};
pub use error::{SharedError, WalletError};
pub use instruments::describe_metrics;
pub use outage::RedisOutage;
pub use queue::{MAX_BATCH, MAX_HOLD};
pub use transfer::{Between, MovementRecordOutcome, Refund, RefundOutcome, TransferOutcome};
pub use tutorial::raise_fence;

use error::{commit, commit_failure};

use crate::idempotency::{self, KeySettings, Keyed};
use crate::lease::LeaseClient;
use crate::ledger::hold::Hold;
use crate::ledger::storage::KnownStorage;
use crate::ledger::{Entry, Wallet};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

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
        let (rounds, unleased) = start_rounds(&db, &leases, keys.settings().retention, &storage, &in_flight);
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
        let service = Arc::make_mut(&mut self.0);
        (service.rounds, service.unleased) =
            start_rounds(&service.db, &service.leases, keys.retention, &service.storage, &service.in_flight);
        service.keys = idempotency::Keys::new(service.db.clone(), keys);
        self
    }

    /// Closes the Postgres pool: after [`Wallets::drain`], at shutdown.
    pub async fn close(&self) {
        self.db.close().await;
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
        instruments::count_movement(kind, &result);
        result
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
}

/// Starts the replica's rounds, on leases and under Postgres alone, storing keys' responses for
/// `retention`. The rounds give up a statement left unanswered for one lease TTL: by then the
/// lease would have expired without its watchdog, and the wallet is better in another holder's
/// hands.
fn start_rounds(
    db: &PgPool,
    leases: &LeaseClient,
    retention: Duration,
    storage: &KnownStorage,
    in_flight: &TaskTracker,
) -> (group::Rounds, unleased::UnleasedRounds) {
    let settings = group::RoundSettings { retention, answer_within: leases.settings().ttl.get() };
    let rounds = group::Rounds::start(db.clone(), settings, storage.clone(), in_flight.clone());
    let unleased = unleased::UnleasedRounds::start(db.clone(), retention, storage.clone(), in_flight.clone());
    (rounds, unleased)
}

/// The lease that guards a wallet's balance.
pub fn lease_name(id: &WalletId) -> String {
    id.scope()
}
