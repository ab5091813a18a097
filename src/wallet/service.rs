//! The service itself: building it (its rounds, queues and settings), running a movement to its
//! end whatever the caller does, and draining it at shutdown.

use super::{
    DEFAULT_QUEUE_LIMIT, RedisOutage, Shared, Strategy, WalletError, Wallets, group, outage, queue, unleased,
};
use crate::idempotency::{self, KeySettings};
use crate::lease::LeaseClient;
use crate::ledger::storage::KnownStorage;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

impl Wallets {
    /// The service over `db` and `leases`, with the default key retention (see
    /// [`Wallets::with_keys`]). Call within a Tokio runtime: it starts the replica's rounds.
    pub fn new(db: PgPool, leases: LeaseClient) -> Self {
        let in_flight = TaskTracker::new();
        let storage = KnownStorage::default();
        let keys = idempotency::Keys::new(db.clone(), KeySettings::default());
        let round_settings = round_settings(&leases, keys.settings().retention, true);
        let (rounds, unleased) = start_rounds(&db, round_settings, &storage, &in_flight);
        Self(Arc::new(Shared {
            round_settings,
            webhooks: Arc::default(),
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
        service.round_settings.retention = keys.retention;
        (service.rounds, service.unleased) =
            start_rounds(&service.db, service.round_settings, &service.storage, &service.in_flight);
        service.keys = idempotency::Keys::new(service.db.clone(), keys);
        self
    }

    /// How webhooks are delivered, and which URLs endpoints may have.
    pub fn with_webhooks(mut self, settings: super::webhooks::WebhookSettings) -> Self {
        Arc::make_mut(&mut self.0).webhooks = Arc::new(settings);
        self
    }

    /// The replica's webhook dispatcher, which sends each event as `render` writes it (the
    /// API's body of the event): run it with [`super::webhooks::Dispatcher::run`].
    pub fn dispatcher(&self, render: super::webhooks::RenderEvent) -> super::webhooks::Dispatcher {
        super::webhooks::Dispatcher::new(self.db.clone(), self.leases.clone(), self.webhooks.clone(), render)
    }

    /// Whether movements write their events (on by default; off only to measure what they cost:
    /// the feed then misses this replica's movements, and the audit reports their entries).
    pub fn with_events(mut self, events: bool) -> Self {
        let service = Arc::make_mut(&mut self.0);
        service.round_settings.events = events;
        (service.rounds, service.unleased) =
            start_rounds(&service.db, service.round_settings, &service.storage, &service.in_flight);
        self
    }

    /// Closes the Postgres pool: after [`Wallets::drain`], at shutdown.
    pub async fn close(&self) {
        self.db.close().await;
    }

    /// Runs `work` as its own task, so that it finishes (commit or roll back, release its lease,
    /// store or give up its idempotency claim) even if the caller is dropped because the client
    /// hung up. A claim whose outcome is not stored is given up, so a retry runs.
    pub(super) async fn run_to_end<T: Send + 'static>(
        &self,
        claim: Option<idempotency::Claim>,
        work: impl Future<Output = Result<T, WalletError>> + Send + 'static,
    ) -> Result<T, WalletError> {
        let keys = self.keys.clone();
        // Boxed: the task held `work` twice over (before its start and while it runs), 34 KB in all
        // for a transfer, copied whole at each spawn and on completion.
        let work = Box::pin(work);
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

/// How the rounds write: storing keys' responses for `retention`, with events or not. They give
/// up a statement left unanswered for one lease TTL: by then the lease would have expired without
/// its watchdog, and the wallet is better in another holder's hands.
fn round_settings(leases: &LeaseClient, retention: Duration, events: bool) -> group::RoundSettings {
    group::RoundSettings { retention, answer_within: leases.settings().ttl.get(), events }
}

/// Starts the replica's rounds, on leases and under Postgres alone.
fn start_rounds(
    db: &PgPool,
    settings: group::RoundSettings,
    storage: &KnownStorage,
    in_flight: &TaskTracker,
) -> (group::Rounds, unleased::UnleasedRounds) {
    let rounds = group::Rounds::start(db.clone(), settings, storage.clone(), in_flight.clone());
    let unleased = unleased::UnleasedRounds::start(db.clone(), settings, storage.clone(), in_flight.clone());
    (rounds, unleased)
}
