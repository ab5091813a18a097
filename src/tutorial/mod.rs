//! `walletlock demo <name>`: the tutorial's experiments, run against real Redis and Postgres. The
//! product does not import this module (only the CLI's `demo` command does); the tutorial's lock
//! itself, kept as the benchmark's baseline, is the `tutorial` lease strategy of `crate::wallet`.
//!
//! Each fires a burst of concurrent spends (50 spends of 10 from a balance of 100 unless stated)
//! at one wallet in a throwaway schema, then prints the tutorial's verdict line: how many spends
//! were accepted, the final balance, the balance those acceptances imply, and OK or BROKEN.
//!
//! | demo | guard | verdict |
//! |---|---|---|
//! | `race` | none: read, work, overwrite | BROKEN: lost updates |
//! | `lock` | the lease (TTL longer than the work) | OK: accepted=10 balance=0 |
//! | `short-ttl` | a lease shorter than the work, no fence | BROKEN: the lease expired mid-work |
//! | `fenced` | the same short lease, with the fenced commit | OK, stale writes refused |
//! | `lockstep` | the lease, fixed vs jittered retries | the time each takes |

use crate::domain::EntryKind;
use crate::lease::{Backoff, LeaseClient, LeaseSettings, RedisPool, Ttl};
use crate::ledger::{self, NewEntry, StoreError, schema::ScratchSchema};
use crate::wallet::{self, WalletError, WalletId};
use clap::ValueEnum;
use sqlx::PgPool;
mod unguarded;

use std::{
    fmt,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::sync::Barrier;

/// The caller that owns the wallets the demos open.
pub const DEMO_CALLER: &str = "demo";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Demo {
    /// No lease: read, work, overwrite. Lost updates.
    Race,
    /// The lease around the spend.
    Lock,
    /// A lease shorter than the work, and no fence.
    ShortTtl,
    /// The same short lease, with the fenced commit.
    Fenced,
    /// Fixed-interval retries against jittered ones, on one hot lease.
    Lockstep,
}

/// The shape of a burst.
#[derive(Debug, Clone, Copy)]
pub struct Burst {
    pub spends: usize,
    pub amount: i64,
    pub initial: i64,
    /// Stands in for the work between reading the balance and writing it back (a fraud check, a
    /// call to another service).
    pub work: Duration,
}

impl Default for Burst {
    fn default() -> Self {
        Self { spends: 50, amount: 10, initial: 100, work: Duration::from_millis(2) }
    }
}

/// What a burst did to one wallet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub accepted: usize,
    /// Writes the fence refused because their lease had passed to another holder.
    pub refused: usize,
    pub initial: i64,
    pub amount: i64,
    pub balance: i64,
}

impl Tally {
    pub fn expected(&self) -> i64 {
        self.initial - self.amount * self.accepted as i64
    }

    /// The books hold: the balance is what the accepted spends imply, and not negative.
    pub fn ok(&self) -> bool {
        self.balance == self.expected() && self.balance >= 0
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.ok() { "OK" } else { "BROKEN" };
        write!(
            f,
            "accepted={} balance={} expected={} {verdict}",
            self.accepted,
            self.balance,
            self.expected()
        )?;
        if self.refused > 0 {
            write!(f, " refused_stale_writes={}", self.refused)?;
        }
        Ok(())
    }
}

/// How one spend ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spent {
    Accepted,
    /// Not enough money: declined, nothing written.
    Declined,
    /// The fence refused the write: our lease had passed to another holder.
    Refused,
}

/// Starts `n` spends at the same instant and counts how they ended. Errors count as neither
/// accepted nor refused, and the first is returned after all spends finished.
pub async fn hammer<F, Fut>(n: usize, spend: F) -> anyhow::Result<(usize, usize)>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<Spent>> + Send + 'static,
{
    let start = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (start, spend) = (start.clone(), spend());
            tokio::spawn(async move {
                start.wait().await;
                spend.await
            })
        })
        .collect();
    let (mut accepted, mut refused, mut first_error) = (0, 0, None);
    for task in tasks {
        match task.await? {
            Ok(Spent::Accepted) => accepted += 1,
            Ok(Spent::Refused) => refused += 1,
            Ok(Spent::Declined) => {}
            Err(err) => {
                first_error.get_or_insert(err);
            }
        }
    }
    match first_error {
        Some(err) => Err(err),
        None => Ok((accepted, refused)),
    }
}

