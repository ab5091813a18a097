//! Prometheus metrics, served by every replica at `GET /metrics`.
//!
//! This module installs the recorder once per process and samples the process gauges at scrape
//! time (the wallets sample their pools). Every metric is declared once, below ([`Metric`], listed in [`ALL`]): its name, kind, unit,
//! labels and help. [`install`] describes them all to the recorder from there, the modules record
//! them by these constants, `walletlock metrics` prints them as the table of
//! docs/operating/observability.md (a test holds the page to it), and `tests/suite/dashboard.rs`
//! checks every query of the Grafana dashboard against [`ALL`] and [`PROCESS`].

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// What a metric is, as Prometheus types it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A metric the replicas export.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<metrics::Unit>,
    /// The names of its labels (each series has every one of them).
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

const fn metric(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Metric {
    Metric { name, kind, unit: None, labels, help }
}

const fn seconds(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
    Metric { name, kind: Kind::Histogram, unit: Some(metrics::Unit::Seconds), labels, help }
}

use Kind::{Counter, Gauge, Histogram};

// The API (`crate::http`).
pub const HTTP_REQUESTS: Metric = metric(
    "walletlock_http_requests_total",
    Counter,
    &["method", "route", "status"],
    "HTTP requests answered, by route and status; not those a replica shed for want of room (MAX_IN_FLIGHT), answered before they are routed and counted by walletlock_requests_shed_total (reason in_flight) alone.",
);
pub const HTTP_REQUEST_DURATION: Metric = seconds(
    "walletlock_http_request_duration_seconds",
    &["method", "route"],
    "Time to answer an HTTP request.",
);
/// Recorded by `crate::http` (`in_flight`: `MAX_IN_FLIGHT` reached) and `crate::wallet`
/// (`wallet_queue`: `WALLET_QUEUE_LIMIT` reached).
pub const REQUESTS_SHED: Metric = metric(
    "walletlock_requests_shed_total",
    Counter,
    &["reason"],
    "Requests answered 503 overloaded before any work, by reason: in_flight (the replica's MAX_IN_FLIGHT) or wallet_queue (the wallet's WALLET_QUEUE_LIMIT).",
);
pub const BATCH_ITEMS: Metric = metric(
    "walletlock_batch_items_total",
    Counter,
    &["op", "status"],
    "Items of `POST /batches` answered, by op and the status the item's own route answered (the batch itself is counted in walletlock_http_requests_total, its items are not).",
);

// The lease (`crate::lease`).
pub const LEASE_ACQUISITIONS: Metric =
    metric("walletlock_lease_acquisitions_total", Counter, &[], "Leases taken.");
pub const LEASE_ACQUIRE_WAIT: Metric =
    seconds("walletlock_lease_acquire_wait_seconds", &[], "Wait for each lease taken.");
pub const LEASE_TIMEOUTS: Metric =
    metric("walletlock_lease_timeouts_total", Counter, &[], "Leases not obtained within the wait.");
pub const LEASE_REFRESHES: Metric =
    metric("walletlock_lease_refreshes_total", Counter, &[], "Watchdog refreshes that kept a lease.");
pub const LEASE_REFRESH_FAILURES: Metric = metric(
    "walletlock_lease_refresh_failures_total",
    Counter,
    &[],
    "Watchdog refreshes that found the lease gone or failed.",
);
pub const LEASE_RELEASES: Metric =
    metric("walletlock_lease_releases_total", Counter, &[], "Leases released.");
pub const LEASE_RELEASE_NOT_HELD: Metric = metric(
    "walletlock_lease_release_not_held_total",
    Counter,
    &[],
    "Releases that found the lease already gone.",
);
pub const FENCE_RESYNCS: Metric = metric(
    "walletlock_fence_resyncs_total",
    Counter,
    &[],
    "Fence counters lifted above what the store had seen.",
);
pub const REDIS_POOL_ACQUIRE_WAIT: Metric =
    seconds("walletlock_redis_pool_acquire_wait_seconds", &[], "Wait for a Redis connection from the pool.");

// Moving money (`crate::wallet`).
pub const MOVEMENTS: Metric = metric(
    "walletlock_movements_total",
    Counter,
    &["kind", "outcome"],
    "Deposits, payments, and holds placed, captured and voided, by kind and outcome.",
);
pub const LIMIT_REFUSALS: Metric = metric(
    "walletlock_limit_refusals_total",
    Counter,
    &["limit"],
    "Debits refused limit_exceeded, by the wallet's limit they would have passed.",
);
pub const TRANSFERS: Metric = metric(
    "walletlock_transfers_total",
    Counter,
    &["kind", "outcome"],
    "Transfers, movements of many legs (posted, held, captured, voided) and refunds, by kind and outcome.",
);
pub const MOVEMENTS_BY_PATH: Metric = metric(
    "walletlock_movements_by_path_total",
    Counter,
    &["path"],
    "Movements of money applied, by path: under a Redis lease, or under Postgres alone (a Redis outage).",
);
pub const REDIS_OUTAGE: Metric = metric(
    "walletlock_redis_outage",
    Gauge,
    &[],
    "1 while this replica cannot reach Redis and moves money under Postgres alone; 0 on leases.",
);
pub const WALLET_BUSY: Metric = metric(
    "walletlock_wallet_busy_total",
    Counter,
    &[],
    "Writes that found the wallet's row locked by another statement (a transfer, a holder that lost its lease), and tried again.",
);
pub const FENCE_REFUSALS: Metric = metric(
    "walletlock_fence_refusals_total",
    Counter,
    &[],
    "Fence raises or commits the fence refused: the lease was lost.",
);
pub const LEASE_NOTE_STALE: Metric = metric(
    "walletlock_lease_note_stale_total",
    Counter,
    &[],
    "Batches begun from the lease's note that found the wallet's row otherwise, and were read and run again.",
);
pub const BATCH_SIZE: Metric = metric(
    "walletlock_batch_movements",
    Histogram,
    &[],
    "Movements of one wallet per group commit (under one lease).",
);
pub const ROUND_WALLETS: Metric = metric(
    "walletlock_round_wallets",
    Histogram,
    &[],
    "Wallets written per round (one statement, one WAL flush).",
);
pub const PAYEE_BATCH: Metric = metric(
    "walletlock_payee_batch_transfers",
    Histogram,
    &[],
    "Transfers into one payee per batch (under the payee's lease).",
);
pub const PAYEE_BATCH_ALONE: Metric = metric(
    "walletlock_payee_batch_alone_total",
    Counter,
    &[],
    "Transfers a payee's worker sent on alone: their payer's lease was busy.",
);
pub const PG_POOL_ACQUIRE_WAIT: Metric =
    seconds("walletlock_pg_pool_acquire_wait_seconds", &[], "Wait for a Postgres connection from the pool.");
pub const PG_POOL_CONNECTIONS: Metric = metric(
    "walletlock_pg_pool_connections",
    Gauge,
    &["state"],
    "Postgres pool connections, idle and in use.",
);
pub const PG_POOL_MAX_CONNECTIONS: Metric =
    metric("walletlock_pg_pool_max_connections", Gauge, &[], "Postgres pool size limit (PG_POOL_SIZE).");
pub const REDIS_POOL_CONNECTIONS: Metric = metric(
    "walletlock_redis_pool_connections",
    Gauge,
    &["state"],
    "Redis pool connections, idle and in use.",
);
pub const REDIS_POOL_MAX_CONNECTIONS: Metric =
    metric("walletlock_redis_pool_max_connections", Gauge, &[], "Redis pool size limit (REDIS_POOL_SIZE).");
pub const REDIS_POOL_WAITING: Metric =
    metric("walletlock_redis_pool_waiting", Gauge, &[], "Requests waiting for a Redis connection.");

// Idempotency keys (`crate::idempotency`).
pub const IDEMPOTENT_REPLAYS: Metric = metric(
    "walletlock_idempotent_replays_total",
    Counter,
    &[],
    "Stored responses replayed for a retried key.",
);
pub const IDEMPOTENCY_CONFLICTS: Metric = metric(
    "walletlock_idempotency_conflicts_total",
    Counter,
    &["reason"],
    "Requests refused because their key was in flight or used for another request.",
);

// Events (`crate::ledger::event`, `crate::wallet`).
pub const EVENTS_WRITTEN: Metric = metric(
    "walletlock_events_written_total",
    Counter,
    &["type"],
    "Events committed with their movements, by type (wallet.opened, payment.accepted, hold.placed, ...).",
);
pub const EVENTS_READ: Metric =
    metric("walletlock_events_read_total", Counter, &[], "Events answered by GET /events.");

// Webhooks (`crate::wallet`'s dispatcher).
pub const WEBHOOK_DELIVERIES: Metric = metric(
    "walletlock_webhook_deliveries_total",
    Counter,
    &["outcome"],
    "Webhook deliveries attempted, by outcome: delivered (a 2xx) or failed (retried later).",
);
pub const WEBHOOK_LAG: Metric = seconds(
    "walletlock_webhook_lag_seconds",
    &[],
    "Time from an event's commit to its delivery to an endpoint.",
);
pub const WEBHOOK_ENDPOINTS_DISABLED: Metric = metric(
    "walletlock_webhook_endpoints_disabled_total",
    Counter,
    &[],
    "Webhook endpoints disabled for failing past WEBHOOK_RETRY_FOR.",
);

// The replica itself (this module).
pub const REPLICA_INFO: Metric = metric(
    "walletlock_replica_info",
    Gauge,
    &["replica", "version"],
    "Always 1; labels name the replica and its version.",
);
pub const PEAK_RESIDENT_MEMORY: Metric = Metric {
    name: "walletlock_process_peak_resident_memory_bytes",
    kind: Gauge,
    unit: Some(metrics::Unit::Bytes),
    labels: &[],
    help: "Highest resident memory since the process started.",
};

/// Every metric of the replicas' own, as [`install`] describes them.
pub const ALL: &[Metric] = &[
    HTTP_REQUESTS,
    HTTP_REQUEST_DURATION,
    REQUESTS_SHED,
    BATCH_ITEMS,
    LEASE_ACQUISITIONS,
    LEASE_ACQUIRE_WAIT,
    LEASE_TIMEOUTS,
    LEASE_REFRESHES,
    LEASE_REFRESH_FAILURES,
    LEASE_RELEASES,
    LEASE_RELEASE_NOT_HELD,
    FENCE_RESYNCS,
    REDIS_POOL_ACQUIRE_WAIT,
    MOVEMENTS,
    LIMIT_REFUSALS,
    TRANSFERS,
    MOVEMENTS_BY_PATH,
    REDIS_OUTAGE,
    WALLET_BUSY,
    FENCE_REFUSALS,
    LEASE_NOTE_STALE,
    BATCH_SIZE,
    ROUND_WALLETS,
    PAYEE_BATCH,
    PAYEE_BATCH_ALONE,
    PG_POOL_ACQUIRE_WAIT,
    PG_POOL_CONNECTIONS,
    PG_POOL_MAX_CONNECTIONS,
    REDIS_POOL_CONNECTIONS,
    REDIS_POOL_MAX_CONNECTIONS,
    REDIS_POOL_WAITING,
    IDEMPOTENT_REPLAYS,
    IDEMPOTENCY_CONFLICTS,
    EVENTS_WRITTEN,
    EVENTS_READ,
    WEBHOOK_DELIVERIES,
    WEBHOOK_LAG,
    WEBHOOK_ENDPOINTS_DISABLED,
    REPLICA_INFO,
    PEAK_RESIDENT_MEMORY,
];

/// The standard process metrics, as Prometheus's own clients name them, which the
/// `metrics-process` crate describes and samples (not described from [`ALL`]).
pub const PROCESS: &[Metric] = &[
    metric("process_cpu_seconds_total", Counter, &[], "CPU time used by the process, in seconds."),
    RESIDENT_MEMORY,
    metric("process_virtual_memory_bytes", Gauge, &[], "Virtual memory, in bytes."),
    metric(
        "process_virtual_memory_max_bytes",
        Gauge,
        &[],
        "The largest virtual memory the process may have.",
    ),
    metric("process_open_fds", Gauge, &[], "Open file descriptors."),
    metric("process_max_fds", Gauge, &[], "The most file descriptors the process may open."),
    metric("process_start_time_seconds", Gauge, &[], "When the process started, in seconds since the epoch."),
    metric("process_threads", Gauge, &[], "Threads of the process."),
];

/// The resident memory, of [`PROCESS`] (`walletlock figures` shows it).
pub const RESIDENT_MEMORY: Metric =
    metric("process_resident_memory_bytes", Gauge, &[], "Resident memory, in bytes.");

/// The table of docs/operating/observability.md (`walletlock metrics`): every metric of [`ALL`]
/// and [`PROCESS`], with its labels, kind and help.
pub fn markdown_table() -> String {
    let mut table = String::from("| metric | type | what |\n|---|---|---|\n");
    for metric in ALL.iter().chain(PROCESS) {
        let labels =
            if metric.labels.is_empty() { String::new() } else { format!("{{{}}}", metric.labels.join(",")) };
        table.push_str(&format!(
            "| `{}{labels}` | {} | {} |\n",
            metric.name,
            metric.kind.as_str(),
            metric.help
        ));
    }
    table
}

/// Latency buckets, in seconds: from half a millisecond to ten seconds.
const BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Batch sizes, in movements or wallets: powers of two up to the largest round.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Installs the process-wide recorder (once; later calls return the same handle), describes every
/// metric, and has each of `register_others` register its modules' series at zero, so a dashboard
/// sees them from the first scrape (`http`, `lease`, `wallet` and `idempotency` each have one; the
/// replica passes them in, so this module, at the bottom, calls up into none of them).
pub fn install(register_others: &[fn()]) -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.name.into()), BATCH_BUCKETS))
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(ROUND_WALLETS.name.into()), BATCH_BUCKETS)
                })
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(PAYEE_BATCH.name.into()), BATCH_BUCKETS))
                .expect("buckets are not empty");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            for register in register_others {
                register();
            }
            handle
        })
        .clone()
}

/// Describes every metric of [`ALL`] to the recorder, and the process's standard ones.
fn describe() {
    for metric in ALL {
        let (name, help) = (metric.name, metric.help);
        match (metric.kind, metric.unit) {
            (Kind::Counter, Some(unit)) => metrics::describe_counter!(name, unit, help),
            (Kind::Counter, None) => metrics::describe_counter!(name, help),
            (Kind::Gauge, Some(unit)) => metrics::describe_gauge!(name, unit, help),
            (Kind::Gauge, None) => metrics::describe_gauge!(name, help),
            (Kind::Histogram, Some(unit)) => metrics::describe_histogram!(name, unit, help),
            (Kind::Histogram, None) => metrics::describe_histogram!(name, help),
        }
    }
    process_collector().describe();
}

/// Labels this process's metrics with the replica's name.
pub fn set_replica(replica: &str) {
    metrics::gauge!(REPLICA_INFO.name, "replica" => replica.to_owned(), "version" => env!("CARGO_PKG_VERSION"))
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
        metrics::gauge!(PEAK_RESIDENT_MEMORY.name).set(peak as f64);
    }
}
