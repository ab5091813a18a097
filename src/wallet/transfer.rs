//! Money between wallets, and back: transfers, movements of many legs, refunds of transfers, and
//! refunds of payments.
//!
//! Each takes the leases of every wallet whose balance changes (both, for a transfer) through
//! [`crate::lease::LeaseClient::acquire_all`], which takes them one at a time in wallet-id order with
//! a bounded wait each, so concurrent A→B and B→A transfers (and longer cycles) never deadlock.
//! Then, on one Postgres, a transfer or a movement rides the replica's rounds
//! ([`Wallets::run_between`], [`group::LegsJob`]): read, decided with everything else of the round
//! ([`super::decision::decide_between`]) and written by the round's one statement, every wallet
//! conditionally on its own lease's fence and the state read, all of them or none. Under Citus or
//! under Postgres alone they commit in a transaction of their own ([`Wallets::attempt_between`]):
//! it locks the wallet rows in id order (bounded by [`ROW_LOCK_TIMEOUT`]), checks that each row's
//! fence is below its lease's, looks up the keys and holds, decides with the same
//! `decide_between`, and writes with the rounds' write. A refund (which sums the refunds before
//! it) runs such a transaction too, deciding with [`decide_legs`]
//! ([`Wallets::write_locked`]). A stale holder of any lease writes nothing either way.
//!
//! A refund runs under the lease of every wallet whose money moves (the payer's, for a payment;
//! both, for a transfer) and sums the refunds so far in the same transaction, with those wallet
//! rows locked. Every refund of one payment or transfer locks the same rows, so two refunds racing
//! on two replicas take turns and never add up to more than what they refund.
//!
//! Who may: a transfer pays from a wallet its caller may use into one it may use or may pay into
//! ([`Access`]); a refund of a transfer is made by a caller that may use the wallet it paid into
//! (the money goes back where it came from, whoever owns that); a refund of a payment by a caller
//! that may use the paying wallet. To anyone else the wallet (or the transfer) does not exist.
//!
//! The known cost: on one replica, a wallet's queue worker may hold that wallet's lease while a
//! transfer waits for it, as another replica would (bounded by the lease wait); the worker hands
//! the lease over after its current batch, because the transfer marks it contended.

use super::decision::{
    FoundKeys, Held, HeldMovement, Known, Leg, LegsOp, LegsWallet, Links, decide_between, decide_legs,
    wallets_of,
};
use super::group;
use super::outage::{Path, count_one};
use super::{Access, Amount, Refusal, WalletError, WalletId, Wallets, lease_name};
use crate::domain::{self, FenceStanding, Funds, LegRefusal, Legs, Parties};
use crate::idempotency::{Keyed, Prior};
use crate::lease::{self, Lease};
use crate::ledger::group::{self as store_round, GroupWrite, KeyWrite, WalletWrite};
use crate::ledger::idempotency::StoredResponse;
use crate::ledger::storage::Storage;
use crate::ledger::transfer::{
    self as store, FoundMovement, FoundTransfer, LockedWallet, MovementRecord, Transfer,
};
use crate::ledger::{Entry, EntryKind, StoreError};
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
}

/// A refund of one of a wallet's payments: `amount`, or all that is left without it.
#[derive(Debug, Clone)]
pub struct Refund {
    pub wallet: WalletId,
    pub payment: Uuid,
    pub amount: Option<Amount>,
}

/// What one run under the leases does.
#[derive(Debug)]
pub(super) enum Work {
    /// A movement between wallets as the rounds decide it ([`decide_between`]): a transfer, or a
    /// movement of many legs placed, posted, captured or voided.
    Between(LegsOp),
    /// A refund, which sums the refunds before it in its own transaction.
    Refund(RefundWork),
}

/// A refund, as one transaction decides it ([`Wallets::attempt_refund`]).
#[derive(Debug)]
pub(super) enum RefundWork {
    /// Money back from a transfer's payee (`parties.from`) to its payer: `amount`, or all that is
    /// left of the `moved` that transfer `transfer` moved.
    OfTransfer {
        access: Access,
        parties: Parties,
        amount: Option<Amount>,
        transfer: Uuid,
        moved: i64,
        key: Option<Keyed<TransferOutcome>>,
    },
    /// Money back into a wallet, for one of its payments.
    OfPayment { access: Access, refund: Refund, key: Option<Keyed<RefundOutcome>> },
}

