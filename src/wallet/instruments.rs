//! The metrics the wallet service records (see `crate::telemetry::metrics`).

use super::{Moved, WalletError, Wallets, outage, transfer};

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

impl Wallets {
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
}

/// Counts how a movement of `kind` under its wallet's lease (or row lock) ended.
pub(super) fn count_movement(kind: &'static str, result: &Result<Moved, WalletError>) {
    let outcome = result.as_ref().map_or_else(WalletError::outcome, |_| "accepted");
    metrics::counter!("walletlock_movements_total", "kind" => kind, "outcome" => outcome).increment(1);
    if matches!(result, Err(WalletError::LeaseLost)) {
        metrics::counter!("walletlock_fence_refusals_total").increment(1);
    }
    if matches!(result, Err(WalletError::Overloaded)) {
        metrics::counter!(crate::telemetry::metrics::REQUESTS_SHED, "reason" => "wallet_queue").increment(1);
    }
}
