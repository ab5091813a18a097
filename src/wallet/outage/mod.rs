//! Redis outages: money keeps moving under Postgres alone while Redis cannot be reached.
//!
//! The lease only saves contention; what keeps money right is the commit's compare-and-set on the
//! wallet row (fence, version, balance, holds, owner: see [`crate::ledger::group::commit`]). So when
//! a wallet's worker cannot take a lease because Redis does not answer (refused, reset, or silent
//! for the operation timeout), not because another holder has it, the replica enters an outage
//! ([`RedisOutage::Postgres`], the default): every wallet's worker on it serves its queue without a
//! lease ([`unleased`]), each batch one transaction that locks the wallet's row, decides,
//! and writes conditionally on that row as locked. The replica logs once when it enters, probes
//! Redis every [`PROBE_EVERY`] with a real lease, and logs once when it is back on leases.
//!
//! Why a lease holder (on a replica that still reaches Redis: a partition, not an outage) and a
//! writer under Postgres alone never both apply against the same version: each writes with a
//! compare-and-set on the row's version, and the row's lock orders them, so the second finds the
//! version moved and writes nothing. The holder reads the row again and decides anew (its batch is
//! retried, never answered from the state it had); the writer under Postgres alone never loses,
//! as it holds the row's lock from its read to its commit. A writer under Postgres alone leaves the
//! row's fence as it found it, so the fence keeps ordering the leases: a holder whose lease passed
//! on is still refused.

pub(in crate::wallet) mod unleased;

use crate::lease::{LeaseClient, RedisFailure};
use crate::telemetry::metrics::{MOVEMENTS_BY_PATH, REDIS_OUTAGE};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What payments do while Redis cannot be reached (the setting `REDIS_OUTAGE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RedisOutage {
    /// Move money under Postgres alone (row locks), and go back to leases once Redis answers.
    Postgres,
    /// Refuse: 503 `dependency_unavailable`, nothing applied.
    Refuse,
}

/// The path a movement of money took: the `path` label of `walletlock_movements_by_path_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Under the wallet's Redis lease.
    Lease,
    /// Under Postgres alone, during a Redis outage.
    PostgresOnly,
}

impl Path {
    pub fn label(self) -> &'static str {
        match self {
            Path::Lease => "lease",
            Path::PostgresOnly => "postgres_only",
        }
    }
}

/// How often a replica in an outage asks Redis for a lease, to learn that it is back.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Whether this replica is in a Redis outage; shared by every worker of the replica.
#[derive(Debug)]
pub struct Outage {
    policy: RedisOutage,
    /// When the outage began; `None`: on leases.
    since: Mutex<Option<Instant>>,
}

impl Outage {
    pub fn new(policy: RedisOutage) -> Self {
        Self { policy, since: Mutex::new(None) }
    }

    pub fn policy(&self) -> RedisOutage {
        self.policy
    }

    /// Whether movements go under Postgres alone right now.
    pub fn is_active(&self) -> bool {
        self.since.lock().expect("outage lock").is_some()
    }

    /// Whether an acquisition of lease `name` that failed with `failure` starts an outage: with the
    /// `postgres` policy, always; the caller then serves its queue without a lease. Entering logs
    /// once and starts the probe that ends the outage: it asks for that same lease (and releases it
    /// at once) until Redis answers, a whole acquisition, so that a Redis that answers `PING` but
    /// not the lease scripts (reloading them after a restart), or a Cluster whose other nodes
    /// answer while this name's does not, does not end it.
    pub fn enter(self: &Arc<Self>, failure: &RedisFailure, leases: &LeaseClient, name: &str) -> bool {
        if self.policy == RedisOutage::Refuse {
            return false;
        }
        {
            let mut since = self.since.lock().expect("outage lock");
            if since.is_some() {
                return true;
            }
            *since = Some(Instant::now());
        }
        tracing::warn!(
            error = %failure,
            "Redis is unreachable: moving money under Postgres alone (row locks) until it answers again"
        );
        metrics::gauge!(REDIS_OUTAGE.name).set(1.0);
        let (this, leases, name) = (self.clone(), leases.clone(), name.to_owned());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                match leases.try_acquire(&name).await {
                    Ok(Some(lease)) => {
                        let _ = lease.release().await;
                    }
                    Ok(None) => {}
                    Err(_) => continue,
                }
                this.leave();
                return;
            }
        });
        true
    }

    fn leave(&self) {
        let Some(since) = self.since.lock().expect("outage lock").take() else { return };
        metrics::gauge!(REDIS_OUTAGE.name).set(0.0);
        tracing::info!(
            lasted_ms = since.elapsed().as_millis() as u64,
            "Redis answers again: moving money under leases"
        );
    }
}

/// Counts the movements of `results` that were applied, by the path they took.
pub fn count_path<T, E>(path: Path, results: &[Result<T, E>]) {
    let applied = results.iter().filter(|result| result.is_ok()).count();
    if applied > 0 {
        metrics::counter!(MOVEMENTS_BY_PATH.name, "path" => path.label()).increment(applied as u64);
    }
}

/// Counts one movement of money applied by `path`.
pub fn count_one(path: Path) {
    metrics::counter!(MOVEMENTS_BY_PATH.name, "path" => path.label()).increment(1);
}

/// Registers the metrics of outages at zero.
pub fn register_metrics() {
    metrics::gauge!(REDIS_OUTAGE.name).set(0.0);
    for path in [Path::Lease, Path::PostgresOnly] {
        metrics::counter!(MOVEMENTS_BY_PATH.name, "path" => path.label()).absolute(0);
    }
}
