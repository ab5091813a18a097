//! The decision of movements between wallets: transfers and movements of many legs, decided in
//! arrival order against the wallets they touch, as read under the leases of every one of them
//! (or, under Postgres alone, with their rows locked).
//!
//! A round carries them as one job per set of wallets (a transfer alone; a payee's transfers from
//! many payers; a movement of 2 to 16 legs, placed, captured or voided), decided here with no
//! I/O. Each movement applies every leg or none ([`decide_legs`]) and each leg sees what the
//! movements before it left, so a payer paying twice in one job pays from its new balance. A
//! refusal changes nothing; a key decides once, as in a wallet's batch ([`super::decide_round`]).
//!
//! A held movement reserves each debit leg with a hold and writes no entry; its capture writes
//! every leg's entry and settles every hold, its void releases every hold, both only while every
//! hold is still held and before `expires_at` by the deciding replica's clock. Past it, a capture
//! or a void is refused `hold_expired` and its write releases every hold still held, so the holds
//! of one movement are captured together or not at all.

use super::{Held, Known, Leg, Links, Settled, as_written, decide_legs, settled};
use crate::domain::{
    self, EntryKind, EventType, Funds, HoldLife, HoldStatus, LegRefusal, Metadata, MovementStatus, Parties,
    Room, pro_rata,
};
use crate::idempotency::{Keyed, Prior, StoredResponse};
use crate::ledger::Entry;
use crate::ledger::event::EventWrite;
use crate::ledger::hold::{Hold, NewHold};
use crate::ledger::transfer::{HeldLeg, MovementHold, MovementRecord, Transfer};
use crate::wallet::transfer::{Done, MovementRecordOutcome, RefundOutcome, TransferOutcome};
use crate::wallet::{Access, Amount, Field, Legs, Refusal, WalletError, WalletId};
use chrono::{DateTime, Utc};
use std::collections::{HashMap, HashSet};
use uuid::Uuid;

/// A key's `(caller, scope, key)`.
type KeyAt<'a> = (&'a str, &'a str, &'a str);

/// A movement between wallets for a caller, with its idempotency key if the request had one.
#[derive(Debug)]
pub enum LegsOp {
    /// `amount` from `parties.from` to `parties.to`: the two-leg case.
    Transfer {
        access: Access,
        parties: Parties,
        amount: Amount,
        reference: Option<String>,
        metadata: Metadata,
        key: Option<Keyed<TransferOutcome>>,
    },
    /// Money between 2 to 16 wallets at once, its legs summing to zero; with `hold`, reserved on
    /// every debit leg for that long instead, to be captured or voided as a whole.
    Movement {
        access: Access,
        legs: Legs,
        reference: Option<String>,
        metadata: Metadata,
        hold: Option<HoldLife>,
        key: Option<Keyed<MovementRecordOutcome>>,
    },
    /// A held movement captured (all of it, or part) or voided: every leg at once.
    Settle {
        access: Access,
        held: Box<HeldMovement>,
        settle: SettleAs,
        key: Option<Keyed<MovementRecordOutcome>>,
    },
    /// Money back for a payment, a transfer or a movement: `amount` (without it, all that is
    /// left), every leg of the original reversed by its share of it ([`pro_rata`] of what each
    /// leg has left to refund), so the refunds of one never add up to more than it moved, on any
    /// leg. The caller may use every wallet the refund takes money from (for a payment's refund,
    /// which takes from none, the wallet it pays into); the money goes back where it came from,
    /// whoever owns that.
    Refund {
        access: Access,
        of: RefundOf,
        legs: Vec<(WalletId, Amount, bool)>,
        amount: Option<Amount>,
        metadata: Metadata,
    },
}

/// How a held movement is settled: captured, all of it or `amount` of it taken from every leg
/// pro rata ([`pro_rata`]: each debit leg's share of it from its hold, the rest of the hold
/// released, and each credit leg its share), or voided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleAs {
    Capture(Option<Amount>),
    Void,
}

/// What a refund gives money back for, with its key if the request had one. The original's legs
/// never change, so they are read before its leases are taken; what has been refunded of it so
/// far is read under them ([`Known::refunded`]).
#[derive(Debug)]
pub enum RefundOf {
    /// A wallet's payment (its `pay` entry): a `refund` entry naming it, money from outside.
    Payment { payment: Uuid, key: Option<Keyed<RefundOutcome>> },
    /// A transfer: a transfer back from its payee to its payer, naming it.
    Transfer { transfer: Uuid, key: Option<Keyed<TransferOutcome>> },
    /// A movement of many legs: a movement of every leg back, naming it.
    Movement { movement: Uuid, key: Option<Keyed<MovementRecordOutcome>> },
}

impl RefundOf {
    /// The payment, transfer or movement refunded.
    pub fn id(&self) -> Uuid {
        match self {
            RefundOf::Payment { payment: id, .. }
            | RefundOf::Transfer { transfer: id, .. }
            | RefundOf::Movement { movement: id, .. } => *id,
        }
    }
}

/// A held movement as found before its leases were taken: its legs and holds never change, and
/// its holds' statuses are decided on as read under the leases.
#[derive(Debug, Clone)]
pub struct HeldMovement {
    pub record: MovementRecord,
    pub legs: Legs,
    pub expires_at: DateTime<Utc>,
    /// Each leg's hold (a debit's), in the legs' order.
    pub holds: Vec<Option<Uuid>>,
}

impl HeldMovement {
    /// The held movement `record` is, if it was placed as a hold and its legs read back as valid.
    pub fn of(record: MovementRecord) -> Option<HeldMovement> {
        let hold = record.hold.clone()?;
        let legs = hold
            .legs
            .iter()
            .map(|leg| WalletId::parse(&leg.wallet_id).ok().map(|id| (id, leg.amount)))
            .collect::<Option<Vec<_>>>()?;
        let legs = Legs::new(legs).ok()?;
        let holds = hold.legs.iter().map(|leg| leg.hold_id).collect();
        Some(HeldMovement { record, legs, expires_at: hold.expires_at, holds })
    }
}

impl LegsOp {
    /// Each leg: its wallet, its amount, and whether it takes money out of the wallet.
    pub fn legs(&self) -> Vec<(&WalletId, Amount, bool)> {
        fn of(legs: &Legs) -> Vec<(&WalletId, Amount, bool)> {
            legs.iter().map(|(id, amount, debit)| (id, *amount, *debit)).collect()
        }
        match self {
            LegsOp::Transfer { parties, amount, .. } => {
                vec![(&parties.from, *amount, true), (&parties.to, *amount, false)]
            }
            LegsOp::Movement { legs, .. } => of(legs),
            LegsOp::Settle { held, .. } => of(&held.legs),
            // A refund's legs are the original's, reversed.
            LegsOp::Refund { legs, .. } => {
                legs.iter().map(|(id, amount, debit)| (id, *amount, !debit)).collect()
            }
        }
    }

    /// The wallets it takes money out of, each with the scope of that wallet's keys, if it has a
    /// key: its key is stored there too, as an alias ([`KeyAlias`]). A key is then one request's
    /// whichever route it is sent to: a payment's key is refused (`idempotency_key_reused`) to a
    /// movement out of that wallet, and this one's to a payment.
    pub fn key_aliases(&self) -> Vec<(&WalletId, String)> {
        if self.key().is_none() {
            return Vec::new();
        }
        self.legs().into_iter().filter(|(_, _, debit)| *debit).map(|(id, _, _)| (id, id.scope())).collect()
    }

    /// The payment, transfer or movement it refunds, if it is a refund.
    pub fn refunds(&self) -> Option<&RefundOf> {
        match self {
            LegsOp::Refund { of, .. } => Some(of),
            _ => None,
        }
    }

