//! The wallet's vocabulary: validated ids and amounts, the movements of money, and the one rule
//! that decides a movement against a balance.

use chrono::{DateTime, Utc};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

mod velocity;
pub use velocity::{MOST_VELOCITY, Per, Room, Used, Velocities, Velocity, VelocityLimit};

/// Input that breaks one of the rules below; names the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {rule}", field.name())]
pub struct InvalidInput {
    pub field: Field,
    pub rule: &'static str,
}

/// A field of a request that has a rule: what a problem document's `field` names, and the code it
/// answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// A wallet's id, in the path or the body of a new wallet.
    WalletId,
    /// A transfer's paying wallet.
    From,
    /// A transfer's paid wallet.
    To,
    /// The payment a refund names.
    Payment,
    /// A transfer's id, in the path.
    TransferId,
    /// A hold's id, in the path.
    HoldId,
    /// How long a hold lasts.
    ExpiresIn,
    Amount,
    Balance,
    Reference,
    /// A movement's metadata, or an entries filter on it.
    Metadata,
    /// A page's size.
    Limit,
    /// A page's cursor.
    Before,
    IdempotencyKey,
    /// A movement's legs.
    Legs,
    /// A movement's id, in the path.
    MovementId,
    /// The instant a wallet's balance is asked as of.
    At,
    /// The start of a period of history (inclusive).
    PeriodStart,
    /// The end of a period of history (exclusive).
    PeriodEnd,
    /// The kinds of entries asked for.
    Kind,
    /// Which way a page of entries runs.
    Order,
    /// A page's cursor, in either order.
    Cursor,
    /// The types of events asked for.
    EventType,
    /// How long a reader of the feed waits for an event.
    Wait,
    /// A webhook endpoint's id, in the path.
    EndpointId,
    /// A balance monitor: `below` or `above`, and its amount.
    Monitor,
    /// A wallet's limits.
    Limits,
}

impl Field {
    /// As the request names it.
    pub fn name(self) -> &'static str {
        match self {
            Field::WalletId => "id",
            Field::From => "from",
            Field::To => "to",
            Field::Payment => "payment",
            Field::TransferId => "transfer_id",
            Field::HoldId => "hold_id",
            Field::ExpiresIn => "expires_in",
            Field::Amount => "amount",
            Field::Balance => "balance",
            Field::Reference => "reference",
            Field::Metadata => "metadata",
            Field::Limit => "limit",
            Field::Before => "before",
            Field::IdempotencyKey => "Idempotency-Key",
            Field::Legs => "legs",
            Field::MovementId => "movement_id",
            Field::At => "at",
            Field::PeriodStart => "from",
            Field::PeriodEnd => "to",
            Field::Kind => "kind",
            Field::Order => "order",
            Field::Cursor => "cursor",
            Field::EventType => "type",
            Field::Wait => "wait",
            Field::EndpointId => "id",
            Field::Monitor => "monitor",
            Field::Limits => "limits",
        }
    }

    /// The stable code of a value that breaks this field's rule.
    pub fn code(self) -> &'static str {
        match self {
            Field::WalletId | Field::From | Field::To => "invalid_wallet_id",
            Field::Payment => "invalid_payment_id",
            Field::TransferId => "invalid_transfer_id",
            Field::HoldId => "invalid_hold_id",
            Field::ExpiresIn => "invalid_expires_in",
            Field::Amount => "invalid_amount",
            Field::Balance => "invalid_balance",
            Field::Reference => "invalid_reference",
            Field::Metadata => "invalid_metadata",
            Field::Limit => "invalid_limit",
            Field::IdempotencyKey => "invalid_idempotency_key",
            Field::Legs => "invalid_legs",
            Field::MovementId => "invalid_movement_id",
            Field::At | Field::PeriodStart | Field::PeriodEnd => "invalid_time",
            Field::Kind => "invalid_kind",
            Field::Order => "invalid_order",
            Field::Before | Field::Cursor => "invalid_cursor",
            Field::EventType => "invalid_event_type",
            Field::Wait => "invalid_wait",
            Field::EndpointId => "invalid_endpoint_id",
            Field::Monitor => "invalid_monitor",
            Field::Limits => "invalid_limits",
        }
    }
}

/// A wallet id: 1 to 64 characters of `[A-Za-z0-9_-]`, so it is safe in a URL path, a Redis key
/// and a log line without escaping.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct WalletId(String);

impl WalletId {
    pub const RULE: &'static str = "1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'";

    pub fn parse(id: &str) -> Result<Self, InvalidInput> {
        let valid = (1..=64).contains(&id.len())
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid {
            Ok(Self(id.to_owned()))
        } else {
            Err(InvalidInput { field: Field::WalletId, rule: Self::RULE })
        }
    }

    /// A fresh random id (a UUID), for wallets created without one.
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What this wallet's lease and its idempotency keys are named under: `wallet:<id>`.
    pub fn scope(&self) -> String {
        format!("{WALLET_SCOPE_PREFIX}{}", self.0)
    }
}

/// The start of every wallet's scope ([`WalletId::scope`]), for a query that matches them all.
pub const WALLET_SCOPE_PREFIX: &str = "wallet:";

impl fmt::Display for WalletId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose wallets a request may see and move: the wallets its caller opened, or every wallet when
/// the token file grants the caller that (an operator, a back office). Everything else is hidden:
/// a wallet the caller may not use is answered as if it did not exist. A transfer may also pay into
/// the wallets of the callers the token file lets this one pay into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// The caller (the API token's name): it owns the wallets it opens, and scopes its keys.
    pub caller: Arc<str>,
    pub every_wallet: bool,
    /// Callers into whose wallets this one's transfers may pay, besides its own.
    pub pays_into: Arc<[Arc<str>]>,
}

impl Access {
    /// A caller with no grant: its own wallets only.
    pub fn own_wallets(caller: &str) -> Self {
        Self { caller: Arc::from(caller), every_wallet: false, pays_into: Arc::new([]) }
    }

    /// Whether the caller may see and move the money of a wallet owned by `owner` (`None`: a
    /// wallet opened before owners were recorded, which only callers granted every wallet see).
    pub fn may_use(&self, owner: Option<&str>) -> bool {
        self.every_wallet || owner == Some(&*self.caller)
    }

    /// Whether a transfer of this caller's may pay into a wallet owned by `owner`.
    pub fn may_pay_into(&self, owner: Option<&str>) -> bool {
        self.may_use(owner) || owner.is_some_and(|owner| self.pays_into.iter().any(|payee| **payee == *owner))
    }
}

/// An amount of money in minor units (cents): 1 to 10^12.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Amount(i64);

impl Amount {
    pub const MAX: i64 = 1_000_000_000_000;
    pub const RULE: &'static str = "an integer from 1 to 1000000000000 (minor units)";

