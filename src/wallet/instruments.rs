//! The metrics the wallet service records (see `crate::telemetry::metrics`).

use super::{Moved, WalletError, Wallets, outage, transfer};
use crate::domain::LimitKind;
use crate::telemetry::metrics::{
    FENCE_REFUSALS, LEASE_NOTE_STALE, LIMIT_REFUSALS, MOVEMENTS, PG_POOL_CONNECTIONS,
    PG_POOL_MAX_CONNECTIONS, REDIS_POOL_CONNECTIONS, REDIS_POOL_MAX_CONNECTIONS, REDIS_POOL_WAITING,
    REQUESTS_SHED, WALLET_BUSY,
};

/// Registers the wallet service's series at zero (the metrics are declared in
/// `crate::telemetry::metrics`), so a dashboard sees them from the first scrape.
pub fn register_metrics() {
    transfer::register_metrics();
    outage::register_metrics();
    for kind in ["pay", "deposit", "hold", "capture", "void"] {
        for outcome in
            ["accepted", "insufficient_funds", "lock_timeout", "overloaded", "lease_lost", "unavailable"]
        {
            metrics::counter!(MOVEMENTS.name, "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
    metrics::counter!(LIMIT_REFUSALS.name, "limit" => LimitKind::PerPayment.as_str()).absolute(0);
    for kind in ["capture", "void"] {
        for outcome in ["hold_captured", "hold_voided", "hold_expired"] {
            metrics::counter!(MOVEMENTS.name, "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
    for metric in [WALLET_BUSY, FENCE_REFUSALS, LEASE_NOTE_STALE] {
        metrics::counter!(metric.name).absolute(0);
    }
    // `crate::http` registers the shed counter's `in_flight` reason; this module records `wallet_queue`.
    metrics::counter!(REQUESTS_SHED.name, "reason" => "wallet_queue").absolute(0);
}

impl Wallets {
    /// Sets the gauges of both connection pools to what they hold now.
    pub fn sample_pool_metrics(&self) {
        let idle = self.db.num_idle() as f64;
        metrics::gauge!(PG_POOL_CONNECTIONS.name, "state" => "idle").set(idle);
        metrics::gauge!(PG_POOL_CONNECTIONS.name, "state" => "in_use").set(f64::from(self.db.size()) - idle);
        metrics::gauge!(PG_POOL_MAX_CONNECTIONS.name).set(f64::from(self.db.options().get_max_connections()));
        let redis = self.leases.pool().status();
        metrics::gauge!(REDIS_POOL_CONNECTIONS.name, "state" => "idle").set(redis.available as f64);
        metrics::gauge!(REDIS_POOL_CONNECTIONS.name, "state" => "in_use")
            .set(redis.size.saturating_sub(redis.available) as f64);
        metrics::gauge!(REDIS_POOL_MAX_CONNECTIONS.name).set(redis.max_size as f64);
        metrics::gauge!(REDIS_POOL_WAITING.name).set(redis.waiting as f64);
    }
}

/// Counts how a movement of `kind` under its wallet's lease (or row lock) ended.
pub(super) fn count_movement(kind: &'static str, result: &Result<Moved, WalletError>) {
    let outcome = result.as_ref().map_or_else(WalletError::outcome, |_| "accepted");
    metrics::counter!(MOVEMENTS.name, "kind" => kind, "outcome" => outcome).increment(1);
    count_refusal(result);
    if matches!(result, Err(WalletError::Overloaded)) {
        metrics::counter!(REQUESTS_SHED.name, "reason" => "wallet_queue").increment(1);
    }
}

/// Counts what every movement's refusal counts apart from its kind: a fence refused, a limit passed.
pub(super) fn count_refusal<T>(result: &Result<T, WalletError>) {
    let Err(err) = result else { return };
    if matches!(err, WalletError::LeaseLost) {
        metrics::counter!(FENCE_REFUSALS.name).increment(1);
    }
    if let Some(limit) = err.limit_passed() {
        metrics::counter!(LIMIT_REFUSALS.name, "limit" => limit.as_str()).increment(1);
    }
}
