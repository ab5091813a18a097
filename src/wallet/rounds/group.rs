//! Rounds: the group commit across the wallets whose leases this replica holds.
//!
//! Every wallet's worker ([`super::queue`]) that holds its lease and has movements queued hands
//! them to the replica's rounds as a [`Job`]; a transfer or a movement of many legs, under the
//! leases of all its wallets, comes as a [`LegsJob`], whose wallets are written all or none. A round takes every job waiting (up to
//! [`MAX_ROUND_OPS`] movements) and runs them together in two statements at most
//! ([`crate::ledger::group`]): one reads the wallets just leased and looks up the round's
//! idempotency keys, one writes every wallet conditionally on its own fence and version, with the
//! entries and stored responses of the wallets that matched. A wallet whose row moved is simply
//! not written, and the others commit: its job comes back to be read again
//! ([`JobOutcome::Stale`]), and if its fence moved, only its movements hear `lease_lost`. While a round runs, the
//! next one's jobs gather, so a busy replica writes many wallets per WAL flush and an idle one
//! writes each job at once: no timer, no added wait.
//!
//! A round in which every wallet is held already, from its holder's last write or from the note
//! the lease's last holder left ([`Held::from_note`]), and whose connection answered just now
//! ([`LANE_FRESH`]), does not read: it writes at once, its keys checked by the write. A wallet
//! whose note was stale matches nothing; its job comes back ([`JobOutcome::Stale`]) to be read
//! and run again, and the others commit.
//!
//! Under Citus ([`crate::ledger::storage`]) a round is the wallets of one node, so that it commits
//! on that node alone, in one phase: the replica knows each wallet's shard and node
//! ([`crate::ledger::shards`]), a round takes the jobs queued for the node of its first (the others
//! wait for a round of their node, ahead of what comes later), and its statements go one per shard.
//! A wallet whose node the replica does not know yet is a round of its own.

use crate::ledger::group::{
    self as store, GroupWrite, HoldsToRead, KeyWrite, ReadOutcome, Settlement, ToRead, WalletWrite,
};
use crate::ledger::hold::Hold;
use crate::ledger::idempotency::KeyRef;
use crate::ledger::shards::{NodeId, ShardMap};
use crate::ledger::storage::{KnownStorage, Storage, Workers};
use crate::telemetry::metrics::{LEASE_NOTE_STALE, PG_POOL_ACQUIRE_WAIT, ROUND_WALLETS, WALLET_BUSY};
use crate::wallet::decision::{self, Batch, FoundKeys, Held, Known, LegsOp, LegsPlan, LegsWallet, Op, Plan};
use crate::wallet::transfer::Done;
use crate::wallet::{Moved, WalletError, WalletId};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;
use uuid::Uuid;

/// The most movements one round writes.
pub const MAX_ROUND_OPS: usize = 512;
/// Rounds in flight at once per replica. One: what arrives while it waits for its WAL flush joins
/// the next, so a busy replica writes more wallets per statement and per flush. Two rounds at once
/// measured 4% fewer spread payments a second, at 0.31 WAL flushes and 0.82 statements per
/// payment instead of 0.24 and 0.53 (`loadtest/bench`, 2 cores). Under Citus too: rounds side by
/// side there are rounds of fewer wallets, each a distributed transaction of a few statements a
/// shard, and eight at once ran at a third of one's rate.
const CONCURRENT_ROUNDS: usize = 1;

/// How long a holder that found its wallet's row busy waits before it tries again (while its
/// lease lasts: a holder that stays busy longer has lost the wallet to the one writing it).
pub(in crate::wallet) const BUSY_PAUSE: Duration = Duration::from_millis(10);

/// One wallet's movements for a round, from the holder of its lease.
#[derive(Debug)]
pub struct Job {
    pub id: WalletId,
    pub fence: i64,
    /// The wallet as this lease last read or wrote it; `None`: the round reads it first.
    pub held: Option<Held>,
    pub ops: Vec<Op>,
}

/// How a job ended.
#[derive(Debug)]
pub enum JobOutcome {
    /// Each op's result; `held` is the wallet after them (`None`: the lease was lost or the write
    /// failed, and the holder must stop).
    Done { held: Option<Held>, results: Vec<Result<Moved, WalletError>> },
    /// The wallet's row has seen a fence at least as high as the lease's: nothing ran, the ops come
    /// back, to run again once the lease's fence is lifted above `seen`.
    FenceBehind { seen: i64, ops: Vec<Op> },
    /// The row is not as the job held it (a stale note, or a write since this holder's last):
    /// nothing ran, the ops come back, to run again from the row itself.
    Stale { ops: Vec<Op> },
    /// Another holder was writing the wallet's row right then: nothing ran, the ops come back, to
    /// run again shortly while the lease is still held.
    Busy { ops: Vec<Op> },
}

type JobWithReply = (Job, oneshot::Sender<JobOutcome>);

/// Movements between wallets for a round (transfers, movements of many legs), from the holder of
/// every one of their wallets' leases. They are read by the round, decided together
/// ([`decision::decide_between`]) and written as one group: every wallet or none.
#[derive(Debug)]
pub struct LegsJob {
    pub wallets: Vec<Leased>,
    pub ops: Vec<LegsOp>,
}