    pub fn new(amount: i64) -> Result<Self, InvalidInput> {
        if (1..=Self::MAX).contains(&amount) {
            Ok(Self(amount))
        } else {
            Err(InvalidInput { field: Field::Amount, rule: Self::RULE })
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

/// A new wallet's balance: 0 to 10^12 minor units.
pub fn opening_balance(balance: i64) -> Result<i64, InvalidInput> {
    if (0..=Amount::MAX).contains(&balance) {
        Ok(balance)
    } else {
        Err(InvalidInput { field: Field::Balance, rule: "an integer from 0 to 1000000000000 (minor units)" })
    }
}

/// The caller's own note on a payment (an order number, say): at most 256 characters.
pub fn reference(reference: Option<String>) -> Result<Option<String>, InvalidInput> {
    match reference {
        Some(text) if text.chars().count() > 256 || text.contains('\0') => {
            Err(InvalidInput { field: Field::Reference, rule: "at most 256 characters, no NUL" })
        }
        other => Ok(other),
    }
}

/// The caller's own key-value pairs on a movement (an order's id, a channel, a country): every
/// entry the movement writes keeps them, each answer that shows an entry returns them, and a
/// wallet's entries can be selected by them (`metadata[key]=value`). At most [`Metadata::MAX_KEYS`]
/// keys of 1 to [`Metadata::MAX_KEY_CHARS`] characters, each value a string of at most
/// [`Metadata::MAX_VALUE_CHARS`], no NUL (Postgres's `jsonb` cannot hold one): a few kilobytes at
/// most, in every entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(transparent)]
#[schema(value_type = BTreeMap<String, String>, example = json!({"order_id": "o-1001", "channel": "web"}))]
pub struct Metadata(BTreeMap<String, String>);

impl Metadata {
    pub const MAX_KEYS: usize = 16;
    pub const MAX_KEY_CHARS: usize = 64;
    pub const MAX_VALUE_CHARS: usize = 256;
    pub const RULE: &'static str = "an object of at most 16 keys of 1 to 64 characters, each value a string of \
                                    at most 256 characters, no NUL";

    /// A request's `metadata` object (none: empty).
    pub fn parse(object: Option<serde_json::Map<String, serde_json::Value>>) -> Result<Self, InvalidInput> {
        let invalid = || InvalidInput { field: Field::Metadata, rule: Self::RULE };
        let pairs = object.unwrap_or_default().into_iter().map(|(key, value)| match value {
            serde_json::Value::String(value) => Ok((key, value)),
            _ => Err(invalid()),
        });
        Self::from_pairs(pairs.collect::<Result<Vec<_>, _>>()?)
    }

    /// Pairs held to the rule (a key twice breaks it).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, InvalidInput> {
        let invalid = || InvalidInput { field: Field::Metadata, rule: Self::RULE };
        let mut map = BTreeMap::new();
        for (key, value) in pairs {
            let key_ok = (1..=Self::MAX_KEY_CHARS).contains(&key.chars().count()) && !key.contains('\0');
            let value_ok = value.chars().count() <= Self::MAX_VALUE_CHARS && !value.contains('\0');
            if !key_ok || !value_ok || map.insert(key, value).is_some() || map.len() > Self::MAX_KEYS {
                return Err(invalid());
            }
        }
        Ok(Self(map))
    }

    /// As the ledger stored it (held to the rule when it was written).
    pub fn stored(map: Option<BTreeMap<String, String>>) -> Self {
        Self(map.unwrap_or_default())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs, for a write (`None` when there are none: the column is then null).
    pub fn pairs(&self) -> Option<&BTreeMap<String, String>> {
        (!self.0.is_empty()).then_some(&self.0)
    }
}

/// How long a hold lasts before it expires by itself: 1 second to 7 days.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldLife(std::time::Duration);

impl HoldLife {
    pub const RULE: &'static str = "an integer number of seconds from 1 to 604800 (7 days)";
    /// When the request does not say: 15 minutes.
    pub const DEFAULT: HoldLife = HoldLife(std::time::Duration::from_secs(15 * 60));

    pub fn seconds(seconds: i64) -> Result<Self, InvalidInput> {
        match u64::try_from(seconds) {
            Ok(secs @ 1..=604_800) => Ok(Self(std::time::Duration::from_secs(secs))),
            _ => Err(InvalidInput { field: Field::ExpiresIn, rule: Self::RULE }),
        }
    }

    pub fn get(self) -> std::time::Duration {
        self.0
    }

    /// When a hold placed at `now` expires.
    pub fn expiry_from(self, now: chrono::DateTime<chrono::Utc>) -> chrono::DateTime<chrono::Utc> {
        now + chrono::Duration::from_std(self.0).unwrap_or(chrono::Duration::MAX)
    }
}

/// A change to a wallet that needs its lease: a change of its balance, or of what is held of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Movement {
    Deposit {
        amount: Amount,
        metadata: Metadata,
    },
    Pay {
        amount: Amount,
        reference: Option<String>,
        metadata: Metadata,
    },
    /// Reserves `amount` of the available balance until `life` from now; its capture's entry
    /// keeps its reference and metadata.
    Hold {
        amount: Amount,
        life: HoldLife,
        reference: Option<String>,
        metadata: Metadata,
    },
    /// Charges `amount` of the hold (all of it without one) and releases the rest.
    Capture {
        hold: uuid::Uuid,
        amount: Option<Amount>,
    },
    /// Releases the hold, charging nothing.
    Void {
        hold: uuid::Uuid,
    },
    /// Releases the wallet's holds past their expiry (what the sweeper asks; any movement that
    /// needs their amount does it too).
    ReleaseExpired,
    /// Sets a balance monitor on the wallet, or removes one: under its lease, in its queue, so
    /// every movement after it is decided with it.
    AddMonitor(Monitor),
    RemoveMonitor(Monitor),
    /// The wallet's limits replaced by these.
    SetLimits(LimitsSet),
}

/// Where a hold stands. `Held` past its expiry is expired, though no movement has released it yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema, sqlx::Type)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum HoldStatus {
    Held,
    Captured,
    Voided,
    Expired,
}

/// What an entry did to its wallet's balance.
// Stored as `text` (the column's check lists the kinds), not as a Postgres enum type: adding a
// kind is then a change of that check, not an `ALTER TYPE`. (A plain comment: doc comments are
// the API document's descriptions.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema, sqlx::Type)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum EntryKind {
    Open,
    Deposit,
    Pay,
    /// A transfer's leg out of the paying wallet.
    TransferOut,
    /// A transfer's leg into the paid wallet.
    TransferIn,
    /// Money back into a wallet, for one of its payments.
    Refund,
}

impl EntryKind {
    pub const ALL: [EntryKind; 6] = [
        EntryKind::Open,
        EntryKind::Deposit,
        EntryKind::Pay,
        EntryKind::TransferOut,
        EntryKind::TransferIn,
        EntryKind::Refund,
    ];

    /// The stored name (as the derive's renames spell it), for array binds: a `Vec<EntryKind>`
    /// binds as an array declared by name, which sqlx looks up in the catalog on each new
    /// connection, and `query!` takes it for a `text[]` parameter only unchecked (`as _`).
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Open => "open",
            EntryKind::Deposit => "deposit",
            EntryKind::Pay => "pay",
            EntryKind::TransferOut => "transfer_out",
            EntryKind::TransferIn => "transfer_in",
            EntryKind::Refund => "refund",
        }
    }

    /// Whether the entry takes money out of its wallet (else it puts money in).
    pub fn is_debit(self) -> bool {
        matches!(self, EntryKind::Pay | EntryKind::TransferOut)
    }
}

/// What happened to a wallet, as its events name it (`GET /events`, the webhooks). One event per
/// change of the wallet: each ledger entry, and each hold placed or settled without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
pub enum EventType {
    /// The wallet was opened, with its opening balance (its `open` entry).
    #[serde(rename = "wallet.opened")]
    WalletOpened,
    #[serde(rename = "deposit.accepted")]
    DepositAccepted,
    #[serde(rename = "payment.accepted")]
    PaymentAccepted,
    /// A leg of a transfer, in or out of the wallet.
    #[serde(rename = "transfer.accepted")]
    TransferAccepted,
    /// A leg of a movement of many legs, posted or captured (a captured debit leg is the
    /// capture of its hold: `hold.captured`).
    #[serde(rename = "movement.accepted")]
    MovementAccepted,
    /// Money back: a refund of a payment, or a leg of a refund of a transfer or a movement.
    #[serde(rename = "refund.accepted")]
    RefundAccepted,
    #[serde(rename = "hold.placed")]
    HoldPlaced,
    /// A hold captured: with the entry that charged it, unless it charged nothing (a held
    /// movement's leg whose share of a partial capture was nothing).
    #[serde(rename = "hold.captured")]
    HoldCaptured,
    #[serde(rename = "hold.voided")]
    HoldVoided,
    /// A hold released past its expiry, uncaptured.
    #[serde(rename = "hold.expired")]
    HoldExpired,
    /// A movement took the balance below a monitor's amount (from at or above it): with that
    /// movement's entry.
    #[serde(rename = "wallet.balance_below")]
    BalanceBelow,
    /// A movement took the balance above a monitor's amount (from at or below it).
    #[serde(rename = "wallet.balance_above")]
    BalanceAbove,
}

