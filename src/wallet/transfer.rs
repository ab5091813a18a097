//! Money between wallets, and back: transfers, movements of many legs (posted, or placed as holds
//! and captured or voided), and refunds of payments, transfers and movements. Each is a
//! [`LegsOp`], decided by [`decide_between`] against every wallet it touches.
//!
//! Each takes the leases of every wallet whose balance changes through
//! [`crate::lease::LeaseClient::acquire_all`], which takes them one at a time in wallet-id order
//! with a bounded wait each, so concurrent A→B and B→A movements (and longer cycles) never
//! deadlock. Then, on one Postgres, it rides the replica's rounds ([`Wallets::run_between`],
//! [`group::LegsJob`]): read, decided with everything else of the round and written by the round's
//! one statement, every wallet conditionally on its own lease's fence and the state read, all of
//! them or none. Under Citus or under Postgres alone, and for every refund, it commits in a
//! transaction of its own ([`Wallets::attempt_between`]): it locks the wallet rows in id order
//! (bounded by [`ROW_LOCK_TIMEOUT`]), checks that each row's fence is below its lease's, looks up
//! the keys, the holds and what was refunded so far, decides with the same `decide_between`, and
//! writes with the rounds' write. A stale holder of any lease writes nothing either way.
//!
//! A refund runs under the lease of every wallet of what it refunds and reads what the refunds
//! before it gave back with those rows locked. Every refund of one payment, transfer or movement
//! locks the same rows, so two refunds racing on two replicas take turns and never add up to
//! more than it moved.
//!
//! Who may: money leaves only wallets the caller may use, and goes into wallets it may use or may
//! pay into ([`Access`]); a refund's money goes back where it came from, whoever owns that (see
//! [`LegsOp::Refund`]). To anyone else the wallet (or the transfer, or the movement) does not
//! exist.
//!
//! The known cost: on one replica, a wallet's queue worker may hold that wallet's lease while a
//! transfer waits for it, as another replica would (bounded by the lease wait); the worker hands
//! the lease over after its current batch, because the transfer marks it contended.

use super::MOST_LIFTS;
use super::decision::{
    FoundKeys, Held, HeldMovement, Known, LegsOp, LegsWallet, RefundOf, Refunds, SettleAs, decide_between,
    wallets_of,
};
use super::outage::{Path, count_one};
use super::rounds::group;
use super::{Access, Amount, Refusal, WalletError, WalletId, Wallets, lease_name};
use crate::domain::{self, FenceStanding, LegRefusal, Legs, Metadata, Parties};
use crate::idempotency::Keyed;
use crate::lease::{self, Lease};
use crate::ledger::Entry;
use crate::ledger::group as store_round;
use crate::ledger::idempotency::KeyRef;
use crate::ledger::storage::Storage;
use crate::ledger::transfer::{self as store, FoundMovement, FoundTransfer, MovementRecord, Transfer};
use crate::telemetry::metrics::{PAYEE_BATCH_ALONE, TRANSFERS};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

/// The longest a transfer's transaction waits for a wallet row another statement holds (a round
/// holds rows for one statement; longer is an operator's session or a stalled holder).
pub(super) const ROW_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// How a transfer (or a refund of one) ended, as stored for its idempotency key.
pub type TransferOutcome = Result<Transfer, Refusal>;

/// How a refund of a payment ended, as stored for its idempotency key: its `refund` entry.
pub type RefundOutcome = Result<Entry, Refusal>;

/// How a movement of many legs ended, as stored for its idempotency key.
pub type MovementRecordOutcome = Result<MovementRecord, LegRefusal>;

/// A transfer to make.
#[derive(Debug, Clone)]
pub struct Between {
    pub parties: Parties,
    pub amount: Amount,
    pub reference: Option<String>,
    pub metadata: Metadata,
}

/// A refund of one of a wallet's payments: `amount`, or all that is left without it.
#[derive(Debug, Clone)]
pub struct Refund {
    pub wallet: WalletId,
    pub payment: Uuid,
    pub amount: Option<Amount>,
    pub metadata: Metadata,
}