/// A wallet of a [`LegsJob`], with its lease's fence, whether that lease has written with it
/// (its row may then be at exactly that fence: see [`crate::domain::FenceStanding::of_holder`]),
/// and the wallet as its holder knows it (from its last write under the lease, or the lease's
/// note; `None`: the round reads the row).
#[derive(Debug)]
pub struct Leased {
    pub id: WalletId,
    pub fence: i64,
    pub written: bool,
    pub held: Option<Held>,
}

/// How a [`LegsJob`] ended.
#[derive(Debug)]
pub enum LegsOutcome {
    /// Each movement's result, and each of the job's wallets as written or read (in the job's
    /// order; empty, or `None` for a wallet: not known, the next round reads it).
    Done { results: Vec<Result<Done, WalletError>>, after: Vec<Option<Held>> },
    /// The row of `wallet` has seen a fence at least as high as its lease's: nothing ran.
    FenceBehind { wallet: WalletId, seen: i64, ops: Vec<LegsOp> },
    /// A wallet's row was not as read when written (only a lost lease lets that happen), or
    /// another statement was writing it right then (`busy`): nothing ran, the ops come back.
    Again { busy: bool, ops: Vec<LegsOp> },
}

type LegsJobWithReply = (LegsJob, oneshot::Sender<LegsOutcome>);

/// What the rounds are handed.
enum Submitted {
    Wallet(JobWithReply),
    Legs(LegsJobWithReply),
}

impl Submitted {
    fn ops(&self) -> usize {
        match self {
            Submitted::Wallet((job, _)) => job.ops.len(),
            Submitted::Legs((job, _)) => job.ops.len(),
        }
    }

    /// The node of the job's wallet under Citus; `None` for movements between wallets, which are
    /// rounds of their own.
    fn node(&self, shards: &ShardMap) -> Option<NodeId> {
        match self {
            Submitted::Wallet((job, _)) => shards.node(job.id.as_str()),
            Submitted::Legs(_) => None,
        }
    }

    fn fail(self, err: &WalletError) {
        match self {
            Submitted::Wallet((job, reply)) => {
                let _ = reply.send(failed(job.ops.len(), err));
            }
            Submitted::Legs((job, reply)) => {
                let _ = reply.send(legs_failed(job.ops.len(), err));
            }
        }
    }
}

/// How the rounds write.
#[derive(Debug, Clone, Copy)]
pub struct RoundSettings {
    /// How long a stored response is replayed for its key.
    pub retention: Duration,
    /// How long a round's statement may go unanswered before the round gives it up (the wallets'
    /// lease TTL), counted while the replica runs ([`answered_within`]). Postgres answers a round in milliseconds, and bounds every statement itself
    /// (`statement_timeout`), but a connection whose packets vanish (a partition, a black-holed
    /// route) gets no answer and no error: TCP keepalives and `tcp_user_timeout` see a healthy
    /// peer wherever a middlebox still acknowledges. Given up, the connection is closed, the
    /// round's requests hear 503 (`outcome_unknown` for a write: the fence decides whether it
    /// lands), and their holders release the wallets' leases, so another replica can take them.
    pub answer_within: Duration,
    /// Whether a round writes its movements' events (the `EVENTS` setting).
    pub events: bool,
}

impl RoundSettings {
    /// What `write` commits: all of it, or without its events when they are off.
    pub(in crate::wallet) fn events_of(self, write: &mut GroupWrite<'_>) {
        if !self.events {
            write.events.clear();
        }
    }
}

/// The replica's rounds. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Rounds {
    jobs: mpsc::UnboundedSender<Submitted>,
}

impl Rounds {
    /// Starts gathering jobs into rounds, each round a task on `tracker` (so a drain waits for
    /// rounds in flight). Stops when the last clone is dropped.
    pub fn start(db: PgPool, settings: RoundSettings, storage: KnownStorage, tracker: TaskTracker) -> Self {
        let (jobs, queued) = mpsc::unbounded_channel();
        tokio::spawn(gather(db, settings, storage, tracker, queued));
        Self { jobs }
    }

    /// Runs `job` in the next round and waits for its outcome.
    pub async fn run(&self, job: Job) -> JobOutcome {
        let (reply, outcome) = oneshot::channel();
        let ops = job.ops.len();
        if self.jobs.send(Submitted::Wallet((job, reply))).is_err() {
            return failed(ops, &WalletError::internal("the replica's rounds stopped"));
        }
        outcome
            .await
            .unwrap_or_else(|_| failed(ops, &WalletError::internal("a round ended without answering")))
    }

    /// Runs `job` (movements between wallets) in the next round and waits for its outcome.
    pub async fn run_legs(&self, job: LegsJob) -> LegsOutcome {
        let (reply, outcome) = oneshot::channel();
        let ops = job.ops.len();
        if self.jobs.send(Submitted::Legs((job, reply))).is_err() {
            return legs_failed(ops, &WalletError::internal("the replica's rounds stopped"));
        }
        outcome
            .await
            .unwrap_or_else(|_| legs_failed(ops, &WalletError::internal("a round ended without answering")))
    }
}

fn failed(ops: usize, err: &WalletError) -> JobOutcome {
    JobOutcome::Done { held: None, results: (0..ops).map(|_| Err(err.clone())).collect() }
}