impl EventType {
    pub const ALL: [EventType; 12] = [
        EventType::WalletOpened,
        EventType::DepositAccepted,
        EventType::PaymentAccepted,
        EventType::TransferAccepted,
        EventType::MovementAccepted,
        EventType::RefundAccepted,
        EventType::HoldPlaced,
        EventType::HoldCaptured,
        EventType::HoldVoided,
        EventType::HoldExpired,
        EventType::BalanceBelow,
        EventType::BalanceAbove,
    ];

    /// The name the API and the store spell it with.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::WalletOpened => "wallet.opened",
            EventType::DepositAccepted => "deposit.accepted",
            EventType::PaymentAccepted => "payment.accepted",
            EventType::TransferAccepted => "transfer.accepted",
            EventType::MovementAccepted => "movement.accepted",
            EventType::RefundAccepted => "refund.accepted",
            EventType::HoldPlaced => "hold.placed",
            EventType::HoldCaptured => "hold.captured",
            EventType::HoldVoided => "hold.voided",
            EventType::HoldExpired => "hold.expired",
            EventType::BalanceBelow => "wallet.balance_below",
            EventType::BalanceAbove => "wallet.balance_above",
        }
    }

    pub fn parse(name: &str) -> Option<EventType> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == name)
    }

    /// The event of a ledger entry of `kind`: an entry that charges a hold is that hold's
    /// capture; a leg between wallets is the event of what moved it (`between`: a transfer, a
    /// movement, or a refund of one).
    pub fn of_entry(kind: EntryKind, charges_hold: bool, between: EventType) -> EventType {
        match kind {
            _ if charges_hold => EventType::HoldCaptured,
            EntryKind::Open => EventType::WalletOpened,
            EntryKind::Deposit => EventType::DepositAccepted,
            EntryKind::Pay => EventType::PaymentAccepted,
            EntryKind::Refund => EventType::RefundAccepted,
            EntryKind::TransferOut | EntryKind::TransferIn => between,
        }
    }

    /// The event of a hold settled as `status` (a capture that wrote an entry is that entry's).
    pub fn of_settled(status: HoldStatus) -> EventType {
        match status {
            HoldStatus::Held => EventType::HoldPlaced,
            HoldStatus::Captured => EventType::HoldCaptured,
            HoldStatus::Voided => EventType::HoldVoided,
            HoldStatus::Expired => EventType::HoldExpired,
        }
    }
}

/// A balance monitor of a wallet: an event when a movement takes the balance below `below` from
/// at or above it, or above `above` from at or below it. So it fires once per crossing, and again
/// only once the balance has gone back and crosses again. The balance, not what is available:
/// holds placed or settled move no balance.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Monitor {
    Below(i64),
    Above(i64),
}

impl Monitor {
    /// Whether a movement that took the balance from `before` to `after` crosses it.
    pub fn crossed(self, before: i64, after: i64) -> bool {
        match self {
            Monitor::Below(amount) => before >= amount && after < amount,
            Monitor::Above(amount) => before <= amount && after > amount,
        }
    }

    /// The event a crossing writes.
    pub fn event(self) -> EventType {
        match self {
            Monitor::Below(_) => EventType::BalanceBelow,
            Monitor::Above(_) => EventType::BalanceAbove,
        }
    }

    pub fn amount(self) -> i64 {
        match self {
            Monitor::Below(amount) | Monitor::Above(amount) => amount,
        }
    }

    /// `below` or `above`, as the API's path names it.
    pub fn side(self) -> &'static str {
        match self {
            Monitor::Below(_) => "below",
            Monitor::Above(_) => "above",
        }
    }

    /// The monitor a path names: `below` or `above`, and an amount.
    pub fn of_side(side: &str, amount: i64) -> Option<Monitor> {
        match side {
            "below" => Some(Monitor::Below(amount)),
            "above" => Some(Monitor::Above(amount)),
            _ => None,
        }
    }
}

/// A wallet's monitors, in order, each once, at most [`Monitors::MOST`] (one of its [`Rules`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Monitors(Vec<Monitor>);

impl Monitors {
    pub const MOST: usize = 8;
    pub const NONE: Monitors = Monitors(Vec::new());

    pub fn new(monitors: impl IntoIterator<Item = Monitor>) -> Self {
        let mut monitors: Vec<Monitor> = monitors.into_iter().collect();
        monitors.sort();
        monitors.dedup();
        Monitors(monitors)
    }

    pub fn list(&self) -> &[Monitor] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The monitors a movement from `before` to `after` crosses, in order.
    pub fn crossed(&self, before: i64, after: i64) -> impl Iterator<Item = Monitor> + '_ {
        self.0.iter().copied().filter(move |monitor| monitor.crossed(before, after))
    }

    /// These with `monitor` (unchanged if it is one of them already); refused past [`Self::MOST`].
    pub fn with(&self, monitor: Monitor) -> Result<Monitors, Refusal> {
        if self.0.contains(&monitor) {
            return Ok(self.clone());
        }
        if self.0.len() >= Self::MOST {
            return Err(Refusal::TooManyMonitors { most: Self::MOST as u8 });
        }
        Ok(Monitors::new(self.0.iter().copied().chain([monitor])))
    }

    /// These without `monitor`; refused if it is not one of them.
    pub fn without(&self, monitor: Monitor) -> Result<Monitors, Refusal> {
        if !self.0.contains(&monitor) {
            return Err(Refusal::MonitorNotFound);
        }
        Ok(Monitors(self.0.iter().copied().filter(|m| *m != monitor).collect()))
    }
}

/// A wallet's limits on what it may spend (docs/api/limits.md): a credit line down to a negative
/// balance, and a cap on each debit. `Copy`, so every [`Funds`] carries its wallet's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Limits {
    /// How far below zero the balance may go: what is available is the balance plus this, less
    /// what is held. 0: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overdraft: i64,
    /// The most one debit may take: a payment, a hold, a transfer's or movement's debit leg.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_payment: Option<i64>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl Limits {
    pub const NONE: Limits = Limits { overdraft: 0, per_payment: None };

    /// These limits in place of `was`, for a wallet at `funds`: refused if the wallet already owes
    /// more than the new overdraft allows (it would be under its floor at once).
    pub fn replacing(self, funds: Funds) -> Result<Limits, Refusal> {
        let available = Funds { limits: self, ..funds }.available();
        if available < 0 {
            return Err(Refusal::LimitBelowUsed {
                limit: LimitKind::Overdraft,
                used: funds.held - funds.balance,
            });
        }
        Ok(self)
    }
}

/// All of a wallet's limits as its owner sets them at once (`PUT /wallets/{id}/limits`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitsSet {
    pub limits: Limits,
    pub velocity: Vec<VelocityLimit>,
    /// The time zone of calendar windows; UTC when left out.
    pub timezone: Option<chrono_tz::Tz>,
}

/// What a wallet's owner set on it beside its balance: its monitors and its limits. Stored with
/// its row (`rules`, migration 0024) and changed under its lease by the decision, like its
/// balance, so each movement is decided with every rule set before it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Rules {
    #[serde(default, skip_serializing_if = "Monitors::is_empty")]
    pub monitors: Monitors,
    #[serde(default, flatten)]
    pub limits: Limits,
    /// Its velocity limits, each with what its current window has taken.
    #[serde(default, flatten)]
    pub velocity: Velocities,
}