/// What a committed [`LegsOp`] wrote.
#[derive(Debug, Clone)]
pub(super) enum Done {
    Transfer(Box<Transfer>),
    Entry(Entry),
    Movement(Box<MovementRecord>),
}

impl Done {
    pub(super) fn into_movement(self) -> Result<MovementRecord, WalletError> {
        match self {
            Done::Movement(movement) => Ok(*movement),
            Done::Transfer(_) | Done::Entry(_) => {
                Err(WalletError::internal("a movement wrote something else"))
            }
        }
    }

    pub(super) fn into_transfer(self) -> Result<Transfer, WalletError> {
        match self {
            Done::Transfer(transfer) => Ok(*transfer),
            Done::Entry(_) | Done::Movement(_) => {
                Err(WalletError::internal("a transfer wrote something else"))
            }
        }
    }

    pub(super) fn into_entry(self) -> Result<Entry, WalletError> {
        match self {
            Done::Entry(entry) => Ok(entry),
            Done::Transfer(_) | Done::Movement(_) => {
                Err(WalletError::internal("a payment's refund wrote something else"))
            }
        }
    }
}

/// A committed transaction's movements: each one's result, and each of its wallets as it left
/// them (`None`: no such wallet).
type Attempted = (Vec<Result<Done, WalletError>>, Vec<WalletId>, Vec<Option<Held>>);

/// Why one transaction attempt did not commit.
#[derive(Debug)]
pub(super) enum Failure {
    /// A wallet's row has seen a fence at least as high as its lease's: lift the lease's fence
    /// above `seen` (token-checked) and try again, once per wallet.
    FenceBehind {
        wallet: WalletId,
        seen: i64,
    },
    /// Another request stored this request's idempotency key after we looked: look again.
    KeyConflict,
    Wallet(WalletError),
}

impl<E: Into<WalletError>> From<E> for Failure {
    fn from(err: E) -> Self {
        Failure::Wallet(err.into())
    }
}

/// What a holder knows of the wallets whose leases it holds: each as its last write under the
/// lease left it, or as the lease's note says. Advice only, as a note is: every write is
/// conditional on the state it was decided on, so a wallet known wrongly moves nothing and is
/// read again.
pub(super) type KnownWallets = HashMap<WalletId, Held>;

/// The fences a transaction writes its wallets with.
pub(super) enum Fences {
    /// Under leases: each lease's fence and whether it has written with it, by lease name. A row
    /// must not have seen it, unless from this holder ([`FenceStanding::of_holder`]).
    Leased(HashMap<String, (i64, bool)>),
    /// Under Postgres alone, during a Redis outage ([`super::outage`]): each row keeps its own
    /// fence, and its lock (held to the commit) stands in for the lease.
    RowsOwn,
}

impl Fences {
    /// The fence wallet `id`'s write carries, its row locked with fence `row_fence`; a row that
    /// has seen its lease's fence is [`Failure::FenceBehind`], one far below it
    /// [`WalletError::FenceImplausible`].
    pub(super) fn for_row(&self, id: &WalletId, row_fence: i64) -> Result<i64, Failure> {
        match self {
            Fences::Leased(by_lease) => {
                let (fence, written) = by_lease.get(&lease_name(id)).copied().unwrap_or_default();
                match FenceStanding::of_holder(fence, written, row_fence) {
                    FenceStanding::Above => Ok(fence),
                    FenceStanding::Behind => {
                        Err(Failure::FenceBehind { wallet: id.clone(), seen: row_fence })
                    }
                    FenceStanding::Implausible => {
                        Err(WalletError::fence_implausible(id, fence, row_fence).into())
                    }
                }
            }
            Fences::RowsOwn => Ok(row_fence),
        }
    }
}