/// What a committed [`Work`] wrote.
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
}

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

/// The fences a transaction writes its wallets with.
pub(super) enum Fences {
    /// Under leases: each lease's fence, by lease name. A row must not have seen it.
    Leased(HashMap<String, i64>),
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
                let fence = by_lease.get(&lease_name(id)).copied().unwrap_or_default();
                match FenceStanding::of(fence, row_fence) {
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

/// One transaction under a set of leases (or under Postgres alone): what
/// [`Wallets::commit_retrying`] and [`Wallets::commit_unleased`] run until it commits.
pub(super) trait Attempt: Sync {
    type Output: Send;

    fn attempt(
        &self,
        wallets: &Wallets,
        fences: &Fences,
    ) -> impl Future<Output = Result<Self::Output, Failure>> + Send;
}

impl Attempt for Work {
    type Output = Done;

    async fn attempt(&self, wallets: &Wallets, fences: &Fences) -> Result<Done, Failure> {
        match self {
            Work::Between(op) => {
                let mut results = wallets.attempt_between(std::slice::from_ref(op), fences).await?;
                let result = results.pop().unwrap_or_else(|| Err(WalletError::internal("no result")));
                result.map_err(Failure::Wallet)
            }
            Work::Refund(refund) => wallets.attempt_refund(refund, fences).await,
        }
    }
}

impl RefundWork {
    /// The wallets whose balances change.
    fn wallets(&self) -> Vec<&WalletId> {
        match self {
            RefundWork::OfTransfer { parties, .. } => vec![&parties.from, &parties.to],
            RefundWork::OfPayment { refund, .. } => vec![&refund.wallet],
        }
    }

    /// Whether the caller may move the money of `wallet`, owned by `owner` (see the module doc):
    /// the refunding wallet must be the caller's; the money goes back where it came from.
    fn may_touch(&self, wallet: &WalletId, owner: Option<&str>) -> bool {
        match self {
            RefundWork::OfTransfer { access, parties, .. } if *wallet == parties.from => {
                access.may_use(owner)
            }
            RefundWork::OfTransfer { .. } => true,
            RefundWork::OfPayment { access, .. } => access.may_use(owner),
        }
    }

    /// The answer when a wallet does not exist, or is not the caller's to touch.
    fn missing(&self) -> WalletError {
        match self {
            RefundWork::OfTransfer { .. } => WalletError::TransferNotFound,
            RefundWork::OfPayment { .. } => WalletError::NotFound,
        }
    }

    /// The key's prior use, if it had one.
    async fn prior(&self, tx: &mut sqlx::PgConnection) -> Result<Option<Prior>, StoreError> {
        let (at, fingerprint) = match self {
            RefundWork::OfTransfer { key: Some(key), .. } => (key.at(), &key.fingerprint),
            RefundWork::OfPayment { key: Some(key), .. } => (key.at(), &key.fingerprint),
            _ => return Ok(None),
        };
        Ok(store::find_key(tx, at).await?.map(|found| Prior::of(&found, fingerprint)))
    }
}

impl Work {
    /// The wallets whose balances change, whose leases it runs under.
    fn wallets(&self) -> Vec<&WalletId> {
        match self {
            Work::Between(op) => op.legs().into_iter().map(|(wallet, _, _)| wallet).collect(),
            Work::Refund(refund) => refund.wallets(),
        }
    }

    /// The metric's `kind` label.
    fn kind(&self) -> &'static str {
        match self {
            Work::Refund(RefundWork::OfTransfer { .. }) => "transfer_refund",
            Work::Refund(RefundWork::OfPayment { .. }) => "payment_refund",
            Work::Between(LegsOp::Transfer { .. }) => "transfer",
            Work::Between(LegsOp::Movement { hold: None, .. }) => "movement",
            Work::Between(LegsOp::Movement { hold: Some(_), .. }) => "movement_hold",
            Work::Between(LegsOp::Settle { capture: true, .. }) => "movement_capture",
            Work::Between(LegsOp::Settle { capture: false, .. }) => "movement_void",
        }
    }
}

/// Describes the metrics this module records, and registers the common ones at zero.
pub(super) fn describe_metrics() {
    metrics::describe_counter!(
        "walletlock_transfers_total",
        "Transfers, movements of many legs, refunds of transfers and refunds of payments, by kind and outcome."
    );
    metrics::describe_histogram!(
        crate::telemetry::metrics::PAYEE_BATCH,
        "Transfers into one payee per transaction (under the payee's lease)."
    );
    metrics::describe_counter!(
        "walletlock_payee_batch_alone_total",
        "Transfers a payee's worker sent on alone: their payer's lease was busy (or their key was twice in the batch)."
    );
    metrics::counter!("walletlock_payee_batch_alone_total").absolute(0);
    for kind in [
        "transfer",
        "movement",
        "movement_hold",
        "movement_capture",
        "movement_void",
        "transfer_refund",
        "payment_refund",
    ] {
        for outcome in ["accepted", "insufficient_funds", "lock_timeout", "lease_lost", "unavailable"] {
            metrics::counter!("walletlock_transfers_total", "kind" => kind, "outcome" => outcome).absolute(0);
        }
    }
}

impl Wallets {
    /// Moves money from one wallet to another: both legs in one transaction, under both leases.
    /// With a key, a key used before answers [`WalletError::AlreadyRan`] and moves nothing; a new
    /// key's outcome is stored in the transaction that moves the money.
    pub async fn transfer(
        &self,
        access: &Access,
        between: Between,
        key: Option<Keyed<TransferOutcome>>,
    ) -> Result<Transfer, WalletError> {
        if self.strategy == super::Strategy::Queue {
            return self.transfer_queued(access, between, key).await;
        }
        let Between { parties, amount, reference } = between;
        let op = LegsOp::Transfer { access: access.clone(), parties, amount, reference, key };
        self.run_work(Work::Between(op)).await?.into_transfer()
    }

