//! Wallets' queues served without a lease, under Postgres alone, during a Redis outage (see
//! [`super`]).
//!
//! Every batch is written in a transaction that holds its wallet's row locked from its read to its
//! commit: the lock is what makes writers on several replicas take turns, as the lease does
//! otherwise. The transaction reads the batch's keys and holds after the lock, so they are as the
//! row's last writer left them, decides exactly as under a lease ([`decision::decide_round`]), writes with
//! the rounds' compare-and-set on the row as locked, and commits. The row's fence is left as it
//! was, so it keeps ordering the leases taken after the outage.
//!
//! Two ways, as the leased path has rounds and waits:
//! - **Rounds across wallets** ([`UnleasedRounds`]): the batches of every wallet waiting on this
//!   replica go in one transaction, which locks their rows in id order without waiting for any
//!   (`SKIP LOCKED`): one lock, one read, one write, one WAL flush for the round, as on leases.
//!   Under Citus a round is the wallets of one worker, each statement a shard's, as on leases
//!   ([`group::RoundQueue`]).
//! - **A wallet alone**: a batch whose row another transaction held (another replica writing the
//!   wallet right then: a hot wallet) waits for it in a transaction of its own, `FOR UPDATE`
//!   bounded by [`ROW_LOCK_TIMEOUT`] (then `503 lock_timeout`), so contended wallets queue in
//!   Postgres's lock queue, first come first served, rather than polling.

use crate::ledger::group::{self as store, GroupWrite, HoldsToRead};
use crate::ledger::idempotency::KeyRef;
use crate::ledger::shards::ShardMap;
use crate::ledger::storage::{KnownStorage, Storage};
use crate::ledger::transfer::{lock_free_wallets, lock_wallets};
use crate::telemetry::metrics::BATCH_SIZE;
use crate::wallet::decision::{self, Batch, Held, Known, Op, Plan};
use crate::wallet::outage::{Path, count_path};
use crate::wallet::rounds::group::{self, RoundQueue, RoundSettings};
use crate::wallet::rounds::queue::{MAX_BATCH, MAX_HOLD, Reply};
use crate::wallet::transfer::ROW_LOCK_TIMEOUT;
use crate::wallet::{Moved, WalletError, WalletId, Wallets};
use sqlx::{PgConnection, PgPool};
use std::collections::HashSet;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;
use uuid::Uuid;

/// How one wallet's batch fared in a round under Postgres alone.
pub(in crate::wallet) enum RoundOutcome {
    /// Each op's result.
    Done(Vec<Result<Moved, WalletError>>),
    /// Nothing ran (the row was held by another transaction, or another writer stored one of the
    /// round's keys first): the ops come back, to be written by the wallet alone.
    NotRun(Vec<Op>),
}

type BatchWithReply = (WalletId, Vec<Op>, oneshot::Sender<RoundOutcome>);

/// The replica's rounds under Postgres alone. Cheap to clone.
#[derive(Debug, Clone)]
pub(in crate::wallet) struct UnleasedRounds {
    batches: mpsc::UnboundedSender<BatchWithReply>,
}

impl UnleasedRounds {
    /// Starts gathering batches into rounds, one round at a time (what queues meanwhile joins the
    /// next); stops when the last clone is dropped, or once `tracker` is closed and empty.
    pub(in crate::wallet) fn start(
        db: PgPool,
        settings: RoundSettings,
        storage: KnownStorage,
        tracker: TaskTracker,
    ) -> Self {
        let (batches, queued) = mpsc::unbounded_channel();
        tokio::spawn(gather(db, settings, storage, tracker, queued));
        Self { batches }
    }

    /// Writes wallet `id`'s `ops` in the next round.
    async fn run(&self, id: &WalletId, ops: Vec<Op>) -> RoundOutcome {
        let (reply, outcome) = oneshot::channel();
        let count = ops.len();
        if self.batches.send((id.clone(), ops, reply)).is_err() {
            return failed(
                count,
                &WalletError::internal("the replica's rounds under Postgres alone stopped"),
            );
        }
        outcome
            .await
            .unwrap_or_else(|_| failed(count, &WalletError::internal("a round ended without answering")))
    }
}

fn failed(ops: usize, err: &WalletError) -> RoundOutcome {
    RoundOutcome::Done((0..ops).map(|_| Err(err.clone())).collect())
}

async fn gather(
    db: PgPool,
    settings: RoundSettings,
    known: KnownStorage,
    tracker: TaskTracker,
    queued: mpsc::UnboundedReceiver<BatchWithReply>,
) {
    let mut queue = RoundQueue::new(queued);
    while let Some(first) = queue.first(&tracker).await {
        let storage = match Box::pin(known.of(&db)).await {
            Ok(storage) => storage,
            Err(err) => {
                let (_, ops, reply) = first;
                let _ = reply.send(failed(ops.len(), &err.into()));
                continue;
            }
        };
        let shards = known.shards(&db);
        let node = |(id, _, _): &BatchWithReply| shards.as_deref()?.node(id.as_str());
        let round = queue.round(first, storage, node, |(_, ops, _)| ops.len());
        Box::pin(run_round(&db, settings, storage, shards.as_deref(), round)).await;
    }
}