impl Rules {
    pub const NONE: Rules =
        Rules { monitors: Monitors::NONE, limits: Limits::NONE, velocity: Velocities::NONE };

    /// These rules with their limits replaced by `set` at `now`, for a wallet at `funds` (refused
    /// if the wallet already owes more than the new overdraft allows); `already`: what debits
    /// stamped `now` took before it, which a new velocity limit counts ([`Velocities::replaced`]).
    pub fn with_limits(
        &self,
        set: &LimitsSet,
        funds: Funds,
        now: DateTime<Utc>,
        already: (i64, i64),
    ) -> Result<Rules, Refusal> {
        let limits = set.limits.replacing(funds)?;
        let velocity = self.velocity.replaced(&set.velocity, set.timezone, now, already);
        for Velocity { limit, used } in &velocity.velocity {
            if limit.amount.is_some_and(|most| used.amount > most) {
                return Err(Refusal::LimitBelowUsed {
                    limit: LimitKind::Amount(limit.per),
                    used: used.amount,
                });
            }
            if limit.count.is_some_and(|most| used.count > most) {
                return Err(Refusal::LimitBelowUsed { limit: LimitKind::Count(limit.per), used: used.count });
            }
        }
        Ok(Rules { monitors: self.monitors.clone(), limits, velocity })
    }

    /// What a debit may take from a wallet at `funds`, with these rules, decided at `now`.
    pub fn funds(&self, balance: i64, held: i64, now: DateTime<Utc>) -> Funds {
        Funds { balance, held, limits: self.limits, room: self.velocity.room(now) }
    }

    /// As a lease's note writes them: the monitors' `b<amount>` and `a<amount>`, then `o<amount>`
    /// for an overdraft and `p<amount>` for a cap per payment, `z<zone>` for a time zone and, per
    /// velocity limit, `v<per>,<amount>,<count>,<from>,<until>,<used amount>,<used count>` (limits
    /// left out empty, times in microseconds since the epoch), joined by `.` (empty: none).
    pub fn to_note(&self) -> String {
        let mut each: Vec<String> =
            self.monitors.0.iter().map(|m| format!("{}{}", &m.side()[..1], m.amount())).collect();
        if self.limits.overdraft != 0 {
            each.push(format!("o{}", self.limits.overdraft));
        }
        if let Some(cap) = self.limits.per_payment {
            each.push(format!("p{cap}"));
        }
        if let Some(zone) = self.velocity.timezone {
            each.push(format!("z{}", zone.name()));
        }
        let or_none = |limit: Option<i64>| limit.map(|n| n.to_string()).unwrap_or_default();
        for Velocity { limit, used } in &self.velocity.velocity {
            each.push(format!(
                "v{},{},{},{},{},{},{}",
                limit.per.name(),
                or_none(limit.amount),
                or_none(limit.count),
                used.from.timestamp_micros(),
                used.until.timestamp_micros(),
                used.amount,
                used.count
            ));
        }
        each.join(".")
    }

    /// What [`Self::to_note`] wrote; `None` if it is not that.
    pub fn from_note(note: &str) -> Option<Rules> {
        let mut rules = Rules::default();
        if note.is_empty() {
            return Some(rules);
        }
        let mut monitors = Vec::new();
        for token in note.split('.') {
            match token.as_bytes().first()? {
                b'z' => {
                    rules.velocity.timezone = Some(token[1..].parse().ok()?);
                    continue;
                }
                b'v' => {
                    rules.velocity.velocity.push(velocity_of_note(&token[1..])?);
                    continue;
                }
                _ => {}
            }
            let amount = token.get(1..)?.parse::<i64>().ok()?;
            match token.as_bytes().first()? {
                b'b' => monitors.push(Monitor::Below(amount)),
                b'a' => monitors.push(Monitor::Above(amount)),
                b'o' => rules.limits.overdraft = amount,
                b'p' => rules.limits.per_payment = Some(amount),
                _ => return None,
            }
        }
        if monitors.len() > Monitors::MOST {
            return None;
        }
        if rules.velocity.velocity.len() > MOST_VELOCITY {
            return None;
        }
        rules.monitors = Monitors::new(monitors);
        Some(rules)
    }
}

/// A velocity limit as [`Rules::to_note`] wrote it, after its `v`.
fn velocity_of_note(token: &str) -> Option<Velocity> {
    let mut fields = token.split(',');
    let per = Per::parse(fields.next()?)?;
    let mut limit = || -> Option<Option<i64>> {
        let field = fields.next()?;
        if field.is_empty() { Some(None) } else { field.parse().ok().map(Some) }
    };
    let (amount, count) = (limit()?, limit()?);
    let mut number = || fields.next()?.parse::<i64>().ok();
    let (from, until) =
        (DateTime::from_timestamp_micros(number()?)?, DateTime::from_timestamp_micros(number()?)?);
    let used = Used { from, until, amount: number()?, count: number()? };
    fields.next().is_none().then_some(Velocity { limit: VelocityLimit { per, amount, count }, used })
}

/// Where a reader of the events is: after the event `seq` of wallet `wallet_id`, at `position`
/// in the feed's order (see `crate::ledger::event`). Written `<position>-<seq>-<wallet id>`: the
/// first two are digits and a wallet id has no other form, so it reads back unambiguously.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventCursor {
    pub position: i64,
    pub wallet_id: String,
    pub seq: i64,
}

impl EventCursor {
    pub fn parse(text: &str) -> Option<EventCursor> {
        let mut parts = text.splitn(3, '-');
        let mut number = || {
            let part = parts.next()?;
            let digits = !part.is_empty() && part.len() <= 19 && part.bytes().all(|b| b.is_ascii_digit());
            digits.then(|| part.parse::<i64>().ok()).flatten()
        };
        let (position, seq) = (number()?, number()?);
        let wallet = WalletId::parse(parts.next()?).ok()?;
        (seq >= 1).then(|| EventCursor { position, wallet_id: wallet.as_str().to_owned(), seq })
    }
}

impl fmt::Display for EventCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}-{}", self.position, self.seq, self.wallet_id)
    }
}

/// Where a movement stands: `posted` (every leg written when it was made) or, for one placed as a
/// hold, `held` until it is `captured` (every leg written then), `voided`, or `expired` (past
/// `expires_at` uncaptured; its amounts are available again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MovementStatus {
    Posted,
    Held,
    Captured,
    Voided,
    Expired,
}

impl Movement {
    /// The `kind` label of its metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Movement::Deposit { .. } => "deposit",
            Movement::Pay { .. } => "pay",
            Movement::Hold { .. } => "hold",
            Movement::Capture { .. } => "capture",
            Movement::Void { .. } => "void",
            Movement::ReleaseExpired => "release_expired",
            Movement::AddMonitor(_) => "add_monitor",
            Movement::RemoveMonitor(_) => "remove_monitor",
            Movement::SetLimits(_) => "set_limits",
        }
    }
}

impl HoldStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            HoldStatus::Held => "held",
            HoldStatus::Captured => "captured",
            HoldStatus::Voided => "voided",
            HoldStatus::Expired => "expired",
        }
    }

    /// Why a hold in this status can be neither captured nor voided; `None` while it is held.
    pub fn refusal(self) -> Option<Refusal> {
        match self {
            HoldStatus::Held => None,
            HoldStatus::Captured => Some(Refusal::HoldCaptured),
            HoldStatus::Voided => Some(Refusal::HoldVoided),
            HoldStatus::Expired => Some(Refusal::HoldExpired),
        }
    }
}