    /// Moves `amount` (without it: all not yet refunded) of transfer `id` back, from its `to` to its
    /// `from`, as a transfer of its own that names it. Its refunds never add up to more than it
    /// ([`Refusal::RefundExceedsPayment`]).
    pub async fn refund_transfer(
        &self,
        access: &Access,
        id: Uuid,
        amount: Option<Amount>,
        key: Option<Keyed<TransferOutcome>>,
    ) -> Result<Transfer, WalletError> {
        // Counted here too: a refund refused before it runs (no such transfer, or not the
        // caller's) is a refund's outcome like any other.
        let original = self
            .find_transfer(access, id)
            .await
            .inspect_err(|err| count_outcome::<()>("transfer_refund", &Err(err.clone())))?
            .transfer;
        let wallet = |id: &str| WalletId::parse(id).map_err(|_| WalletError::internal("a stored wallet id"));
        let parties = Parties { from: wallet(&original.to)?, to: wallet(&original.from)? };
        let refund = RefundWork::OfTransfer {
            access: access.clone(),
            parties,
            amount,
            transfer: original.id,
            moved: original.amount,
            key,
        };
        self.run_work(Work::Refund(refund)).await?.into_transfer()
    }

    /// Puts money back into a wallet for one of its payments: a `refund` entry that names the
    /// payment. Its refunds never add up to more than it ([`Refusal::RefundExceedsPayment`]).
    pub async fn refund_payment(
        &self,
        access: &Access,
        refund: Refund,
        key: Option<Keyed<RefundOutcome>>,
    ) -> Result<Entry, WalletError> {
        match self
            .run_work(Work::Refund(RefundWork::OfPayment { access: access.clone(), refund, key }))
            .await?
        {
            Done::Entry(entry) => Ok(entry),
            Done::Transfer(_) | Done::Movement(_) => {
                Err(WalletError::internal("a payment refund wrote something else"))
            }
        }
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
        hold: Option<domain::HoldLife>,
        key: Option<Keyed<MovementRecordOutcome>>,
    ) -> Result<MovementRecord, WalletError> {
        let op = LegsOp::Movement { access: access.clone(), legs, reference, hold, key };
        self.run_work(Work::Between(op)).await?.into_movement()
    }

