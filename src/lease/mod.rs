//! The distributed lock: a lease on a name, kept in Redis.
//!
//! This module knows nothing of wallets. A caller names what it wants exclusive access to, gets a
//! [`Lease`] carrying a fencing token, does its work, and releases it. It is the Rust counterpart of
//! the tutorial's `lock` package and of bsm/redislock:
//!
//! - **acquire** is `SET key token NX PX ttl` with a fresh 128-bit random token, retried with
//!   randomized backoff until a deadline, then [`LeaseError::NotObtained`]. The same script
//!   increments the name's fence counter, so the lease and its fencing token come in one round trip.
//! - **release** deletes the key only while it still holds our token; otherwise it deletes nothing
//!   and reports [`LeaseError::NotHeld`].
//! - **refresh** resets the expiry only while the key holds our token. [`Lease::keep_alive`] starts a
//!   watchdog that refreshes every TTL/3 and signals [`Lease::lost`] the moment a refresh fails.
//! - A lease is released on every path: explicitly, or by `Drop` when the holder returns early,
//!   panics, or is a future that was dropped.
//!
//! # What a lease cannot promise
//! A lease expires whether or not its holder has finished, and Redis can forget it (a restart
//! without persistence, `FLUSHALL`, a failover to a replica that had not seen the write). A holder
//! that was paused cannot tell that its lease is gone. So a lease is never proof of exclusivity: it
//! keeps holders from contending, and the fencing token lets the store that is written refuse a
//! holder whose lease has passed to someone else. Fences only grow for a name as long as Redis keeps
//! the counter; when a store sees a fence at least as high as the one it was handed, the counter
//! went backwards and [`Lease::advance_fence`] lifts it above what the store has seen.
//!
//! # Waiting
//! A waiter that finds the lease busy marks it contended (`{P:N}:contended`, for one TTL) and,
//! when the client has [`Wakeups`], subscribes to `{P:N}:released`; releasing a contended lease
//! publishes there, so the waiter retries at once rather than after a blind pause. Without
//! wake-ups (or when one is lost) waiters poll with randomized backoff, never in lockstep.
//! [`Lease::release`] reports whether anyone was waiting, and [`LeaseClient::acquire_after_others`]
//! lets a holder that just released step back for them: leases pass around instead of staying with
//! whoever is fastest to ask again.
//!
//! # Notes
//! A holder may leave a note for the next one when it releases ([`Lease::release_with_note`]): a
//! few bytes, opaque here, that the next [`LeaseClient::acquire`] hands over with the lease in the
//! same round trip ([`Lease::take_note`]), and deletes. The distributed lock managers of VMS and
//! Linux call it the lock value block: what the last holder knew, so that the next need not ask the
//! store again. A note is advice and never proof, for the same reasons a lease is not: only a
//! holder that releases in time leaves one, Redis can lose it or keep an older one, and anyone
//! with a Redis credential can write it. Whoever uses a note checks it against the store it
//! describes, in the same write that depends on it. [`LeaseClient::leave_note`] leaves one without
//! holding the lease, where none is: for a name whose store was just written outside any lease.
//!
//! # Keys
//! For prefix `P` and name `N`, `{P:N}:lease` holds the holder's token, `{P:N}:fence` the fence
//! counter, `{P:N}:contended` the waiters' mark and `{P:N}:note` the note. The braces are a Redis Cluster hash tag: all
//! live in one slot, so every script that touches several runs on one node.

mod scripts;
mod settings;
mod topology;
mod wake;

pub use scripts::{LIBRARY, LIBRARY_NAME};
pub use settings::{Backoff, InvalidTtl, LeaseSettings, Ttl};
pub use topology::{
    ClusterManager, RedisConnection, RedisPool, SentinelManager, SharedConnection, WakeSource,
};
pub use wake::Wakeups;

use crate::telemetry::metrics::{
    FENCE_RESYNCS, LEASE_ACQUIRE_WAIT, LEASE_ACQUISITIONS, LEASE_REFRESH_FAILURES, LEASE_REFRESHES,
    LEASE_RELEASE_NOT_HELD, LEASE_RELEASES, LEASE_TIMEOUTS, REDIS_POOL_ACQUIRE_WAIT,
};
use deadpool_redis::PoolError;
use deadpool_redis::redis::{self, RedisError};
use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Registers this module's counters at zero (declared in `crate::telemetry::metrics`).
pub fn register_metrics() {
    for metric in [
        LEASE_ACQUISITIONS,
        LEASE_TIMEOUTS,
        LEASE_REFRESHES,
        LEASE_REFRESH_FAILURES,
        LEASE_RELEASES,
        LEASE_RELEASE_NOT_HELD,
        FENCE_RESYNCS,
    ] {
        metrics::counter!(metric.name).absolute(0);
    }
}