/// Registers this module's series at zero.
pub(super) fn register_metrics() {
    metrics::counter!(PAYEE_BATCH_ALONE.name).absolute(0);
    for kind in [
        "transfer",
        "movement",
        "movement_hold",
        "movement_capture",
        "movement_void",
        "transfer_refund",
        "payment_refund",
        "movement_refund",
    ] {
        for outcome in ["accepted", "insufficient_funds", "lock_timeout", "lease_lost", "unavailable"] {
            metrics::counter!(TRANSFERS.name, "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
}

impl Wallets {
    /// Moves money from one wallet to another: both legs in one write, under both leases. With a
    /// key, a key used before answers [`WalletError::AlreadyRan`] and moves nothing; a new key's
    /// outcome is stored in the write that moves the money.
    pub async fn transfer(
        &self,
        access: &Access,
        between: Between,
        key: Option<Keyed<TransferOutcome>>,
    ) -> Result<Transfer, WalletError> {
        if self.strategy == super::Strategy::Queue {
            return self.transfer_queued(access, between, key).await;
        }
        let Between { parties, amount, reference, metadata } = between;
        let op = LegsOp::Transfer { access: access.clone(), parties, amount, reference, metadata, key };
        self.run_op(op).await?.into_transfer()
    }

    /// Moves `amount` (without it: all not yet refunded) of transfer `id` back, from its `to` to its
    /// `from`, as a transfer of its own that names it. Its refunds never add up to more than it
    /// ([`Refusal::RefundExceedsPayment`]).
    pub async fn refund_transfer(
        &self,
        access: &Access,
        id: Uuid,
        amount: Option<Amount>,
        metadata: Metadata,
        key: Option<Keyed<TransferOutcome>>,
    ) -> Result<Transfer, WalletError> {
        // Counted here too: a refund refused before it runs (no such transfer, or not the
        // caller's) is a refund's outcome like any other.
        let original = self
            .find_transfer(access, id)
            .await
            .inspect_err(|err| count_outcome::<()>("transfer_refund", &Err(err.clone())))?
            .transfer;
        let amount_moved =
            Amount::new(original.amount).map_err(|_| WalletError::internal("a stored amount"))?;
        let legs = vec![
            (stored_id(&original.from)?, amount_moved, true),
            (stored_id(&original.to)?, amount_moved, false),
        ];
        let of = RefundOf::Transfer { transfer: original.id, key };
        self.run_op(LegsOp::Refund { access: access.clone(), of, legs, amount, metadata })
            .await?
            .into_transfer()
    }

    /// Puts money back into a wallet for one of its payments: a `refund` entry that names the
    /// payment. Its refunds never add up to more than it ([`Refusal::RefundExceedsPayment`]).
    pub async fn refund_payment(
        &self,
        access: &Access,
        refund: Refund,
        key: Option<Keyed<RefundOutcome>>,
    ) -> Result<Entry, WalletError> {
        let Refund { wallet, payment, amount, metadata } = refund;
        let found = async {
            let mut conn = self.connection().await?;
            let owner = crate::ledger::find_wallet(&mut conn, wallet.as_str()).await?.map(|w| w.owner);
            if !owner.is_some_and(|owner| access.may_use(owner.as_deref())) {
                return Err(WalletError::NotFound);
            }
            store::find_payment(&mut conn, wallet.as_str(), payment)
                .await?
                .ok_or(WalletError::PaymentNotFound)
        };
        let paid = found.await.inspect_err(|err| count_outcome::<()>("payment_refund", &Err(err.clone())))?;
        let paid = Amount::new(paid.amount).map_err(|_| WalletError::internal("a stored amount"))?;
        let of = RefundOf::Payment { payment, key };
        let legs = vec![(wallet, paid, true)];
        let op = LegsOp::Refund { access: access.clone(), of, legs, amount, metadata };
        self.run_op(op).await?.into_entry()
    }

    /// Moves `amount` (without it: all not yet refunded) of movement `id` back, every leg by its
    /// share ([`LegsOp::Refund`]), as a movement of its own that names it. Its refunds never give
    /// back more than a leg moved ([`Refusal::RefundExceedsPayment`]); a held movement not
    /// captured moved nothing ([`WalletError::MovementNotCaptured`]).
    pub async fn refund_movement(
        &self,
        access: &Access,
        id: Uuid,
        amount: Option<Amount>,
        metadata: Metadata,
        key: Option<Keyed<MovementRecordOutcome>>,
    ) -> Result<MovementRecord, WalletError> {
        let found = async {
            let original = self.find_movement(access, id).await?;
            if original.legs.is_empty() {
                return Err(WalletError::MovementNotCaptured);
            }
            original
                .legs
                .iter()
                .map(|entry| {
                    let amount =
                        Amount::new(entry.amount).map_err(|_| WalletError::internal("a stored amount"))?;
                    Ok((stored_id(&entry.wallet_id)?, amount, entry.kind.is_debit()))
                })
                .collect::<Result<Vec<_>, WalletError>>()
        };
        let legs =
            found.await.inspect_err(|err| count_outcome::<()>("movement_refund", &Err(err.clone())))?;
        let of = RefundOf::Movement { movement: id, key };
        self.run_op(LegsOp::Refund { access: access.clone(), of, legs, amount, metadata })
            .await?
            .into_movement()
    }

    /// Moves money between 2 to 16 wallets at once, under every wallet's lease, in one
    /// write: every leg, or none; with `hold`, reserves every debit leg for that long instead, to
    /// be captured or voided as a whole ([`Wallets::settle_movement`]). With a key, a key used
    /// before answers [`WalletError::AlreadyRan`] and moves nothing; a new key's outcome is stored
    /// with the legs.
    pub async fn move_between(
        &self,
        access: &Access,
        legs: Legs,
        reference: Option<String>,
        metadata: Metadata,
        hold: Option<domain::HoldLife>,
        key: Option<Keyed<MovementRecordOutcome>>,
    ) -> Result<MovementRecord, WalletError> {
        let op = LegsOp::Movement { access: access.clone(), legs, reference, metadata, hold, key };
        self.run_op(op).await?.into_movement()
    }

    /// Captures (all of it, or part of it taken from every leg pro rata) or voids held movement
    /// `id` as a whole, under the leases of all its wallets: every leg's entry and every hold
    /// captured, or every hold released; refused with nothing changed once any of its holds is
    /// settled, and `hold_expired` past its expiry.
    pub async fn settle_movement(
        &self,
        access: &Access,
        id: Uuid,
        settle: SettleAs,
        key: Option<Keyed<MovementRecordOutcome>>,
    ) -> Result<MovementRecord, WalletError> {
        let found = self.find_movement(access, id).await?;
        let held = HeldMovement::of(found).ok_or(WalletError::MovementNotHeld)?;
        let op = LegsOp::Settle { access: access.clone(), held: Box::new(held), settle, key };
        self.run_op(op).await?.into_movement()
    }

    /// The movement `id` as it stands now, if `access` may use one of its wallets.
    pub async fn find_movement(&self, access: &Access, id: Uuid) -> Result<MovementRecord, WalletError> {
        let mut conn = self.connection().await?;
        store::find_movement(&mut conn, id, chrono::Utc::now())
            .await?
            .filter(|found: &FoundMovement| found.owners.iter().any(|owner| access.may_use(owner.as_deref())))
            .map(|found| found.movement)
            .ok_or(WalletError::MovementNotFound)
    }

    /// The transfer `id` and what has been refunded of it, if `access` may use one of its wallets.
    pub async fn find_transfer(&self, access: &Access, id: Uuid) -> Result<FoundTransfer, WalletError> {
        let mut conn = self.connection().await?;
        store::find_transfer(&mut conn, id)
            .await?
            .filter(|found| found.owners.iter().any(|owner| access.may_use(owner.as_deref())))
            .ok_or(WalletError::TransferNotFound)
    }

    /// Runs `op` to its end (even if the client hangs up) and counts its outcome.
    async fn run_op(&self, op: LegsOp) -> Result<Done, WalletError> {
        let kind = op.kind();
        let this = self.clone();
        let result = self.run_to_end(None, async move { this.under_leases(op).await }).await;
        count_outcome(kind, &result);
        result
    }

    /// Takes the leases of `op`'s wallets, commits it, releases them; or, in a Redis outage,
    /// commits it under Postgres alone.
    pub(super) async fn under_leases(&self, op: LegsOp) -> Result<Done, WalletError> {
        let ops = vec![op];
        let one = |results: Vec<Result<Done, WalletError>>| {
            results.into_iter().next().unwrap_or_else(|| Err(WalletError::internal("no result")))
        };
        if self.outage.is_active() {
            return self.commit_unleased(&ops).await.and_then(one).inspect(|_| count_one(Path::PostgresOnly));
        }
        let names: Vec<String> = wallets_of(&ops).iter().map(lease_name).collect();
        let acquired = self.leases.acquire_all(&names.iter().map(String::as_str).collect::<Vec<_>>()).await;
        let mut leases = match acquired {
            Ok(leases) => leases,
            Err(lease::LeaseError::Unavailable(failure))
                if self.outage.enter(&failure, &self.leases, &names[0]) =>
            {
                return self
                    .commit_unleased(&ops)
                    .await
                    .and_then(one)
                    .inspect(|_| count_one(Path::PostgresOnly));
            }
            Err(err) => return Err(err.into()),
        };
        let waited = leases.iter().map(Lease::waited).sum::<Duration>();
        tracing::Span::current().record("lease_wait_ms", waited.as_secs_f64() * 1e3);
        crate::failpoint::hit("transfer_leases_held");
        let started = std::time::Instant::now();
        let mut known = known_from_notes(&mut leases, &wallets_of(&ops));
        let mut held: Vec<&mut Lease> = leases.iter_mut().collect();
        let outcome = self.commit_under(&mut held, ops, &mut known).await;
        if outcome.is_err() {
            known.clear();
        }
        let result = outcome.and_then(one).inspect(|_| count_one(Path::Lease));
        tracing::Span::current().record("db_ms", started.elapsed().as_secs_f64() * 1e3);
        lease::release_all_with_notes(with_notes(leases, &known)).await;
        result
    }

    /// Commits `ops`, movements between wallets whose every lease is in `leases`: on one Postgres in
    /// the replica's rounds ([`Wallets::run_between`]); under Citus, and for a refund (which reads
    /// the refunds before it with its rows locked), in a transaction of their own
    /// ([`Wallets::attempt_between`]).
    /// `known`: the wallets as the holder knows them (a round then need not read them), which it
    /// learns again from what was written.
    pub(super) async fn commit_under(
        &self,
        leases: &mut [&mut Lease],
        ops: Vec<LegsOp>,
        known: &mut KnownWallets,
    ) -> Result<Vec<Result<Done, WalletError>>, WalletError> {
        let refunds = ops.iter().any(|op| op.refunds().is_some());
        match self.storage.of(&self.db).await? {
            Storage::OnePostgres if !refunds => {
                let wallets = wallets_of(&ops);
                self.run_between(leases, wallets, ops, known).await
            }
            _ => self.commit_retrying(leases, &ops, known).await,
        }
    }

    /// Runs `ops`, movements between `wallets` whose every lease is in `leases`, in the replica's
    /// rounds until they are written (see [`group::LegsJob`]); tries again after a fence lifted
    /// (up to [`MOST_LIFTS`] times a wallet), after a row found busy (for up to
    /// [`ROW_LOCK_TIMEOUT`]), and after a row found not as read while every lease is still ours
    /// (as often).
    pub(super) async fn run_between(
        &self,
        leases: &mut [&mut Lease],
        wallets: Vec<WalletId>,
        mut ops: Vec<LegsOp>,
        known: &mut KnownWallets,
    ) -> Result<Vec<Result<Done, WalletError>>, WalletError> {
        let mut lifted: HashMap<WalletId, u32> = HashMap::new();
        let mut read_again = 0;
        let busy_until = std::time::Instant::now() + ROW_LOCK_TIMEOUT;
        loop {
            if leases.iter().any(|lease| lease.is_lost()) {
                return Err(WalletError::LeaseLost);
            }
            let leased = |id: &WalletId| {
                let name = lease_name(id);
                let lease = leases.iter().find(|lease| lease.name() == name);
                group::Leased {
                    id: id.clone(),
                    fence: lease.map_or(0, |lease| lease.fence()),
                    written: lease.is_some_and(|lease| lease.fence_written()),
                    held: known.get(id).cloned(),
                }
            };
            let job = group::LegsJob { wallets: wallets.iter().map(leased).collect(), ops };
            match self.rounds.run_legs(job).await {
                group::LegsOutcome::Done { results, after } => {
                    learn(leases, known, &wallets, after);
                    return Ok(results);
                }
                group::LegsOutcome::FenceBehind { wallet, seen, ops: back } => {
                    lift_fence(leases, &mut lifted, wallet, seen).await?;
                    ops = back;
                }
                group::LegsOutcome::Again { busy: true, ops: back } => {
                    if std::time::Instant::now() >= busy_until {
                        return Err(WalletError::LockTimeout { waited: ROW_LOCK_TIMEOUT });
                    }
                    tokio::time::sleep(group::BUSY_PAUSE).await;
                    ops = back;
                }
                // A row not as the round read it, under our lease: only a holder we did not know
                // of writes so, one whose lease is gone (Redis lost it, or its TTL ran out) and who
                // has not noticed yet. Read again while every lease is still ours (token-checked),
                // a few times: that holder's writes stop once it notices.
                group::LegsOutcome::Again { busy: false, ops: back } => {
                    for wallet in &wallets {
                        known.remove(wallet);
                    }
                    read_again += 1;
                    if read_again > MOST_LIFTS {
                        return Err(WalletError::LeaseLost);
                    }
                    for lease in leases.iter() {
                        lease.refresh().await?;
                    }
                    ops = back;
                }
            }
        }
    }

    /// Commits `ops` in one transaction under `leases` ([`Wallets::attempt_between`]), given
    /// each lease's fence by name, until it commits; tries again after a fence lifted (up to
    /// [`MOST_LIFTS`] times a wallet) or a key found stored (once).
    pub(super) async fn commit_retrying(
        &self,
        leases: &mut [&mut Lease],
        ops: &[LegsOp],
        known: &mut KnownWallets,
    ) -> Result<Vec<Result<Done, WalletError>>, WalletError> {
        let mut lifted: HashMap<WalletId, u32> = HashMap::new();
        let mut looked_again = false;
        loop {
            if leases.iter().any(|lease| lease.is_lost()) {
                return Err(WalletError::LeaseLost);
            }
            let fences = Fences::Leased(
                leases
                    .iter()
                    .map(|lease| (lease.name().to_owned(), (lease.fence(), lease.fence_written())))
                    .collect(),
            );
            match self.attempt_between(ops, &fences).await {
                Ok((results, wallets, after)) => {
                    learn(leases, known, &wallets, after);
                    return Ok(results);
                }
                Err(Failure::Wallet(err)) => return Err(err),
                Err(Failure::FenceBehind { wallet, seen }) => {
                    lift_fence(leases, &mut lifted, wallet, seen).await?;
                }
                Err(Failure::KeyConflict) if !looked_again => looked_again = true,
                Err(Failure::KeyConflict) => {
                    return Err(WalletError::internal("an idempotency key conflicted twice"));
                }
            }
        }
    }

    /// Commits `ops` in one transaction under Postgres alone (a Redis outage): the rows' locks,
    /// held to the commit, stand in for the leases. Tries again once after a key found stored.
    pub(super) async fn commit_unleased(
        &self,
        ops: &[LegsOp],
    ) -> Result<Vec<Result<Done, WalletError>>, WalletError> {
        let mut looked_again = false;
        loop {
            match self.attempt_between(ops, &Fences::RowsOwn).await {
                Ok((results, _, _)) => return Ok(results),
                Err(Failure::Wallet(err)) => return Err(err),
                Err(Failure::FenceBehind { .. }) => {
                    return Err(WalletError::internal("a fence behind without a lease"));
                }
                Err(Failure::KeyConflict) if !looked_again => looked_again = true,
                Err(Failure::KeyConflict) => {
                    return Err(WalletError::internal("an idempotency key conflicted twice"));
                }
            }
        }
    }
}

/// A wallet id as stored, which was valid when it was written.
fn stored_id(id: &str) -> Result<WalletId, WalletError> {
    WalletId::parse(id).map_err(|_| WalletError::internal("a stored wallet id"))
}

impl Wallets {
    /// Movements between wallets in one transaction of their own (under Citus, under Postgres
    /// alone, and refunds): lock their wallets' rows in id order, check each fence, look up their
    /// keys, the holds they settle and what the refunds before them gave back, decide them as a
    /// round does ([`decide_between`], reading the expired holds it asks for), and write them with
    /// the rounds' one write, all or nothing.
    async fn attempt_between(&self, ops: &[LegsOp], fences: &Fences) -> Result<Attempted, Failure> {
        let wallets = wallets_of(ops);
        let ids: Vec<&str> = wallets.iter().map(WalletId::as_str).collect();
        // Every transfer's and movement's future holds this one, from its handler down.
        let mut tx = crate::ledger::begin(&self.db).await?;
        let locked = store::lock_wallets(&mut tx, &ids, ROW_LOCK_TIMEOUT).await?;
        let mut rows: Vec<(i64, Option<Held>)> = Vec::with_capacity(wallets.len());
        for wallet in &wallets {
            rows.push(match locked.get(wallet.as_str()) {
                Some(row) => (fences.for_row(wallet, row.fence)?, Some(Held::of_locked(row))),
                // A missing wallet is the answer of the movements that name it.
                None => (0, None),
            });
        }
        let legs_wallets: Vec<LegsWallet<'_>> = wallets
            .iter()
            .zip(&rows)
            .map(|(id, (fence, held))| LegsWallet { id, fence: *fence, held: held.as_ref() })
            .collect();
        let mut keys = FoundKeys::new();
        for op in ops {
            let Some((at, _)) = op.key() else { continue };
            let aliases = op.key_aliases();
            let scopes = std::iter::once((at.wallet, at.scope))
                .chain(aliases.iter().map(|(wallet, scope)| (wallet.as_str(), scope.as_str())));
            for (wallet, scope) in scopes {
                if let Some(found) = store::find_key(&mut tx, KeyRef { wallet, scope, ..at }).await? {
                    keys.insert((at.caller.to_owned(), scope.to_owned(), at.key.to_owned()), found);
                }
            }
        }
        let mut refunded = Refunds::new();
        for of in ops.iter().filter_map(LegsOp::refunds) {
            let by_wallet = match of {
                RefundOf::Payment { payment, .. } => {
                    let wallet = ids.first().copied().unwrap_or_default();
                    let sum = store::refunded_of_payment(&mut tx, wallet, *payment).await?;
                    HashMap::from([(wallet.to_owned(), sum)])
                }
                RefundOf::Transfer { transfer, .. } => {
                    let sum = store::refunded_of_transfer(&mut tx, *transfer).await?;
                    ids.iter().map(|id| ((*id).to_owned(), sum)).collect()
                }
                RefundOf::Movement { movement, .. } => {
                    store::refunded_of_movement(&mut tx, *movement).await?
                }
            };
            refunded.insert(of.id(), by_wallet);
        }
        let now = crate::ledger::entry_time();
        let hold_ids: Vec<Uuid> = ops.iter().flat_map(LegsOp::settles).collect();
        let mut expired_read: HashSet<String> = HashSet::new();
        let plan = loop {
            let expired_of: Vec<&str> = expired_read.iter().map(String::as_str).collect();
            let holds = crate::ledger::hold::read_holds(&mut tx, &ids, &hold_ids, &expired_of, now).await?;
            let known =
                Known { keys: &keys, holds: &holds, expired_read: &expired_read, refunded: &refunded, now };
            match decide_between(&legs_wallets, ops, known) {
                Ok(plan) => break plan,
                // Nothing is written yet: read those wallets' expired holds, and decide again.
                Err(short) => expired_read.extend(short),
            }
        };
        if plan.runs() {
            let mut write = store_round::GroupWrite::default();
            group::add_legs(&mut write, &legs_wallets, ops, &plan);
            self.round_settings.events_of(&mut write);
            let storage = self.storage.on(&mut tx).await?;
            let retention = self.round_settings.retention;
            match Box::pin(store_round::commit(&mut tx, storage, None, None, &write, now, retention)).await {
                Ok(committed) if committed.moved.len() == write.wallets.len() => {}
                // Its rows are locked by this transaction: only a bug lets one not match.
                Ok(_) => return Err(WalletError::LeaseLost.into()),
                Err(err) if err.is_key_conflict() => return Err(Failure::KeyConflict),
                Err(err) => return Err(err.into()),
            }
        }
        crate::failpoint::hit("before_commit");
        super::commit(tx).await?;
        crate::failpoint::hit("after_commit");
        let after =
            if plan.runs() { plan.after.clone() } else { rows.into_iter().map(|(_, held)| held).collect() };
        Ok((plan.results(Ok(true)), wallets, after))
    }
}

/// Lifts the fence of `wallet`'s lease (among `leases`) above `seen`, the fence its row has seen.
/// After one lift a lease's fence is above every fence the row has seen, unless another holder
/// raised it meanwhile: one whose lease is gone and who has not noticed yet (after a Redis
/// FLUSHALL, each holder of before writes under the fence it had). The lift is token-checked, so
/// while the lease is ours it lifts again; past [`MOST_LIFTS`] lifts of one wallet (`lifted`
/// counts them) the movement gives up, [`WalletError::LeaseLost`], nothing written.
async fn lift_fence(
    leases: &mut [&mut Lease],
    lifted: &mut HashMap<WalletId, u32>,
    wallet: WalletId,
    seen: i64,
) -> Result<(), WalletError> {
    let name = lease_name(&wallet);
    let Some(lease) = leases.iter_mut().find(|lease| lease.name() == name) else {
        return Err(WalletError::internal("a fence behind for a wallet without a lease"));
    };
    let lifts = lifted.entry(wallet).or_default();
    *lifts += 1;
    if *lifts > MOST_LIFTS {
        return Err(WalletError::LeaseLost);
    }
    lease.advance_fence(seen).await?;
    Ok(())
}

/// `wallets` as the notes of their `leases` describe them, each note taken (see
/// [`Held::from_note`]: one that does not fit the lease's fence says nothing).
pub(super) fn known_from_notes(leases: &mut [Lease], wallets: &[WalletId]) -> KnownWallets {
    let mut known = KnownWallets::new();
    for wallet in wallets {
        let name = lease_name(wallet);
        let Some(lease) = leases.iter_mut().find(|lease| lease.name() == name) else { continue };
        if let Some(held) = lease.take_note().and_then(|note| Held::from_note(&note, lease.fence())) {
            known.insert(wallet.clone(), held);
        }
    }
    known
}

/// `leases`, each with a note of its wallet as `known` has it for the next holder (none if not
/// known).
pub(super) fn with_notes(leases: Vec<Lease>, known: &KnownWallets) -> Vec<(Lease, Option<String>)> {
    let notes: HashMap<String, String> =
        known.iter().map(|(wallet, held)| (lease_name(wallet), held.to_note())).collect();
    leases
        .into_iter()
        .map(|lease| {
            let note = notes.get(lease.name()).cloned();
            (lease, note)
        })
        .collect()
}

/// Learns `wallets` as a write or read left them (`after`, in the same order; empty, or `None` for
/// a wallet: not known), and marks the leases whose fence a write carried: the holder then finds
/// its own fence on those rows (see [`FenceStanding::of_holder`]).
fn learn(
    leases: &mut [&mut Lease],
    known: &mut KnownWallets,
    wallets: &[WalletId],
    after: Vec<Option<Held>>,
) {
    let mut after = after.into_iter();
    for wallet in wallets {
        let Some(held) = after.next().flatten() else {
            known.remove(wallet);
            continue;
        };
        let name = lease_name(wallet);
        if let Some(lease) = leases.iter_mut().find(|lease| lease.name() == name)
            && held.fence == lease.fence()
        {
            lease.mark_fence_written();
        }
        known.insert(wallet.clone(), held);
    }
}

/// Counts how a transfer (or refund) of `kind` ended.
pub(super) fn count_outcome<T>(kind: &'static str, result: &Result<T, WalletError>) {
    let outcome = result.as_ref().map_or_else(WalletError::outcome, |_| "accepted");
    metrics::counter!(TRANSFERS.name, "kind" => kind, "outcome" => outcome).increment(1);
    super::instruments::count_refusal(result);
}