fn legs_failed(ops: usize, err: &WalletError) -> LegsOutcome {
    LegsOutcome::Done { results: (0..ops).map(|_| Err(err.clone())).collect(), after: Vec::new() }
}

/// A round's connection, kept from one round to the next while its rounds succeed: a round then
/// runs its statements and nothing else, where a pool checkout would add a health-check ping
/// (one more round trip per round) and its own timeout. `None` until first used and after a failed
/// round; the next round then takes a fresh connection from the pool.
type RoundConnection = Option<Kept>;

/// A kept connection, and when it last answered.
struct Kept {
    conn: PoolConnection<Postgres>,
    answered: Instant,
}

/// How recently a kept connection must have answered for a round on it to skip its read. A read
/// that fails on a connection that died meanwhile (Postgres restarted) is retried on a fresh one,
/// nothing applied; a write that fails that way may have happened or not (`outcome_unknown`). So
/// only a connection in use a moment ago takes a write first; a busy replica's rounds follow each
/// other well within this, and an idle one pays one read.
const LANE_FRESH: Duration = Duration::from_millis(10);

async fn gather(
    db: PgPool,
    settings: RoundSettings,
    known: KnownStorage,
    tracker: TaskTracker,
    queued: mpsc::UnboundedReceiver<Submitted>,
) {
    let (lane_back, mut lanes) = mpsc::channel::<RoundConnection>(CONCURRENT_ROUNDS);
    for _ in 0..CONCURRENT_ROUNDS {
        lane_back.try_send(None).expect("a channel sized for every lane");
    }
    let mut queue = RoundQueue::new(queued);
    // A round waits for a lane as a request waits for a pooled connection: no longer than the
    // pool's acquire timeout, then it is answered 503 rather than left to time out.
    let lane_wait = db.options().get_acquire_timeout();
    while let Some(first) = queue.first(&tracker).await {
        // What the round may gather depends on where the tables live, learnt from the first
        // round's database (a replica starts whether or not Postgres is up).
        let storage = match Box::pin(known.of(&db)).await {
            Ok(storage) => storage,
            Err(err) => {
                first.fail(&err.into());
                continue;
            }
        };
        let shards = known.shards(&db);
        let lane = match tokio::time::timeout(lane_wait, lanes.recv()).await {
            Ok(Some(lane)) => lane,
            Ok(None) => return,
            Err(_elapsed) => {
                first.fail(&WalletError::from(sqlx::Error::PoolTimedOut));
                continue;
            }
        };
        let node = |job: &Submitted| shards.as_deref().and_then(|map| job.node(map));
        let round = queue.round(first, storage, node, Submitted::ops);
        let (db, known, lane_back) = (db.clone(), known.clone(), lane_back.clone());
        tracker.spawn(async move {
            let lane = run_round(&db, known.workers(&db), lane, settings, storage, shards, round).await;
            let _ = lane_back.send(lane).await;
        });
    }
}

/// What waits for the rounds: the jobs as they were queued, and under Citus those set aside for a
/// round of their node.
pub(in crate::wallet) struct RoundQueue<T> {
    queued: mpsc::UnboundedReceiver<T>,
    waiting: VecDeque<T>,
}

impl<T> RoundQueue<T> {
    pub(in crate::wallet) fn new(queued: mpsc::UnboundedReceiver<T>) -> Self {
        RoundQueue { queued, waiting: VecDeque::new() }
    }

    /// The job the next round starts with: the first set aside, or the next queued; `None` once
    /// the queue is closed or the replica drained (no worker or round left: the rounds' kept
    /// connections go back to the pool, which can then close).
    pub(in crate::wallet) async fn first(&mut self, tracker: &TaskTracker) -> Option<T> {
        if let Some(first) = self.waiting.pop_front() {
            return Some(first);
        }
        tokio::select! {
            next = self.queued.recv() => next,
            () = tracker.wait() => None,
        }
    }

    /// The jobs of the round `first` starts, up to [`MAX_ROUND_OPS`] movements: on one Postgres,
    /// everything queued meanwhile; under Citus, the jobs of `first`'s node (`node`: where the map
    /// of shards knows it; otherwise `first` alone), from those set aside and then those queued.
    /// The jobs of other nodes are set aside, and the next round starts with the first of them,
    /// ahead of anything queued later.
    pub(in crate::wallet) fn round(
        &mut self,
        first: T,
        storage: Storage,
        node: impl Fn(&T) -> Option<NodeId>,
        ops: impl Fn(&T) -> usize,
    ) -> Vec<T> {
        let mut count = ops(&first);
        let round_node = node(&first);
        let mut round = vec![first];
        match (storage, round_node) {
            (Storage::OnePostgres, _) => {
                while count < MAX_ROUND_OPS {
                    let Ok(next) = self.queued.try_recv() else { break };
                    count += ops(&next);
                    round.push(next);
                }
            }
            (Storage::Citus, Some(round_node)) => {
                let mut others = VecDeque::new();
                let queued = std::iter::from_fn(|| self.queued.try_recv().ok());
                for next in self.waiting.drain(..).chain(queued) {
                    if count < MAX_ROUND_OPS && node(&next) == Some(round_node) {
                        count += ops(&next);
                        round.push(next);
                    } else {
                        others.push_back(next);
                    }
                }
                self.waiting = others;
            }
            (Storage::Citus, None) => {}
        }
        round
    }
}