/// The tutorial's `Spend`: read the balance, work, write back what was read minus the amount.
/// Neither fence nor version guards the write, so whatever happened meanwhile is overwritten.
pub async fn unguarded_spend(
    db: &PgPool,
    wallet: &WalletId,
    amount: i64,
    work: impl Future<Output = ()>,
) -> anyhow::Result<Spent> {
    let balance = unguarded::read_balance(&mut *db.acquire().await?, wallet.as_str())
        .await?
        .ok_or_else(|| anyhow::anyhow!("no wallet {wallet}"))?;
    if balance < amount {
        return Ok(Spent::Declined);
    }
    work.await;
    unguarded::overwrite_balance(&mut *db.acquire().await?, wallet.as_str(), balance - amount).await?;
    Ok(Spent::Accepted)
}

/// A spend under a lease, with the fenced commit: raise the wallet's fence to the lease's (which
/// reads the balance), work, then write only if no newer holder fenced the wallet meanwhile.
pub async fn fenced_spend(
    db: &PgPool,
    leases: &LeaseClient,
    wallet: &WalletId,
    amount: i64,
    work: impl Future<Output = ()>,
) -> anyhow::Result<Spent> {
    let mut lease = leases.acquire(&wallet::lease_name(wallet)).await?;
    let mut conn = db.acquire().await?;
    let read = match wallet::raise_fence(&mut conn, &mut lease, wallet).await {
        Ok(read) => read,
        Err(WalletError::LeaseLost) => return Ok(Spent::Refused),
        Err(err) => return Err(err.into()),
    };
    if read.balance < amount {
        return Ok(Spent::Declined);
    }
    work.await;
    let entry = NewEntry {
        id: uuid::Uuid::new_v4(),
        kind: EntryKind::Pay,
        amount,
        balance_after: read.balance - amount,
        reference: None,
    };
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let spent = match ledger::commit(&mut tx, wallet.as_str(), lease.fence(), read.version, &[entry]).await {
        Ok(_) => Spent::Accepted,
        Err(StoreError::LeaseLost) => Spent::Refused,
        Err(err) => return Err(err.into()),
    };
    tx.commit().await?;
    // The short-lease demos expect their lease to be gone by now: that is the point.
    let _ = lease.release().await;
    Ok(spent)
}

/// A spend of the unguarded kind, but inside a lease.
pub async fn leased_spend(
    db: &PgPool,
    leases: &LeaseClient,
    wallet: &WalletId,
    amount: i64,
    work: impl Future<Output = ()>,
) -> anyhow::Result<Spent> {
    let lease = leases.acquire(&wallet::lease_name(wallet)).await?;
    let spent = unguarded_spend(db, wallet, amount, work).await;
    let _ = lease.release().await;
    spent
}

/// Where the demos run: a throwaway schema, and a key prefix no one else uses.
pub struct Sandbox {
    schema: ScratchSchema,
    db: PgPool,
    redis: RedisPool,
    prefix: String,
}

impl Sandbox {
    pub async fn create(database_url: &str, redis: RedisPool) -> anyhow::Result<Self> {
        let (schema, db) = ScratchSchema::create(database_url, "walletlock_demo", 20).await?;
        let prefix = format!("demo-{}", uuid::Uuid::new_v4().simple());
        Ok(Self { schema, db, redis, prefix })
    }

    pub async fn drop(self) -> anyhow::Result<()> {
        self.db.close().await;
        self.schema.drop().await
    }

    /// A lease client whose leases live `ttl`, retried with `backoff`.
    pub fn leases(&self, ttl: Duration, backoff: Backoff) -> anyhow::Result<LeaseClient> {
        let settings = LeaseSettings::new(Ttl::new(ttl)?, Duration::from_secs(30)).with_backoff(backoff);
        Ok(LeaseClient::new(self.redis.clone(), self.prefix.clone(), settings))
    }

    /// A fresh wallet holding `balance`, owned by the caller [`DEMO_CALLER`].
    pub async fn wallet(&self, balance: i64) -> anyhow::Result<WalletId> {
        let id = WalletId::generate();
        let mut tx = self.db.begin().await?;
        ledger::create_wallet(&mut tx, id.as_str(), DEMO_CALLER, balance, true).await?;
        tx.commit().await?;
        Ok(id)
    }

