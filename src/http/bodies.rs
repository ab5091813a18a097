//! What the API answers with: wallets, ledger entries, holds, transfers and movements as a client
//! reads them, each mapped from the row the wallet service returns. A stored column can then change
//! without changing the API, and what a client sees is decided here, field by field, in the order
//! it is sent.
//!
//! Each type is named for the document as the API has always named it (`Entry`, `Hold`, ...:
//! `#[schema(as = ...)]`); in the code the suffix `Body` keeps it apart from the row it is made
//! of.

use crate::domain::{EntryKind, HoldStatus, Limits, Metadata, Monitor, MovementStatus, Rules};
use crate::wallet::{Entry, HeldLeg, Hold, MovementHold, MovementRecord, Transfer, Wallet};
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

/// A wallet: its balance, what of it may be spent, and its version.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Wallet)]
pub struct WalletBody {
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    pub id: String,
    /// Below zero only within its overdraft.
    #[schema(example = 7500)]
    pub balance: i64,
    /// The balance and the overdraft, less what the wallet's active holds reserve: what a
    /// payment, a transfer or a new hold may spend.
    #[schema(minimum = 0, example = 3500)]
    pub available: i64,
    #[schema(minimum = 1, example = 2)]
    pub version: i64,
    /// Its balance monitors (`POST /wallets/{id}/monitors`).
    pub monitors: Vec<Monitor>,
    /// Its limits (`PUT /wallets/{id}/limits`).
    pub limits: LimitsBody,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl From<Wallet> for WalletBody {
    fn from(wallet: Wallet) -> Self {
        // What holds reserve, the fence and the owner are the service's, not the client's.
        let Wallet {
            id,
            balance,
            available,
            version,
            rules,
            created_at,
            updated_at,
            held: _,
            fence: _,
            owner: _,
        } = wallet;
        WalletBody {
            id,
            balance,
            available,
            version,
            monitors: rules.monitors.list().to_vec(),
            limits: LimitsBody::of(&rules, Utc::now()),
            created_at,
            updated_at,
        }
    }
}

/// A wallet's balance monitors, after one was set or removed.
#[derive(Debug, Serialize, ToSchema)]
pub struct MonitorsBody {
    /// Each fires an event when a movement crosses it: `wallet.balance_below` when the balance
    /// goes below `below` from at or above it, `wallet.balance_above` when it goes above `above`
    /// from at or below it.
    pub monitors: Vec<Monitor>,
}

/// A wallet's limits: each is always there, `null` (or an overdraft of 0, or no velocity limits)
/// for none.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Limits)]
pub struct LimitsBody {
    /// How far below zero the balance may go.
    #[schema(minimum = 0, example = 50000)]
    pub overdraft: i64,
    /// The most one debit may take.
    #[schema(minimum = 1, example = 20000)]
    pub per_payment: Option<i64>,
    /// Its velocity limits, each with what its current window has taken and left.
    pub velocity: Vec<VelocityBody>,
    /// The IANA time zone its calendar windows (`day`, `week`, `month`) are counted in.
    #[schema(example = "Europe/Paris")]
    pub timezone: String,
}

/// A velocity limit and its current window.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Velocity)]
pub struct VelocityBody {
    /// `day`, `week` (from Monday), `month`, or a fixed window (`30s`, `1m`, `24h`, ...).
    #[schema(example = "day")]
    pub per: String,
    /// The most debited per window, if limited.
    #[schema(minimum = 1, example = 200000)]
    pub amount: Option<i64>,
    /// The most debits per window, if limited.
    #[schema(minimum = 1, example = 50)]
    pub count: Option<i64>,
    /// What this window has taken.
    pub used: WindowBody,
    /// What is left of it (`null` for a measure not limited).
    pub left: LeftBody,
    /// What it counts from: the window's start, or when the limit was set if that is later.
    pub counts_from: DateTime<Utc>,
    /// When the window ends and its counts start again from nothing.
    pub resets_at: DateTime<Utc>,
}

/// An amount and a number of debits.
#[derive(Debug, Serialize, ToSchema)]
pub struct WindowBody {
    pub amount: i64,
    pub count: i64,
}

/// What a window has left, for each measure its limit bounds.
#[derive(Debug, Serialize, ToSchema)]
pub struct LeftBody {
    pub amount: Option<i64>,
    pub count: Option<i64>,
}

impl LimitsBody {
    /// The limits of `rules`, their windows as of `now`.
    pub fn of(rules: &Rules, now: DateTime<Utc>) -> LimitsBody {
        let Limits { overdraft, per_payment } = rules.limits;
        let velocity = rules
            .velocity
            .velocity
            .iter()
            .map(|velocity| {
                let limit = velocity.limit;
                let used = rules.velocity.used_at(velocity, now);
                let left = |limit: Option<i64>, used: i64| limit.map(|limit| (limit - used).max(0));
                VelocityBody {
                    per: limit.per.name(),
                    amount: limit.amount,
                    count: limit.count,
                    used: WindowBody { amount: used.amount, count: used.count },
                    left: LeftBody {
                        amount: left(limit.amount, used.amount),
                        count: left(limit.count, used.count),
                    },
                    counts_from: used.from,
                    resets_at: used.until,
                }
            })
            .collect();
        let timezone = rules.velocity.timezone.map_or("UTC", |zone| zone.name()).to_owned();
        LimitsBody { overdraft, per_payment, velocity, timezone }
    }
}

/// One ledger entry: what it did to its wallet, and the wallet's balance and version right after.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Entry)]
pub struct EntryBody {
    pub id: Uuid,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    pub wallet_id: String,
    pub kind: EntryKind,
    /// Minor units; an `open` entry's amount is the opening balance, which may be 0.
    #[schema(minimum = 0, maximum = 1_000_000_000_000_i64, example = 2500)]
    pub amount: i64,
    /// The wallet's balance right after this entry (below zero only within an overdraft).
    #[schema(example = 7500)]
    pub balance: i64,
    /// The wallet's version right after this entry (its position in the wallet's ledger).
    #[schema(minimum = 1, example = 2)]
    pub version: i64,
    /// The fencing token of the lease it was written under (0 for an `open` entry).
    #[schema(minimum = 0, example = 1)]
    pub fence: i64,
    /// The payment's reference; omitted when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, max_length = 256, example = "order-1001")]
    pub reference: Option<String>,
    /// The movement's metadata; omitted when it has none.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    #[schema(required = false)]
    pub metadata: Metadata,
    /// The transfer a `transfer_out` or `transfer_in` entry is a leg of; omitted otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub transfer_id: Option<Uuid>,
    /// The `pay` entry a `refund` entry returns money for; omitted otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub refund_of: Option<Uuid>,
    /// The hold a `pay` entry captured; omitted otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub hold_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
}

impl From<Entry> for EntryBody {
    fn from(entry: Entry) -> Self {
        let Entry {
            id,
            wallet_id,
            kind,
            amount,
            balance,
            version,
            fence,
            reference,
            metadata,
            transfer_id,
            refund_of,
            hold_id,
            created_at,
        } = entry;
        EntryBody {
            id,
            wallet_id,
            kind,
            amount,
            balance,
            version,
            fence,
            reference,
            metadata,
            transfer_id,
            refund_of,
            hold_id,
            created_at,
        }
    }
}

/// Part of a wallet's available balance reserved until it is captured, voided or expires. A hold
/// still `held` past `expires_at` shows as `expired`: its amount is available again, whether or
/// not a movement has released it yet.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Hold)]
pub struct HoldBody {
    pub id: Uuid,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    pub wallet_id: String,
    /// Minor units reserved.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 4000)]
    pub amount: i64,
    /// What its capture charged; 0 unless captured.
    #[schema(minimum = 0, example = 0)]
    pub captured: i64,
    pub status: HoldStatus,
    pub expires_at: DateTime<Utc>,
    #[schema(required = true, max_length = 256, example = "ride-77")]
    pub reference: Option<String>,
    /// The hold's metadata (its capture's entry keeps it); omitted when it has none.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    #[schema(required = false)]
    pub metadata: Metadata,
    pub created_at: DateTime<Utc>,
    /// When it was captured, voided or released; null while held.
    #[schema(required = true)]
    pub settled_at: Option<DateTime<Utc>>,
    /// The `pay` entry of its capture; omitted unless captured.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub capture_entry: Option<Uuid>,
    /// The held movement whose debit leg it reserves; omitted for a hold of its own. Such a hold
    /// is captured or voided with its movement, never alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub movement_id: Option<Uuid>,
}

impl From<Hold> for HoldBody {
    fn from(hold: Hold) -> Self {
        let Hold {
            id,
            wallet_id,
            amount,
            captured,
            status,
            expires_at,
            reference,
            metadata,
            created_at,
            settled_at,
            capture_entry,
            movement_id,
            fence: _,
        } = hold;
        HoldBody {
            id,
            wallet_id,
            amount,
            captured,
            status,
            expires_at,
            reference,
            metadata,
            created_at,
            settled_at,
            capture_entry,
            movement_id,
        }
    }
}

/// A hold as a hold operation answers: the hold, and the `pay` entry its capture wrote.
#[derive(Debug, Serialize, ToSchema)]
pub struct HoldReceipt {
    #[serde(flatten)]
    pub hold: HoldBody,
    /// The capture's `pay` entry; omitted unless this request captured the hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub entry: Option<EntryBody>,
}

/// Money from one wallet to another: the transfer and its two ledger entries.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Transfer)]
pub struct TransferBody {
    pub id: Uuid,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    pub from: String,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "bob")]
    pub to: String,
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64, example = 2500)]
    pub amount: i64,
    /// The caller's own note, or null.
    #[schema(required = true, max_length = 256, example = "invoice-77")]
    pub reference: Option<String>,
    /// The transfer's metadata (each of its entries keeps it); omitted when it has none.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    #[schema(required = false)]
    pub metadata: Metadata,
    /// The transfer this one refunds (it moves money back from that one's `to` to its `from`);
    /// omitted when it refunds none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub refund_of: Option<Uuid>,
    /// The `transfer_out` entry of `from`.
    pub from_entry: EntryBody,
    /// The `transfer_in` entry of `to`.
    pub to_entry: EntryBody,
    pub created_at: DateTime<Utc>,
}