/// A job in a round, once its wallet is held.
struct Ready {
    job: Job,
    held: Held,
    reply: oneshot::Sender<JobOutcome>,
}

impl Ready {
    fn batch(&self) -> Batch<'_> {
        Batch { id: &self.job.id, fence: self.job.fence, held: &self.held, ops: &self.job.ops }
    }
}

/// A [`LegsJob`] in a round, once its wallets are read (`None`: no such wallet).
struct LegsReady {
    job: LegsJob,
    held: Vec<Option<Held>>,
    reply: oneshot::Sender<LegsOutcome>,
}

impl LegsReady {
    fn wallets(&self) -> Vec<LegsWallet<'_>> {
        self.job
            .wallets
            .iter()
            .zip(&self.held)
            .map(|(Leased { id, fence, .. }, held)| LegsWallet { id, fence: *fence, held: held.as_ref() })
            .collect()
    }
}

/// The jobs of a round, as they go from read to written.
#[derive(Default)]
struct RoundJobs {
    pending: Vec<JobWithReply>,
    ready: Vec<Ready>,
    legs_pending: Vec<LegsJobWithReply>,
    legs_ready: Vec<LegsReady>,
}

/// Runs one round on `lane`'s connection; the lane to keep for the next round.
async fn run_round(
    db: &PgPool,
    workers: &Workers,
    lane: RoundConnection,
    settings: RoundSettings,
    storage: Storage,
    shards: Option<Arc<ShardMap>>,
    round: Vec<Submitted>,
) -> RoundConnection {
    metrics::histogram!(ROUND_WALLETS.name).record(round.len() as f64);
    let kept = lane.is_some();
    let fresh = lane.as_ref().is_some_and(|lane| lane.answered.elapsed() < LANE_FRESH);
    let mut jobs = RoundJobs::default();
    for submitted in round {
        match submitted {
            Submitted::Wallet(job) => jobs.pending.push(job),
            Submitted::Legs(job) => jobs.legs_pending.push(job),
        }
    }
    // The statements' futures are boxed (and `connect`'s wait): sqlx's are kilobytes each, and
    // unboxed they made every round's task 15 KB, copied whole at each spawn and poll transition.
    let mut conn = match connect(db, lane).await {
        Ok(conn) => conn,
        Err(err) => return answer_all(jobs, &err.into()),
    };
    // A key stored before (by a request this round did not look it up for, or by another holder
    // between our read and our write) fails the write whole; the second read finds it and
    // replays it.
    let mut first_attempt = true;
    // The wallets whose movements need their expired holds read (see `batch`).
    let mut expired_of: HashSet<String> = HashSet::new();
    loop {
        let read_at = crate::ledger::entry_time();
        let look_up_keys = !(first_attempt && fresh);
        let hold_ids: Vec<Uuid> = jobs
            .pending
            .iter()
            .map(|(job, _)| job)
            .chain(jobs.ready.iter().map(|r| &r.job))
            .flat_map(|job| job.ops.iter().filter_map(Op::settles))
            .chain(
                jobs.legs_pending
                    .iter()
                    .map(|(job, _)| job)
                    .chain(jobs.legs_ready.iter().map(|r| &r.job))
                    .flat_map(|job| job.ops.iter().flat_map(LegsOp::settles)),
            )
            .collect();
        let expired: Vec<&str> = expired_of.iter().map(String::as_str).collect();
        let holds = HoldsToRead { ids: &hold_ids, expired_of: &expired, now: read_at };
        crate::failpoint::hit("before_round_read");
        let reading = Box::pin(read(&mut conn, shards.as_deref(), &mut jobs, look_up_keys, holds));
        let (mut found, gave_up) = match answered_within(settings.answer_within, reading).await {
            Some(found) => (found, false),
            None => (Err(WalletError::from(unanswered(settings.answer_within))), true),
        };
        if kept && first_attempt && !gave_up && matches!(found, Err(WalletError::Unavailable { .. })) {
            // The kept connection died while idle (Postgres restarted, say), which a pool
            // checkout's ping would have caught: read again, once, on a fresh one. The read is
            // safe to repeat: it writes nothing a second read would not find as it left it.
            conn.close_on_drop();
            conn = match connect(db, None).await {
                Ok(fresh) => fresh,
                Err(err) => return answer_all(jobs, &err.into()),
            };
            found = Box::pin(read(&mut conn, shards.as_deref(), &mut jobs, true, holds)).await;
        }
        let (keys, held_holds) = match found {
            Ok(found) => found,
            Err(err) => {
                conn.close_on_drop();
                return answer_all(jobs, &err);
            }
        };
        // The round is timed after its read: whatever the read found (a version another path wrote
        // while this holder waited, say) was committed before it, so each wallet's entries are
        // timed in the order they were written, which history's reads by time rely on. A hold
        // that expired between the two is not among the expired holds read: it counts as held.
        let now = crate::ledger::entry_time();
        let batches: Vec<Batch<'_>> = jobs.ready.iter().map(Ready::batch).collect();
        // Refunds never ride the rounds (see `Wallets::commit_under`): none is read.
        let refunded = decision::Refunds::new();
        let known =
            Known { keys: &keys, holds: &held_holds, expired_read: &expired_of, refunded: &refunded, now };
        let plans = decision::decide_round(&batches, known);
        let legs_wallets: Vec<Vec<LegsWallet<'_>>> = jobs.legs_ready.iter().map(LegsReady::wallets).collect();
        let legs_plans: Vec<Result<LegsPlan, Vec<String>>> = legs_wallets
            .iter()
            .zip(&jobs.legs_ready)
            .map(|(wallets, r)| decision::decide_between(wallets, &r.job.ops, known))
            .collect();
        let short: Vec<String> = plans
            .as_ref()
            .err()
            .into_iter()
            .flatten()
            .chain(legs_plans.iter().filter_map(|plan| plan.as_ref().err()).flatten())
            .cloned()
            .collect();
        if !short.is_empty() {
            // Nothing is written yet: read those wallets' expired holds, and decide again.
            expired_of.extend(short);
            first_attempt = false;
            continue;
        }
        let plans = plans.expect("no wallet short");
        let legs_plans: Vec<LegsPlan> =
            legs_plans.into_iter().map(|plan| plan.expect("no wallet short")).collect();
        let mut write = group_write(&batches, &plans);
        for ((wallets, plan), r) in legs_wallets.iter().zip(&legs_plans).zip(&jobs.legs_ready) {
            if plan.runs() {
                add_legs(&mut write, wallets, &r.job.ops, plan);
            }
        }
        settings.events_of(&mut write);
        let written = if write.wallets.is_empty() {
            Ok(Default::default())
        } else {
            crate::failpoint::hit("before_commit");
            let writing = Box::pin(store::commit(
                &mut conn,
                storage,
                shards.as_deref(),
                Some(workers),
                &write,
                now,
                settings.retention,
            ));
            let written = answered_within(settings.answer_within, writing)
                .await
                .unwrap_or_else(|| Err(unanswered(settings.answer_within).into()));
            crate::failpoint::hit("after_commit");
            written
        };
        drop(write);
        drop(batches);
        drop(legs_wallets);
        match written {
            Err(err) if err.is_key_conflict() && first_attempt => {
                first_attempt = false;
                continue;
            }
            Err(err) => {
                conn.close_on_drop();
                let err = crate::wallet::commit_failure(err);
                for (r, plan) in jobs.ready.into_iter().zip(plans) {
                    let results = plan.results(if plan.runs() { Err(&err) } else { Ok(true) });
                    let _ = r.reply.send(JobOutcome::Done { held: None, results });
                }
                for (r, plan) in jobs.legs_ready.into_iter().zip(legs_plans) {
                    let results = plan.results(if plan.runs() { Err(&err) } else { Ok(true) });
                    let _ = r.reply.send(LegsOutcome::Done { results, after: Vec::new() });
                }
                return None;
            }
            Ok(committed) => {
                for (r, plan) in jobs.ready.into_iter().zip(plans) {
                    let id = r.job.id.as_str();
                    if plan.runs() && committed.busy.contains(id) {
                        // Another statement is writing the row right now: nothing was written,
                        // and the holder tries again shortly while its lease lasts.
                        metrics::counter!(WALLET_BUSY.name).increment(1);
                        let _ = r.reply.send(JobOutcome::Busy { ops: r.job.ops });
                        continue;
                    }
                    let matched = !plan.runs() || committed.moved.contains(id);
                    // A write that did not match was decided on a state the row no longer has: the
                    // note was stale, or the row was written since this holder last did (by a
                    // writer under Postgres alone, or by a newer holder, whose fence the read then
                    // finds). It is read again, never answered from that state. Only a write that
                    // matched confirms a note; one that hides the wallet from a caller without
                    // writing never rests on the note alone.
                    if !matched || (r.held.from_note && !plan.runs() && plan.hides()) {
                        if r.held.from_note {
                            metrics::counter!(LEASE_NOTE_STALE.name).increment(1);
                        }
                        let _ = r.reply.send(JobOutcome::Stale { ops: r.job.ops });
                        continue;
                    }
                    let results = plan.results(Ok(matched));
                    let held = if matched { Some(plan.after) } else { None };
                    let _ = r.reply.send(JobOutcome::Done { held, results });
                }
                for (r, plan) in jobs.legs_ready.into_iter().zip(legs_plans) {
                    let present = || r.job.wallets.iter().zip(&r.held).filter(|(_, held)| held.is_some());
                    if plan.runs() && present().any(|(leased, _)| committed.busy.contains(leased.id.as_str()))
                    {
                        metrics::counter!(WALLET_BUSY.name).increment(1);
                        let _ = r.reply.send(LegsOutcome::Again { busy: true, ops: r.job.ops });
                        continue;
                    }
                    // As for one wallet's job: a write that did not match was decided on a state
                    // a row no longer has, and only a write that matched confirms a note, so
                    // answers given without writing are never given on a note alone.
                    let on_note = || r.held.iter().flatten().any(|held| held.from_note);
                    if (plan.runs()
                        && !present().all(|(leased, _)| committed.moved.contains(leased.id.as_str())))
                        || (!plan.runs() && on_note())
                    {
                        if on_note() {
                            metrics::counter!(LEASE_NOTE_STALE.name).increment(1);
                        }
                        let _ = r.reply.send(LegsOutcome::Again { busy: false, ops: r.job.ops });
                        continue;
                    }
                    let after = if plan.runs() { plan.after.clone() } else { r.held };
                    let _ = r.reply.send(LegsOutcome::Done { results: plan.results(Ok(true)), after });
                }
                return Some(Kept { conn, answered: Instant::now() });
            }
        }
    }
}