/// Why a transaction under Postgres alone did not end with each op's result.
enum Failed {
    /// Another writer stored one of the batch's keys first: nothing was written; read again.
    KeyConflict,
    Wallet(WalletError),
}

impl<E: Into<WalletError>> From<E> for Failed {
    fn from(err: E) -> Self {
        Failed::Wallet(err.into())
    }
}

/// A batch whose row the round locked.
struct Locked {
    id: WalletId,
    ops: Vec<Op>,
    held: Held,
    reply: oneshot::Sender<RoundOutcome>,
}

impl Locked {
    /// Written under the row's lock, with the row's own fence (see the module doc).
    fn batch(&self) -> Batch<'_> {
        Batch { id: &self.id, fence: self.held.fence, held: &self.held, ops: &self.ops }
    }
}

/// One round: lock the rows no one else holds, read, decide, write, commit; the batches whose rows
/// were held come back ([`RoundOutcome::NotRun`]).
async fn run_round(
    db: &PgPool,
    settings: RoundSettings,
    storage: Storage,
    shards: Option<&ShardMap>,
    round: Vec<BatchWithReply>,
) {
    let answer_all = |round: Vec<(oneshot::Sender<RoundOutcome>, usize)>, err: &WalletError| {
        for (reply, ops) in round {
            let _ = reply.send(failed(ops, err));
        }
    };
    let mut tx = match db.begin().await {
        Ok(tx) => tx,
        Err(err) => {
            return answer_all(round.into_iter().map(|(_, ops, r)| (r, ops.len())).collect(), &err.into());
        }
    };
    let ids: Vec<&str> = round.iter().map(|(id, _, _)| id.as_str()).collect();
    let rows = match lock_free_wallets(&mut tx, shards, &ids).await {
        Ok(rows) => rows,
        Err(err) => {
            return answer_all(round.into_iter().map(|(_, ops, r)| (r, ops.len())).collect(), &err.into());
        }
    };
    let mut locked: Vec<Locked> = Vec::with_capacity(round.len());
    for (id, ops, reply) in round {
        match rows.get(id.as_str()) {
            Some(row) => locked.push(Locked { held: Held::of_locked(row), id, ops, reply }),
            None => {
                let _ = reply.send(RoundOutcome::NotRun(ops));
            }
        }
    }
    if locked.is_empty() {
        return;
    }
    let batches: Vec<Batch<'_>> = locked.iter().map(Locked::batch).collect();
    let written = decide_write_commit(tx, storage, shards, &batches, settings).await;
    drop(batches);
    match written {
        Ok(results) => {
            for (l, results) in locked.into_iter().zip(results) {
                let _ = l.reply.send(RoundOutcome::Done(results));
            }
        }
        // Nothing is written; each batch goes alone, and reads the key first.
        Err(Failed::KeyConflict) => {
            for l in locked {
                let _ = l.reply.send(RoundOutcome::NotRun(l.ops));
            }
        }
        Err(Failed::Wallet(err)) => {
            answer_all(locked.into_iter().map(|l| (l.reply, l.ops.len())).collect(), &err);
        }
    }
}