    /// The metric's `kind` label.
    pub fn kind(&self) -> &'static str {
        match self {
            LegsOp::Transfer { .. } => "transfer",
            LegsOp::Movement { hold: None, .. } => "movement",
            LegsOp::Movement { hold: Some(_), .. } => "movement_hold",
            LegsOp::Settle { settle: SettleAs::Capture(_), .. } => "movement_capture",
            LegsOp::Settle { settle: SettleAs::Void, .. } => "movement_void",
            LegsOp::Refund { of: RefundOf::Payment { .. }, .. } => "payment_refund",
            LegsOp::Refund { of: RefundOf::Transfer { .. }, .. } => "transfer_refund",
            LegsOp::Refund { of: RefundOf::Movement { .. }, .. } => "movement_refund",
        }
    }

    /// The holds it settles, which the round reads by id.
    pub fn settles(&self) -> impl Iterator<Item = Uuid> + '_ {
        let holds = match self {
            LegsOp::Settle { held, .. } => held.holds.as_slice(),
            _ => &[],
        };
        holds.iter().flatten().copied()
    }

    fn access(&self) -> &Access {
        let (LegsOp::Transfer { access, .. }
        | LegsOp::Movement { access, .. }
        | LegsOp::Settle { access, .. }
        | LegsOp::Refund { access, .. }) = self;
        access
    }

    /// Whether the caller may take money out of (`debit`) or pay into a wallet owned by `owner`.
    fn may_touch(&self, debit: bool, owner: Option<&str>) -> bool {
        match self {
            // A refund of a payment takes money from no wallet: its wallet must be the caller's.
            LegsOp::Refund { of: RefundOf::Payment { .. }, .. } => self.access().may_use(owner),
            LegsOp::Refund { .. } if !debit => true,
            _ if debit => self.access().may_use(owner),
            _ => self.access().may_pay_into(owner),
        }
    }

    /// The answer when the wallet of leg `n` does not exist, or is not the caller's to touch.
    fn missing(&self, n: usize) -> WalletError {
        match self {
            LegsOp::Transfer { .. } => {
                WalletError::PartyNotFound { field: if n == 0 { Field::From } else { Field::To } }
            }
            LegsOp::Movement { .. } | LegsOp::Settle { .. } => WalletError::LegNotFound { leg: n },
            LegsOp::Refund { of: RefundOf::Payment { .. }, .. } => WalletError::NotFound,
            LegsOp::Refund { of: RefundOf::Transfer { .. }, .. } => WalletError::TransferNotFound,
            LegsOp::Refund { of: RefundOf::Movement { .. }, .. } => WalletError::MovementNotFound,
        }
    }

    /// The key's reference and the request's fingerprint, if it had one.
    pub fn key(&self) -> Option<(crate::ledger::idempotency::KeyRef<'_>, &[u8; 32])> {
        match self {
            LegsOp::Transfer { key: Some(key), .. } => Some((key.at(), &key.fingerprint)),
            LegsOp::Movement { key: Some(key), .. }
            | LegsOp::Settle { key: Some(key), .. }
            | LegsOp::Refund { of: RefundOf::Movement { key: Some(key), .. }, .. } => {
                Some((key.at(), &key.fingerprint))
            }
            LegsOp::Refund { of: RefundOf::Transfer { key: Some(key), .. }, .. } => {
                Some((key.at(), &key.fingerprint))
            }
            LegsOp::Refund { of: RefundOf::Payment { key: Some(key), .. }, .. } => {
                Some((key.at(), &key.fingerprint))
            }
            _ => None,
        }
    }
}

/// One job's wallet in a round: its id, the fence its write carries, and the row as read (`None`:
/// no such wallet).
#[derive(Debug, Clone, Copy)]
pub struct LegsWallet<'a> {
    pub id: &'a WalletId,
    pub fence: i64,
    pub held: Option<&'a Held>,
}

/// How one movement fared.
#[derive(Debug)]
enum LegsDecision {
    /// Runs, with this outcome once written.
    Accepted(Done),
    Refused(WalletError),
    /// Answered without running: a wallet missing or hidden, or a key used before this job.
    Answered(WalletError),
    /// Its key is the one an earlier movement of this job (the n-th) carries, for the same request.
    SameAs(usize),
}

/// A job's movements decided: what to write, and how to answer each once the write is known.
#[derive(Debug)]
pub struct LegsPlan {
    decisions: Vec<LegsDecision>,
    /// The ledger entries of the accepted movements, in order.
    pub entries: Vec<Entry>,
    /// The holds placed by held movements.
    pub placed: Vec<Hold>,
    /// The holds settled (the index of their wallet in the job, and the settlement): expired ones
    /// released, and those of held movements captured, voided or found expired.
    pub settled: Vec<(usize, Settled)>,
    /// Each wallet after the movements, in the job's order (`None`: no such wallet).
    pub after: Vec<Option<Held>>,
    pub transfers: Vec<Transfer>,
    /// What happened to each wallet, in the order it happened: an event per entry, and per hold
    /// placed or settled without one.
    pub events: Vec<EventWrite>,
    /// The movements made (not those settled: they are stored already).
    pub movements: Vec<MovementRecord>,
    /// The response to store for each keyed movement that ran: (index, response, its first entry).
    pub responses: Vec<(usize, StoredResponse, Option<Uuid>)>,
    /// Where each of those keys is stored again ([`LegsOp::key_aliases`]).
    pub key_aliases: Vec<KeyAlias>,
}

/// A movement's key stored again in the scope of a wallet it takes money out of. It is there to
/// refuse any other request sent with that key on that wallet, never to answer: a retry of the
/// movement itself is answered from the movement's own key, which one statement writes with its
/// aliases and the same expiry, so neither is ever found without the other. Its response is then
/// only the status and what names the movement (`{"id": ...}`, which `walletlock audit` checks),
/// not the whole body again: a transfer's key costs one stored response, not two.
#[derive(Debug)]
pub struct KeyAlias {
    /// The movement's index in the job.
    pub op: usize,
    /// The wallet's index in the job.
    pub wallet: usize,
    pub scope: String,
    /// `{"id": ...}` of what the movement made, or `{}` for a refusal.
    pub body: Vec<u8>,
}

impl LegsPlan {
    /// Whether any movement runs: then the job's wallets must be written (with only refusals,
    /// checked) before it is answered.
    pub fn runs(&self) -> bool {
        !self.settled.is_empty()
            || self
                .decisions
                .iter()
                .any(|d| matches!(d, LegsDecision::Accepted(_) | LegsDecision::Refused(_)))
    }

    /// Each movement's result, given whether the job's write matched (`false`: nothing of it was
    /// written) or failed with `failure`.
    pub fn results(&self, written: Result<bool, &WalletError>) -> Vec<Result<Done, WalletError>> {
        let ran = |outcome| as_written(outcome, written);
        let mut results: Vec<Result<Done, WalletError>> = Vec::with_capacity(self.decisions.len());
        for decision in &self.decisions {
            let result = match decision {
                LegsDecision::Accepted(done) => ran(Ok(done.clone())),
                LegsDecision::Refused(err) => ran(Err(err.clone())),
                LegsDecision::Answered(err) => Err(err.clone()),
                LegsDecision::SameAs(first) => match &results[*first] {
                    Ok(_) | Err(WalletError::Refused(_) | WalletError::LegRefused { .. }) => {
                        match self.responses.iter().find(|(n, _, _)| n == first) {
                            Some((_, response, _)) => {
                                Err(WalletError::AlreadyRan(Prior::Replay(response.clone())))
                            }
                            None => Err(WalletError::internal("no response for a keyed movement")),
                        }
                    }
                    Err(err) => Err(err.clone()),
                },
            };
            results.push(result);
        }
        results
    }
}

/// One job's decision in progress: each wallet as the movements decided so far leave it, and each
/// hold as they settled it.
struct Deciding<'a, 'k> {
    wallets: &'a [LegsWallet<'a>],
    state: Vec<Option<Held>>,
    status_now: HashMap<Uuid, HoldStatus>,
    /// What the refunds this job made gave back, beside what [`Known::refunded`] says of those
    /// before it.
    refunded_now: super::Refunds,
    known: Known<'k>,
    plan: LegsPlan,
}

/// How one movement was decided: made, or refused naming the leg (a refusal changes nothing but
/// the holds it found expired).
type Decided = Result<Made, (usize, Refusal)>;

/// A movement accepted, before it is answered.
enum Made {
    /// A refund of a payment: its `refund` entry.
    Entry(Entry),
    Transfer(Box<Transfer>),
    /// A movement posted or placed (`new`: its row is to be written), or one settled.
    Movement {
        record: MovementRecord,
        new: bool,
    },
}