    /// Captures (`capture`) or voids held movement `id` as a whole, under the leases of all its
    /// wallets: every leg's entry and every hold captured, or every hold released; refused with
    /// nothing changed once any of its holds is settled, and `hold_expired` past its expiry.
    pub async fn settle_movement(
        &self,
        access: &Access,
        id: Uuid,
        capture: bool,
        key: Option<Keyed<MovementRecordOutcome>>,
    ) -> Result<MovementRecord, WalletError> {
        let found = self.find_movement(access, id).await?;
        let held = HeldMovement::of(found).ok_or(WalletError::MovementNotHeld)?;
        let op = LegsOp::Settle { access: access.clone(), held: Box::new(held), capture, key };
        self.run_work(Work::Between(op)).await?.into_movement()
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

    /// Runs `work` to its end (even if the client hangs up) and counts its outcome.
    async fn run_work(&self, work: Work) -> Result<Done, WalletError> {
        let kind = work.kind();
        let this = self.clone();
        let result = self.run_to_end(None, async move { this.under_leases(work).await }).await;
        count_outcome(kind, &result);
        result
    }

    /// Takes the leases of `work`'s wallets, commits it, releases them; or, in a Redis outage,
    /// commits it under Postgres alone.
    pub(super) async fn under_leases(&self, work: Work) -> Result<Done, WalletError> {
        if self.outage.is_active() {
            return self.commit_unleased(&work).await.inspect(|_| count_one(Path::PostgresOnly));
        }
        let names: Vec<String> = work.wallets().into_iter().map(lease_name).collect();
        let acquired = self.leases.acquire_all(&names.iter().map(String::as_str).collect::<Vec<_>>()).await;
        let mut leases = match acquired {
            Ok(leases) => leases,
            Err(lease::LeaseError::Unavailable(failure))
                if self.outage.enter(&failure, &self.leases, &names[0]) =>
            {
                return self.commit_unleased(&work).await.inspect(|_| count_one(Path::PostgresOnly));
            }
            Err(err) => return Err(err.into()),
        };
        let waited = leases.iter().map(Lease::waited).sum::<Duration>();
        tracing::Span::current().record("lease_wait_ms", waited.as_secs_f64() * 1e3);
        crate::failpoint::hit("transfer_leases_held");
        let started = std::time::Instant::now();
        let mut held: Vec<&mut Lease> = leases.iter_mut().collect();
        // On one Postgres a transfer or movement rides the replica's rounds; a refund, and every
        // movement under Citus, commits in a transaction of its own.
        let result = match (self.storage.of(&self.db).await, work) {
            (Ok(Storage::OnePostgres), Work::Between(op)) => {
                let ops = vec![op];
                let wallets = wallets_of(&ops);
                self.run_between(&mut held, wallets, ops).await.and_then(|results| {
                    results.into_iter().next().unwrap_or_else(|| Err(WalletError::internal("no result")))
                })
            }
            (Ok(_), work) => self.commit_retrying(&mut held, &work).await,
            (Err(err), _) => Err(err.into()),
        }
        .inspect(|_| count_one(Path::Lease));
        tracing::Span::current().record("db_ms", started.elapsed().as_secs_f64() * 1e3);
        lease::release_all(leases).await;
        result
    }

    /// Runs `ops`, movements between `wallets` whose every lease is in `leases`, in the replica's
    /// rounds until they are written (see [`group::LegsJob`]); tries again after a fence lifted
    /// (once per wallet), after a row found busy (for up to [`ROW_LOCK_TIMEOUT`]), and once after
    /// a row found not as read.
    pub(super) async fn run_between(
        &self,
        leases: &mut [&mut Lease],
        wallets: Vec<WalletId>,
        mut ops: Vec<LegsOp>,
    ) -> Result<Vec<Result<Done, WalletError>>, WalletError> {
        let mut resynced: HashSet<WalletId> = HashSet::new();
        let mut read_again = false;
        let busy_until = std::time::Instant::now() + ROW_LOCK_TIMEOUT;
        loop {
            if leases.iter().any(|lease| lease.is_lost()) {
                return Err(WalletError::LeaseLost);
            }
            let fence_of = |id: &WalletId| {
                let name = lease_name(id);
                leases
                    .iter()
                    .find(|lease| lease.name() == name)
                    .map(|lease| lease.fence())
                    .unwrap_or_default()
            };
            let job = group::LegsJob {
                wallets: wallets.iter().map(|id| (id.clone(), fence_of(id))).collect(),
                ops,
            };
            match self.rounds.run_legs(job).await {
                group::LegsOutcome::Done(results) => return Ok(results),
                group::LegsOutcome::FenceBehind { wallet, seen, ops: back } => {
                    lift_fence(leases, &mut resynced, wallet, seen).await?;
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
                // of writes so. Read once more; a second time, the lease is not ours.
                group::LegsOutcome::Again { busy: false, .. } if read_again => {
                    return Err(WalletError::LeaseLost);
                }
                group::LegsOutcome::Again { busy: false, ops: back } => {
                    read_again = true;
                    ops = back;
                }
            }
        }
    }

    /// Runs `attempt` (one transaction) under `leases`, given each lease's fence by name, until it
    /// commits; tries again after a fence lifted (once per wallet) or a key found stored (once).
    pub(super) async fn commit_retrying<A: Attempt>(
        &self,
        leases: &mut [&mut Lease],
        attempt: &A,
    ) -> Result<A::Output, WalletError> {
        let mut resynced: HashSet<WalletId> = HashSet::new();
        let mut looked_again = false;
        loop {
            if leases.iter().any(|lease| lease.is_lost()) {
                return Err(WalletError::LeaseLost);
            }
            let fences =
                Fences::Leased(leases.iter().map(|lease| (lease.name().to_owned(), lease.fence())).collect());
            match attempt.attempt(self, &fences).await {
                Ok(done) => return Ok(done),
                Err(Failure::Wallet(err)) => return Err(err),
                Err(Failure::FenceBehind { wallet, seen }) => {
                    lift_fence(leases, &mut resynced, wallet, seen).await?;
                }
                Err(Failure::KeyConflict) if !looked_again => looked_again = true,
                Err(Failure::KeyConflict) => {
                    return Err(WalletError::internal("an idempotency key conflicted twice"));
                }
            }
        }
    }

    /// Runs `attempt` under Postgres alone (a Redis outage): the rows' locks, held to the commit,
    /// stand in for the leases. Tries again once after a key found stored.
    pub(super) async fn commit_unleased<A: Attempt>(&self, attempt: &A) -> Result<A::Output, WalletError> {
        let mut looked_again = false;
        loop {
            match attempt.attempt(self, &Fences::RowsOwn).await {
                Ok(done) => return Ok(done),
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

    /// A refund in one transaction: lock the wallets in id order, check each fence, look the key
    /// up, sum the refunds before it, decide, write, store the response, commit.
    async fn attempt_refund(&self, work: &RefundWork, fences: &Fences) -> Result<Done, Failure> {
        let wallets = work.wallets();
        let ids: Vec<&str> = wallets.iter().map(|id| id.as_str()).collect();
        let mut tx = self.db.begin().await?;
        let mut locked = store::lock_wallets(&mut tx, &ids, ROW_LOCK_TIMEOUT).await?;
        // The fence each wallet's write carries, by wallet id.
        let mut fence_by_id: HashMap<&str, i64> = HashMap::new();
        for wallet in &wallets {
            let row = locked.get(wallet.as_str()).filter(|row| work.may_touch(wallet, row.owner.as_deref()));
            let Some(row) = row else { return Err(work.missing().into()) };
            fence_by_id.insert(wallet.as_str(), fences.for_row(wallet, row.fence)?);
        }
        if let Some(prior) = work.prior(&mut tx).await? {
            return Err(WalletError::AlreadyRan(prior).into());
        }
        let now = crate::ledger::entry_time();
        let fence_of = |id: &WalletId| fence_by_id.get(id.as_str()).copied().unwrap_or_default();
        let outcome: Result<Done, WalletError> = match work {
            RefundWork::OfTransfer { parties, amount, transfer, moved, key, .. } => {
                let refunded = store::refunded_of_transfer(&mut tx, *transfer).await?;
                let amount = domain::refund_amount(*amount, *moved, refunded);
                if let (Ok(amount), Some(payer)) = (amount, locked.get_mut(parties.from.as_str())) {
                    release_if_short(&mut tx, payer, &parties.from, amount, now).await?;
                }
                let from = (&parties.from, &locked[parties.from.as_str()], fence_of(&parties.from));
                let to = (&parties.to, &locked[parties.to.as_str()], fence_of(&parties.to));
                let outcome =
                    amount.and_then(|amount| plan_transfer(from, to, amount, None, Some(*transfer), now));
                let entries: Vec<&Entry> =
                    outcome.as_ref().map(|t| vec![&t.from_entry, &t.to_entry]).unwrap_or_default();
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let keys =
                    key_write(&parties.from, key.as_ref(), response.as_ref(), entries.first().map(|e| e.id));
                let transfers = outcome.as_ref().into_iter().collect();
                let write = GroupWrite { entries, keys, transfers, ..Default::default() };
                self.write_locked(&mut tx, &[from, to], write, now).await?;
                outcome.map(|transfer| Done::Transfer(Box::new(transfer))).map_err(WalletError::Refused)
            }
            RefundWork::OfPayment { refund, key, .. } => {
                let wallet = &locked[refund.wallet.as_str()];
                let Some((payment, refunded)) =
                    store::find_payment(&mut tx, refund.wallet.as_str(), refund.payment).await?
                else {
                    return Err(WalletError::PaymentNotFound.into());
                };
                let side: Side<'_> = (&refund.wallet, wallet, fence_of(&refund.wallet));
                let outcome =
                    domain::refund_amount(refund.amount, payment.amount, refunded).and_then(|amount| {
                        let links =
                            Links { movement: None, reference: None, refund_of: Some(payment.id), now };
                        let leg = leg_of(side, amount, false);
                        let mut entries = decide_legs(&[leg], (EntryKind::Refund, EntryKind::Refund), links)
                            .map_err(|(_, refusal)| refusal)?;
                        Ok(entries.remove(0))
                    });
                let entries: Vec<&Entry> = outcome.as_ref().map(|entry| vec![entry]).unwrap_or_default();
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let keys =
                    key_write(&refund.wallet, key.as_ref(), response.as_ref(), entries.first().map(|e| e.id));
                let write = GroupWrite { entries, keys, ..Default::default() };
                self.write_locked(&mut tx, &[side], write, now).await?;
                outcome.map(Done::Entry).map_err(WalletError::Refused)
            }
        };
        crate::failpoint::hit("before_commit");
        super::commit(tx).await?;
        crate::failpoint::hit("after_commit");
        outcome.map_err(Failure::Wallet)
    }
}

impl Wallets {
    /// Movements between wallets in one transaction of their own (under Citus, or under Postgres
    /// alone): lock their wallets' rows in id order, check each fence, look up their keys and the
    /// holds they settle, decide them as a round does ([`decide_between`], reading the expired
    /// holds it asks for), and write them with the rounds' one write, all or nothing.
    async fn attempt_between(
        &self,
        ops: &[LegsOp],
        fences: &Fences,
    ) -> Result<Vec<Result<Done, WalletError>>, Failure> {
        let wallets = wallets_of(ops);
        let ids: Vec<&str> = wallets.iter().map(WalletId::as_str).collect();
        let mut tx = self.db.begin().await?;
        let locked = store::lock_wallets(&mut tx, &ids, ROW_LOCK_TIMEOUT).await?;
        let mut rows: Vec<(i64, Option<Held>)> = Vec::with_capacity(wallets.len());
        for wallet in &wallets {
            rows.push(match locked.get(wallet.as_str()) {
                Some(row) => (fences.for_row(wallet, row.fence)?, Some(held_of(row))),
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
        for (at, _) in ops.iter().filter_map(LegsOp::key) {
            if let Some(found) = store::find_key(&mut tx, at).await? {
                keys.insert((at.caller.to_owned(), at.scope.to_owned(), at.key.to_owned()), found);
            }
        }
        let now = crate::ledger::entry_time();
        let hold_ids: Vec<Uuid> = ops.iter().flat_map(LegsOp::settles).collect();
        let mut expired_read: HashSet<String> = HashSet::new();
        let (plan, holds) = loop {
            let expired_of: Vec<&str> = expired_read.iter().map(String::as_str).collect();
            let holds = crate::ledger::hold::read_holds(&mut tx, &ids, &hold_ids, &expired_of, now).await?;
            let known = Known { keys: &keys, holds: &holds, expired_read: &expired_read, now };
            match decide_between(&legs_wallets, ops, known) {
                Ok(plan) => break (plan, holds),
                Err(short) => expired_read.extend(short),
            }
        };
        drop(holds);
        if plan.runs() {
            let mut write = GroupWrite::default();
            group::add_legs(&mut write, &legs_wallets, ops, &plan);
            let storage = self.storage.on(&mut tx).await?;
            let retention = self.keys.settings().retention;
            match Box::pin(store_round::commit(&mut tx, storage, &write, now, retention)).await {
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
        Ok(plan.results(Ok(true)))
    }
}

/// A wallet row as locked, as the decision holds it.
fn held_of(row: &LockedWallet) -> Held {
    Held {
        balance: row.balance,
        held: row.held,
        version: row.version,
        fence: row.fence,
        owner: row.owner.as_deref().map(std::sync::Arc::from),
        from_note: false,
    }
}

/// Lifts the fence of `wallet`'s lease (among `leases`) above `seen`, the fence its row has seen.
/// After one lift a lease's fence is above every fence the row has seen, unless another holder
/// raised it meanwhile, which only a lost lease lets happen: a second lift for one wallet
/// (`resynced` holds those lifted) is [`WalletError::LeaseLost`].
async fn lift_fence(
    leases: &mut [&mut Lease],
    resynced: &mut HashSet<WalletId>,
    wallet: WalletId,
    seen: i64,
) -> Result<(), WalletError> {
    let name = lease_name(&wallet);
    let Some(lease) = leases.iter_mut().find(|lease| lease.name() == name) else {
        return Err(WalletError::internal("a fence behind for a wallet without a lease"));
    };
    if !resynced.insert(wallet) {
        return Err(WalletError::LeaseLost);
    }
    lease.advance_fence(seen).await?;
    Ok(())
}

pub(super) type Side<'a> = (&'a WalletId, &'a LockedWallet, i64);

/// Before a payer `row` short of `amount` while something of it is held is refused, releases its
/// holds that expired by `now` (in the caller's transaction, which has the row locked under the
/// payer's lease and writes it fenced): they may cover it, and only a write that releases them may
/// count on that.
pub(super) async fn release_if_short(
    tx: &mut sqlx::PgConnection,
    row: &mut LockedWallet,
    id: &WalletId,
    amount: Amount,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), Failure> {
    let funds = Funds { balance: row.balance, held: row.held };
    if row.held > 0 && funds.available() < amount.get() {
        row.held = crate::ledger::hold::release_expired(tx, id.as_str(), now).await?;
    }
    Ok(())
}

/// Counts how a transfer (or refund) of `kind` ended.
pub(super) fn count_outcome<T>(kind: &'static str, result: &Result<T, WalletError>) {
    let outcome = result.as_ref().map_or_else(WalletError::outcome, |_| "accepted");
    metrics::counter!("walletlock_transfers_total", "kind" => kind, "outcome" => outcome).increment(1);
    if matches!(result, Err(WalletError::LeaseLost)) {
        metrics::counter!("walletlock_fence_refusals_total").increment(1);
    }
}

/// The leg of `amount` out of (`debit`) or into the wallet of `side`.
pub(super) fn leg_of<'a>((wallet, row, fence): Side<'a>, amount: Amount, debit: bool) -> Leg<'a> {
    Leg {
        wallet,
        funds: Funds { balance: row.balance, held: row.held },
        version: row.version,
        fence,
        amount,
        debit,
    }
}

/// Decides a transfer of `amount` from `from` to `to` (each: its id, its locked row, its lease's
/// fence): a movement of two legs ([`decide_legs`]).
pub(super) fn plan_transfer(
    from: Side<'_>,
    to: Side<'_>,
    amount: Amount,
    reference: Option<String>,
    refund_of: Option<Uuid>,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Transfer, Refusal> {
    let id = Uuid::new_v4();
    let links = Links { movement: Some(id), reference: reference.as_deref(), refund_of: None, now };
    let legs = [leg_of(from, amount, true), leg_of(to, amount, false)];
    let [from_entry, to_entry]: [Entry; 2] =
        decide_legs(&legs, (EntryKind::TransferOut, EntryKind::TransferIn), links)
            .map_err(|(_, refusal)| refusal)?
            .try_into()
            .expect("two legs, two entries");
    Ok(Transfer {
        id,
        from: from.0.as_str().to_owned(),
        to: to.0.as_str().to_owned(),
        amount: amount.get(),
        reference,
        refund_of,
        from_entry,
        to_entry,
        created_at: now,
    })
}

/// The response to store for `key`, if the request had one, with the wallet whose write it
/// depends on (`wallet`, which the write must name) and the entry it reports.
pub(super) fn key_write<'a, T>(
    wallet: &'a WalletId,
    key: Option<&'a Keyed<T>>,
    response: Option<&'a StoredResponse>,
    entry_id: Option<Uuid>,
) -> Vec<KeyWrite<'a>> {
    match (key, response) {
        (Some(key), Some(response)) => vec![KeyWrite {
            wallet_id: wallet.as_str(),
            at: key.at(),
            fingerprint: &key.fingerprint,
            response,
            entry_id,
        }],
        _ => Vec::new(),
    }
}

impl Wallets {
    /// Writes, in the caller's transaction, every wallet of `sides` (their rows locked by it) as
    /// the last of `write`'s entries on it leaves it, or as locked (a refusal's stored response
    /// depends on a wallet written), with what `write` brings (entries, keys, transfers,
    /// movements; its wallets are filled in here): all or nothing, by the one write the rounds use
    /// ([`store_round::commit`]), its compare-and-set included. Nothing to write, nothing written.
    /// A wallet that does not match was written by someone who did not hold its row's lock: a
    /// bug or a holder we did not know of, so the lease is lost and the caller rolls back. A key
    /// stored meanwhile is [`Failure::KeyConflict`].
    pub(super) async fn write_locked(
        &self,
        tx: &mut sqlx::PgConnection,
        sides: &[Side<'_>],
        mut write: GroupWrite<'_>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), Failure> {
        if write.entries.is_empty() && write.keys.is_empty() {
            return Ok(());
        }
        let entries = &write.entries;
        write.wallets = sides
            .iter()
            .map(|&(id, row, fence)| {
                let last = entries.iter().rev().find(|entry| entry.wallet_id == id.as_str());
                WalletWrite {
                    id: id.as_str(),
                    group: 0,
                    fence,
                    read_fence: row.fence,
                    read_version: row.version,
                    read_balance: row.balance,
                    read_held: row.held,
                    owner: row.owner.as_deref(),
                    balance: last.map_or(row.balance, |entry| entry.balance),
                    held: row.held,
                    version: last.map_or(row.version, |entry| entry.version),
                }
            })
            .collect();
        let storage = self.storage.on(tx).await?;
        let retention = self.keys.settings().retention;
        match Box::pin(store_round::commit(tx, storage, &write, now, retention)).await {
            Ok(committed) if committed.moved.len() == write.wallets.len() => Ok(()),
            Ok(_) => Err(WalletError::LeaseLost.into()),
            Err(err) if err.is_key_conflict() => Err(Failure::KeyConflict),
            Err(err) => Err(err.into()),
        }
    }
}