/// How long a fence counter outlives the last acquisition of its name.
const FENCE_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;

/// Loads (or replaces) [`LIBRARY`], the lease scripts as Redis Functions, into `pool`'s Redis: on
/// every primary of a Cluster (the client sends `FUNCTION LOAD` to each; their replicas get it by
/// replication), on the primary of a Sentinel set. Needs a user that may `FUNCTION LOAD`: the
/// deploy step's administrator, never the replicas' user. Returns the library's name.
pub async fn load_library(pool: &RedisPool) -> Result<String, RedisFailure> {
    let mut conn = pool.get().await?;
    let mut load = redis::cmd("FUNCTION");
    load.arg("LOAD").arg("REPLACE").arg(LIBRARY.as_str());
    Ok(load.query_async::<String>(&mut conn).await?)
}

/// Keeps [`LIBRARY`] loaded for good: every `every`, asks the server whether it holds this build's
/// library and loads it when it does not, so a Redis that restarted without persistence (or a
/// replica promoted that never had it) has the lease scripts back within one period. The replicas'
/// user may only call the functions, never load them, so without this an emptied Redis leaves
/// every lease refused until an operator loads them. Logs each load, and each failure to reach
/// Redis once until it answers again. Never returns.
pub async fn keep_library(pool: &RedisPool, every: std::time::Duration) {
    let mut reachable = true;
    loop {
        let checked: Result<bool, RedisFailure> = async {
            let mut conn = pool.get().await?;
            let loaded = scripts::loaded_library(&mut conn).await?;
            Ok(loaded.as_deref() == Some(LIBRARY.as_str()))
        }
        .await;
        match checked {
            Ok(true) => reachable = true,
            Ok(false) => match load_library(pool).await {
                Ok(library) => {
                    reachable = true;
                    tracing::info!(library, "the lease scripts were missing or another build's: loaded them");
                }
                Err(err) => tracing::warn!(error = %err, "could not load the lease scripts; trying again"),
            },
            Err(err) if reachable => {
                reachable = false;
                tracing::warn!(error = %err, "Redis did not answer; the lease scripts will be checked again");
            }
            Err(_) => {}
        }
        tokio::time::sleep(every).await;
    }
}

/// Why a lease operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another holder kept the lease for the whole wait.
    #[error("lease {name:?} not obtained within {waited:?}")]
    NotObtained { name: String, waited: Duration },
    /// The lease expired or passed to another holder; nothing was changed.
    #[error("lease {name:?} is not held (it expired or belongs to another holder)")]
    NotHeld { name: String },
    /// No fence above the one asked for exists: the store has seen 2^63-1, the largest fence a
    /// signed 64-bit integer holds. Nothing was changed; an operator must reset the store's fence
    /// (docs/operating/fence-resets.md).
    #[error("lease {name:?}: no fence above {seen} exists (the fence space is exhausted)")]
    FenceExhausted { name: String, seen: i64 },
    /// Redis did not answer, or answered with an error.
    #[error("redis unavailable")]
    Unavailable(#[from] RedisFailure),
}