impl Refusal {
    /// The stable code its problem document carries.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::InsufficientFunds { .. } => "insufficient_funds",
            Refusal::BalanceOverflow { .. } => "balance_overflow",
            Refusal::RefundExceedsPayment { .. } => "refund_exceeds_payment",
            Refusal::HoldExpired => "hold_expired",
            Refusal::HoldCaptured => "hold_captured",
            Refusal::HoldVoided => "hold_voided",
            Refusal::CaptureExceedsHold { .. } => "capture_exceeds_hold",
            Refusal::TooManyMonitors { .. } => "too_many_monitors",
            Refusal::MonitorNotFound => "monitor_not_found",
            Refusal::LimitExceeded { .. } => "limit_exceeded",
            Refusal::LimitBelowUsed { .. } => "limit_below_used",
        }
    }
}

/// How much a capture charges: `requested`, or without it the whole of a hold of `held`; never
/// more than was held.
pub fn capture_amount(requested: Option<Amount>, held: i64) -> Result<Amount, Refusal> {
    match requested.map_or(held, Amount::get) {
        amount if amount <= held => Amount::new(amount).map_err(|_| Refusal::CaptureExceedsHold { held }),
        _ => Err(Refusal::CaptureExceedsHold { held }),
    }
}

/// Why a movement was refused on its merits (as opposed to a failure to run it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The available balance (the balance less what active holds reserve) does not cover it.
    #[error("insufficient funds: {available} of the balance of {balance} is available")]
    InsufficientFunds { balance: i64, available: i64 },
    #[error("the deposit would overflow the balance of {balance}")]
    BalanceOverflow { balance: i64 },
    /// The refunds of a payment or transfer would add up to more than it: only `refundable` is
    /// left to refund.
    #[error("only {refundable} is left to refund")]
    RefundExceedsPayment { refundable: i64 },
    /// The hold passed its expiry before it was captured or voided: its amount is released.
    #[error("the hold has expired")]
    HoldExpired,
    #[error("the hold was captured already")]
    HoldCaptured,
    #[error("the hold was voided")]
    HoldVoided,
    /// A capture of more than the hold holds.
    #[error("the capture is more than the {held} held")]
    CaptureExceedsHold { held: i64 },
    #[error("a wallet has at most {most} monitors")]
    TooManyMonitors { most: u8 },
    /// A monitor to remove that the wallet does not have.
    #[error("the wallet has no such monitor")]
    MonitorNotFound,
    /// A debit past one of the wallet's limits: `left` is the most it allows now.
    /// `resets_at`: when the velocity limit passed frees room again.
    #[error("over the wallet's {} limit: at most {left}", limit.as_str())]
    LimitExceeded { limit: LimitKind, left: i64, resets_at: Option<DateTime<Utc>> },
    /// New limits the wallet is already past: it owes `used` beyond its balance and holds (an
    /// overdraft), or its window has taken `used` already (a velocity limit).
    #[error("the wallet already uses {used} of its {} limit", limit.as_str())]
    LimitBelowUsed { limit: LimitKind, used: i64 },
}

impl Refusal {
    /// Whether releasing the wallet's expired holds might lift it: short of funds, or a velocity
    /// limit (an expired hold gives back what its placement counted).
    pub fn spends_past_holds(&self) -> bool {
        matches!(self, Refusal::InsufficientFunds { .. } | Refusal::LimitExceeded { resets_at: Some(_), .. })
    }
}

/// Which of a wallet's limits a debit would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Overdraft,
    PerPayment,
    /// A velocity limit on the amount debited per window.
    Amount(Per),
    /// A velocity limit on the number of debits per window.
    Count(Per),
}

impl LimitKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Overdraft => "overdraft",
            LimitKind::PerPayment => "per_payment",
            LimitKind::Amount(_) => "velocity_amount",
            LimitKind::Count(_) => "velocity_count",
        }
    }

    /// The window of a velocity limit.
    pub fn per(self) -> Option<Per> {
        match self {
            LimitKind::Overdraft | LimitKind::PerPayment => None,
            LimitKind::Amount(per) | LimitKind::Count(per) => Some(per),
        }
    }
}

/// The furthest a lease's fence may stand above the fence of the row it writes: 2^32. Every lease
/// of a wallet takes the next value of its Redis counter, and nearly every lease writes the row,
/// so a legitimate gap is a handful of leases that wrote nothing; four billion of them is a
/// counter moved from outside (a leaked Redis password's `SET`). Such a fence is refused before it
/// is written: written, it would spend the wallet's remaining fences at once (a counter set near
/// 2^63 makes the next payment write the largest fence there is, and every later one would need an
/// operator to reset the row by hand).
pub const MAX_FENCE_STEP: i64 = 1 << 32;

/// How a lease's fence stands against the fence of the row it is to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceStanding {
    /// Above the row's, within [`MAX_FENCE_STEP`]: it may write.
    Above,
    /// At or below the row's: the lease is stale, or Redis lost its counter (the holder lifts it).
    Behind,
    /// More than [`MAX_FENCE_STEP`] above the row's: the counter was moved from outside.
    Implausible,
}

impl FenceStanding {
    /// Where `fence` stands against a row whose last writer had `row_fence`.
    pub fn of(fence: i64, row_fence: i64) -> Self {
        if fence <= row_fence {
            FenceStanding::Behind
        } else if fence - row_fence > MAX_FENCE_STEP {
            FenceStanding::Implausible
        } else {
            FenceStanding::Above
        }
    }

    /// As [`FenceStanding::of`], for a holder that knows whether it has written with `fence`
    /// (`written`): a row at exactly its fence is then its own last write, which it may follow
    /// with the next (a holder that keeps its lease across rounds re-reads the rows it wrote).
    pub fn of_holder(fence: i64, written: bool, row_fence: i64) -> Self {
        if written && fence == row_fence { FenceStanding::Above } else { FenceStanding::of(fence, row_fence) }
    }
}

/// The two wallets of a transfer, which differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parties {
    pub from: WalletId,
    pub to: WalletId,
}

/// A transfer from a wallet to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a transfer moves money between two different wallets")]
pub struct SameWallet;

impl Parties {
    pub fn new(from: WalletId, to: WalletId) -> Result<Self, SameWallet> {
        if from == to { Err(SameWallet) } else { Ok(Self { from, to }) }
    }
}

/// The legs of a movement between wallets: 2 to 16, on as many distinct wallets, each an amount
/// of 1 to 10^12 out of its wallet (negative) or into it (positive), summing to zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Legs(Vec<(WalletId, Amount, bool)>);

impl Legs {
    pub const MAX: usize = 16;
    pub const RULE: &'static str = "2 to 16 legs on distinct wallets, each a whole amount from 1 to \
                                    1000000000000 out (negative) or in (positive), summing to zero";

    /// The legs `(wallet, amount)` of a movement, as a request lists them.
    pub fn new(legs: Vec<(WalletId, i64)>) -> Result<Self, InvalidInput> {
        let invalid = InvalidInput { field: Field::Legs, rule: Self::RULE };
        if !(2..=Self::MAX).contains(&legs.len()) {
            return Err(invalid);
        }
        let mut seen = std::collections::HashSet::new();
        let mut sum: i128 = 0;
        let mut checked = Vec::with_capacity(legs.len());
        for (wallet, amount) in legs {
            let magnitude = Amount::new(amount.checked_abs().unwrap_or(0)).map_err(|_| invalid.clone())?;
            if !seen.insert(wallet.clone()) {
                return Err(invalid);
            }
            sum += i128::from(amount);
            checked.push((wallet, magnitude, amount < 0));
        }
        if sum != 0 {
            return Err(invalid);
        }
        Ok(Self(checked))
    }

