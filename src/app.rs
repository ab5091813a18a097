//! One replica: build it from its settings, run it until a shutdown signal, drain. Its pools and
//! clients are built in [`connect`], which the other subcommands use too.

pub mod connect;

use crate::config::ServeArgs;
use crate::http::auth::Callers;
use crate::http::{self, ApiContext, Draining};
use crate::idempotency::KeySettings;
use crate::wallet::Wallets;
use crate::wallet::webhooks::WebhookSettings;
use secrecy::ExposeSecret;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// How often each replica deletes idempotency keys past their retention. Replicas may purge at
/// the same time: each skips the rows another is deleting.
const PURGE_EVERY: Duration = Duration::from_secs(60);

async fn purge_expired_keys(wallets: Wallets, stop: CancellationToken) {
    loop {
        match wallets.purge_expired_keys().await {
            Ok(0) => {}
            Ok(purged) => tracing::info!(purged, "purged expired idempotency keys"),
            Err(err) => tracing::warn!(error = %err, "could not purge expired idempotency keys"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(PURGE_EVERY) => {}
        }
    }
}

/// How often each replica releases holds long past their expiry. Only tidying: a hold's amount is
/// available from its expiry on, and the first movement that needs it releases it.
const SWEEP_HOLDS_EVERY: Duration = Duration::from_secs(5);

async fn sweep_expired_holds(wallets: Wallets, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(SWEEP_HOLDS_EVERY) => {}
        }
        match wallets.release_expired_holds().await {
            Ok(0) => {}
            Ok(wallets) => tracing::info!(wallets, "released expired holds"),
            Err(err) => tracing::warn!(error = %err, "could not release expired holds"),
        }
    }
}

// The replicas' allocator: glibc's malloc and free took 16% of a replica's CPU under spread
// payments (perf), most of it in consolidating and unlinking chunks, where mimalloc's thread-local
// free lists take little. Built without transparent huge pages (Cargo.toml): with them its eagerly
// committed arenas made an idle replica 26 MiB resident instead of 15.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often the allocator is asked to give freed memory back to the system.
const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Gives the heap's free pages back to the system every [`TRIM_EVERY`]. The allocator keeps what a
/// flood freed for reuse, and purges it only as later allocations come by, so without this an idle
/// replica stays near its peak resident memory after a flood (22-26 MiB instead of 17-20 with it).
async fn trim_heap(stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(TRIM_EVERY) => {}
        }
        // SAFETY: mi_collect only frees what no allocation uses; it has no preconditions.
        unsafe { libmimalloc_sys::mi_collect(true) };
    }
}

pub struct Application {
    listener: TcpListener,
    ctx: ApiContext,
    grace: Duration,
}

impl Application {
    /// Binds the listener and sets up the pools. Connects to nothing yet: a replica starts (and
    /// reports not ready) while Redis or Postgres is still down.
    pub async fn build(args: &ServeArgs) -> anyhow::Result<Self> {
        // A replica without any caller refuses to start.
        let callers = Callers::parse(args.api_tokens()?.expose_secret()).map_err(|err| {
            anyhow::anyhow!("API_TOKENS / API_TOKENS_FILE: {err} (`walletlock token` makes a token)")
        })?;
        let leases = connect::lease_client(&args.lease, &args.redis)?;
        // Logs whether the lease scripts go as Redis Functions or EVALSHA; a Redis still down
        // leaves it to the first payment.
        tokio::spawn({
            let leases = leases.clone();
            async move {
                if let Err(err) = leases.decide_scripting().await {
                    tracing::debug!(error = %err, "lease scripts: Redis not reached yet; the first payment decides");
                }
            }
        });
        let keys =
            KeySettings { retention: args.idempotency_retention, stale_after: args.idempotency_stale_after };
        let wallets = Wallets::new(connect::serving_postgres_pool(&args.database)?, leases)
            .with_strategy(args.lease.lease_strategy)
            .with_redis_outage(args.lease.outage())
            .with_keys(keys)
            .with_events(args.events == crate::config::Switch::On)
            .with_webhooks(WebhookSettings {
                allow_hosts: args
                    .webhook_allow_hosts
                    .iter()
                    .map(|h| h.trim().to_owned())
                    .filter(|h| !h.is_empty())
                    .collect(),
                timeout: args.webhook_timeout,
                retry_for: args.webhook_retry_for,
            })
            .with_queue_limit(args.wallet_queue_limit as usize);
        let listener = http::server::bind(args.listen, args.listen_backlog)
            .map_err(|err| anyhow::anyhow!("cannot listen on {}: {err}", args.listen))?;
        let port = listener.local_addr()?.port();
        let replica = args.replica_name(port);
        let metrics = crate::telemetry::metrics::install(&[
            crate::http::register_metrics,
            crate::lease::register_metrics,
            crate::wallet::register_metrics,
            crate::idempotency::register_metrics,
        ]);
        crate::telemetry::metrics::set_replica(&replica);
        let ctx = ApiContext {
            wallets,
            metrics,
            replica: replica.into(),
            draining: Draining::default(),
            request_timeout: args.request_timeout,
            callers,
            in_flight: Arc::new(Semaphore::new(args.max_in_flight as usize)),
        };
        Ok(Self { listener, ctx, grace: args.shutdown_grace })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|addr| addr.port()).unwrap_or_default()
    }

    /// Serves until `shutdown` completes, then drains: connections close, movements whose
    /// clients left finish (commit or roll back, release their lease), pools close.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Self { listener, ctx, grace } = self;
        tracing::info!(replica = %ctx.replica, addr = %listener.local_addr()?, "walletlock serving");
        let stop_purging = CancellationToken::new();
        let purger = tokio::spawn(purge_expired_keys(ctx.wallets.clone(), stop_purging.clone()));
        let sweeper = tokio::spawn(sweep_expired_holds(ctx.wallets.clone(), stop_purging.clone()));
        let trimmer = tokio::spawn(trim_heap(stop_purging.clone()));
        let dispatcher = tokio::spawn(ctx.wallets.dispatcher(http::events::render).run(stop_purging.clone()));
        http::server::serve(listener, http::router(ctx.clone()), ctx.draining.clone(), shutdown, grace).await;
        stop_purging.cancel();
        let _ = purger.await;
        let _ = sweeper.await;
        let _ = trimmer.await;
        let _ = dispatcher.await;
        if !ctx.wallets.drain(grace).await {
            tracing::warn!("payments still in flight after the grace period");
        }
        ctx.wallets.close().await;
        tracing::info!(replica = %ctx.replica, "walletlock stopped");
        Ok(())
    }
}