/// The slices in which [`answered_within`] counts a wait.
const ANSWER_SLICE: Duration = Duration::from_millis(100);

/// `answer`'s output, or `None` once it has gone unanswered for `limit` of this process's running
/// time. The wait is counted in slices of [`ANSWER_SLICE`], each counted as its own length however
/// late its timer fires: a process frozen past the limit (a GC pause, a stalled VM, SIGSTOP) wakes
/// with every timer expired, and `tokio::time::timeout` would give up on a statement that
/// Postgres answered, or that was not even sent yet, while the process slept. Waking, the round
/// gets its answer instead, and the fence decides: a lease lost in the pause is refused there.
async fn answered_within<F: std::future::Future>(limit: Duration, answer: F) -> Option<F::Output> {
    let mut answer = std::pin::pin!(answer);
    let mut counted = Duration::ZERO;
    while counted < limit {
        let slice = ANSWER_SLICE.min(limit - counted);
        tokio::select! {
            biased;
            output = &mut answer => return Some(output),
            () = tokio::time::sleep(slice) => counted += slice,
        }
    }
    None
}

/// A statement given up unanswered after `waited` (see [`RoundSettings::answer_within`]): to the
/// round, its connection failed.
fn unanswered(waited: Duration) -> sqlx::Error {
    let cause = format!("Postgres did not answer the round within {waited:?}");
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, cause))
}