    /// Each leg: its wallet, its amount, and whether it takes money out of the wallet.
    pub fn iter(&self) -> impl Iterator<Item = &(WalletId, Amount, bool)> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A movement refused on its merits, and the leg (from 0, in the request's order) it was refused at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegRefusal {
    pub leg: usize,
    pub refusal: Refusal,
}

/// How much a refund returns: `requested`, or without it all that is left, of a payment or
/// transfer of `paid` whose refunds so far add up to `refunded`. The refunds of one payment never
/// add up to more than it.
pub fn refund_amount(requested: Option<Amount>, paid: i64, refunded: i64) -> Result<Amount, Refusal> {
    let refundable = paid - refunded;
    let amount = requested.map_or(refundable, Amount::get);
    if amount > refundable {
        return Err(Refusal::RefundExceedsPayment { refundable });
    }
    Amount::new(amount).map_err(|_| Refusal::RefundExceedsPayment { refundable })
}

/// `total` shared among parts of sizes `sizes` in proportion to them, in whole units: each part's
/// exact share rounded down, and the units left over given one each to the parts whose shares lost
/// the most to rounding (the first of equal ones first). The shares add up to `total` exactly, and
/// none is above its part's size while `total` is at most their sum; all of it gives each part its
/// size. A partial capture or refund of a movement takes each leg's share of it this way.
pub fn pro_rata(total: i64, sizes: &[i64]) -> Vec<i64> {
    let sum: i128 = sizes.iter().map(|&size| i128::from(size)).sum();
    if sum <= 0 {
        return vec![0; sizes.len()];
    }
    let exact: Vec<(i128, i128)> = sizes
        .iter()
        .map(|&size| {
            let scaled = i128::from(total) * i128::from(size);
            (scaled / sum, scaled % sum)
        })
        .collect();
    let mut shares: Vec<i64> = exact.iter().map(|&(share, _)| share as i64).collect();
    let left = total - shares.iter().sum::<i64>();
    let mut by_remainder: Vec<usize> = (0..sizes.len()).collect();
    by_remainder.sort_by_key(|&n| std::cmp::Reverse(exact[n].1));
    for &n in by_remainder.iter().take(left.max(0) as usize) {
        shares[n] += 1;
    }
    shares
}

/// A balance, and what of it active holds reserve. A payment (or a new hold, or a transfer out)
/// must leave what is held untouched: it spends from the available balance only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Funds {
    pub balance: i64,
    pub held: i64,
    /// The wallet's limits: its overdraft moves the floor, its cap bounds each debit.
    pub limits: Limits,
    /// What its velocity limits leave at the moment of the decision.
    pub room: Room,
}

impl Funds {
    /// A balance with `held` of it reserved, and no limits.
    pub fn new(balance: i64, held: i64) -> Funds {
        Funds { balance, held, limits: Limits::NONE, room: Room::NONE }
    }

    /// What may be spent: the balance and the overdraft, less what is held. Never below zero
    /// once decided ([`Limits::replacing`] keeps it so when an overdraft shrinks).
    pub fn available(self) -> i64 {
        self.balance + self.limits.overdraft - self.held
    }

    /// The balance after paying `amount` out of the available balance, or why it cannot be paid:
    /// over the wallet's cap per payment or a velocity limit, or more than is available.
    pub fn pay(self, amount: Amount) -> Result<i64, Refusal> {
        if let Some(cap) = self.limits.per_payment.filter(|cap| amount.get() > *cap) {
            return Err(Refusal::LimitExceeded { limit: LimitKind::PerPayment, left: cap, resets_at: None });
        }
        if let Some(refusal) = self.room.refuses(amount.get()) {
            return Err(refusal);
        }
        if amount.get() <= self.available() {
            Ok(self.balance - amount.get())
        } else {
            Err(Refusal::InsufficientFunds { balance: self.balance, available: self.available() })
        }
    }

    /// The balance after a deposit of `amount`; it never passes `i64::MAX`.
    pub fn deposit(self, amount: Amount) -> Result<i64, Refusal> {
        let balance = self.balance;
        balance.checked_add(amount.get()).ok_or(Refusal::BalanceOverflow { balance })
    }