/// A failed conversation with Redis.
#[derive(Debug, thiserror::Error)]
pub enum RedisFailure {
    #[error("no redis connection: {0}")]
    Pool(#[from] PoolError),
    #[error("redis command failed: {0}")]
    Command(#[from] RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

impl RedisFailure {
    /// Redis did not answer in time (as opposed to refusing the connection or erring).
    pub fn is_timeout(&self) -> bool {
        match self {
            RedisFailure::Timeout(_) => true,
            RedisFailure::Pool(PoolError::Timeout(_)) => true,
            RedisFailure::Pool(PoolError::Backend(err)) | RedisFailure::Command(err) => err.is_timeout(),
            RedisFailure::Pool(_) => false,
        }
    }
}

/// Takes and manages leases. Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub struct LeaseClient {
    pool: RedisPool,
    /// The pooled connection every command of this client is sent on, until one fails on it
    /// (see [`LeaseClient::checkout`]). Shared by the clones.
    shared: Arc<std::sync::Mutex<Option<(RedisConnection, SharedConnection)>>>,
    /// Namespaces every key, so several deployments (or tests) can share one Redis.
    prefix: Arc<str>,
    settings: LeaseSettings,
    /// Release notifications for waiters; `None`: waiters only poll.
    wakeups: Option<Arc<Wakeups>>,
    /// Whether the scripts go as `FCALL` or `EVALSHA`; shared by the clones.
    scripting: Arc<scripts::Scripting>,
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Someone was waiting for the lease (and was woken).
    pub contended: bool,
}

impl fmt::Debug for LeaseClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseClient")
            .field("prefix", &self.prefix)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl LeaseClient {
    pub fn new(pool: impl Into<RedisPool>, prefix: impl Into<Arc<str>>, settings: LeaseSettings) -> Self {
        Self {
            pool: pool.into(),
            shared: Arc::default(),
            prefix: prefix.into(),
            settings,
            wakeups: None,
            scripting: Arc::default(),
        }
    }

    /// Wakes waiters when a contended lease is released, over a Pub/Sub connection to `source`.
    pub fn with_wakeups(mut self, source: impl Into<WakeSource>) -> Self {
        self.wakeups = Some(Wakeups::new(source.into()));
        self
    }

    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// Takes the lease on `name`, waiting up to the configured wait.
    pub async fn acquire(&self, name: &str) -> Result<Lease, LeaseError> {
        self.acquire_until(name, Instant::now() + self.settings.wait).await
    }

    /// Takes the leases on all of `names` (a name given twice is taken once), for work that needs
    /// them together: the multi-lock of bsm/redislock's `ObtainMulti` or Redisson's `MultiLock`.
    /// Returned in name order, each with its watchdog running.
    ///
    /// First every name is asked for at once, without waiting ([`LeaseClient::try_acquire_each`]):
    /// uncontended, that is one round trip for all of them. Past the first name found busy, it
    /// waits for each in turn.
    ///
    /// Never deadlocks: a caller waits for a name only while it holds none above it in one global
    /// order (sorted): the ones it got above the first busy name are let go first, and taken again
    /// in order. So no two callers each hold a name the other waits for; and each wait is bounded
    /// by the configured wait, so no holder waits unboundedly for the next name while holding the
    /// earlier ones. Each lease's watchdog starts as soon as it is taken, so it does not expire
    /// while its holder waits for the next. If one is not obtained, those already held are
    /// released (waking their waiters) before the error is returned.
    pub async fn acquire_all(&self, names: &[&str]) -> Result<Vec<Lease>, LeaseError> {
        let mut ordered = names.to_vec();
        ordered.sort_unstable();
        ordered.dedup();
        let mut held: Vec<Lease> = Vec::with_capacity(ordered.len());
        let mut above_busy: Vec<Lease> = Vec::new();
        let mut first_busy: Option<usize> = None;
        for (n, asked) in self.try_acquire_each(&ordered).await.into_iter().enumerate() {
            match asked {
                Ok(Some(mut lease)) if first_busy.is_none() => {
                    lease.keep_alive();
                    held.push(lease);
                }
                Ok(Some(lease)) => above_busy.push(lease),
                // Busy, or Redis failed to answer (the wait below retries it).
                Ok(None) | Err(_) => {
                    first_busy.get_or_insert(n);
                }
            }
        }
        release_all(above_busy).await;
        let Some(first_busy) = first_busy else { return Ok(held) };
        for name in &ordered[first_busy..] {
            match self.acquire(name).await {
                Ok(mut lease) => {
                    lease.keep_alive();
                    held.push(lease);
                }
                Err(err) => {
                    release_all(held).await;
                    return Err(err);
                }
            }
        }
        Ok(held)
    }

    /// Takes the lease on `name`, retrying with backoff until `deadline`.
    ///
    /// Redis errors are retried like a busy lease until the deadline, so a Redis restart shorter
    /// than the wait is invisible to the caller; past the deadline the last error is returned.
    /// With [`LeaseSettings::fail_fast`], the first error is returned at once.
    pub async fn acquire_until(&self, name: &str, deadline: Instant) -> Result<Lease, LeaseError> {
        self.acquire_inner(name, deadline, false).await.inspect_err(count_timeout)
    }

    /// Asks for the lease on `name` once, without waiting: `None` if another holder has it. For a
    /// holder of another lease that must not wait for this one (it may come earlier in the order
    /// [`LeaseClient::acquire_all`] keeps): not waiting can close no cycle.
    pub async fn try_acquire(&self, name: &str) -> Result<Option<Lease>, LeaseError> {
        match self.acquire_inner(name, Instant::now(), false).await {
            Ok(lease) => Ok(Some(lease)),
            Err(LeaseError::NotObtained { .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// Asks for the leases on each of `names` (distinct) once, all at once, without waiting for
    /// any: each taken, or `None` where another holder has it, in `names`' order. The asks go
    /// together over the shared connection (pipelined), so many cost about one round trip, not one
    /// each. Not waiting, they close no cycle, whatever other leases the caller holds.
    pub async fn try_acquire_each(&self, names: &[&str]) -> Vec<Result<Option<Lease>, LeaseError>> {
        futures::future::join_all(names.iter().map(|name| self.try_acquire(name))).await
    }

    /// Like [`LeaseClient::acquire_until`], but first lets those already waiting go: marks the lease
    /// contended and waits for its next release (or one poll) before asking. A holder that just
    /// released a contended lease and has more work calls this, so it does not win the lease back
    /// ahead of the waiters it woke.
    pub async fn acquire_after_others(&self, name: &str, deadline: Instant) -> Result<Lease, LeaseError> {
        self.acquire_inner(name, deadline, true).await.inspect_err(count_timeout)
    }

    async fn acquire_inner(
        &self,
        name: &str,
        deadline: Instant,
        yield_first: bool,
    ) -> Result<Lease, LeaseError> {
        let started = Instant::now();
        let keys = LeaseKeys::new(&self.prefix, name);
        let token = Token::random();
        // Subscribed once this call first has to wait; then each busy answer waits for a release.
        let mut watch = None;
        if yield_first {
            watch = self.watch(&keys).await;
            let _ = self.mark_contended(&keys).await;
            self.pause(watch.as_ref(), deadline).await;
        }
        loop {
            let outcome = self
                .run::<scripts::Acquired>(
                    &scripts::ACQUIRE,
                    &[&keys.lease, &keys.fence, &keys.contended, &keys.note],
                    (&token.0, self.settings.ttl.as_millis(), FENCE_RETENTION_MS),
                )
                .await;
            let last_error = match outcome {
                Ok(scripts::Acquired { taken: taken @ (1 | 2), fence, note }) => {
                    if taken == 2 {
                        tracing::warn!(
                            lease = name,
                            fence,
                            "the fence counter could not grow (at 2^63-1, or not an integer) and started over; the store's fence lifts it"
                        );
                    }
                    tracing::debug!(
                        lease = name,
                        fence,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "lease acquired"
                    );
                    metrics::counter!(LEASE_ACQUISITIONS.name).increment(1);
                    metrics::histogram!(LEASE_ACQUIRE_WAIT.name).record(started.elapsed());
                    return Ok(Lease {
                        client: self.clone(),
                        name: name.to_owned(),
                        keys,
                        token,
                        fence,
                        fence_written: false,
                        acquired_at: Instant::now(),
                        waited: started.elapsed(),
                        note,
                        watchdog: None,
                        lost: CancellationToken::new(),
                        released: false,
                    });
                }
                Ok(_busy) => None,
                Err(failure) if self.settings.fail_fast => return Err(LeaseError::Unavailable(failure)),
                Err(failure) => Some(failure),
            };
            let now = Instant::now();
            if now >= deadline {
                // A Redis that answers too slowly (paused, overloaded) is a lease not obtained in
                // time; a Redis that cannot be reached at all is unavailable.
                return Err(match last_error {
                    Some(failure) if !failure.is_timeout() => LeaseError::Unavailable(failure),
                    _ => LeaseError::NotObtained { name: name.to_owned(), waited: started.elapsed() },
                });
            }
            if watch.is_none() && self.wakeups.is_some() && last_error.is_none() {
                // First time busy: subscribe, then ask again at once, in case the release came
                // before the subscription did.
                watch = self.watch(&keys).await;
                continue;
            }
            self.pause(watch.as_ref(), deadline).await;
        }
    }

    /// Subscribes to the lease's release channel, if this client has wake-ups.
    async fn watch(&self, keys: &LeaseKeys) -> Option<wake::Watch> {
        match &self.wakeups {
            Some(wakeups) => Some(wakeups.watch(&keys.channel).await),
            None => None,
        }
    }

    /// Waits before the next attempt: until a release is published (bounded by the poll
    /// fallback) with wake-ups, else a randomized backoff; never past `deadline`.
    async fn pause(&self, watch: Option<&wake::Watch>, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        match watch {
            Some(watch) => watch.released_or(self.settings.poll_fallback.min(left)).await,
            None => tokio::time::sleep(self.settings.backoff.pause().min(left)).await,
        }
    }

    async fn mark_contended(&self, keys: &LeaseKeys) -> Result<(), RedisFailure> {
        let mut set = redis::cmd("SET");
        set.arg(&keys.contended).arg("1").arg("PX").arg(self.settings.ttl.as_millis());
        self.query(&set).await
    }

    /// The connection pool, for its gauges.
    pub fn pool(&self) -> &RedisPool {
        &self.pool
    }

    /// Answers whether Redis responds within the operation timeout.
    pub async fn ping(&self) -> Result<(), RedisFailure> {
        self.query(&redis::cmd("PING")).await
    }

    /// Runs one plain command, bounded like every Redis call (see [`LeaseClient::checkout`]).
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, RedisFailure> {
        let (mut conn, left) = self.checkout().await?;
        let outcome = tokio::time::timeout(left, cmd.query_async::<T>(&mut conn)).await;
        self.settle(outcome)
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &scripts::LeaseScript,
        keys: &[&str],
        args: impl redis::ToRedisArgs,
    ) -> Result<T, RedisFailure> {
        let (mut conn, left) = self.checkout().await?;
        let outcome = tokio::time::timeout(left, script.run(&mut conn, &self.scripting, keys, args)).await;
        self.settle(outcome)
    }

    /// Decides (once Redis answers) whether the lease scripts go as Redis Functions or as
    /// `EVALSHA` scripts, and logs which; the first script sent decides it otherwise. Call at
    /// startup, so the log says it before the first payment.
    pub async fn decide_scripting(&self) -> Result<(), RedisFailure> {
        let (mut conn, left) = self.checkout().await?;
        let outcome = tokio::time::timeout(left, self.scripting.decide(&mut conn)).await;
        self.settle(outcome).map(|_| ())
    }

    /// Whether the lease scripts go as Redis Functions (`FCALL`): `None` until decided.
    pub fn uses_functions(&self) -> Option<bool> {
        match self.scripting.get() {
            scripts::Way::Unknown => None,
            way => Some(way == scripts::Way::Functions),
        }
    }

    /// The connection to send on, and what is left of the operation timeout for using it: the
    /// checkout and the command are bounded together, so a paused or unreachable Redis never hangs
    /// a caller. Every command goes over one pooled connection, shared (see [`SharedConnection`]);
    /// the pool is asked again only after a command failed on it.
    async fn checkout(&self) -> Result<(SharedConnection, Duration), RedisFailure> {
        let limit = self.settings.op_timeout;
        if let Some((_, shared)) = self.shared.lock().expect("shared connection lock").as_ref() {
            return Ok((shared.clone(), limit));
        }
        let started = Instant::now();
        // Boxed: the pool's future is 10 KB, and unboxed it made every Redis call's future that
        // large (every lease operation's, the watchdog's task), though it runs only until the
        // shared connection exists.
        let conn = tokio::time::timeout(limit, Box::pin(self.pool.get()))
            .await
            .map_err(|_| RedisFailure::Timeout(limit))??;
        metrics::histogram!(REDIS_POOL_ACQUIRE_WAIT.name).record(started.elapsed());
        let shared = conn.share();
        let mut slot = self.shared.lock().expect("shared connection lock");
        if slot.is_none() {
            *slot = Some((conn, shared.clone()));
        }
        Ok((shared, limit.saturating_sub(started.elapsed())))
    }

    /// The outcome of a command. A connection that timed out or broke is closed instead of going
    /// back to the pool: after a failover it may point at a node that is gone, or no longer
    /// primary (which still answers the pool's `PING`), and a fresh one asks the topology anew.
    fn settle<T>(
        &self,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, RedisFailure> {
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => {
                let stopped_primary = matches!(
                    err.kind(),
                    redis::ErrorKind::Server(
                        redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown
                    )
                );
                if stopped_primary
                    || err.is_io_error()
                    || err.is_connection_dropped()
                    || err.is_timeout()
                    || err.is_cluster_error()
                {
                    self.discard_shared();
                }
                Err(err.into())
            }
            Err(_) => {
                self.discard_shared();
                Err(RedisFailure::Timeout(self.settings.op_timeout))
            }
        }
    }

    fn discard_shared(&self) {
        if let Some((conn, _)) = self.shared.lock().expect("shared connection lock").take() {
            conn.discard();
        }
    }

    /// Leaves `note` on `name` for its next holder, unless a note is there already (a holder's is
    /// newer than ours); whether it was left. For a name whose store was just written without the
    /// lease (a wallet just opened, say), so that its first holder need not read the store. Without
    /// note retention ([`LeaseSettings::note_retention`] zero), leaves nothing.
    pub async fn leave_note(&self, name: &str, note: &str) -> Result<bool, RedisFailure> {
        let Some(retention) = self.note_retention_ms() else { return Ok(false) };
        let mut set = redis::cmd("SET");
        set.arg(LeaseKeys::new(&self.prefix, name).note).arg(note).arg("NX").arg("PX").arg(retention);
        Ok(self.query::<Option<String>>(&set).await?.is_some())
    }

    /// The note retention in whole milliseconds, as `PX` takes them; `None` when notes are off.
    fn note_retention_ms(&self) -> Option<u64> {
        let ms = u64::try_from(self.settings.note_retention.as_millis()).unwrap_or(u64::MAX);
        (ms > 0).then_some(ms)
    }

    async fn release_token(
        &self,
        name: &str,
        keys: &LeaseKeys,
        token: &Token,
        note: Option<&str>,
    ) -> Result<Released, LeaseError> {
        let keys_touched = [keys.lease.as_str(), keys.contended.as_str(), keys.note.as_str()];
        let retention = self.note_retention_ms();
        let note = if retention.is_some() { note.unwrap_or_default() } else { "" };
        let args = (&token.0, &keys.channel, note, retention.unwrap_or(0));
        match self.run::<(i64, i64)>(&scripts::RELEASE, &keys_touched, args).await? {
            (1, contended) => {
                metrics::counter!(LEASE_RELEASES.name).increment(1);
                Ok(Released { contended: contended == 1 })
            }
            _ => {
                metrics::counter!(LEASE_RELEASE_NOT_HELD.name).increment(1);
                Err(LeaseError::NotHeld { name: name.to_owned() })
            }
        }
    }

    async fn refresh_token(&self, name: &str, keys: &LeaseKeys, token: &Token) -> Result<(), LeaseError> {
        let ttl = self.settings.ttl.as_millis();
        match self.run::<i64>(&scripts::REFRESH, &[&keys.lease], (&token.0, ttl)).await? {
            1 => Ok(()),
            _ => Err(LeaseError::NotHeld { name: name.to_owned() }),
        }
    }
}

/// The keys and the channel of one name; see the module doc for their layout.
#[derive(Debug, Clone)]
struct LeaseKeys {
    lease: String,
    fence: String,
    contended: String,
    note: String,
    channel: String,
}

impl LeaseKeys {
    fn new(prefix: &str, name: &str) -> Self {
        let tag = format!("{{{prefix}:{name}}}");
        Self {
            lease: format!("{tag}:lease"),
            fence: format!("{tag}:fence"),
            contended: format!("{tag}:contended"),
            note: format!("{tag}:note"),
            channel: format!("{tag}:released"),
        }
    }
}

/// A lease holder's secret: 128 random bits, so no other holder can guess it and release or
/// extend a lease that is not theirs.
#[derive(Clone, PartialEq, Eq)]
struct Token(String);

impl Token {
    fn random() -> Self {
        Self(format!("{:032x}", rand::random::<u128>()))
    }
}

/// A held lease on one name.
///
/// Dropping a lease that was not released releases it in the background (token-checked, like
/// [`Lease::release`]), so an early return, a panic or a dropped future never leaves it behind
/// for a full TTL.
pub struct Lease {
    client: LeaseClient,
    name: String,
    keys: LeaseKeys,
    token: Token,
    /// Issued with the lease; higher than every fence issued for this name before, as long as
    /// Redis kept the counter (see [`Lease::advance_fence`] for when it did not).
    fence: i64,
    /// Whether a write of this holder has carried `fence` (see [`Lease::fence_written`]).
    fence_written: bool,
    acquired_at: Instant,
    waited: Duration,
    /// The note the last holder left, until taken.
    note: Option<String>,
    /// The refresh task, once [`Lease::keep_alive`] started it; stopped when the lease goes.
    watchdog: Option<JoinHandle<()>>,
    /// Cancelled by the watchdog when it could not keep the lease.
    lost: CancellationToken,
    /// Set once released, so `Drop` does not release again.
    released: bool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .field("lost", &self.lost.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing token: pass it to every write this lease protects.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// Whether this holder has written with the fence it holds ([`Lease::mark_fence_written`]): a
    /// store row at exactly this fence is then its own write, not the same fence issued twice
    /// (which a store refuses, as it refuses a stale one).
    pub fn fence_written(&self) -> bool {
        self.fence_written
    }

    /// Records that a write carrying this lease's fence committed.
    pub fn mark_fence_written(&mut self) {
        self.fence_written = true;
    }

    /// How long [`LeaseClient::acquire`] waited for this lease.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// How long this lease has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// The note the last holder left when it released (see the module doc), once: advice to check
    /// against the store, never proof.
    pub fn take_note(&mut self) -> Option<String> {
        self.note.take()
    }

    /// Starts the watchdog: it refreshes the lease every TTL/3, each refresh bounded by TTL/3, and
    /// signals [`Lease::lost`] as soon as a refresh fails or finds the lease gone. Idempotent.
    pub fn keep_alive(&mut self) {
        if self.watchdog.is_some() {
            return;
        }
        let (client, name, keys, token, lost) = (
            self.client.clone(),
            self.name.clone(),
            self.keys.clone(),
            self.token.clone(),
            self.lost.clone(),
        );
        let period = self.client.settings.ttl.refresh_period();
        self.watchdog = Some(tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            loop {
                ticks.tick().await;
                let refresh = tokio::time::timeout(period, client.refresh_token(&name, &keys, &token));
                match refresh.await {
                    Ok(Ok(())) => {
                        metrics::counter!(LEASE_REFRESHES.name).increment(1);
                        tracing::trace!(lease = %name, "lease refreshed");
                    }
                    Ok(Err(err)) => {
                        metrics::counter!(LEASE_REFRESH_FAILURES.name).increment(1);
                        tracing::warn!(lease = %name, error = %err, "lease refresh failed; cancelling the holder's work");
                        lost.cancel();
                        return;
                    }
                    Err(_) => {
                        metrics::counter!(LEASE_REFRESH_FAILURES.name).increment(1);
                        tracing::warn!(lease = %name, "lease refresh timed out; cancelling the holder's work");
                        lost.cancel();
                        return;
                    }
                }
            }
        }));
    }

    /// Completes when the watchdog finds the lease gone; never, without a watchdog. Select on it
    /// around the protected work so the work stops as soon as the lease does. The future does not
    /// borrow the lease, so the work may use it meanwhile.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.lost.clone().cancelled_owned()
    }

    /// Whether the watchdog has found the lease gone.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Extends the lease by one TTL from now, if it is still ours.
    pub async fn refresh(&self) -> Result<(), LeaseError> {
        self.client.refresh_token(&self.name, &self.keys, &self.token).await
    }

    /// Replaces this lease's fence with one above `seen`: call it when the store this lease
    /// protects has already seen a fence at least as high as ours. Redis lost the counter, so it
    /// went backwards; lifting it keeps fences growing and keeps the name from being wedged.
    ///
    /// Token-checked: a holder whose lease is gone gets [`LeaseError::NotHeld`], because a stale
    /// holder is exactly the case a store refuses on purpose.
    /// At the top of the fence space (`seen` is `i64::MAX`) there is no fence to give:
    /// [`LeaseError::FenceExhausted`], with nothing changed.
    pub async fn advance_fence(&mut self, seen: i64) -> Result<i64, LeaseError> {
        let keys = [self.keys.lease.as_str(), self.keys.fence.as_str()];
        // Stores hold fences from 0 up; the script takes the floor as digits without a sign.
        let floor = seen.max(0).to_string();
        let args = (&self.token.0, floor, FENCE_RETENTION_MS);
        match self.client.run::<(i64, i64)>(&scripts::ADVANCE_FENCE, &keys, args).await? {
            (0, _) => Err(LeaseError::NotHeld { name: self.name.clone() }),
            (-1, _) => {
                tracing::error!(lease = %self.name, seen, "no fence above the store's exists: an operator must reset the store's fence (docs/operating/fence-resets.md)");
                Err(LeaseError::FenceExhausted { name: self.name.clone(), seen })
            }
            (_, fence) => {
                metrics::counter!(FENCE_RESYNCS.name).increment(1);
                tracing::info!(lease = %self.name, old = self.fence, new = fence, seen, "fence counter resynchronized from the store");
                self.fence = fence;
                self.fence_written = false;
                Ok(fence)
            }
        }
    }

    /// Whether someone is waiting for this lease right now.
    pub async fn contended(&self) -> Result<bool, LeaseError> {
        self.contention().await
    }

    /// [`Lease::contended`] as a future of its own, which does not borrow the lease: a holder asks
    /// it while it works under the lease (its write in flight), instead of after.
    pub fn contention(&self) -> impl Future<Output = Result<bool, LeaseError>> + Send + 'static {
        let (client, key) = (self.client.clone(), self.keys.contended.clone());
        async move {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(&key);
            Ok(client.query::<i64>(&exists).await? == 1)
        }
    }

    /// Releases the lease if it is still ours, waking whoever waits for it; [`LeaseError::NotHeld`]
    /// (with nothing deleted) if it expired or passed to another holder.
    pub async fn release(self) -> Result<Released, LeaseError> {
        self.release_inner(None).await
    }

    /// Releases the lease like [`Lease::release`], and leaves `note` for the next holder (see the
    /// module doc), in the same round trip. A lease found gone leaves no note.
    pub async fn release_with_note(self, note: &str) -> Result<Released, LeaseError> {
        self.release_inner(Some(note)).await
    }

    async fn release_inner(mut self, note: Option<&str>) -> Result<Released, LeaseError> {
        self.released = true;
        self.stop_watchdog();
        let result = self.client.release_token(&self.name, &self.keys, &self.token, note).await;
        tracing::debug!(lease = %self.name, fence = self.fence, held_ms = self.held_for().as_millis() as u64, ok = result.is_ok(), "lease released");
        result
    }

    fn stop_watchdog(&mut self) {
        if let Some(task) = self.watchdog.take() {
            task.abort();
        }
    }
}

/// Counts a wait that ended without the lease.
fn count_timeout(err: &LeaseError) {
    if matches!(err, LeaseError::NotObtained { .. }) {
        metrics::counter!(LEASE_TIMEOUTS.name).increment(1);
    }
}

/// Releases every lease of `leases` (as [`LeaseClient::acquire_all`] returned them), each
/// token-checked. A lease found already gone is only logged: whatever it guarded has been decided
/// by its fence by now.
pub async fn release_all(leases: Vec<Lease>) {
    release_all_with_notes(leases.into_iter().map(|lease| (lease, None)).collect()).await;
}

/// Releases every lease of `leases` as [`release_all`] does, each leaving its note, if it has
/// one, for its next holder ([`Lease::release_with_note`]).
pub async fn release_all_with_notes(leases: Vec<(Lease, Option<String>)>) {
    // All at once, pipelined over the shared connection: each release is its own token's.
    futures::future::join_all(leases.into_iter().map(|(lease, note)| async move {
        let name = lease.name.clone();
        let released = match note {
            Some(note) => lease.release_with_note(&note).await,
            None => lease.release().await,
        };
        if let Err(err) = released {
            tracing::debug!(lease = %name, error = %err, "release found the lease gone");
        }
    }))
    .await;
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_watchdog();
        if self.released {
            return;
        }
        // Without a runtime (the process is exiting) the lease simply expires after its TTL.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (client, name, keys, token) =
                (self.client.clone(), std::mem::take(&mut self.name), self.keys.clone(), self.token.clone());
            runtime.spawn(async move {
                let result = client.release_token(&name, &keys, &token, None).await;
                tracing::debug!(lease = %name, ok = result.is_ok(), "lease released on drop");
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease operation's future is held inline by every wallet worker, round and request above
    /// it, and copied whole at each box and spawn: it must stay small. (The pool's future, 10 KB,
    /// made each of them that large until `checkout` boxed it.)
    #[tokio::test]
    async fn a_lease_operation_is_a_small_future() {
        let config = deadpool_redis::Config::from_url("redis://127.0.0.1:1");
        let pool = config.create_pool(Some(deadpool_redis::Runtime::Tokio1)).expect("a pool connects lazily");
        let ttl = Ttl::new(Duration::from_secs(1)).expect("a valid TTL");
        let client = LeaseClient::new(pool, "t", LeaseSettings::new(ttl, Duration::from_secs(1)));
        let sizes = [
            ("acquire_until", std::mem::size_of_val(&client.acquire_until("w", Instant::now()))),
            ("try_acquire", std::mem::size_of_val(&client.try_acquire("w"))),
            ("leave_note", std::mem::size_of_val(&client.leave_note("w", "n"))),
        ];
        for (operation, size) in sizes {
            assert!(size <= 4096, "{operation}'s future is {size} bytes");
        }
    }
}
