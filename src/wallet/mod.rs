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
//! - `rounds/`: queueing and rounds: `queue` (each wallet's requests behind one worker, which
//!   holds the lease), `payee` (transfers queued by the wallet they pay into), `group` (the
//!   rounds that write every worker's batch, many wallets per statement);
//! - `decision/`: every movement decided, with no I/O: a wallet's batch (`mod.rs`), and the
//!   movements between wallets (`legs`);
//! - `transfer`: the movements between wallets (transfers, movements posted, placed, captured or
//!   voided, refunds), each under its wallets' leases: on one Postgres they ride the rounds,
//!   elsewhere (and refunds) a transaction of their own decides them the same way;
//! - `outage/`: when Redis cannot be reached (`mod.rs`), and the rounds under Postgres alone
//!   (`unleased`);
//! - `tutorial`: the tutorial's strategy ([`Strategy::Tutorial`]), a product setting (the
//!   benchmark's baseline) and so here, not in `crate::tutorial`, which the product never imports;
//! - `events`: the change feed (`GET /events`), read with no lease, waited on by long polling;
//! - `webhooks/`: endpoints, and the delivery of their events by every replica under leases
//!   (`dispatch`), signed and sent (`deliver`);
//! - around them: `service` (building the service, running movements to their end, draining),
//!   `open` (opening and reading wallets), `holds` (finding holds, the sweeper), `error`,
//!   `instruments` (metrics).

mod decision;
mod error;
mod events;
mod history;
mod holds;
mod instruments;
mod open;
mod outage;
mod rounds;
mod service;
mod transfer;
mod tutorial;
pub mod webhooks;

pub use crate::domain::{
    Access, Amount, Field, HoldLife, InvalidInput, LegRefusal, Legs, Limits, Metadata, Monitors, Movement,
    Parties, Refusal, SameWallet, WalletId,
};
// The rows the service answers with, as the store reads them; its callers map them to what they
// show (the HTTP layer, to bodies of its own).
pub use crate::ledger::event::StoredEvent;
pub use crate::ledger::history::{BalanceAt, EntryFilter, KindTotal, Order, Statement};
pub use crate::ledger::hold::Hold;
pub use crate::ledger::transfer::{HeldLeg, MovementHold, MovementRecord, Transfer};
pub use crate::ledger::{Entry, Wallet};
pub use decision::SettleAs;
pub use error::{SharedError, WalletError};
pub use events::{EventsAsked, EventsPage, MAX_WAIT, WAIT_TICK};
pub use instruments::register_metrics;
pub use outage::RedisOutage;
pub use rounds::queue::{MAX_BATCH, MAX_HOLD, telling_when_queued};
pub use transfer::{Between, MovementRecordOutcome, Refund, RefundOutcome, TransferOutcome};
pub use tutorial::raise_fence;

use error::{commit, commit_failure};
use outage::unleased;
use rounds::{group, payee, queue};

use crate::idempotency::{self, Keyed};
use crate::lease::LeaseClient;
use crate::ledger::storage::KnownStorage;
use sqlx::PgPool;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

/// How many times a movement lifts one wallet's lease's fence above its row's, or reads its row
/// again, before it takes the lease for lost. More than once: after Redis lost its keys (a
/// FLUSHALL, a failover to an empty replica), a holder of before whose lease is gone writes on
/// under its old fence until it notices, and may raise the row's fence past a lift. Each lift is
/// token-checked, so a lease that is not ours fails the first.
const MOST_LIFTS: u32 = 4;

/// What a movement did: the ledger entry of a deposit or payment; the hold placed, captured (with
/// its `pay` entry) or voided; the expired holds released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    Entry(Entry),
    Hold {
        hold: Hold,
        entry: Option<Entry>,
    },
    Released,
    /// A monitor set or removed: the wallet's monitors after it.
    Monitors(Monitors),
    /// Limits set: the wallet's rules now, as of the decision's time `at` (what each velocity
    /// window has taken, and when it ends, are of that moment).
    Limits {
        rules: Box<crate::domain::Rules>,
        at: chrono::DateTime<chrono::Utc>,
    },
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
    /// How the rounds write (also movements written outside them: transfers in a transaction of
    /// their own, a wallet alone under Postgres alone).
    round_settings: group::RoundSettings,
    /// How webhooks are delivered (and which URLs endpoints may have).
    webhooks: Arc<webhooks::WebhookSettings>,
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
}

/// The lease that guards a wallet's balance.
pub fn lease_name(id: &WalletId) -> String {
    id.scope()
}