    /// What is held after reserving `amount` of the available balance, or why it cannot be.
    pub fn hold(self, amount: Amount) -> Result<i64, Refusal> {
        self.pay(amount).map(|_| self.held + amount.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_share_is_in_proportion_and_the_units_left_over_go_where_rounding_took_most() {
        assert_eq!(pro_rata(50, &[900, 100]), [45, 5]);
        assert_eq!(pro_rata(1, &[999, 1]), [1, 0]);
        assert_eq!(pro_rata(2, &[1, 1, 1]), [1, 1, 0], "equal remainders: the first parts first");
        assert_eq!(pro_rata(10, &[3, 3, 4]), [3, 3, 4], "all of it: each part its size");
        assert_eq!(pro_rata(0, &[3, 4]), [0, 0]);
    }

    proptest! {
        #[test]
        fn shares_add_up_to_the_total_and_none_passes_its_part(
            sizes in proptest::collection::vec(0..Amount::MAX, 1..16),
            fraction in 0.0..=1.0_f64,
        ) {
            let sum: i64 = sizes.iter().sum();
            let total = ((sum as f64) * fraction) as i64;
            let shares = pro_rata(total, &sizes);
            prop_assert_eq!(shares.iter().sum::<i64>(), total);
            for (share, size) in shares.iter().zip(&sizes) {
                prop_assert!((0..=*size).contains(share), "{} of {}", share, size);
            }
            prop_assert_eq!(pro_rata(sum, &sizes), sizes);
        }
    }

    #[test]
    fn metadata_is_at_most_sixteen_short_string_pairs_without_nul() {
        let object = |value: serde_json::Value| value.as_object().cloned();
        assert_eq!(Metadata::parse(None), Ok(Metadata::default()));
        assert!(Metadata::parse(object(serde_json::json!({ "a": "1", "b": "" }))).is_ok());
        for bad in [
            serde_json::json!({ "a": 1 }),
            serde_json::json!({ "a": null }),
            serde_json::json!({ "a": ["1"] }),
            serde_json::json!({ "": "1" }),
            serde_json::json!({ "a\u{0}": "1" }),
            serde_json::json!({ "a": "1\u{0}2" }),
        ] {
            let refused = Metadata::parse(object(bad.clone()));
            assert_eq!(refused.map_err(|e| e.field), Err(Field::Metadata), "{bad}");
        }
        let pair = |key: &str, value: &str| (key.to_owned(), value.to_owned());
        assert!(Metadata::from_pairs([pair("a", "1"), pair("a", "2")]).is_err(), "a key twice");
        let keys = |n: usize| (0..n).map(|n| (format!("{n:0>64}"), "é".repeat(256)));
        assert_eq!(Metadata::from_pairs(keys(16)).map(|m| m.pairs().map(BTreeMap::len)), Ok(Some(16)));
        assert!(Metadata::from_pairs(keys(17)).is_err(), "a 17th key");
    }

    proptest! {
        #[test]
        fn metadata_within_its_bounds_is_kept_as_sent_and_past_them_refused(
            pairs in proptest::collection::btree_map("[^\\x00]{1,64}", "[^\\x00]{0,256}", 0..=16),
            extra_key in "[^\\x00]{65,70}",
            extra_value in "[^\\x00]{257,260}",
        ) {
            let kept = Metadata::from_pairs(pairs.clone()).unwrap();
            prop_assert_eq!(kept.pairs().cloned().unwrap_or_default(), pairs.clone());
            prop_assert_eq!(serde_json::to_value(&kept).unwrap(), serde_json::to_value(&pairs).unwrap());
            let with = |key: String, value: String| pairs.clone().into_iter().chain([(key, value)]);
            prop_assert!(Metadata::from_pairs(with(extra_key, "v".into())).is_err(), "a key too long");
            prop_assert!(Metadata::from_pairs(with("k".into(), extra_value)).is_err(), "a value too long");
        }
    }

    #[test]
    fn wallet_ids_are_short_url_safe_words() {
        for ok in ["a", "wallet-42", "A_b-9", &"x".repeat(64)] {
            assert!(WalletId::parse(ok).is_ok(), "{ok:?} should be accepted");
        }
        for bad in ["", &"x".repeat(65), "a/b", "..", "%2e%2e", "a\0b", "a\r\nb", "é", "a b", "a.b"] {
            assert!(WalletId::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn amounts_are_positive_and_bounded() {
        assert!(Amount::new(1).is_ok());
        assert!(Amount::new(Amount::MAX).is_ok());
        for bad in [0, -1, Amount::MAX + 1, i64::MIN, i64::MAX] {
            assert!(Amount::new(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn a_payment_spends_only_what_no_hold_reserves() {
        let amount = |amount| Amount::new(amount).unwrap();
        assert_eq!(Funds::new(10, 0).pay(amount(10)), Ok(0));
        assert_eq!(
            Funds::new(10, 0).pay(amount(11)),
            Err(Refusal::InsufficientFunds { balance: 10, available: 10 })
        );
        assert_eq!(Funds::new(10, 4).pay(amount(6)), Ok(4), "what is held stays");
        assert_eq!(
            Funds::new(10, 4).pay(amount(7)),
            Err(Refusal::InsufficientFunds { balance: 10, available: 6 })
        );
        assert_eq!(Funds::new(10, 4).hold(amount(6)), Ok(10), "a hold reserves the rest");
        assert!(Funds::new(10, 4).hold(amount(7)).is_err());
    }

    #[test]
    fn a_capture_charges_at_most_what_was_held() {
        let some = |amount| Some(Amount::new(amount).unwrap());
        assert_eq!(capture_amount(None, 40), Ok(Amount(40)), "all of it");
        assert_eq!(capture_amount(some(25), 40), Ok(Amount(25)));
        assert_eq!(capture_amount(some(41), 40), Err(Refusal::CaptureExceedsHold { held: 40 }));
        assert_eq!(HoldStatus::Held.refusal(), None);
        assert_eq!(HoldStatus::Voided.refusal(), Some(Refusal::HoldVoided));
    }

    #[test]
    fn holds_last_from_a_second_to_a_week() {
        assert!(HoldLife::seconds(1).is_ok() && HoldLife::seconds(604_800).is_ok());
        for bad in [0, -1, 604_801, i64::MIN] {
            assert!(HoldLife::seconds(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn refunds_never_add_up_to_more_than_the_payment() {
        let some = |amount| Some(Amount::new(amount).unwrap());
        assert_eq!(refund_amount(None, 100, 30), Ok(Amount::new(70).unwrap()), "the rest");
        assert_eq!(refund_amount(some(70), 100, 30), Ok(Amount::new(70).unwrap()));
        assert_eq!(refund_amount(some(71), 100, 30), Err(Refusal::RefundExceedsPayment { refundable: 70 }));
        assert_eq!(refund_amount(None, 100, 100), Err(Refusal::RefundExceedsPayment { refundable: 0 }));
        assert_eq!(refund_amount(some(1), 100, 100), Err(Refusal::RefundExceedsPayment { refundable: 0 }));
    }

    #[test]
    fn a_caller_uses_its_own_wallets_and_pays_into_those_it_is_granted() {
        let shop = Access::own_wallets("shop");
        assert!(shop.may_use(Some("shop")));
        assert!(!shop.may_use(Some("bank")), "another caller's wallet");
        assert!(!shop.may_use(None), "a wallet opened before owners were recorded");
        assert!(!shop.may_pay_into(Some("bank")));
        let granted = Access { pays_into: Arc::from([Arc::from("bank")]), ..shop };
        assert!(
            granted.may_pay_into(Some("bank")) && !granted.may_use(Some("bank")),
            "pays into, cannot move"
        );
        let ops = Access { every_wallet: true, ..Access::own_wallets("ops") };
        assert!(ops.may_use(Some("shop")) && ops.may_use(None) && ops.may_pay_into(Some("bank")));
    }

    #[test]
    fn a_transfer_needs_two_wallets() {
        let id = |id| WalletId::parse(id).unwrap();
        assert_eq!(Parties::new(id("a"), id("a")), Err(SameWallet));
        assert!(Parties::new(id("a"), id("b")).is_ok());
    }

    #[test]
    fn a_fence_writes_only_a_little_above_the_row() {
        assert_eq!(FenceStanding::of(8, 7), FenceStanding::Above);
        assert_eq!(FenceStanding::of(7, 7), FenceStanding::Behind, "a fence issued twice");
        assert_eq!(FenceStanding::of(3, 7), FenceStanding::Behind);
        assert_eq!(FenceStanding::of(7 + MAX_FENCE_STEP, 7), FenceStanding::Above);
        assert_eq!(FenceStanding::of(8 + MAX_FENCE_STEP, 7), FenceStanding::Implausible);
        assert_eq!(FenceStanding::of(i64::MAX, 0), FenceStanding::Implausible, "no overflow");
        assert_eq!(FenceStanding::of(i64::MAX, i64::MAX - 1), FenceStanding::Above);
        assert_eq!(FenceStanding::of_holder(7, true, 7), FenceStanding::Above, "its own last write");
        assert_eq!(FenceStanding::of_holder(7, false, 7), FenceStanding::Behind);
        assert_eq!(FenceStanding::of_holder(7, true, 8), FenceStanding::Behind);
        assert_eq!(FenceStanding::of_holder(8 + MAX_FENCE_STEP, true, 7), FenceStanding::Implausible);
    }

    #[test]
    fn a_movement_has_two_to_sixteen_legs_on_distinct_wallets_summing_to_zero() {
        let legs = |spec: &[(&str, i64)]| {
            Legs::new(spec.iter().map(|&(id, amount)| (WalletId::parse(id).unwrap(), amount)).collect())
        };
        assert!(legs(&[("a", -10), ("b", 10)]).is_ok());
        assert!(legs(&[("a", -10), ("b", 7), ("c", 3)]).is_ok());
        let sixteen: Vec<(String, i64)> =
            (0..16).map(|n| (format!("w{n}"), if n == 0 { -15 } else { 1 })).collect();
        let sixteen: Vec<(&str, i64)> = sixteen.iter().map(|(id, a)| (id.as_str(), *a)).collect();
        assert!(legs(&sixteen).is_ok());
        let seventeen: Vec<(String, i64)> =
            (0..17).map(|n| (format!("w{n}"), if n == 0 { -16 } else { 1 })).collect();
        let seventeen: Vec<(&str, i64)> = seventeen.iter().map(|(id, a)| (id.as_str(), *a)).collect();
        for bad in [
            vec![],
            vec![("a", 0)],
            vec![("a", -10), ("b", 9)],
            vec![("a", -10), ("a", 10)],
            vec![("a", 0), ("b", 0)],
            vec![("a", i64::MIN), ("b", 1)],
            vec![("a", -(Amount::MAX + 1)), ("b", Amount::MAX + 1)],
            seventeen,
        ] {
            assert_eq!(legs(&bad).unwrap_err().field, Field::Legs, "{bad:?}");
        }
    }

    #[test]
    fn a_deposit_never_overflows_the_balance() {
        let max = Amount::new(Amount::MAX).unwrap();
        assert_eq!(Funds::new(5, 0).deposit(max), Ok(5 + Amount::MAX));
        assert_eq!(
            Funds::new(i64::MAX - 1, 0).deposit(max),
            Err(Refusal::BalanceOverflow { balance: i64::MAX - 1 })
        );
    }

    #[test]
    fn each_event_type_reads_back_from_its_name_and_only_its_name() {
        for kind in EventType::ALL {
            assert_eq!(EventType::parse(kind.as_str()), Some(kind));
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
        }
        for name in ["", "payment", "payment.refused", "PAYMENT.ACCEPTED", "payment.accepted "] {
            assert_eq!(EventType::parse(name), None, "{name:?}");
        }
    }

    #[test]
    fn an_entry_is_the_event_of_what_wrote_it() {
        let between = EventType::TransferAccepted;
        let of = |kind, charges_hold| EventType::of_entry(kind, charges_hold, between);
        assert_eq!(of(EntryKind::Open, false), EventType::WalletOpened);
        assert_eq!(of(EntryKind::Deposit, false), EventType::DepositAccepted);
        assert_eq!(of(EntryKind::Pay, false), EventType::PaymentAccepted);
        assert_eq!(of(EntryKind::Refund, false), EventType::RefundAccepted);
        assert_eq!(of(EntryKind::TransferIn, false), between);
        assert_eq!(of(EntryKind::TransferOut, false), between);
        // A capture's entry, of a hold of one wallet or of a held movement's debit leg.
        assert_eq!(of(EntryKind::Pay, true), EventType::HoldCaptured);
        assert_eq!(of(EntryKind::TransferOut, true), EventType::HoldCaptured);
        assert_eq!(EventType::of_settled(HoldStatus::Voided), EventType::HoldVoided);
        assert_eq!(EventType::of_settled(HoldStatus::Expired), EventType::HoldExpired);
    }

    #[test]
    fn a_cursor_reads_only_as_the_feed_writes_it() {
        let cursor = EventCursor { position: 7_450, wallet_id: "shop-9_a".into(), seq: 12 };
        assert_eq!(cursor.to_string(), "7450-12-shop-9_a");
        assert_eq!(EventCursor::parse("7450-12-shop-9_a"), Some(cursor));
        for bad in [
            "",
            "7450",
            "7450-12",
            "7450-12-",
            "7450-0-w",
            "-12-w",
            "x-12-w",
            "7450-+12-w",
            "7450-12-w w",
            "99999999999999999999-1-w",
            "7450-12-w/1",
        ] {
            assert_eq!(EventCursor::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_monitor_is_crossed_going_past_it_not_staying_on_one_side() {
        let below = Monitor::Below(50);
        assert!(below.crossed(50, 49) && below.crossed(100, 0));
        assert!(!below.crossed(49, 10) && !below.crossed(100, 50) && !below.crossed(10, 100));
        let above = Monitor::Above(50);
        assert!(above.crossed(50, 51) && above.crossed(0, 100));
        assert!(!above.crossed(51, 100) && !above.crossed(0, 50) && !above.crossed(100, 10));
    }

    #[test]
    fn monitors_are_kept_sorted_once_each_and_at_most_eight() {
        let mut monitors = Monitors::NONE;
        for amount in [70, 10, 40, 10] {
            monitors = monitors.with(Monitor::Below(amount)).unwrap();
        }
        assert_eq!(monitors.list(), [Monitor::Below(10), Monitor::Below(40), Monitor::Below(70)]);
        for amount in 0..5 {
            monitors = monitors.with(Monitor::Above(amount)).unwrap();
        }
        assert_eq!(monitors.list().len(), Monitors::MOST);
        assert_eq!(monitors.with(Monitor::Above(99)), Err(Refusal::TooManyMonitors { most: 8 }));
        assert_eq!(monitors.with(Monitor::Above(4)).as_ref(), Ok(&monitors), "one already set");
        assert_eq!(monitors.without(Monitor::Above(99)), Err(Refusal::MonitorNotFound));
        let fewer = monitors.without(Monitor::Below(40)).unwrap();
        assert!(!fewer.list().contains(&Monitor::Below(40)) && fewer.list().len() == 7);
        let crossed: Vec<Monitor> = fewer.crossed(80, 5).collect();
        assert_eq!(crossed, [Monitor::Below(10), Monitor::Below(70)]);
    }

    #[test]
    fn a_note_that_is_not_rules_is_refused() {
        assert_eq!(Rules::from_note(""), Some(Rules::NONE));
        let rules = Rules {
            monitors: Monitors::new([Monitor::Below(-5), Monitor::Above(7)]),
            limits: Limits { overdraft: 300, per_payment: Some(50) },
            velocity: Velocities::NONE,
        };
        assert_eq!(Rules::from_note("b-5.a7.o300.p50"), Some(rules));
        let bad_velocity =
            ["vday", "vday,1,,0,86400000000,0", "vweek,,,0,1,0,0,9", "vyear,1,,0,1,0,0", "zMars/Base"];
        for bad in ["x5", "b", "b5.", ".a7", "b5..a7", "b5a7", "o", "p1.5", "a1.a2.a3.a4.a5.a6.a7.a8.a9"]
            .into_iter()
            .chain(bad_velocity)
        {
            assert_eq!(Rules::from_note(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_overdraft_moves_the_floor_and_a_cap_bounds_each_debit() {
        let amount = |amount| Amount::new(amount).unwrap();
        let limits = Limits { overdraft: 100, per_payment: Some(60) };
        let funds = Funds { limits, ..Funds::new(30, 10) };
        assert_eq!(funds.available(), 120);
        assert_eq!(funds.pay(amount(60)), Ok(-30), "into the overdraft");
        let over_cap =
            Err(Refusal::LimitExceeded { limit: LimitKind::PerPayment, left: 60, resets_at: None });
        assert_eq!(funds.pay(amount(61)), over_cap);
        assert_eq!(funds.hold(amount(61)), over_cap, "a hold is a debit too");
        let deep = Funds { balance: -60, ..funds };
        assert_eq!(deep.pay(amount(31)), Err(Refusal::InsufficientFunds { balance: -60, available: 30 }));
        // Shrinking the overdraft below what the wallet owes (60, and 10 held) is refused.
        assert_eq!(
            Limits { overdraft: 69, per_payment: None }.replacing(deep),
            Err(Refusal::LimitBelowUsed { limit: LimitKind::Overdraft, used: 70 })
        );
        assert!(Limits { overdraft: 70, per_payment: None }.replacing(deep).is_ok());
    }

    proptest! {
        #[test]
        fn every_set_of_rules_reads_back_from_its_note(
            monitors in proptest::collection::vec(
                prop_oneof![any::<i64>().prop_map(Monitor::Below), any::<i64>().prop_map(Monitor::Above)],
                0..=Monitors::MOST,
            ),
            overdraft in prop_oneof![Just(0_i64), 1..i64::MAX],
            per_payment in proptest::option::of(1..i64::MAX),
            velocity in proptest::collection::vec(
                (
                    prop_oneof![Just(Per::Day), Just(Per::Week), Just(Per::Month), (1..=Per::LONGEST).prop_map(Per::Every)],
                    proptest::option::of(1..i64::MAX),
                    proptest::option::of(1..i64::MAX),
                    0..4_000_000_000_000_000_i64,
                    1..1_000_000_000_000_i64,
                    any::<i64>(),
                    any::<i64>(),
                ),
                0..=MOST_VELOCITY,
            ),
            timezone in proptest::option::of(proptest::sample::select(vec![chrono_tz::Tz::UTC, chrono_tz::Tz::Europe__Paris, chrono_tz::Tz::America__Argentina__Buenos_Aires, chrono_tz::Tz::Etc__GMTPlus5])),
        ) {
            let velocity = velocity
                .into_iter()
                .map(|(per, amount, count, from, span, taken, times)| {
                    let at = |micros| DateTime::from_timestamp_micros(micros).unwrap();
                    let used = Used { from: at(from), until: at(from + span), amount: taken, count: times };
                    Velocity { limit: VelocityLimit { per, amount, count }, used }
                })
                .collect();
            let velocity = Velocities { velocity, timezone };
            let rules = Rules { monitors: Monitors::new(monitors), limits: Limits { overdraft, per_payment }, velocity };
            prop_assert_eq!(Rules::from_note(&rules.to_note()), Some(rules));
        }
    }

    proptest! {
        #[test]
        fn every_cursor_reads_back_as_itself(
            position in 0..i64::MAX,
            wallet_id in "[A-Za-z0-9_-]{1,64}",
            seq in 1..i64::MAX,
        ) {
            let cursor = EventCursor { position, wallet_id, seq };
            prop_assert_eq!(EventCursor::parse(&cursor.to_string()), Some(cursor));
        }
    }
}