impl Deciding<'_, '_> {
    /// The legs of `op`, each against its wallet as the job left it (`touched`: the wallet of each
    /// leg, by index), with `held_off` taken off what each wallet holds (a capture's own holds).
    /// Its debits count against the wallets' velocity limits only if `counted` (not a capture's,
    /// counted when placed, nor a refund's).
    fn legs<'o>(&self, op: &'o LegsOp, touched: &[usize], held_off: &[i64], counted: bool) -> Vec<Leg<'o>> {
        op.legs()
            .into_iter()
            .zip(touched)
            .zip(held_off)
            .map(|(((wallet, amount, debit), &w), off)| {
                let held = self.state[w].as_ref().expect("touched wallets exist");
                let funds = held.rules.funds(held.balance, held.held - off, self.known.now);
                Leg {
                    wallet,
                    funds: if counted { funds } else { Funds { room: Room::NONE, ..funds } },
                    version: held.version,
                    fence: self.wallets[w].fence,
                    amount,
                    debit,
                }
            })
            .collect()
    }

    /// Applies `entries` (one a leg, in `touched`'s order) of a movement whose legs are events of
    /// type `between` to the job's wallets, its debits counted against their velocity limits if
    /// `counted` (as [`Self::legs`] decided them).
    /// Each entry's event comes first, then those of the monitors it crossed.
    fn apply(&mut self, entries: &[Entry], touched: &[usize], between: EventType, counted: bool) {
        let mut crossings = Vec::new();
        for (entry, &w) in entries.iter().zip(touched) {
            let held = self.state[w].as_mut().expect("touched wallets exist");
            crossings.extend(EventWrite::of_crossings(entry, &held.rules.monitors, held.balance));
            if counted && entry.balance < held.balance {
                held.rules.velocity.count(entry.amount, self.known.now);
            }
            (held.balance, held.version) = (entry.balance, entry.version);
        }
        self.plan.events.extend(entries.iter().map(|entry| EventWrite::of_entry(entry, between)));
        self.plan.events.extend(crossings);
        self.plan.entries.extend(entries.iter().cloned());
    }

    /// Settles hold `hold` of wallet `w` as `status`, releasing what it held; a capture charged
    /// `captured` of it, by its entry `capture_entry` (none for a leg whose share was nothing).
    fn settle(
        &mut self,
        w: usize,
        hold: &Hold,
        status: HoldStatus,
        captured: i64,
        capture_entry: Option<Uuid>,
    ) {
        let held = self.state[w].as_mut().expect("touched wallets exist");
        held.held -= hold.amount;
        // What its placement counted and it does not take goes back: a capture keeps its count.
        let count = if status == HoldStatus::Captured { 0 } else { 1 };
        held.rules.velocity.give_back(hold.created_at, hold.amount - captured, count, self.known.now);
        self.status_now.insert(hold.id, status);
        // A capture that charged something is its entry's event.
        if capture_entry.is_none() {
            self.plan.events.push(EventWrite::of_hold(&hold.wallet_id, hold.id, status));
        }
        self.plan.settled.push((w, settled(hold.id, status, captured, capture_entry)));
    }

    /// A transfer, or a movement posted at once.
    fn post(&mut self, op: &LegsOp, touched: &[usize], now: DateTime<Utc>) -> Decided {
        let legs = self.legs(op, touched, &vec![0; touched.len()], true);
        let id = Uuid::new_v4();
        let (reference, metadata, parties) = match op {
            LegsOp::Transfer { reference, metadata, parties, .. } => (reference, metadata, Some(parties)),
            LegsOp::Movement { reference, metadata, .. } => (reference, metadata, None),
            LegsOp::Settle { .. } | LegsOp::Refund { .. } => unreachable!("posted by its own arm"),
        };
        let links =
            Links { movement: Some(id), reference: reference.as_deref(), metadata, refund_of: None, now };
        let entries = decide_legs(&legs, (EntryKind::TransferOut, EntryKind::TransferIn), links)?;
        let between =
            if parties.is_some() { EventType::TransferAccepted } else { EventType::MovementAccepted };
        self.apply(&entries, touched, between, true);
        Ok(match parties {
            Some(parties) => {
                let [from_entry, to_entry]: [Entry; 2] = entries.try_into().expect("two legs, two entries");
                Made::Transfer(Box::new(Transfer {
                    id,
                    from: parties.from.as_str().to_owned(),
                    to: parties.to.as_str().to_owned(),
                    amount: from_entry.amount,
                    reference: reference.clone(),
                    metadata: metadata.clone(),
                    refund_of: None,
                    from_entry,
                    to_entry,
                    created_at: now,
                }))
            }
            None => Made::Movement {
                record: MovementRecord {
                    id,
                    reference: reference.clone(),
                    metadata: metadata.clone(),
                    status: MovementStatus::Posted,
                    legs: entries,
                    hold: None,
                    refund_of: None,
                    created_at: now,
                },
                new: true,
            },
        })
    }

    /// A movement placed as a hold: every debit leg reserved for `life`, no entry written.
    fn place(&mut self, op: &LegsOp, touched: &[usize], life: HoldLife, now: DateTime<Utc>) -> Decided {
        let LegsOp::Movement { reference, metadata, .. } = op else {
            unreachable!("only a movement is placed")
        };
        let legs = self.legs(op, touched, &vec![0; touched.len()], true);
        let id = Uuid::new_v4();
        let expires_at = life.expiry_from(now);
        let mut holds: Vec<Option<Hold>> = Vec::with_capacity(legs.len());
        for (n, leg) in legs.iter().enumerate() {
            if !leg.debit {
                holds.push(None);
                continue;
            }
            leg.funds.hold(leg.amount).map_err(|refusal| (n, refusal))?;
            let new = NewHold {
                wallet_id: leg.wallet.as_str().to_owned(),
                amount: leg.amount.get(),
                expires_at,
                reference: reference.clone(),
                metadata: metadata.clone(),
                fence: leg.fence,
                movement_id: Some(id),
            };
            holds.push(Some(Hold::placed(new, now)));
        }
        let held_legs = legs
            .iter()
            .zip(&holds)
            .map(|(leg, hold)| HeldLeg {
                wallet_id: leg.wallet.as_str().to_owned(),
                amount: leg.signed(),
                hold_id: hold.as_ref().map(|h| h.id),
            })
            .collect();
        for (hold, &w) in holds.iter().zip(touched) {
            if let Some(hold) = hold {
                let held = self.state[w].as_mut().expect("touched wallets exist");
                held.held += hold.amount;
                held.rules.velocity.count(hold.amount, now);
            }
        }
        let placed = holds.into_iter().flatten();
        for hold in placed {
            self.plan.events.push(EventWrite::of_hold(&hold.wallet_id, hold.id, HoldStatus::Held));
            self.plan.placed.push(hold);
        }
        let record = MovementRecord {
            id,
            reference: reference.clone(),
            metadata: metadata.clone(),
            status: MovementStatus::Held,
            legs: Vec::new(),
            hold: Some(MovementHold { expires_at, legs: held_legs }),
            refund_of: None,
            created_at: now,
        };
        Ok(Made::Movement { record, new: true })
    }

    /// A held movement captured (every leg's entry written, every hold settled `captured`) or
    /// voided (every hold released), if every hold is still held and it has not expired by `now`.
    fn settle_movement(
        &mut self,
        op: &LegsOp,
        touched: &[usize],
        now: DateTime<Utc>,
    ) -> Result<Decided, WalletError> {
        let LegsOp::Settle { held, settle, .. } = op else { unreachable!("only a settlement settles") };
        let mut holds: Vec<Option<Hold>> = Vec::with_capacity(held.holds.len());
        for id in &held.holds {
            holds.push(match id {
                Some(id) => Some(
                    self.known
                        .holds
                        .get(id)
                        .cloned()
                        .ok_or_else(|| WalletError::internal("a held movement's hold not read"))?,
                ),
                None => None,
            });
        }
        // The first leg whose hold is settled already says why nothing more can be.
        let settled_before = holds.iter().enumerate().find_map(|(n, hold)| {
            let hold = hold.as_ref()?;
            self.status_now
                .get(&hold.id)
                .copied()
                .unwrap_or(hold.status)
                .refusal()
                .map(|refusal| (n, refusal))
        });
        if let Some(refused) = settled_before {
            return Ok(Err(refused));
        }
        let first_debit = holds.iter().position(Option::is_some).unwrap_or(0);
        if held.expires_at <= now {
            // Expired: this write releases every hold of it, so no capture can come after.
            for (hold, &w) in holds.iter().zip(touched) {
                if let Some(hold) = hold {
                    self.settle(w, hold, HoldStatus::Expired, 0, None);
                }
            }
            return Ok(Err((first_debit, Refusal::HoldExpired)));
        }
        let mut record = MovementRecord { status: MovementStatus::Voided, ..held.record.clone() };
        // Each leg's entry and what it captured, if this settlement writes one: a capture's leg
        // whose share is not nothing.
        let mut written: Vec<Option<(Uuid, i64)>> = vec![None; holds.len()];
        if let SettleAs::Capture(amount) = settle {
            let held_off: Vec<i64> = holds.iter().map(|hold| hold.as_ref().map_or(0, |h| h.amount)).collect();
            let all = self.legs(op, touched, &held_off, false);
            let reserved: i64 = all.iter().filter(|leg| leg.debit).map(|leg| leg.amount.get()).sum();
            let total = amount.map_or(reserved, Amount::get);
            if total > reserved {
                return Ok(Err((first_debit, Refusal::CaptureExceedsHold { held: reserved })));
            }
            let sizes: Vec<i64> = all.iter().map(|leg| leg.amount.get()).collect();
            let (legs, at) = shares(&all, &sizes, total);
            let links = Links {
                movement: Some(held.record.id),
                reference: held.record.reference.as_deref(),
                metadata: &held.record.metadata,
                refund_of: None,
                now,
            };
            let mut entries = match decide_legs(&legs, (EntryKind::TransferOut, EntryKind::TransferIn), links)
            {
                Ok(entries) => entries,
                Err((n, refusal)) => return Ok(Err((at[n], refusal))),
            };
            for (entry, &n) in entries.iter_mut().zip(&at) {
                entry.hold_id = holds[n].as_ref().map(|h| h.id);
                written[n] = Some((entry.id, entry.amount));
            }
            self.apply(
                &entries,
                &at.iter().map(|&n| touched[n]).collect::<Vec<_>>(),
                EventType::MovementAccepted,
                false,
            );
            record =
                MovementRecord { status: MovementStatus::Captured, legs: entries, ..held.record.clone() };
        }
        let status = match settle {
            SettleAs::Capture(_) => HoldStatus::Captured,
            SettleAs::Void => HoldStatus::Voided,
        };
        for ((hold, &w), written) in holds.iter().zip(touched).zip(&written) {
            if let Some(hold) = hold {
                let captured = written.map_or(0, |(_, amount)| amount);
                self.settle(w, hold, status, captured, written.map(|(entry, _)| entry));
            }
        }
        Ok(Ok(Made::Movement { record, new: false }))
    }

    /// A refund: every leg of the original back by its share of the amount refunded, in
    /// proportion to what each leg has left to refund ([`LegsOp::Refund`]).
    fn refund(&mut self, op: &LegsOp, touched: &[usize], now: DateTime<Utc>) -> Result<Decided, WalletError> {
        let LegsOp::Refund { of, amount, metadata, .. } = op else { unreachable!("only a refund refunds") };
        let refunded = self
            .known
            .refunded
            .get(&of.id())
            .ok_or_else(|| WalletError::internal("the refunds so far of a refund's original not read"))?;
        let refunded_now = self.refunded_now.get(&of.id());
        let refunded_on = |wallet: &WalletId| {
            let now = refunded_now.and_then(|by_wallet| by_wallet.get(wallet.as_str())).copied();
            refunded.get(wallet.as_str()).copied().unwrap_or(0) + now.unwrap_or(0)
        };
        // The original's legs reversed: a refund's credits are the original's debits.
        let all = self.legs(op, touched, &vec![0; touched.len()], false);
        let left: Vec<i64> = all.iter().map(|leg| leg.amount.get() - refunded_on(leg.wallet)).collect();
        let moved: i64 = all.iter().filter(|leg| !leg.debit).map(|leg| leg.amount.get()).sum();
        let left_in: i64 = all.iter().zip(&left).filter(|(leg, _)| !leg.debit).map(|(_, left)| left).sum();
        let total = match domain::refund_amount(*amount, moved, moved - left_in) {
            Ok(total) => total.get(),
            Err(refusal) => return Ok(Err((0, refusal))),
        };
        let (legs, at) = shares(&all, &left, total);
        let id = Uuid::new_v4();
        let (kinds, links) = match of {
            RefundOf::Payment { payment, .. } => (
                (EntryKind::Refund, EntryKind::Refund),
                Links { movement: None, reference: None, metadata, refund_of: Some(*payment), now },
            ),
            RefundOf::Transfer { .. } | RefundOf::Movement { .. } => (
                (EntryKind::TransferOut, EntryKind::TransferIn),
                Links { movement: Some(id), reference: None, metadata, refund_of: None, now },
            ),
        };
        let entries = match decide_legs(&legs, kinds, links) {
            Ok(entries) => entries,
            Err((n, refusal)) => return Ok(Err((at[n], refusal))),
        };
        self.apply(
            &entries,
            &at.iter().map(|&n| touched[n]).collect::<Vec<_>>(),
            EventType::RefundAccepted,
            false,
        );
        let refunded_now = self.refunded_now.entry(of.id()).or_default();
        for entry in &entries {
            *refunded_now.entry(entry.wallet_id.clone()).or_default() += entry.amount;
        }
        Ok(Ok(match of {
            RefundOf::Payment { .. } => Made::Entry(entries.into_iter().next().expect("one leg, one entry")),
            RefundOf::Transfer { transfer, .. } => {
                let leg = |kind| entries.iter().find(|e| e.kind == kind).cloned().expect("both legs");
                let (from_entry, to_entry) = (leg(EntryKind::TransferOut), leg(EntryKind::TransferIn));
                Made::Transfer(Box::new(Transfer {
                    id,
                    from: from_entry.wallet_id.clone(),
                    to: to_entry.wallet_id.clone(),
                    amount: total,
                    reference: None,
                    metadata: metadata.clone(),
                    refund_of: Some(*transfer),
                    from_entry,
                    to_entry,
                    created_at: now,
                }))
            }
            RefundOf::Movement { movement, .. } => Made::Movement {
                record: MovementRecord {
                    id,
                    reference: None,
                    metadata: metadata.clone(),
                    status: MovementStatus::Posted,
                    legs: entries,
                    hold: None,
                    refund_of: Some(*movement),
                    created_at: now,
                },
                new: true,
            },
        }))
    }
}