    async fn tally(
        &self,
        wallet: &WalletId,
        burst: &Burst,
        (accepted, refused): (usize, usize),
    ) -> anyhow::Result<Tally> {
        let balance = unguarded::read_balance(&mut *self.db.acquire().await?, wallet.as_str())
            .await?
            .unwrap_or_default();
        Ok(Tally { accepted, refused, initial: burst.initial, amount: burst.amount, balance })
    }

    /// No lease at all.
    pub async fn race(&self, burst: &Burst) -> anyhow::Result<Tally> {
        let wallet = self.wallet(burst.initial).await?;
        let counts = hammer(burst.spends, || {
            let (db, wallet, amount, work) = (self.db.clone(), wallet.clone(), burst.amount, burst.work);
            async move { unguarded_spend(&db, &wallet, amount, tokio::time::sleep(work)).await }
        })
        .await?;
        self.tally(&wallet, burst, counts).await
    }

    /// The unguarded spend inside a lease of `ttl`; BROKEN when the TTL is shorter than the work.
    pub async fn leased(&self, burst: &Burst, ttl: Duration, backoff: Backoff) -> anyhow::Result<Tally> {
        let (wallet, leases) = (self.wallet(burst.initial).await?, self.leases(ttl, backoff)?);
        let counts = hammer(burst.spends, || {
            let (db, leases, wallet, amount, work) =
                (self.db.clone(), leases.clone(), wallet.clone(), burst.amount, burst.work);
            async move { leased_spend(&db, &leases, &wallet, amount, tokio::time::sleep(work)).await }
        })
        .await?;
        self.tally(&wallet, burst, counts).await
    }

    /// The fenced spend with a lease of `ttl`: OK whatever the TTL.
    pub async fn fenced(&self, burst: &Burst, ttl: Duration) -> anyhow::Result<Tally> {
        let (wallet, leases) = (self.wallet(burst.initial).await?, self.leases(ttl, Backoff::TUTORIAL)?);
        let counts = hammer(burst.spends, || {
            let (db, leases, wallet, amount, work) =
                (self.db.clone(), leases.clone(), wallet.clone(), burst.amount, burst.work);
            async move { fenced_spend(&db, &leases, &wallet, amount, tokio::time::sleep(work)).await }
        })
        .await?;
        self.tally(&wallet, burst, counts).await
    }
}

/// A lease that comfortably outlives the burst's work.
const LONG_TTL: Duration = Duration::from_secs(2);
/// A lease much shorter than the short-ttl demos' work.
const SHORT_TTL: Duration = Duration::from_millis(5);
/// Ten times the lease, so that the next spender takes the expired lease while the last one still
/// works even on a loaded machine, whose timers fire late (at four times, a suite's parallel tests
/// now and then serialized every spend and the demos showed nothing).
const SLOW_WORK: Duration = Duration::from_millis(50);

/// Runs one demo and returns the lines it prints, the verdict line first.
pub async fn run(demo: Demo, sandbox: &Sandbox) -> anyhow::Result<Vec<String>> {
    let burst = Burst::default();
    let slow = Burst { work: SLOW_WORK, ..burst };
    Ok(match demo {
        Demo::Race => vec![sandbox.race(&burst).await?.to_string()],
        Demo::Lock => vec![sandbox.leased(&burst, LONG_TTL, Backoff::TUTORIAL).await?.to_string()],
        Demo::ShortTtl => vec![sandbox.leased(&slow, SHORT_TTL, Backoff::TUTORIAL).await?.to_string()],
        Demo::Fenced => vec![sandbox.fenced(&slow, SHORT_TTL).await?.to_string()],
        Demo::Lockstep => {
            let mut lines = Vec::new();
            for (label, backoff) in [
                ("fixed 10ms retries", Backoff::Fixed(Duration::from_millis(10))),
                ("jittered 5-15ms retries", Backoff::TUTORIAL),
            ] {
                let started = Instant::now();
                let tally = sandbox.leased(&burst, LONG_TTL, backoff).await?;
                lines.push(format!(
                    "{tally} {label}: {} spends in {} ms",
                    burst.spends,
                    started.elapsed().as_millis()
                ));
            }
            lines
        }
    })
}