/// The lane's connection, or a fresh one from the pool.
async fn connect(db: &PgPool, lane: RoundConnection) -> Result<PoolConnection<Postgres>, sqlx::Error> {
    if let Some(Kept { conn, .. }) = lane {
        return Ok(conn);
    }
    let started = Instant::now();
    // Not needed by a round that keeps its lane's connection.
    let conn = crate::ledger::acquire(db).await?;
    metrics::histogram!(PG_POOL_ACQUIRE_WAIT.name).record(started.elapsed());
    Ok(conn)
}

/// Answers every job of a round that failed before writing anything.
fn answer_all(jobs: RoundJobs, err: &WalletError) -> RoundConnection {
    for job in jobs.pending {
        Submitted::Wallet(job).fail(err);
    }
    for job in jobs.legs_pending {
        Submitted::Legs(job).fail(err);
    }
    for r in jobs.ready {
        let _ = r.reply.send(failed(r.job.ops.len(), err));
    }
    for r in jobs.legs_ready {
        Submitted::Legs((r.job, r.reply)).fail(err);
    }
    None
}

/// The round's read: reads the wallets of the pending jobs not yet held (moving them to the ready
/// ones, or answering those not found or whose fence is behind), looks up the keys of every ready
/// job and reads `holds`. With every wallet held, no hold to read and `look_up_keys` false, reads
/// nothing: the write checks the keys.
async fn read(
    conn: &mut sqlx::PgConnection,
    shards: Option<&ShardMap>,
    jobs: &mut RoundJobs,
    look_up_keys: bool,
    holds: HoldsToRead<'_>,
) -> Result<(FoundKeys, HashMap<Uuid, Hold>), WalletError> {
    let to_read: Vec<ToRead<'_>> = jobs
        .pending
        .iter()
        .filter(|(job, _)| job.held.is_none())
        .map(|(job, _)| ToRead { id: job.id.as_str(), fence: job.fence, written: false })
        .chain(jobs.legs_pending.iter().flat_map(|(job, _)| {
            job.wallets.iter().filter(|w| w.held.is_none()).map(|w| ToRead {
                id: w.id.as_str(),
                fence: w.fence,
                written: w.written,
            })
        }))
        .collect();
    let wallet_jobs = jobs.pending.iter().map(|(job, _)| job).chain(jobs.ready.iter().map(|r| &r.job));
    let legs_jobs =
        jobs.legs_pending.iter().map(|(job, _)| job).chain(jobs.legs_ready.iter().map(|r| &r.job));
    // The keys of movements between wallets, with their aliases in the wallets they take money
    // out of (`LegsOp::key_aliases`).
    let legs_keys: Vec<(KeyRef<'_>, Vec<(&WalletId, String)>)> = legs_jobs
        .clone()
        .flat_map(|job| job.ops.iter().filter_map(|op| op.key().map(|(at, _)| (at, op.key_aliases()))))
        .collect();
    let keys: Vec<KeyRef<'_>> = if look_up_keys || !to_read.is_empty() || !holds.is_empty() {
        wallet_jobs
            .clone()
            .flat_map(|job| job.ops.iter().filter_map(|op| op.key.as_ref().map(|key| key.at())))
            .chain(legs_keys.iter().flat_map(|(at, aliases)| {
                std::iter::once(*at).chain(aliases.iter().map(|(wallet, scope)| KeyRef {
                    wallet: wallet.as_str(),
                    scope,
                    ..*at
                }))
            }))
            .collect()
    } else {
        Vec::new()
    };
    let mut found = if to_read.is_empty() && keys.is_empty() && holds.is_empty() {
        store::Found::default()
    } else {
        // Every wallet the round names, and the wallets its keys are stored with.
        let round: Vec<&str> = wallet_jobs
            .map(|job| job.id.as_str())
            .chain(legs_jobs.flat_map(|job| job.wallets.iter().map(|w| w.id.as_str())))
            .chain(keys.iter().map(|key| key.wallet))
            .collect();
        store::read(conn, shards, &to_read, &round, &keys, holds).await.map_err(WalletError::from)?
    };
    for (job, reply) in jobs.pending.drain(..) {
        let held = match job.held {
            Some(held) => held,
            None => match found.wallets.get(job.id.as_str()) {
                Some(ready @ ReadOutcome::Ready { .. }) => held_as_read(ready),
                Some(ReadOutcome::FenceBehind { seen }) => {
                    let _ = reply.send(JobOutcome::FenceBehind { seen: *seen, ops: job.ops });
                    continue;
                }
                Some(ReadOutcome::FenceImplausible { seen }) => {
                    let err = WalletError::fence_implausible(&job.id, job.fence, *seen);
                    let _ = reply.send(failed(job.ops.len(), &err));
                    continue;
                }
                Some(ReadOutcome::NotFound) | None => {
                    let _ = reply.send(failed(job.ops.len(), &WalletError::NotFound));
                    continue;
                }
            },
        };
        jobs.ready.push(Ready { job: Job { held: Some(held.clone()), ..job }, held, reply });
    }
    'legs: for (job, reply) in jobs.legs_pending.drain(..) {
        let mut held = Vec::with_capacity(job.wallets.len());
        for Leased { id, fence, held: known, .. } in &job.wallets {
            if known.is_some() {
                held.push(known.clone());
                continue;
            }
            held.push(match found.wallets.get(id.as_str()) {
                Some(ready @ ReadOutcome::Ready { .. }) => Some(held_as_read(ready)),
                Some(ReadOutcome::FenceBehind { seen }) => {
                    let _ = reply.send(LegsOutcome::FenceBehind {
                        wallet: id.clone(),
                        seen: *seen,
                        ops: job.ops,
                    });
                    continue 'legs;
                }
                Some(ReadOutcome::FenceImplausible { seen }) => {
                    let err = WalletError::fence_implausible(id, *fence, *seen);
                    Submitted::Legs((job, reply)).fail(&err);
                    continue 'legs;
                }
                // A missing wallet is the answer of the movements that name it, decided with the rest.
                Some(ReadOutcome::NotFound) | None => None,
            });
        }
        jobs.legs_ready.push(LegsReady { job, held, reply });
    }
    Ok((std::mem::take(&mut found.keys), std::mem::take(&mut found.holds)))
}