impl From<Transfer> for TransferBody {
    fn from(transfer: Transfer) -> Self {
        let Transfer {
            id,
            from,
            to,
            amount,
            reference,
            metadata,
            refund_of,
            from_entry,
            to_entry,
            created_at,
        } = transfer;
        TransferBody {
            id,
            from,
            to,
            amount,
            reference,
            metadata,
            refund_of,
            from_entry: from_entry.into(),
            to_entry: to_entry.into(),
            created_at,
        }
    }
}

/// Money between 2 to 16 wallets at once: the movement and its legs, in the order the request
/// listed them; for one placed as a hold, what it reserves.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = MovementRecord)]
pub struct MovementBody {
    pub id: Uuid,
    /// The caller's own note, or null.
    #[schema(required = true, max_length = 256, example = "order-1001")]
    pub reference: Option<String>,
    /// The movement's metadata (each of its entries keeps it); omitted when it has none.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    #[schema(required = false)]
    pub metadata: Metadata,
    pub status: MovementStatus,
    /// One entry a leg: a `transfer_out` of each wallet it takes from, a `transfer_in` of each it
    /// pays into, each with the wallet's balance after it. Empty while a held movement is not
    /// captured.
    pub legs: Vec<EntryBody>,
    /// For a movement placed as a hold: its legs as asked and the hold of each debit; omitted
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub hold: Option<MovementHoldBody>,
    /// The movement this one refunds (every leg of that one back, in part or whole); omitted when
    /// it refunds none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub refund_of: Option<Uuid>,
    pub created_at: DateTime<Utc>,
}