/// `total` taken from `legs` in proportion to `sizes` (one a leg), on each side alike: the debits
/// share it by their sizes, and so do the credits ([`pro_rata`]), so the legs still sum to zero.
/// The legs whose share is not nothing, each of its share, and the index of each among `legs`.
fn shares<'o>(legs: &[Leg<'o>], sizes: &[i64], total: i64) -> (Vec<Leg<'o>>, Vec<usize>) {
    let mut amounts = vec![0; legs.len()];
    for debit in [true, false] {
        let side: Vec<usize> = (0..legs.len()).filter(|&n| legs[n].debit == debit).collect();
        let of_side: Vec<i64> = side.iter().map(|&n| sizes[n]).collect();
        for (&n, share) in side.iter().zip(pro_rata(total, &of_side)) {
            amounts[n] = share;
        }
    }
    legs.iter()
        .zip(amounts)
        .enumerate()
        .filter_map(|(n, (leg, share))| Some((Leg { amount: Amount::new(share).ok()?, ..*leg }, n)))
        .unzip()
}

/// Decides a job's movements, in order, against `wallets` as read. `Err` names the wallets one of
/// whose debits was short of funds while something of it is held, and whose expired holds `known`
/// lacks: nothing may be written; read those and decide again (as [`super::decide_round`] asks).
pub fn decide_between(
    wallets: &[LegsWallet<'_>],
    ops: &[LegsOp],
    known: Known<'_>,
) -> Result<LegsPlan, Vec<String>> {
    let now = known.now;
    let index: HashMap<&WalletId, usize> = wallets.iter().enumerate().map(|(n, w)| (w.id, n)).collect();
    let mut job = Deciding {
        wallets,
        state: wallets.iter().map(|w| w.held.cloned()).collect(),
        status_now: HashMap::new(),
        refunded_now: super::Refunds::new(),
        known,
        plan: LegsPlan {
            decisions: Vec::with_capacity(ops.len()),
            entries: Vec::new(),
            placed: Vec::new(),
            settled: Vec::new(),
            after: Vec::new(),
            transfers: Vec::new(),
            events: Vec::new(),
            movements: Vec::new(),
            responses: Vec::new(),
            key_aliases: Vec::new(),
        },
    };
    // A hold is only treated as expired by the write that releases it (see the module doc of
    // `decision`): every expired hold read of a wallet is released with its movements.
    for (n, wallet) in wallets.iter().enumerate() {
        if job.state[n].is_none() || !known.expired_read.contains(wallet.id.as_str()) {
            continue;
        }
        for hold in known.holds.values().filter(|h| h.wallet_id == wallet.id.as_str()) {
            if hold.status == HoldStatus::Held && hold.expires_at <= now {
                job.settle(n, hold, HoldStatus::Expired, 0, None);
            }
        }
    }
    let mut short: Vec<String> = Vec::new();
    let mut first_with_key: HashMap<KeyAt<'_>, (usize, &[u8; 32])> = HashMap::new();
    for (n, op) in ops.iter().enumerate() {
        let legs = op.legs();
        // Each leg's wallet, by its index in the job, if the caller may touch it.
        let touched: Result<Vec<usize>, WalletError> = legs
            .iter()
            .enumerate()
            .map(|(leg, (id, _, debit))| {
                index
                    .get(id)
                    .copied()
                    .filter(|&w| {
                        job.state[w].as_ref().is_some_and(|h| op.may_touch(*debit, h.owner.as_deref()))
                    })
                    .ok_or_else(|| op.missing(leg))
            })
            .collect();
        let touched = match touched {
            Ok(touched) => touched,
            Err(missing) => {
                job.plan.decisions.push(LegsDecision::Answered(missing));
                continue;
            }
        };
        if let Some((at, fingerprint)) = op.key() {
            let at: KeyAt<'_> = (at.caller, at.scope, at.key);
            // Its own key; or the same key stored in the scope of a wallet it takes money out of
            // for another request (a payment's, or another movement's alias: see [`KeyAlias`]).
            let own = known.keys.get(&(at.0.to_owned(), at.1.to_owned(), at.2.to_owned()));
            let prior = own.map(|stored| Prior::of(stored, fingerprint)).or_else(|| {
                op.key_aliases()
                    .into_iter()
                    .filter_map(|(_, scope)| known.keys.get(&(at.0.to_owned(), scope, at.2.to_owned())))
                    .find(|stored| stored.fingerprint != fingerprint)
                    .map(|_| Prior::Reused)
            });
            if let Some(prior) = prior {
                job.plan.decisions.push(LegsDecision::Answered(WalletError::AlreadyRan(prior)));
                continue;
            }
            if let Some((first, first_fingerprint)) = first_with_key.get(&at) {
                job.plan.decisions.push(if *first_fingerprint == fingerprint {
                    LegsDecision::SameAs(*first)
                } else {
                    LegsDecision::Answered(WalletError::AlreadyRan(Prior::Reused))
                });
                continue;
            }
            first_with_key.insert(at, (n, fingerprint));
        }
        let decided = match op {
            LegsOp::Transfer { .. } | LegsOp::Movement { hold: None, .. } => job.post(op, &touched, now),
            LegsOp::Movement { hold: Some(life), .. } => job.place(op, &touched, *life, now),
            LegsOp::Settle { .. } | LegsOp::Refund { .. } => {
                let decided = match op {
                    LegsOp::Settle { .. } => job.settle_movement(op, &touched, now),
                    _ => job.refund(op, &touched, now),
                };
                match decided {
                    Ok(decided) => decided,
                    Err(err) => {
                        job.plan.decisions.push(LegsDecision::Answered(err));
                        continue;
                    }
                }
            }
        };
        // Short of funds while something is held: the holds that expired may cover it, and only a
        // write that releases them may count on that.
        if let Err((leg, refusal)) = &decided
            && refusal.spends_past_holds()
        {
            let leg = *leg;
            let wallet = wallets[touched[leg]].id.as_str();
            let held = job.state[touched[leg]].as_ref().map_or(0, |h| h.held);
            if held > 0 && !known.expired_read.contains(wallet) {
                short.push(wallet.to_owned());
                job.plan.decisions.push(LegsDecision::Answered(WalletError::internal("decided again")));
                continue;
            }
        }
        let first_entry = match &decided {
            Ok(Made::Entry(entry)) => Some(entry.id),
            Ok(Made::Transfer(t)) => Some(t.from_entry.id),
            Ok(Made::Movement { record, .. }) => record.legs.first().map(|e| e.id),
            Err(_) => None,
        };
        let (decision, response) = match op {
            LegsOp::Refund { of: RefundOf::Payment { key, .. }, .. } => {
                let outcome: RefundOutcome = match decided {
                    Ok(Made::Entry(entry)) => Ok(entry),
                    Ok(Made::Transfer(_) | Made::Movement { .. }) => {
                        unreachable!("a payment's refund is an entry")
                    }
                    Err((_, refusal)) => Err(refusal),
                };
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let decision = match outcome {
                    Ok(entry) => LegsDecision::Accepted(Done::Entry(entry)),
                    Err(refusal) => LegsDecision::Refused(WalletError::Refused(refusal)),
                };
                (decision, response)
            }
            LegsOp::Transfer { key, .. } | LegsOp::Refund { of: RefundOf::Transfer { key, .. }, .. } => {
                let outcome: TransferOutcome = match decided {
                    Ok(Made::Transfer(transfer)) => Ok(*transfer),
                    Ok(Made::Movement { .. } | Made::Entry(_)) => unreachable!("a transfer posts one"),
                    Err((_, refusal)) => Err(refusal),
                };
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let decision = match outcome {
                    Ok(transfer) => {
                        job.plan.transfers.push(transfer.clone());
                        LegsDecision::Accepted(Done::Transfer(Box::new(transfer)))
                    }
                    Err(refusal) => LegsDecision::Refused(WalletError::Refused(refusal)),
                };
                (decision, response)
            }
            LegsOp::Movement { key, .. }
            | LegsOp::Settle { key, .. }
            | LegsOp::Refund { of: RefundOf::Movement { key, .. }, .. } => {
                let outcome: MovementRecordOutcome = match decided {
                    Ok(Made::Movement { record, new }) => {
                        if new {
                            job.plan.movements.push(record.clone());
                        }
                        Ok(record)
                    }
                    Ok(Made::Transfer(_) | Made::Entry(_)) => unreachable!("a movement posts no transfer"),
                    Err((leg, refusal)) => Err(LegRefusal { leg, refusal }),
                };
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let decision = match outcome {
                    Ok(movement) => LegsDecision::Accepted(Done::Movement(Box::new(movement))),
                    Err(LegRefusal { leg, refusal }) => {
                        LegsDecision::Refused(WalletError::LegRefused { leg, refusal })
                    }
                };
                (decision, response)
            }
        };
        if let Some(response) = response {
            job.plan.responses.push((n, response, first_entry));
            let made = match &decision {
                LegsDecision::Accepted(Done::Transfer(transfer)) => Some(transfer.id),
                LegsDecision::Accepted(Done::Movement(movement)) => Some(movement.id),
                LegsDecision::Accepted(Done::Entry(entry)) => Some(entry.id),
                _ => None,
            };
            let body = match made {
                Some(id) => serde_json::to_vec(&serde_json::json!({ "id": id })).unwrap_or_default(),
                None => b"{}".to_vec(),
            };
            let aliases = op.key_aliases().into_iter().map(|(wallet, scope)| KeyAlias {
                op: n,
                wallet: index[wallet],
                scope,
                body: body.clone(),
            });
            job.plan.key_aliases.extend(aliases);
        }
        job.plan.decisions.push(decision);
    }
    if !short.is_empty() {
        return Err(short);
    }
    // The wallets written raise their rows' fences to the leases'.
    let mut plan = job.plan;
    plan.after = job
        .state
        .into_iter()
        .zip(wallets)
        .map(|(held, wallet)| held.map(|held| Held { fence: wallet.fence, from_note: false, ..held }))
        .collect();
    Ok(plan)
}

/// The wallets of `ops`, each once, in the order they first appear.
pub fn wallets_of(ops: &[LegsOp]) -> Vec<WalletId> {
    let mut seen: HashSet<&WalletId> = HashSet::new();
    ops.iter()
        .flat_map(LegsOp::legs)
        .filter(|(id, _, _)| seen.insert(id))
        .map(|(id, _, _)| id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::{IdempotencyKey, Scope};
    use crate::ledger::group::FoundKey;
    use crate::ledger::hold::Hold;
    use crate::ledger::idempotency::ResponseRow;
    use chrono::Utc;
    use proptest::prelude::*;
    use std::sync::Arc;

    const OWNER: &str = "shop";

    fn id(n: usize) -> WalletId {
        WalletId::parse(&format!("w{n}")).unwrap()
    }

    fn held(balance: i64, held: i64) -> Held {
        Held::of_tests(balance, held, OWNER)
    }

    fn render(outcome: &TransferOutcome) -> StoredResponse {
        let body = match outcome {
            Ok(transfer) => transfer.amount.to_string(),
            Err(refusal) => refusal.code().to_owned(),
        };
        StoredResponse { status: 200, content_type: "text/plain".into(), body: body.into_bytes() }
    }

    fn transfer(from: usize, to: usize, amount: i64) -> LegsOp {
        LegsOp::Transfer {
            access: Access::own_wallets(OWNER),
            parties: Parties { from: id(from), to: id(to) },
            amount: Amount::new(amount).unwrap(),
            reference: None,
            metadata: Metadata::default(),
            key: None,
        }
    }

    fn keyed(op: LegsOp, key: &str, request: u8) -> LegsOp {
        let LegsOp::Transfer { access, parties, amount, reference, metadata, .. } = op else {
            unreachable!()
        };
        let key = Keyed {
            scope: Scope::transfers(OWNER),
            key: IdempotencyKey::parse(key.as_bytes()).unwrap(),
            fingerprint: [request; 32],
            render,
        };
        LegsOp::Transfer { access, parties, amount, reference, metadata, key: Some(key) }
    }

    struct Fixture {
        ids: Vec<WalletId>,
        held: Vec<Option<Held>>,
        keys: HashMap<(String, String, String), FoundKey>,
        holds: HashMap<Uuid, Hold>,
        expired_read: HashSet<String>,
        refunded: super::super::Refunds,
    }

    impl Fixture {
        fn of(wallets: &[Option<(i64, i64)>]) -> Self {
            Fixture {
                ids: (0..wallets.len()).map(id).collect(),
                held: wallets.iter().map(|w| w.map(|(balance, h)| held(balance, h))).collect(),
                keys: HashMap::new(),
                holds: HashMap::new(),
                expired_read: HashSet::new(),
                refunded: super::super::Refunds::new(),
            }
        }

        fn decide(&self, ops: &[LegsOp]) -> Result<LegsPlan, Vec<String>> {
            let wallets: Vec<LegsWallet<'_>> = self
                .ids
                .iter()
                .zip(&self.held)
                .map(|(id, held)| LegsWallet { id, fence: 9, held: held.as_ref() })
                .collect();
            let known = Known {
                keys: &self.keys,
                holds: &self.holds,
                expired_read: &self.expired_read,
                refunded: &self.refunded,
                now: Utc::now(),
            };
            decide_between(&wallets, ops, known)
        }
    }

    fn balances(plan: &LegsPlan) -> Vec<i64> {
        plan.after.iter().map(|held| held.as_ref().map_or(0, |h| h.balance)).collect()
    }

    #[test]
    fn a_payer_paying_twice_in_one_job_pays_from_its_new_balance_and_a_refusal_changes_nothing() {
        let fixture = Fixture::of(&[Some((100, 0)), Some((0, 0)), Some((5, 0))]);
        let plan = fixture.decide(&[transfer(0, 1, 60), transfer(0, 1, 60), transfer(2, 1, 5)]).unwrap();
        let results = plan.results(Ok(true));
        assert!(matches!(results[0], Ok(Done::Transfer(_))));
        assert!(matches!(results[1], Err(WalletError::Refused(Refusal::InsufficientFunds { .. }))));
        assert!(matches!(results[2], Ok(Done::Transfer(_))));
        assert_eq!(balances(&plan), [40, 65, 0]);
        // Each wallet's entries are its next versions, in the order the movements were decided.
        let versions: Vec<(&str, i64)> =
            plan.entries.iter().map(|e| (e.wallet_id.as_str(), e.version)).collect();
        assert_eq!(versions, [("w0", 6), ("w1", 6), ("w2", 6), ("w1", 7)]);
        assert_eq!(plan.after.iter().map(|h| h.as_ref().unwrap().version).collect::<Vec<_>>(), [6, 7, 6]);
        assert!(
            plan.after.iter().all(|h| h.as_ref().unwrap().fence == 9),
            "written under the leases' fences"
        );
        assert_eq!(plan.transfers.len(), 2);
    }

    #[test]
    fn a_transfers_debit_counts_against_the_payers_velocity_limits_and_not_the_payees() {
        let now = Utc::now();
        let mut fixture = Fixture::of(&[Some((1_000, 0)), Some((0, 0))]);
        let day =
            crate::domain::VelocityLimit { per: crate::domain::Per::Day, amount: Some(100), count: Some(2) };
        for wallet in fixture.held.iter_mut().flatten() {
            wallet.rules.velocity = crate::domain::Velocities::NONE.replaced(&[day], None, now, (0, 0));
        }
        let ops = [
            transfer(0, 1, 40),
            transfer(0, 1, 70),
            transfer(0, 1, 60),
            transfer(0, 1, 1),
            transfer(1, 0, 5),
        ];
        let plan = fixture.decide(&ops).unwrap();
        let results = plan.results(Ok(true));
        let refused = |n: usize| match &results[n] {
            Err(WalletError::Refused(Refusal::LimitExceeded { limit, left, .. })) => {
                Some((limit.as_str(), *left))
            }
            _ => None,
        };
        assert_eq!(refused(1), Some(("velocity_amount", 60)));
        assert_eq!(refused(3), Some(("velocity_count", 0)));
        assert!(results[0].is_ok() && results[2].is_ok() && results[4].is_ok());
        assert_eq!(balances(&plan), [905, 95]);
        let used = |n: usize| plan.after[n].as_ref().unwrap().rules.velocity.velocity[0].used;
        assert_eq!((used(0).amount, used(0).count), (100, 2));
        assert_eq!((used(1).amount, used(1).count), (5, 1), "the payee's own debit, not what it received");
    }

    #[test]
    fn a_missing_or_hidden_wallet_answers_for_its_movement_alone() {
        let mut fixture = Fixture::of(&[Some((100, 0)), None, Some((0, 0))]);
        fixture.held[2].as_mut().unwrap().owner = Some(Arc::from("someone-else"));
        let plan = fixture.decide(&[transfer(0, 1, 10), transfer(2, 0, 10), transfer(0, 2, 10)]).unwrap();
        let results = plan.results(Ok(true));
        assert!(matches!(results[0], Err(WalletError::PartyNotFound { field: Field::To })));
        assert!(matches!(results[1], Err(WalletError::PartyNotFound { field: Field::From })));
        assert!(matches!(results[2], Err(WalletError::PartyNotFound { field: Field::To })));
        assert!(!plan.runs(), "nothing to write");
        assert!(plan.entries.is_empty());
    }

    #[test]
    fn a_key_decides_once_whether_stored_before_or_carried_twice_in_the_job() {
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((0, 0))]);
        let stored = ResponseRow { status: 200, content_type: "text/plain".into(), body: b"7".to_vec() };
        let at = (OWNER.to_owned(), "transfers".to_owned(), "old".to_owned());
        fixture.keys.insert(at, FoundKey { fingerprint: vec![1; 32], response: Some(stored.clone()) });
        let stored = StoredResponse::from(stored);
        let ops = [
            keyed(transfer(0, 1, 7), "old", 1),
            keyed(transfer(0, 1, 10), "new", 2),
            keyed(transfer(0, 1, 10), "new", 2),
            keyed(transfer(0, 1, 10), "new", 3),
        ];
        let plan = fixture.decide(&ops).unwrap();
        let results = plan.results(Ok(true));
        assert!(matches!(&results[0], Err(WalletError::AlreadyRan(Prior::Replay(r))) if *r == stored));
        assert!(matches!(results[1], Ok(Done::Transfer(_))));
        assert!(matches!(&results[2], Err(WalletError::AlreadyRan(Prior::Replay(r))) if r.body == b"10"));
        assert!(matches!(results[3], Err(WalletError::AlreadyRan(Prior::Reused))));
        assert_eq!(balances(&plan), [90, 10], "charged once");
        assert_eq!(plan.responses.len(), 1);
    }

    #[test]
    fn a_keys_alias_refuses_other_requests_and_names_the_transfer_without_its_body() {
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((0, 0))]);
        let alias = |fingerprint: u8| FoundKey {
            fingerprint: vec![fingerprint; 32],
            response: Some(ResponseRow {
                status: 200,
                content_type: "text/plain".into(),
                body: b"{}".to_vec(),
            }),
        };
        let payer_scope = id(0).scope();
        // "paid": a payment's key on the payer; "mine": this transfer's own alias, found without its
        // key (which one statement writes with it: never so, but it must not answer for it).
        fixture.keys.insert((OWNER.to_owned(), payer_scope.clone(), "paid".to_owned()), alias(8));
        fixture.keys.insert((OWNER.to_owned(), payer_scope, "mine".to_owned()), alias(1));
        let plan = fixture
            .decide(&[keyed(transfer(0, 1, 10), "paid", 1), keyed(transfer(0, 1, 10), "mine", 1)])
            .unwrap();
        let results = plan.results(Ok(true));
        assert!(matches!(results[0], Err(WalletError::AlreadyRan(Prior::Reused))));
        let Ok(Done::Transfer(transfer)) = &results[1] else { panic!("{:?}", results[1]) };
        // Its alias in the payer's scope holds only what names the transfer.
        let [alias] = &plan.key_aliases[..] else { panic!("{:?}", plan.key_aliases) };
        assert_eq!((alias.op, alias.wallet, alias.scope.as_str()), (1, 0, "wallet:w0"));
        let named: serde_json::Value = serde_json::from_slice(&alias.body).unwrap();
        assert_eq!(named, serde_json::json!({ "id": transfer.id }));
    }

    #[test]
    fn a_debit_short_while_something_is_held_asks_for_the_expired_holds_and_then_releases_them() {
        let mut fixture = Fixture::of(&[Some((100, 80)), Some((0, 0))]);
        assert_eq!(fixture.decide(&[transfer(0, 1, 50)]).unwrap_err(), ["w0"]);
        let expired = Hold {
            id: Uuid::new_v4(),
            wallet_id: "w0".into(),
            amount: 80,
            metadata: Metadata::default(),
            captured: 0,
            status: HoldStatus::Held,
            expires_at: Utc::now() - chrono::Duration::seconds(1),
            reference: None,
            created_at: Utc::now(),
            settled_at: None,
            capture_entry: None,
            movement_id: None,
            fence: 3,
        };
        fixture.holds.insert(expired.id, expired.clone());
        fixture.expired_read.insert("w0".into());
        let plan = fixture.decide(&[transfer(0, 1, 50)]).unwrap();
        assert!(matches!(plan.results(Ok(true))[0], Ok(Done::Transfer(_))));
        assert_eq!(plan.settled.len(), 1);
        assert_eq!((plan.settled[0].0, plan.settled[0].1.status), (0, HoldStatus::Expired));
        assert_eq!(plan.after[0].as_ref().map(|h| (h.balance, h.held)), Some((50, 0)));
    }

    #[test]
    fn a_write_that_did_not_match_answers_lease_lost_and_a_failed_one_its_failure() {
        let fixture = Fixture::of(&[Some((100, 0)), Some((0, 0))]);
        let plan = fixture.decide(&[transfer(0, 1, 10), transfer(1, 0, 1_000)]).unwrap();
        assert!(plan.results(Ok(false)).iter().all(|r| matches!(r, Err(WalletError::LeaseLost))));
        let failure = WalletError::internal("down");
        assert!(plan.results(Err(&failure)).iter().all(|r| matches!(r, Err(WalletError::Internal { .. }))));
    }

    fn split(hold: Option<HoldLife>) -> LegsOp {
        let legs = Legs::new(vec![(id(0), -60), (id(1), -40), (id(2), 100)]).unwrap();
        let access = Access::own_wallets(OWNER);
        LegsOp::Movement { access, legs, reference: None, metadata: Metadata::default(), hold, key: None }
    }

    /// Places a held split of w0 and w1 into w2, and returns the settlement of it, the holds it
    /// placed and the wallets it left.
    fn placed(fixture: &Fixture, settle: SettleAs) -> (LegsOp, Vec<Hold>, Vec<Option<Held>>) {
        let plan = fixture.decide(&[split(Some(HoldLife::DEFAULT))]).unwrap();
        let Ok(Done::Movement(record)) = plan.results(Ok(true)).remove(0) else { panic!("placed") };
        assert_eq!((record.status, record.legs.len()), (MovementStatus::Held, 0));
        let held = HeldMovement::of(*record).expect("a held movement");
        let settle =
            LegsOp::Settle { access: Access::own_wallets(OWNER), held: Box::new(held), settle, key: None };
        (settle, plan.placed, plan.after)
    }

    #[test]
    fn a_held_movement_reserves_every_debit_and_settles_every_leg_at_once() {
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((50, 10)), Some((0, 0))]);
        let (capture, holds, after) = placed(&fixture, SettleAs::Capture(None));
        assert_eq!(
            holds.iter().map(|h| (h.wallet_id.as_str(), h.amount)).collect::<Vec<_>>(),
            [("w0", 60), ("w1", 40)]
        );
        assert_eq!(after.iter().map(|h| h.as_ref().unwrap().held).collect::<Vec<_>>(), [60, 50, 0]);
        assert!(after.iter().all(|h| h.as_ref().unwrap().version == 5), "no entry while held");

        // Captured against the wallets as placing left them: every leg's entry, every hold settled.
        fixture.held = after.clone();
        fixture.holds = holds.iter().map(|h| (h.id, h.clone())).collect();
        let plan = fixture.decide(&[capture]).unwrap();
        let Ok(Done::Movement(record)) = plan.results(Ok(true)).remove(0) else { panic!("captured") };
        assert_eq!(record.status, MovementStatus::Captured);
        assert_eq!(record.legs.iter().map(|e| e.balance).collect::<Vec<_>>(), [40, 10, 100]);
        assert_eq!(record.legs[0].hold_id, Some(holds[0].id), "a debit's entry names its hold");
        assert_eq!(plan.after.iter().map(|h| h.as_ref().unwrap().held).collect::<Vec<_>>(), [0, 10, 0]);
        assert!(
            plan.settled.iter().all(|(_, s)| s.status == HoldStatus::Captured) && plan.settled.len() == 2
        );
        assert!(plan.movements.is_empty(), "the movement's row is written once, when placed");

        // A hold settled already refuses the other settlement, naming its leg, and changes nothing.
        let (void, _, _) =
            placed(&Fixture::of(&[Some((100, 0)), Some((50, 0)), Some((0, 0))]), SettleAs::Void);
        let LegsOp::Settle { held, .. } = &void else { unreachable!() };
        let mut settled_holds: HashMap<Uuid, Hold> = HashMap::new();
        for (n, hold) in held.holds.iter().flatten().enumerate() {
            let status = if n == 0 { HoldStatus::Voided } else { HoldStatus::Held };
            let wallet = format!("w{n}");
            settled_holds
                .insert(*hold, Hold { id: *hold, wallet_id: wallet, amount: 1, status, ..holds[0].clone() });
        }
        fixture.holds = settled_holds;
        let plan = fixture.decide(&[void]).unwrap();
        assert!(matches!(
            plan.results(Ok(true))[0],
            Err(WalletError::LegRefused { leg: 0, refusal: Refusal::HoldVoided })
        ));
        assert!(plan.settled.is_empty() && plan.entries.is_empty());
    }

    #[test]
    fn a_held_movement_past_its_expiry_is_refused_and_its_write_releases_every_hold() {
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((50, 0)), Some((0, 0))]);
        let (capture, holds, after) = placed(&fixture, SettleAs::Capture(None));
        let LegsOp::Settle { mut held, access, settle, key } = capture else { unreachable!() };
        held.expires_at = Utc::now() - chrono::Duration::seconds(1);
        let capture = LegsOp::Settle { access, held, settle, key };
        fixture.held = after;
        fixture.holds = holds.iter().map(|h| (h.id, h.clone())).collect();
        let plan = fixture.decide(&[capture]).unwrap();
        assert!(matches!(
            plan.results(Ok(true))[0],
            Err(WalletError::LegRefused { leg: 0, refusal: Refusal::HoldExpired })
        ));
        assert!(plan.runs(), "the refusal is written: it releases the holds");
        assert!(plan.settled.iter().all(|(_, s)| s.status == HoldStatus::Expired) && plan.settled.len() == 2);
        assert_eq!(plan.after.iter().map(|h| h.as_ref().unwrap().held).collect::<Vec<_>>(), [0, 0, 0]);
        assert!(plan.entries.is_empty());
    }

    #[test]
    fn a_capture_of_part_takes_each_legs_share_and_releases_the_rest_of_every_hold() {
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((50, 0)), Some((0, 0))]);
        let (capture, holds, after) = placed(&fixture, SettleAs::Capture(Some(Amount::new(51).unwrap())));
        fixture.held = after;
        fixture.holds = holds.iter().map(|h| (h.id, h.clone())).collect();
        let plan = fixture.decide(&[capture]).unwrap();
        let Ok(Done::Movement(record)) = plan.results(Ok(true)).remove(0) else { panic!("captured") };
        // 51 of the 60 + 40 held: 30.6 and 20.4, rounded down, and the unit left to the first.
        let moved: Vec<(&str, EntryKind, i64)> =
            record.legs.iter().map(|e| (e.wallet_id.as_str(), e.kind, e.amount)).collect();
        assert_eq!(
            moved,
            [
                ("w0", EntryKind::TransferOut, 31),
                ("w1", EntryKind::TransferOut, 20),
                ("w2", EntryKind::TransferIn, 51)
            ]
        );
        assert_eq!(balances(&plan), [69, 30, 51]);
        assert_eq!(plan.after.iter().map(|h| h.as_ref().unwrap().held).collect::<Vec<_>>(), [0, 0, 0]);
        let captured: Vec<i64> = plan.settled.iter().map(|(_, s)| s.captured).collect();
        assert_eq!(captured, [31, 20]);

        // More than is held is refused, and changes nothing.
        let mut fixture = Fixture::of(&[Some((100, 0)), Some((50, 0)), Some((0, 0))]);
        let (capture, holds, after) = placed(&fixture, SettleAs::Capture(Some(Amount::new(101).unwrap())));
        fixture.held = after;
        fixture.holds = holds.iter().map(|h| (h.id, h.clone())).collect();
        let plan = fixture.decide(&[capture]).unwrap();
        assert!(matches!(
            plan.results(Ok(true))[0],
            Err(WalletError::LegRefused { leg: 0, refusal: Refusal::CaptureExceedsHold { held: 100 } })
        ));
        assert!(plan.entries.is_empty() && plan.settled.is_empty());
    }

    fn refund(of: RefundOf, legs: &[(usize, i64)], amount: Option<i64>) -> LegsOp {
        let legs = legs.iter().map(|&(w, a)| (id(w), Amount::new(a.abs()).unwrap(), a < 0)).collect();
        LegsOp::Refund {
            access: Access::own_wallets(OWNER),
            of,
            legs,
            amount: amount.map(|a| Amount::new(a).unwrap()),
            metadata: Metadata::default(),
        }
    }

    #[test]
    fn a_refund_moves_each_leg_back_by_its_share_of_what_is_left_and_never_past_it() {
        // A split of 100 out of w0: 90 to w1 and 10 to w2, of which 45 and 5 were refunded already.
        let movement = Uuid::new_v4();
        let original = [(0, -100), (1, 90), (2, 10)];
        let mut fixture = Fixture::of(&[Some((0, 0)), Some((45, 0)), Some((5, 0))]);
        let of = || RefundOf::Movement { movement, key: None };
        let op = refund(of(), &original, Some(30));
        assert!(
            matches!(
                fixture.decide(std::slice::from_ref(&op)).unwrap().results(Ok(true))[0],
                Err(WalletError::Internal(_))
            ),
            "a refund decided without what was refunded before is never made"
        );
        fixture
            .refunded
            .insert(movement, HashMap::from([("w0".into(), 50), ("w1".into(), 45), ("w2".into(), 5)]));
        let plan =
            fixture.decide(&[op, refund(of(), &original, Some(21)), refund(of(), &original, None)]).unwrap();
        let results = plan.results(Ok(true));
        let Ok(Done::Movement(first)) = &results[0] else { panic!("refunded: {:?}", results[0]) };
        assert_eq!(first.refund_of, Some(movement));
        let moved: Vec<(&str, EntryKind, i64)> =
            first.legs.iter().map(|e| (e.wallet_id.as_str(), e.kind, e.amount)).collect();
        assert_eq!(
            moved,
            [
                ("w0", EntryKind::TransferIn, 30),
                ("w1", EntryKind::TransferOut, 27),
                ("w2", EntryKind::TransferOut, 3)
            ]
        );
        assert!(
            matches!(
                results[1],
                Err(WalletError::LegRefused {
                    refusal: Refusal::RefundExceedsPayment { refundable: 20 },
                    ..
                })
            ),
            "20 is left once 30 of the 50 left is refunded: {:?}",
            results[1]
        );
        let Ok(Done::Movement(rest)) = &results[2] else { panic!("the rest: {:?}", results[2]) };
        assert_eq!(rest.legs.iter().map(|e| e.amount).collect::<Vec<_>>(), [20, 18, 2]);
        assert_eq!(balances(&plan), [50, 0, 0], "every leg back to where it started");
    }

    #[test]
    fn a_payments_refund_is_one_entry_into_its_wallet_and_a_transfers_moves_it_back() {
        let (payment, transfer) = (Uuid::new_v4(), Uuid::new_v4());
        let mut fixture = Fixture::of(&[Some((10, 0)), Some((70, 0))]);
        fixture.refunded.insert(payment, HashMap::from([("w0".into(), 30)]));
        fixture.refunded.insert(transfer, HashMap::from([("w0".into(), 0), ("w1".into(), 0)]));
        let ops = [
            refund(RefundOf::Payment { payment, key: None }, &[(0, -100)], None),
            refund(RefundOf::Transfer { transfer, key: None }, &[(0, -60), (1, 60)], Some(60)),
        ];
        let plan = fixture.decide(&ops).unwrap();
        let results = plan.results(Ok(true));
        let Ok(Done::Entry(entry)) = &results[0] else { panic!("refunded: {:?}", results[0]) };
        assert_eq!((entry.kind, entry.amount, entry.refund_of), (EntryKind::Refund, 70, Some(payment)));
        let Ok(Done::Transfer(back)) = &results[1] else { panic!("moved back: {:?}", results[1]) };
        assert_eq!(
            (back.from.as_str(), back.to.as_str(), back.amount, back.refund_of),
            ("w1", "w0", 60, Some(transfer))
        );
        assert_eq!(balances(&plan), [140, 10]);
    }

    /// Wallets as (balance, held), and movements among them as (from, to, amount).
    type Scenario = (Vec<(i64, i64)>, Vec<(usize, usize, i64)>);

    /// A scenario: wallets and movements among them.
    fn scenario() -> impl Strategy<Value = Scenario> {
        prop::collection::vec((0i64..1_000, 0i64..300), 2..6).prop_flat_map(|wallets| {
            let n = wallets.len();
            let movement = (0..n, 0..n, 1i64..600).prop_filter("two wallets", |(a, b, _)| a != b);
            (Just(wallets), prop::collection::vec(movement, 0..24))
        })
    }

    /// A movement's legs, summing to zero: debits (negative) and the credits that share their total.
    fn movement_legs() -> impl Strategy<Value = Vec<i64>> {
        (prop::collection::vec(1i64..300, 1..4), 1usize..5).prop_map(|(debits, credits)| {
            let total: i64 = debits.iter().sum();
            let mut legs: Vec<i64> = debits.iter().map(|d| -d).collect();
            let shares = pro_rata(total, &vec![1; credits]);
            legs.extend(shares.into_iter().filter(|&share| share > 0));
            legs
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_movements_refunds_never_give_back_more_than_a_leg_moved_and_the_last_gives_back_the_rest(
            legs in movement_legs(),
            amounts in prop::collection::vec(proptest::option::of(1i64..400), 0..6),
        ) {
            // The wallets as the movement left them: each credited wallet holds what it was paid.
            let wallets: Vec<Option<(i64, i64)>> = legs.iter().map(|&a| Some((a.max(0), 0))).collect();
            let fixture = {
                let mut fixture = Fixture::of(&wallets);
                let movement = Uuid::nil();
                fixture.refunded.insert(movement, HashMap::new());
                fixture
            };
            let original: Vec<(usize, i64)> = legs.iter().copied().enumerate().collect();
            let of = || RefundOf::Movement { movement: Uuid::nil(), key: None };
            let mut ops: Vec<LegsOp> = amounts.iter().map(|&a| refund(of(), &original, a)).collect();
            ops.push(refund(of(), &original, None));
            let plan = fixture.decide(&ops).unwrap();
            let mut back = vec![0_i64; legs.len()];
            for result in plan.results(Ok(true)) {
                let Ok(Done::Movement(record)) = result else { continue };
                prop_assert_eq!(record.legs.iter().map(|e| if e.kind.is_debit() { -e.amount } else { e.amount }).sum::<i64>(), 0);
                for entry in &record.legs {
                    let n: usize = entry.wallet_id[1..].parse().unwrap();
                    prop_assert_eq!(entry.kind.is_debit(), legs[n] > 0, "each leg moves back the other way");
                    back[n] += entry.amount;
                }
            }
            let moved: Vec<i64> = legs.iter().map(|a| a.abs()).collect();
            prop_assert_eq!(&back, &moved, "all of it back, and no leg more than it moved");
            prop_assert_eq!(balances(&plan).iter().sum::<i64>(), legs.iter().map(|&a| a.max(0)).sum::<i64>());
        }

        #[test]
        fn a_job_conserves_money_keeps_every_available_balance_at_or_above_zero_and_decides_in_order(
            (wallets, movements) in scenario(),
        ) {
            let mut fixture = Fixture::of(&wallets.iter().map(|&(b, h)| Some((b.max(h), h))).collect::<Vec<_>>());
            // The expired holds are known read (and there are none): every short debit is refused.
            fixture.expired_read = fixture.ids.iter().map(|id| id.as_str().to_owned()).collect();
            let ops: Vec<LegsOp> = movements.iter().map(|&(a, b, amount)| transfer(a, b, amount)).collect();
            let plan = fixture.decide(&ops).unwrap();
            let before: i64 = fixture.held.iter().flatten().map(|h| h.balance).sum();
            prop_assert_eq!(before, balances(&plan).iter().sum::<i64>(), "money is conserved");
            // Replaying the accepted movements in order, each against what the ones before left,
            // gives every entry's balance: the order decided is the order they arrived in.
            let mut funds: Vec<Funds> = fixture.held.iter().flatten().map(|h| Funds::new(h.balance, h.held)).collect();
            let mut entries = plan.entries.iter();
            for (result, &(from, to, amount)) in plan.results(Ok(true)).iter().zip(&movements) {
                let fits = funds[from].available() >= amount;
                prop_assert_eq!(result.is_ok(), fits);
                if fits {
                    funds[from].balance -= amount;
                    funds[to].balance += amount;
                    prop_assert_eq!(entries.next().map(|e| e.balance), Some(funds[from].balance));
                    prop_assert_eq!(entries.next().map(|e| e.balance), Some(funds[to].balance));
                }
            }
            prop_assert!(entries.next().is_none());
            for (after, funds) in plan.after.iter().flatten().zip(&funds) {
                prop_assert_eq!(after.balance, funds.balance);
                prop_assert!(after.balance - after.held >= 0, "no available balance below zero");
            }
        }

        #[test]
        fn a_key_decides_once_in_a_job_and_a_refusal_changes_nothing(
            (wallets, movements) in scenario(),
            keys in prop::collection::vec(proptest::option::of((0..3_u8, 1..3_u8)), 24),
        ) {
            let mut fixture = Fixture::of(&wallets.iter().map(|&(b, h)| Some((b.max(h), h))).collect::<Vec<_>>());
            fixture.expired_read = fixture.ids.iter().map(|id| id.as_str().to_owned()).collect();
            let ops: Vec<LegsOp> = movements
                .iter()
                .zip(&keys)
                .map(|(&(a, b, amount), key)| match key {
                    Some((key, request)) => keyed(transfer(a, b, amount), &format!("k{key}"), *request),
                    None => transfer(a, b, amount),
                })
                .collect();
            let plan = fixture.decide(&ops).unwrap();
            let results = plan.results(Ok(true));
            // A key decides once: only the first movement carrying it runs, and its response is the
            // one stored; every later one is answered without running.
            let mut first_of: HashMap<u8, usize> = HashMap::new();
            for (n, key) in keys.iter().take(ops.len()).enumerate() {
                let Some((key, _)) = key else { continue };
                if *first_of.entry(*key).or_insert(n) != n {
                    prop_assert!(matches!(results[n], Err(WalletError::AlreadyRan(_))), "{:?}", results[n]);
                }
            }
            prop_assert_eq!(plan.responses.len(), first_of.len());
            // A refusal changes nothing: the movements that ran, alone and in order, make the same
            // entries and leave the same wallets.
            let ran: Vec<LegsOp> = movements
                .iter()
                .zip(&results)
                .filter(|(_, result)| result.is_ok())
                .map(|(&(a, b, amount), _)| transfer(a, b, amount))
                .collect();
            let again = fixture.decide(&ran).unwrap();
            let shape = |plan: &LegsPlan| -> Vec<(String, i64, i64)> {
                plan.entries.iter().map(|e| (e.wallet_id.clone(), e.amount, e.balance)).collect()
            };
            prop_assert_eq!(shape(&again), shape(&plan));
            prop_assert_eq!(balances(&again), balances(&plan));
            // Each leg's entry is a `transfer.accepted` event of its wallet, in the entries' order.
            let events: Vec<(Option<Uuid>, &str, EventType)> =
                plan.events.iter().map(|e| (e.entry_id, e.wallet_id.as_str(), e.kind)).collect();
            let entries: Vec<(Option<Uuid>, &str, EventType)> = plan
                .entries
                .iter()
                .map(|e| (Some(e.id), e.wallet_id.as_str(), EventType::TransferAccepted))
                .collect();
            prop_assert_eq!(events, entries);
        }
    }
}
