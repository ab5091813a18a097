//! Prometheus metrics, served by every replica at `GET /metrics`.
//!
//! Each module describes the metrics it records and registers them at zero, so a dashboard sees
//! all of them from the first scrape (`http::describe_metrics`, `lease::describe_metrics`,
//! `wallet::describe_metrics`, `idempotency::describe_metrics`; the replica passes them to
//! [`install`], so this module, at the bottom, calls up into none of them). This module installs
//! the recorder once per process, describes the replica's and the process's own metrics, and
//! samples the process gauges at scrape time (the wallets sample their pools).
//!
//! | metric | type | what |
//! |---|---|---|
//! | `walletlock_http_requests_total{method,route,status}` | counter | requests answered |
//! | `walletlock_http_request_duration_seconds{method,route}` | histogram | time to answer |
//! | `walletlock_movements_total{kind,outcome}` | counter | deposits and payments by outcome (`accepted`, `insufficient_funds`, `lock_timeout`, `lease_lost`, ...) |
//! | `walletlock_requests_shed_total{reason}` | counter | requests answered 503 `overloaded` before any work: `in_flight` (`MAX_IN_FLIGHT` reached), `wallet_queue` (`WALLET_QUEUE_LIMIT` reached) |
//! | `walletlock_lease_acquisitions_total` | counter | leases taken |
//! | `walletlock_lease_acquire_wait_seconds` | histogram | wait for each lease taken |
//! | `walletlock_lease_timeouts_total` | counter | leases not obtained within the wait |
//! | `walletlock_lease_refreshes_total`, `walletlock_lease_refresh_failures_total` | counter | watchdog refreshes, and the ones that found the lease gone or failed |
//! | `walletlock_lease_releases_total`, `walletlock_lease_release_not_held_total` | counter | releases, and the ones that found the lease already gone |
//! | `walletlock_fence_refusals_total` | counter | fence raises or writes the fence refused (`lease_lost`) |
//! | `walletlock_fence_resyncs_total` | counter | fence counters lifted after Redis lost them |
//! | `walletlock_redis_outage` | gauge | 1 while the replica cannot reach Redis and moves money under Postgres alone (`REDIS_OUTAGE=postgres`), else 0 |
//! | `walletlock_movements_by_path_total{path}` | counter | movements of money applied, by path: `lease` or `postgres_only` |
//! | `walletlock_idempotent_replays_total` | counter | stored responses replayed |
//! | `walletlock_idempotency_conflicts_total{reason}` | counter | `in_flight` and `reused` refusals |
//! | `walletlock_pg_pool_connections{state}`, `walletlock_pg_pool_max_connections` | gauge | Postgres pool: `idle`, `in_use`, and its size |
//! | `walletlock_pg_pool_acquire_wait_seconds` | histogram | wait for a Postgres connection |
//! | `walletlock_redis_pool_connections{state}`, `walletlock_redis_pool_max_connections`, `walletlock_redis_pool_waiting` | gauge | Redis pool |
//! | `walletlock_redis_pool_acquire_wait_seconds` | histogram | wait for a Redis connection |
//! | `process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`, `process_threads`, ... | gauge, counter | the process, as Prometheus's own clients report it (the `metrics-process` crate) |
//! | `walletlock_process_peak_resident_memory_bytes` | gauge | the process's peak memory (not among the standard process metrics) |
//! | `walletlock_replica_info{replica,version}` | gauge | 1, labelled with the replica's name |

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// The counter of requests refused before any work because the replica was full (label
/// `reason`: `in_flight` for `MAX_IN_FLIGHT`, recorded by `crate::http`; `wallet_queue` for
/// `WALLET_QUEUE_LIMIT`, recorded by `crate::wallet`).
pub const REQUESTS_SHED: &str = "walletlock_requests_shed_total";
/// The histogram of group-commit sizes per wallet (recorded by `crate::wallet`).
pub const BATCH_SIZE: &str = "walletlock_batch_movements";
/// The histogram of transfers into one payee per transaction (recorded by `crate::wallet`).
pub const PAYEE_BATCH: &str = "walletlock_payee_batch_transfers";
/// The histogram of wallets per round (one statement, one WAL flush; recorded by `crate::wallet`).
pub const ROUND_WALLETS: &str = "walletlock_round_wallets";

/// Latency buckets, in seconds: from half a millisecond to ten seconds.
const BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Batch sizes, in movements or wallets: powers of two up to the largest round.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Installs the process-wide recorder (once; later calls return the same handle) and registers
/// every metric at zero: this module's own, then each of `describe_others`.
pub fn install(describe_others: &[fn()]) -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS))
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ROUND_WALLETS.into()), BATCH_BUCKETS))
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(PAYEE_BATCH.into()), BATCH_BUCKETS))
                .expect("buckets are not empty");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            for describe in describe_others {
                describe();
            }
            handle
        })
        .clone()
}

fn describe() {
    metrics::describe_gauge!("walletlock_replica_info", "Always 1; labels name the replica and its version.");
    process_collector().describe();
    metrics::describe_gauge!(
        "walletlock_process_peak_resident_memory_bytes",
        metrics::Unit::Bytes,
        "Highest resident memory since the process started."
    );
}

/// Labels this process's metrics with the replica's name.
pub fn set_replica(replica: &str) {
    metrics::gauge!("walletlock_replica_info", "replica" => replica.to_owned(), "version" => env!("CARGO_PKG_VERSION"))
        .set(1.0);
}

/// The standard process metrics (`process_*`, as client_golang names them).
fn process_collector() -> &'static metrics_process::Collector {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// Samples the process gauges; the caller samples its pools, then renders.
pub fn sample_process() {
    process_collector().collect();
    let resident = metrics_process::collector::collect().resident_memory_bytes.unwrap_or(0);
    // The peak is not among the standard metrics: the kernel's high-water mark, from getrusage.
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF is always valid.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        (libc::getrusage(libc::RUSAGE_SELF, &mut usage) == 0).then_some(usage)
    };
    if let Some(usage) = usage {
        // ru_maxrss is in kilobytes on Linux, and the kernel updates it lazily.
        let peak = (usage.ru_maxrss as u64 * 1024).max(resident);
        metrics::gauge!("walletlock_process_peak_resident_memory_bytes").set(peak as f64);
    }
}