/// The wallet as the round's read found it ready (any other outcome is not read).
fn held_as_read(ready: &ReadOutcome) -> Held {
    let ReadOutcome::Ready { wallet, held, fence, owner, rules } = ready else {
        unreachable!("only a wallet found ready is held")
    };
    Held {
        balance: wallet.balance,
        held: *held,
        version: wallet.version,
        fence: *fence,
        owner: owner.clone(),
        rules: rules.clone(),
        from_note: false,
    }
}

/// What the round writes: every wallet with an op that runs, its entries, its keys' responses.
fn group_write<'a>(batches: &[Batch<'a>], plans: &'a [Plan]) -> GroupWrite<'a> {
    let mut write = GroupWrite::default();
    for (batch, plan) in batches.iter().zip(plans).filter(|(_, plan)| plan.runs()) {
        add_wallet(&mut write, batch, plan);
    }
    write
}

/// Adds to `write` the write of a [`LegsJob`]'s wallets (`wallets`, as read) as `plan` decided
/// them: one group, so every wallet of it is written or none.
pub(in crate::wallet) fn add_legs<'a>(
    write: &mut GroupWrite<'a>,
    wallets: &[LegsWallet<'a>],
    ops: &'a [LegsOp],
    plan: &'a LegsPlan,
) {
    let group = write.wallets.len() as i32;
    let mut first: Option<&'a str> = None;
    for (wallet, after) in wallets.iter().zip(&plan.after) {
        let (Some(held), Some(after)) = (wallet.held, after) else { continue };
        let id = wallet.id.as_str();
        first.get_or_insert(id);
        write.wallets.push(WalletWrite {
            id,
            group,
            fence: wallet.fence,
            read_fence: held.fence,
            read_version: held.version,
            read_balance: held.balance,
            read_held: held.held,
            owner: held.owner.as_deref(),
            balance: after.balance,
            held: after.held,
            version: after.version,
        });
        write.read_rules.push(&held.rules);
        // What the velocity limits' windows took (a movement sets no other rule).
        if after.rules != held.rules {
            write.rules.push((id, &after.rules));
        }
    }
    let Some(first) = first else { return };
    write.entries.extend(plan.entries.iter());
    write.placed.extend(plan.placed.iter());
    write.events.extend(plan.events.iter());
    write.settled.extend(plan.settled.iter().map(|(n, s)| Settlement {
        hold: s.hold,
        wallet_id: wallets[*n].id.as_str(),
        status: s.status,
        captured: s.captured,
        capture_entry: s.capture_entry,
    }));
    write.transfers.extend(plan.transfers.iter());
    write.movements.extend(plan.movements.iter());
    // Every wallet of the group is written or none: each key's response depends on the first.
    for (op, response, entry_id) in &plan.responses {
        let Some((at, fingerprint)) = ops[*op].key() else { continue };
        let stored = |at, body| KeyWrite {
            wallet_id: first,
            at,
            fingerprint,
            status: response.status,
            content_type: &response.content_type,
            body,
            entry_id: *entry_id,
        };
        // Its own, and its aliases in the scopes of the wallets it takes money out of.
        write.keys.push(stored(at, &response.body));
        for alias in plan.key_aliases.iter().filter(|alias| alias.op == *op) {
            let at = KeyRef { wallet: wallets[alias.wallet].id.as_str(), scope: &alias.scope, ..at };
            write.keys.push(stored(at, &alias.body));
        }
    }
}

