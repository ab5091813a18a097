//! Why a wallet operation did not happen, and how the failures of the layers below map to it.

use super::{Field, Refusal, WalletId, lease_name, transfer};
use crate::domain::LimitKind;
use crate::idempotency::Prior;
use crate::lease::LeaseError;
use crate::ledger::StoreError;
use std::sync::Arc;
use std::time::Duration;

/// The cause of a failure, shared by every request of a round or batch that it failed.
pub type SharedError = Arc<dyn std::error::Error + Send + Sync>;

/// Why a wallet operation did not happen. Every variant but [`WalletError::OutcomeUnknown`] means
/// nothing was applied. Cloning shares the cause: one failed round answers many requests.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WalletError {
    #[error("wallet not found")]
    NotFound,
    /// One of a transfer's wallets does not exist; `field` says which ([`Field::From`] or
    /// [`Field::To`]).
    #[error("the {} wallet does not exist", .field.name())]
    PartyNotFound { field: Field },
    /// The wallet opened after the instant its history was asked about.
    #[error("the wallet opened after that instant")]
    NotOpenYet,
    #[error("transfer not found")]
    TransferNotFound,
    /// No movement has this id (or none of its wallets is one the caller may use).
    #[error("movement not found")]
    MovementNotFound,
    /// A movement's leg names a wallet that does not exist, or that the caller may not take money
    /// from (a debit) or pay into (a credit); `leg` counts from 0 in the request's order.
    #[error("the wallet of leg {leg} does not exist")]
    LegNotFound { leg: usize },
    /// A movement refused at one of its legs; nothing of it was applied.
    #[error("leg {leg}: {refusal}")]
    LegRefused { leg: usize, refusal: Refusal },
    /// No `pay` entry of the wallet has this id.
    #[error("payment not found")]
    PaymentNotFound,
    /// No hold has this id (or its wallet is one the caller may not use).
    #[error("hold not found")]
    HoldNotFound,
    /// The movement was not placed as a hold: there is nothing to capture or void.
    #[error("the movement was not placed as a hold")]
    MovementNotHeld,
    /// The movement was placed as a hold and not captured: it moved no money, so there is nothing
    /// to refund (void it instead, while it is held).
    #[error("the movement moved no money: it was not captured")]
    MovementNotCaptured,
    /// The hold reserves a leg of held movement `movement`: it is captured or voided with it.
    #[error("the hold is a leg of movement {movement}")]
    HoldOfMovement { movement: uuid::Uuid },
    /// No webhook endpoint of the caller's has this id.
    #[error("webhook endpoint not found")]
    EndpointNotFound,
    /// A webhook endpoint's URL the replicas may not call, and why.
    #[error("the endpoint's URL is refused: {0}")]
    EndpointRefused(String),
    #[error("wallet already exists")]
    Exists,
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Another holder kept the wallet's lease for the whole wait.
    #[error("the wallet's lease was not obtained within {waited:?}")]
    LockTimeout { waited: Duration },
    /// The wallet already had as many movements queued on this replica as its queue holds
    /// (`WALLET_QUEUE_LIMIT`): this one was not queued, nothing was applied.
    #[error("the wallet's queue on this replica is full; nothing was applied")]
    Overloaded,
    /// Our lease expired or passed to another holder before the commit, which was refused.
    #[error("the wallet's lease was lost before the commit; nothing was applied")]
    LeaseLost,
    /// The wallet's row has seen the largest fence there is: no lease can write it until an
    /// operator resets its fence (docs/operating/fence-resets.md).
    #[error("the wallet's fence is at its top; an operator must reset it")]
    FenceExhausted(#[source] Arc<LeaseError>),
    /// The lease's fence is more than [`crate::domain::MAX_FENCE_STEP`] above the fence of the
    /// wallet's row: the wallet's fence counter in Redis was moved from outside. Nothing was
    /// written, so the row keeps its fences; an operator deletes the counter
    /// (docs/operating/fence-resets.md), and the next lease lifts it above the row's.
    #[error("the lease's fence {fence} is implausibly far above the wallet's {seen}; nothing was applied")]
    FenceImplausible { fence: i64, seen: i64 },
    /// Redis or Postgres could not be reached in time.
    #[error("{dependency} unavailable")]
    Unavailable { dependency: &'static str, source: SharedError },
    /// The connection to Postgres failed while a commit was in flight: it may or may not have
    /// happened. The only variant that does not mean "nothing was applied"; a retry with the same
    /// idempotency key learns which.
    #[error("the commit's outcome is unknown")]
    OutcomeUnknown(#[source] Arc<sqlx::Error>),
    /// The request's idempotency key was taken over by a retry while this request ran (it was
    /// presumed dead); the retry runs it, this one applied nothing.
    #[error("the idempotency key was taken over by another request; nothing was applied")]
    KeyTakenOver,
    /// The request's idempotency key was used before: it did not run again.
    #[error("the idempotency key was used before; nothing was applied again")]
    AlreadyRan(Prior),
    #[error(transparent)]
    Internal(SharedError),
}

impl WalletError {
    /// A bug, described by `what`.
    pub fn internal(what: &str) -> Self {
        WalletError::Internal(Arc::from(Box::<dyn std::error::Error + Send + Sync>::from(what)))
    }

    /// [`WalletError::FenceImplausible`] for wallet `id`, logged: it needs an operator.
    pub(crate) fn fence_implausible(id: &WalletId, fence: i64, seen: i64) -> Self {
        tracing::error!(
            wallet = %id,
            fence,
            seen,
            lease = %lease_name(id),
            "a lease's fence is implausibly far above the wallet's: its Redis fence counter was moved from outside; delete the counter"
        );
        WalletError::FenceImplausible { fence, seen }
    }

    /// The `outcome` label of `walletlock_movements_total`.
    /// The limit a debit refused `limit_exceeded` would have passed.
    pub(super) fn limit_passed(&self) -> Option<LimitKind> {
        match self {
            WalletError::Refused(Refusal::LimitExceeded { limit, .. })
            | WalletError::LegRefused { refusal: Refusal::LimitExceeded { limit, .. }, .. } => Some(*limit),
            _ => None,
        }
    }

    pub(super) fn outcome(&self) -> &'static str {
        match self {
            WalletError::NotFound | WalletError::PartyNotFound { .. } | WalletError::NotOpenYet => {
                "not_found"
            }
            WalletError::TransferNotFound
            | WalletError::PaymentNotFound
            | WalletError::HoldNotFound
            | WalletError::MovementNotFound
            | WalletError::EndpointNotFound
            | WalletError::LegNotFound { .. } => "not_found",
            WalletError::EndpointRefused(_) => "invalid",
            WalletError::LegRefused { refusal, .. } => refusal.code(),
            WalletError::Exists => "exists",
            WalletError::MovementNotHeld | WalletError::HoldOfMovement { .. } => "not_held_alone",
            WalletError::MovementNotCaptured => "not_captured",
            WalletError::Refused(refusal) => refusal.code(),
            WalletError::LockTimeout { .. } => "lock_timeout",
            WalletError::Overloaded => "overloaded",
            WalletError::LeaseLost => "lease_lost",
            WalletError::FenceExhausted(_) => "fence_exhausted",
            WalletError::FenceImplausible { .. } => "fence_implausible",
            WalletError::Unavailable { .. } => "unavailable",
            WalletError::OutcomeUnknown(_) => "unknown",
            WalletError::KeyTakenOver => "key_taken_over",
            WalletError::AlreadyRan(Prior::Replay(_)) => "replayed",
            WalletError::AlreadyRan(_) => "key_conflict",
            WalletError::Internal(_) => "error",
        }
    }

    /// Whether the outcome is stored for an idempotency key: deterministic refusals are (a retry
    /// would be refused the same way); failures that a retry might not meet are not.
    pub(super) fn is_stored(&self) -> bool {
        matches!(
            self,
            WalletError::Refused(_)
                | WalletError::LegRefused { .. }
                | WalletError::Exists
                | WalletError::KeyTakenOver
        )
    }
}

impl From<StoreError> for WalletError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::WalletNotFound => WalletError::NotFound,
            StoreError::WalletExists => WalletError::Exists,
            StoreError::LeaseLost | StoreError::FenceBehind { .. } => WalletError::LeaseLost,
            err if err.is_lock_timeout() => WalletError::LockTimeout { waited: transfer::ROW_LOCK_TIMEOUT },
            err if err.is_unavailable() => {
                WalletError::Unavailable { dependency: "postgres", source: Arc::new(err) }
            }
            err => WalletError::Internal(Arc::new(err)),
        }
    }
}

impl From<sqlx::Error> for WalletError {
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

impl From<LeaseError> for WalletError {
    fn from(err: LeaseError) -> Self {
        match err {
            LeaseError::NotObtained { waited, .. } => WalletError::LockTimeout { waited },
            LeaseError::NotHeld { .. } => WalletError::LeaseLost,
            err @ LeaseError::FenceExhausted { .. } => WalletError::FenceExhausted(Arc::new(err)),
            LeaseError::Unavailable(failure) => {
                WalletError::Unavailable { dependency: "redis", source: Arc::new(failure) }
            }
        }
    }
}

/// A failed write: one whose connection broke may have happened or not, which is
/// [`WalletError::OutcomeUnknown`], never "unavailable, nothing applied".
pub(super) fn commit_failure(err: StoreError) -> WalletError {
    match err {
        StoreError::Database(err) if StoreError::is_connection_failure_of(&err) => {
            WalletError::OutcomeUnknown(Arc::new(err))
        }
        err => err.into(),
    }
}

/// Commits `tx`. A commit whose connection failed may have happened or not: that is
/// [`WalletError::OutcomeUnknown`], never "unavailable, nothing applied".
pub(crate) async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), WalletError> {
    tx.commit().await.map_err(|err| commit_failure(err.into()))
}