impl From<MovementRecord> for MovementBody {
    fn from(movement: MovementRecord) -> Self {
        let MovementRecord { id, reference, metadata, status, legs, hold, refund_of, created_at } = movement;
        MovementBody {
            id,
            reference,
            metadata,
            status,
            legs: legs.into_iter().map(EntryBody::from).collect(),
            hold: hold.map(MovementHoldBody::from),
            refund_of,
            created_at,
        }
    }
}

/// What a held movement reserves, and until when.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = MovementHold)]
pub struct MovementHoldBody {
    pub expires_at: DateTime<Utc>,
    /// Every leg as asked, in order.
    pub legs: Vec<HeldLegBody>,
}

impl From<MovementHold> for MovementHoldBody {
    fn from(MovementHold { expires_at, legs }: MovementHold) -> Self {
        MovementHoldBody { expires_at, legs: legs.into_iter().map(HeldLegBody::from).collect() }
    }
}

/// One leg of a held movement: its wallet, its amount (negative out of the wallet), and for a
/// debit the hold that reserves it.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = HeldLeg)]
pub struct HeldLegBody {
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "payer")]
    pub wallet_id: String,
    #[schema(example = -1000)]
    pub amount: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub hold_id: Option<Uuid>,
}

impl From<HeldLeg> for HeldLegBody {
    fn from(HeldLeg { wallet_id, amount, hold_id }: HeldLeg) -> Self {
        HeldLegBody { wallet_id, amount, hold_id }
    }
}

/// A request's `metadata`, as JSON gives it; [`Metadata::parse`] holds it to its rule, so a value
/// that is not a string is `invalid_metadata` like any other break of it, not a body that cannot be
/// read.
pub(super) type MetadataObject = Option<serde_json::Map<String, serde_json::Value>>;