/// Adds to `write` the write of `batch`'s wallet as `plan` decided it.
pub(in crate::wallet) fn add_wallet<'a>(write: &mut GroupWrite<'a>, batch: &Batch<'a>, plan: &'a Plan) {
    let Batch { id, fence, held, ops } = *batch;
    let id = id.as_str();
    // A batch is one wallet's, written on its own: a group of its own.
    let group = write.wallets.len() as i32;
    write.wallets.push(WalletWrite {
        id,
        group,
        fence,
        read_fence: held.fence,
        read_version: held.version,
        read_balance: held.balance,
        read_held: held.held,
        owner: held.owner.as_deref(),
        balance: plan.after.balance,
        held: plan.after.held,
        version: plan.after.version,
    });
    write.read_rules.push(&held.rules);
    if plan.after.rules != held.rules {
        write.rules.push((id, &plan.after.rules));
    }
    write.entries.extend(plan.entries.iter());
    write.placed.extend(plan.placed.iter());
    write.events.extend(plan.events.iter());
    write.settled.extend(plan.settled.iter().map(|s| Settlement {
        hold: s.hold,
        wallet_id: id,
        status: s.status,
        captured: s.captured,
        capture_entry: s.capture_entry,
    }));
    for (op, response) in &plan.responses {
        let Some(key) = &ops[*op].key else { continue };
        write.keys.push(KeyWrite {
            wallet_id: id,
            at: key.at(),
            fingerprint: &key.fingerprint,
            status: response.status,
            content_type: &response.content_type,
            body: &response.body,
            entry_id: plan.entry_of(*op).map(|entry| entry.id),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs as `(node, movements)`, taken into rounds as `gather` takes them.
    async fn rounds_of(storage: Storage, jobs: &[(NodeId, usize)]) -> Vec<Vec<(NodeId, usize)>> {
        let (send, queued) = mpsc::unbounded_channel();
        jobs.iter().for_each(|&job| send.send(job).expect("open"));
        drop(send);
        let mut queue = RoundQueue::new(queued);
        let mut rounds = Vec::new();
        let tracker = TaskTracker::new();
        while let Some(first) = queue.first(&tracker).await {
            let node = |&(node, _): &(NodeId, usize)| (node >= 0).then_some(node);
            rounds.push(queue.round(first, storage, node, |&(_, ops)| ops));
        }
        rounds
    }

    #[tokio::test]
    async fn under_citus_a_round_takes_its_first_jobs_node_and_the_others_wait_their_turn_in_order() {
        let jobs = [(1, 1), (2, 1), (1, 2), (-1, 1), (2, 3), (1, 1)];
        assert_eq!(
            rounds_of(Storage::Citus, &jobs).await,
            [vec![(1, 1), (1, 2), (1, 1)], vec![(2, 1), (2, 3)], vec![(-1, 1)]],
            "a job of no known node is a round of its own"
        );
        assert_eq!(rounds_of(Storage::OnePostgres, &jobs).await, [jobs.to_vec()]);
    }

    #[tokio::test]
    async fn a_round_stops_taking_jobs_at_its_most_movements() {
        let jobs = [(1, MAX_ROUND_OPS - 1), (1, 1), (1, 1), (2, 1)];
        assert_eq!(
            rounds_of(Storage::Citus, &jobs).await,
            [vec![(1, MAX_ROUND_OPS - 1), (1, 1)], vec![(1, 1)], vec![(2, 1)]]
        );
    }

    /// Blocks the runtime's only thread, as a frozen process is blocked.
    fn freeze(for_: Duration) {
        std::thread::sleep(for_);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_answer_that_comes_just_after_a_pause_longer_than_the_limit_is_taken() {
        let (answer, answered) = oneshot::channel::<u8>();
        let waiting = tokio::spawn(answered_within(Duration::from_millis(300), answered));
        tokio::task::yield_now().await;
        freeze(Duration::from_millis(500));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = answer.send(7);
        });
        assert_eq!(waiting.await.unwrap().map(Result::unwrap), Some(7));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_statement_never_answered_is_given_up_after_the_limit() {
        let (_answer, answered) = oneshot::channel::<u8>();
        let started = Instant::now();
        assert!(answered_within(Duration::from_millis(250), answered).await.is_none());
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(1), "{waited:?}");
    }
}