/// Decides `batches`, whose rows `tx` holds locked, writes them in one statement and commits:
/// each batch's results, in order. A key another writer stored first fails it whole, nothing
/// written ([`Failed::KeyConflict`]).
async fn decide_write_commit(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    storage: Storage,
    shards: Option<&ShardMap>,
    batches: &[Batch<'_>],
    settings: RoundSettings,
) -> Result<Vec<Vec<Result<Moved, WalletError>>>, Failed> {
    let (now, plans) = decide_all(&mut tx, shards, batches).await?;
    let mut write = GroupWrite::default();
    for (batch, plan) in batches.iter().zip(&plans).filter(|(_, plan)| plan.runs()) {
        group::add_wallet(&mut write, batch, plan);
    }
    settings.events_of(&mut write);
    if !write.wallets.is_empty() {
        match Box::pin(store::commit(&mut tx, storage, shards, None, &write, now, settings.retention)).await {
            Ok(committed) if committed.moved.len() == write.wallets.len() => {}
            // Every row written is locked by this transaction: nobody else can have moved it.
            Ok(_) => return Err(WalletError::internal("a row locked for a write did not match it").into()),
            Err(err) if err.is_key_conflict() => return Err(Failed::KeyConflict),
            Err(err) => return Err(err.into()),
        }
    }
    crate::failpoint::hit("before_commit");
    let committed = crate::wallet::commit(tx).await;
    crate::failpoint::hit("after_commit");
    Ok(plans
        .iter()
        .map(|plan| match &committed {
            Ok(()) => plan.results(Ok(true)),
            Err(err) => plan.results(Err(err)),
        })
        .collect())
}

/// Reads the keys and holds of `batches` (their rows locked, so they are as the rows' last writers
/// left them) and decides the round; its time and each batch's plan.
async fn decide_all(
    conn: &mut PgConnection,
    shards: Option<&ShardMap>,
    batches: &[Batch<'_>],
) -> Result<(chrono::DateTime<chrono::Utc>, Vec<Plan>), WalletError> {
    let keys: Vec<KeyRef<'_>> = batches
        .iter()
        .flat_map(|batch| batch.ops.iter().filter_map(|op| op.key.as_ref().map(|key| key.at())))
        .collect();
    let hold_ids: Vec<Uuid> =
        batches.iter().flat_map(|batch| batch.ops.iter().filter_map(Op::settles)).collect();
    let round: Vec<&str> = batches.iter().map(|batch| batch.id.as_str()).collect();
    let mut expired_read: HashSet<String> = HashSet::new();
    loop {
        let now = crate::ledger::entry_time();
        let expired: Vec<&str> = expired_read.iter().map(String::as_str).collect();
        let holds = HoldsToRead { ids: &hold_ids, expired_of: &expired, now };
        let found = if keys.is_empty() && holds.is_empty() {
            store::Found::default()
        } else {
            Box::pin(store::read(conn, shards, &[], &round, &keys, holds)).await?
        };
        let refunded = decision::Refunds::new();
        let known = Known {
            keys: &found.keys,
            holds: &found.holds,
            expired_read: &expired_read,
            refunded: &refunded,
            now,
        };
        match decision::decide_round(batches, known) {
            Ok(plans) => return Ok((now, plans)),
            // Nothing is written yet: read those wallets' expired holds, and decide again.
            Err(short) => expired_read.extend(short),
        }
    }
}

impl Wallets {
    /// Serves the wallet's queue under Postgres alone, batch after batch, for at most
    /// [`MAX_HOLD`], or until the outage ends.
    pub(in crate::wallet) async fn hold_unleased(&self, id: &WalletId) {
        let since = Instant::now();
        loop {
            let batch = self.queues.take(id, MAX_BATCH);
            if batch.is_empty() {
                return;
            }
            let started = Instant::now();
            let (waiters, ops): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|pending| pending.into_parts()).unzip();
            metrics::histogram!(BATCH_SIZE.name).record(ops.len() as f64);
            let results = match self.unleased.run(id, ops).await {
                RoundOutcome::Done(results) => results,
                RoundOutcome::NotRun(ops) => Box::pin(self.write_alone_unleased(id, &ops)).await,
            };
            count_path(Path::PostgresOnly, &results);
            let db = started.elapsed();
            for ((enqueued, reply), result) in waiters.into_iter().zip(results) {
                let waited = enqueued.elapsed().saturating_sub(db);
                let _ = reply.send(Reply { result, waited, db });
            }
            if since.elapsed() >= MAX_HOLD || !self.outage.is_active() {
                return;
            }
        }
    }

    /// Applies `ops` to wallet `id` in a transaction of its own, waiting for its row's lock;
    /// each op's result.
    async fn write_alone_unleased(&self, id: &WalletId, ops: &[Op]) -> Vec<Result<Moved, WalletError>> {
        let mut first_attempt = true;
        loop {
            match self.attempt_alone_unleased(id, ops).await {
                Ok(results) => return results,
                Err(Failed::KeyConflict) if first_attempt => first_attempt = false,
                Err(Failed::KeyConflict) => {
                    let err = WalletError::internal("an idempotency key conflicted twice");
                    return ops.iter().map(|_| Err(err.clone())).collect();
                }
                Err(Failed::Wallet(err)) => return ops.iter().map(|_| Err(err.clone())).collect(),
            }
        }
    }

    async fn attempt_alone_unleased(
        &self,
        id: &WalletId,
        ops: &[Op],
    ) -> Result<Vec<Result<Moved, WalletError>>, Failed> {
        let mut tx = self.db.begin().await?;
        let rows = lock_wallets(&mut tx, &[id.as_str()], ROW_LOCK_TIMEOUT).await?;
        let Some(row) = rows.get(id.as_str()) else {
            return Ok(ops.iter().map(|_| Err(WalletError::NotFound)).collect());
        };
        let held = Held::of_locked(row);
        let storage = self.storage.on(&mut tx).await?;
        let batch = Batch { id, fence: held.fence, held: &held, ops };
        let mut results =
            Box::pin(decide_write_commit(tx, storage, None, &[batch], self.round_settings)).await?;
        results.pop().ok_or_else(|| WalletError::internal("a batch decided into nothing").into())
    }
}
