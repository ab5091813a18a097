//! The decision: every movement of a round decided against its wallet, with no I/O. The rounds
//! that run it ([`super::group`] under leases, [`super::unleased`] under Postgres alone) read
//! before and write after; this module only decides, so it is tested on its own (below).
//!
//! Each wallet's batch is decided on its own, its movements one by one in arrival order, against
//! the balance and holds the previous ones left, and each idempotency key looked up first. A
//! payment that does not fit is refused alone; the rest go through. A request whose key is
//! already stored does not run: it gets the stored response (or `idempotency_key_reused`). A
//! request whose key an earlier request of the same batch carries waits for that one and gets its
//! response too, so a double tap that lands in one batch charges once. A request from a caller
//! that may not use the wallet ([`Access`]) is answered as if the wallet did not exist.
//!
//! Holds: a payment, or a new hold, spends the available balance (the balance less what is held).
//! A hold is only ever treated as expired when the write that relies on it also releases it: a
//! movement short of funds while something is held asks for the wallet's expired holds first
//! ([`decide_round`] answers with the wallets to read them for), and the round, decided again
//! with them, then releases them all before its movements. So a hold a payment spent past is
//! settled `expired` by that payment's own write, and no capture on any replica can charge it
//! afterwards, whatever its clock says.

mod legs;

pub use legs::{HeldMovement, LegsOp, LegsPlan, LegsWallet, RefundOf, SettleAs, decide_between, wallets_of};

use super::{Access, Moved, MovementOutcome, WalletError, WalletId};
use crate::domain::{
    Amount, EntryKind, EventType, FenceStanding, Funds, HoldStatus, Metadata, Room, Rules, capture_amount,
};
use crate::idempotency::{Keyed, Prior, StoredResponse};
use crate::ledger::event::EventWrite;
use crate::ledger::group::FoundKey;
use crate::ledger::hold::{Hold, NewHold};
use crate::ledger::{self, Entry};
use crate::wallet::{Movement, Refusal};
use chrono::{DateTime, Utc};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use uuid::Uuid;

/// One movement to apply for a caller, with its idempotency key if the request had one.
#[derive(Debug)]
pub struct Op {
    pub movement: Movement,
    pub access: Access,
    pub key: Option<Keyed<MovementOutcome>>,
}

impl Op {
    /// The hold this op settles, if it captures or voids one.
    pub fn settles(&self) -> Option<Uuid> {
        match self.movement {
            Movement::Capture { hold, .. } | Movement::Void { hold } => Some(hold),
            _ => None,
        }
    }
}

/// The wallet as its lease holder last read or wrote it, or as the last holder's note says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub balance: i64,
    /// What the wallet's holds not yet settled reserve.
    pub held: i64,
    pub version: i64,
    /// The fence of the row's last writer: below the lease's when just read, the lease's own once
    /// this holder has written.
    pub fence: i64,
    /// The caller that owns the wallet (it never changes).
    pub owner: Option<Arc<str>>,
    /// Its monitors and limits: every movement is decided with them; one that crosses a monitor
    /// writes its event ([`crate::domain::Monitors::crossed`]), none passes a limit.
    pub rules: Rules,
    /// Only the lease's note says so (see [`Held::from_note`]): no write of this holder has matched
    /// it yet, so a write that does not match means the note was stale, not that the lease was lost.
    pub from_note: bool,
}

/// The version of the notes' layout: a note of another layout is not read.
const NOTE_LAYOUT: &str = "w3";

#[cfg(test)]
impl Held {
    /// A wallet of `owner` at version 5 and fence 3, with no rules: the unit tests' start.
    pub(crate) fn of_tests(balance: i64, held: i64, owner: &str) -> Held {
        let owner = Some(Arc::from(owner));
        Held { balance, held, version: 5, fence: 3, owner, rules: Rules::NONE, from_note: false }
    }
}

impl Held {
    /// The note a holder leaves for the wallet's next one when it releases the lease
    /// ([`crate::lease::Lease::release_with_note`]): this state,
    /// `w3:balance:held:version:fence:rules:owner` (rules: [`Rules::to_note`]).
    pub fn to_note(&self) -> String {
        let owner = self.owner.as_deref().unwrap_or_default();
        let rules = self.rules.to_note();
        format!(
            "{NOTE_LAYOUT}:{}:{}:{}:{}:{rules}:{owner}",
            self.balance, self.held, self.version, self.fence
        )
    }

    /// The wallet as `note` says it was left, for the lease holding `fence`; `None` if it is not a
    /// note of this layout, or names a fence the lease's does not stand plausibly above (Redis's
    /// fence counter went backwards, or was moved: the holder reads the row, which says how far). Advice only: the holder's write is
    /// conditional on every field of it (see [`crate::ledger::group::commit`]), so a stale or forged
    /// note moves nothing and costs a read.
    pub fn from_note(note: &str, fence: i64) -> Option<Held> {
        let mut fields = note.splitn(7, ':');
        if fields.next() != Some(NOTE_LAYOUT) {
            return None;
        }
        let mut number = || fields.next().and_then(|field| field.parse::<i64>().ok());
        let (balance, held, version, written_by) = (number()?, number()?, number()?, number()?);
        let rules = Rules::from_note(fields.next()?)?;
        let owner = fields.next()?;
        let owner = (!owner.is_empty()).then(|| Arc::from(owner));
        let plausible = FenceStanding::of(fence, written_by) == FenceStanding::Above;
        let held = Held { balance, held, version, fence: written_by, owner, rules, from_note: true };
        let available =
            Funds { limits: held.rules.limits, ..Funds::new(held.balance, held.held) }.available();
        (plausible && held.held >= 0 && available >= 0 && version >= 1).then_some(held)
    }

    /// The wallet as its row, locked, has it.
    pub fn of_locked(row: &crate::ledger::transfer::LockedWallet) -> Held {
        Held {
            balance: row.balance,
            held: row.held,
            version: row.version,
            fence: row.fence,
            owner: row.owner.as_deref().map(Arc::from),
            rules: row.rules.clone(),
            from_note: false,
        }
    }

    /// What it may spend, decided at `now`.
    fn funds(&self, now: DateTime<Utc>) -> Funds {
        self.rules.funds(self.balance, self.held, now)
    }
}

/// Stored keys by `(caller, scope, key)`.
pub type FoundKeys = HashMap<(String, String, String), FoundKey>;

/// What the refunds so far of a payment, transfer or movement (by its id) gave back, by wallet.
pub type Refunds = HashMap<Uuid, HashMap<String, i64>>;

/// How one op fared.
#[derive(Debug)]
enum Decision {
    /// Runs, with this outcome once written.
    Accepted(Box<Moved>),
    Refused(Refusal),
    /// Its key was used before this batch.
    Prior(Prior),
    /// Its key is the one an earlier op of this batch (the n-th) carries, for the same request.
    SameAs(usize),
    /// Its caller may not use the wallet: answered as if the wallet did not exist.
    Hidden,
}

/// A hold settled by a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub hold: Uuid,
    pub status: HoldStatus,
    pub captured: i64,
    pub capture_entry: Option<Uuid>,
}

/// A batch decided: what to write, and how to answer each op once the write is known.
#[derive(Debug)]
pub struct Plan {
    decisions: Vec<Decision>,
    /// The ledger entries of the accepted ops, in order.
    pub entries: Vec<Entry>,
    /// The holds placed, and those settled.
    pub placed: Vec<Hold>,
    pub settled: Vec<Settled>,
    /// What happened to the wallet, in the order it happened: an event per entry, and per hold
    /// placed or settled without one.
    pub events: Vec<EventWrite>,
    /// The wallet after them.
    pub after: Held,
    /// The response to store for each op with a key that ran: (op index, response).
    pub responses: Vec<(usize, StoredResponse)>,
    /// A movement was short of funds while something is held, and the wallet's expired holds were
    /// not read: nothing of this plan may be written; decide again with them.
    needs_expired: bool,
}

impl Plan {
    /// Settles a hold of `wallet`, with its event unless the entry it wrote is the event (a
    /// capture that charged something).
    fn settle(&mut self, wallet: &str, settled: Settled) {
        if settled.capture_entry.is_none() {
            self.events.push(EventWrite::of_hold(wallet, settled.hold, settled.status));
        }
        self.settled.push(settled);
    }

    /// What the debits decided so far took, as a velocity window counts them: the payments (not
    /// the captures: their holds counted) and the holds placed.
    fn counted(&self) -> (i64, i64) {
        let payments = self.entries.iter().filter(|e| e.kind.is_debit() && e.hold_id.is_none());
        let (paid, payments) = payments.fold((0, 0), |(sum, n), e| (sum + e.amount, n + 1));
        let placed: i64 = self.placed.iter().map(|h| h.amount).sum();
        (paid + placed, payments + self.placed.len() as i64)
    }

    /// Whether any op runs: then the batch must be written (or, with only refusals, its hold
    /// checked) before it is answered.
    pub fn runs(&self) -> bool {
        !self.settled.is_empty()
            || self.decisions.iter().any(|d| matches!(d, Decision::Accepted(_) | Decision::Refused(_)))
    }

    /// Whether an op is answered as if the wallet did not exist (its caller may not use it).
    pub fn hides(&self) -> bool {
        self.decisions.iter().any(|d| matches!(d, Decision::Hidden))
    }

    /// The ledger entry op `n` wrote, if it ran and was accepted and wrote one.
    pub fn entry_of(&self, n: usize) -> Option<&Entry> {
        match self.decisions.get(n) {
            Some(Decision::Accepted(moved)) => moved.entry(),
            _ => None,
        }
    }

    /// Each op's result, given whether the batch's write matched (`false`: the lease was lost and
    /// nothing of it was written) or failed with `failure`.
    pub fn results(&self, written: Result<bool, &WalletError>) -> Vec<Result<Moved, WalletError>> {
        let ran = |outcome| as_written(outcome, written);
        let mut results: Vec<Result<Moved, WalletError>> = Vec::with_capacity(self.decisions.len());
        for decision in &self.decisions {
            let result = match decision {
                Decision::Accepted(moved) => ran(Ok((**moved).clone())),
                Decision::Refused(refusal) => ran(Err(WalletError::Refused(*refusal))),
                Decision::Prior(prior) => Err(WalletError::AlreadyRan(prior.clone())),
                Decision::Hidden => Err(WalletError::NotFound),
                Decision::SameAs(first) => match &results[*first] {
                    Ok(_) | Err(WalletError::Refused(_)) => {
                        let stored =
                            self.responses.iter().find(|(op, _)| op == first).map(|(_, r)| r.clone());
                        match stored {
                            Some(response) => Err(WalletError::AlreadyRan(Prior::Replay(response))),
                            None => Err(WalletError::internal("no response for a keyed op")),
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

/// What a round decides on besides its wallets: the keys already stored, the holds its captures
/// and voids name (as read under the lease or the row lock), and, once read, wallets' expired
/// holds.
#[derive(Debug, Clone, Copy)]
pub struct Known<'a> {
    pub keys: &'a FoundKeys,
    pub holds: &'a HashMap<Uuid, Hold>,
    /// The wallets for which `holds` has every hold still held that expired by `now`.
    pub expired_read: &'a HashSet<String>,
    /// What the refunds so far of each original a refund of the round names gave back, as read
    /// under the leases (or row locks) of the original's wallets, which every refund of it holds.
    pub refunded: &'a Refunds,
    /// The time of the round's entries, and what "expired" is decided against.
    pub now: DateTime<Utc>,
}

/// One wallet's batch in a round: the fence its write carries (the lease's, or under Postgres
/// alone the row's own), the wallet as its writer holds it, and its movements in arrival order.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub id: &'a WalletId,
    pub fence: i64,
    pub held: &'a Held,
    pub ops: &'a [Op],
}

/// Decides every batch of a round: each batch's plan, in the round's order. `Err` names the
/// wallets one of whose movements was short of funds while something of it is held, and whose
/// expired holds `known` lacks: nothing of the round may be written; read those and decide again.
pub fn decide_round(batches: &[Batch<'_>], known: Known<'_>) -> Result<Vec<Plan>, Vec<String>> {
    let plans: Vec<Plan> = batches.iter().map(|batch| decide(batch, known)).collect();
    let short: Vec<String> = batches
        .iter()
        .zip(&plans)
        .filter(|(_, plan)| plan.needs_expired)
        .map(|(batch, _)| batch.id.as_str().to_owned())
        .collect();
    if short.is_empty() { Ok(plans) } else { Err(short) }
}

/// Decides one wallet's batch.
fn decide(batch: &Batch<'_>, known: Known<'_>) -> Plan {
    let Batch { id, fence, held, ops } = *batch;
    let now = known.now;
    let expired_read = known.expired_read.contains(id.as_str());
    let mut funds = held.funds(now);
    let mut rules = held.rules.clone();
    let mut plan = Plan {
        decisions: Vec::with_capacity(ops.len()),
        entries: Vec::new(),
        placed: Vec::new(),
        settled: Vec::new(),
        events: Vec::new(),
        after: held.clone(),
        responses: Vec::new(),
        needs_expired: false,
    };
    // What this batch settled so far, by hold: a second capture of one hold in the batch sees it.
    let mut status_now: HashMap<Uuid, HoldStatus> = HashMap::new();
    if expired_read {
        for hold in known.holds.values().filter(|h| h.wallet_id == id.as_str()) {
            if hold.status == HoldStatus::Held && hold.expires_at <= now {
                funds.held -= hold.amount;
                rules.velocity.give_back(hold.created_at, hold.amount, 1, now);
                status_now.insert(hold.id, HoldStatus::Expired);
                plan.settle(id.as_str(), settled(hold.id, HoldStatus::Expired, 0, None));
            }
        }
    }
    // The ops of this batch that carry each key: (op index, fingerprint).
    let mut first_with_key: HashMap<(&str, &str, &str), (usize, &[u8; 32])> = HashMap::new();
    for (n, op) in ops.iter().enumerate() {
        let balance_before = funds.balance;
        funds.room = rules.velocity.room(now);
        if !op.access.may_use(held.owner.as_deref()) {
            plan.decisions.push(Decision::Hidden);
            continue;
        }
        if let Some(key) = &op.key {
            let at = key.at();
            let stored = known.keys.get(&(at.caller.to_owned(), at.scope.to_owned(), at.key.to_owned()));
            if let Some(stored) = stored {
                plan.decisions.push(Decision::Prior(Prior::of(stored, &key.fingerprint)));
                continue;
            }
            if let Some((first, fingerprint)) = first_with_key.get(&(at.caller, at.scope, at.key)) {
                plan.decisions.push(if *fingerprint == &key.fingerprint {
                    Decision::SameAs(*first)
                } else {
                    Decision::Prior(Prior::Reused)
                });
                continue;
            }
            first_with_key.insert((at.caller, at.scope, at.key), (n, &key.fingerprint));
        }
        // A deposit, a payment, a capture: one leg, into the wallet from outside the ledger or out
        // of it, decided as every leg of every movement is (`decide_legs`).
        let version = held.version + plan.entries.len() as i64;
        let one_leg = |funds: Funds, amount: Amount, debit: bool, reference: Option<&str>, metadata| {
            let leg = Leg { wallet: id, funds, version, fence, amount, debit };
            let links = Links { movement: None, reference, metadata, refund_of: None, now };
            let entries = decide_legs(&[leg], (EntryKind::Pay, EntryKind::Deposit), links);
            entries.map(|mut entries| entries.remove(0)).map_err(|(_, refusal)| refusal)
        };
        let outcome: MovementOutcome = match &op.movement {
            Movement::Deposit { amount, metadata } => {
                one_leg(funds, *amount, false, None, metadata).map(|entry| {
                    funds.balance = entry.balance;
                    Moved::Entry(entry)
                })
            }
            Movement::Pay { amount, reference, metadata } => {
                one_leg(funds, *amount, true, reference.as_deref(), metadata).map(|entry| {
                    funds.balance = entry.balance;
                    rules.velocity.count(amount.get(), now);
                    Moved::Entry(entry)
                })
            }
            Movement::Hold { amount, life, reference, metadata } => funds.hold(*amount).map(|after| {
                funds.held = after;
                rules.velocity.count(amount.get(), now);
                let new = NewHold {
                    wallet_id: id.as_str().to_owned(),
                    amount: amount.get(),
                    expires_at: life.expiry_from(now),
                    reference: reference.clone(),
                    metadata: metadata.clone(),
                    fence,
                    movement_id: None,
                };
                let hold = Hold::placed(new, now);
                plan.events.push(EventWrite::of_hold(id.as_str(), hold.id, HoldStatus::Held));
                plan.placed.push(hold.clone());
                Moved::Hold { hold, entry: None }
            }),
            Movement::Capture { hold: hold_id, .. } | Movement::Void { hold: hold_id }
                if !known.holds.contains_key(hold_id) =>
            {
                // The request found the hold before it was queued, and holds are never deleted.
                plan.decisions.push(Decision::Hidden);
                tracing::error!(hold = %hold_id, "a hold named by a queued capture or void was not read");
                continue;
            }
            Movement::Capture { hold: hold_id, amount } => {
                let hold = &known.holds[hold_id];
                match standing(hold, &mut status_now, (&mut funds, &mut rules), &mut plan, now) {
                    Err(refusal) => Err(refusal),
                    Ok(()) => capture_amount(*amount, hold.amount).and_then(|charged| {
                        // The hold's own amount is released as it is charged; its placement
                        // counted against the velocity limits already.
                        let released = Funds { held: funds.held - hold.amount, room: Room::NONE, ..funds };
                        let mut paid =
                            one_leg(released, charged, true, hold.reference.as_deref(), &hold.metadata)?;
                        paid.hold_id = Some(hold.id);
                        (funds.balance, funds.held) = (paid.balance, released.held);
                        status_now.insert(hold.id, HoldStatus::Captured);
                        let charged = charged.get();
                        rules.velocity.give_back(hold.created_at, hold.amount - charged, 0, now);
                        plan.settle(
                            id.as_str(),
                            settled(hold.id, HoldStatus::Captured, charged, Some(paid.id)),
                        );
                        let hold = Hold {
                            captured: charged,
                            status: HoldStatus::Captured,
                            settled_at: Some(now),
                            capture_entry: Some(paid.id),
                            ..hold.clone()
                        };
                        Ok(Moved::Hold { hold, entry: Some(paid) })
                    }),
                }
            }
            Movement::Void { hold: hold_id } => {
                let hold = &known.holds[hold_id];
                standing(hold, &mut status_now, (&mut funds, &mut rules), &mut plan, now).map(|()| {
                    funds.held -= hold.amount;
                    rules.velocity.give_back(hold.created_at, hold.amount, 1, now);
                    status_now.insert(hold.id, HoldStatus::Voided);
                    plan.settle(id.as_str(), settled(hold.id, HoldStatus::Voided, 0, None));
                    let hold = Hold { status: HoldStatus::Voided, settled_at: Some(now), ..hold.clone() };
                    Moved::Hold { hold, entry: None }
                })
            }
            Movement::ReleaseExpired if !expired_read => {
                plan.needs_expired = true;
                return plan;
            }
            Movement::ReleaseExpired => Ok(Moved::Released),
            Movement::AddMonitor(monitor) => rules.monitors.with(*monitor).map(|after| {
                rules.monitors = after;
                Moved::Monitors(rules.monitors.clone())
            }),
            Movement::RemoveMonitor(monitor) => rules.monitors.without(*monitor).map(|after| {
                rules.monitors = after;
                Moved::Monitors(rules.monitors.clone())
            }),
            // A velocity limit set here also counts the debits decided before it in this batch:
            // they are stamped with its moment.
            Movement::SetLimits(set) => rules.with_limits(set, funds, now, plan.counted()).map(|after| {
                rules = after;
                funds.limits = rules.limits;
                Moved::Limits { rules: Box::new(rules.clone()), at: now }
            }),
        };
        if let Some(entry) = outcome.as_ref().ok().and_then(Moved::entry) {
            // Only deposits, payments and captures are decided here: no leg between wallets.
            plan.events.push(EventWrite::of_entry(entry, EventType::MovementAccepted));
            plan.events.extend(EventWrite::of_crossings(entry, &rules.monitors, balance_before));
            plan.entries.push(entry.clone());
        }
        // Short of funds while something is held: the holds that expired may cover it, and only a
        // write that releases them may count on that.
        if outcome.as_ref().is_err_and(|refusal| refusal.spends_past_holds())
            && funds.held > 0
            && !expired_read
        {
            plan.needs_expired = true;
            return plan;
        }
        plan.decisions.push(match &outcome {
            Ok(moved) => Decision::Accepted(Box::new(moved.clone())),
            Err(refusal) => Decision::Refused(*refusal),
        });
        if let Some(key) = &op.key {
            plan.responses.push((n, (key.render)(&outcome)));
        }
    }
    // Only a batch that is written raises the row's fence to the lease's.
    if plan.runs() {
        let version = held.version + plan.entries.len() as i64;
        // The write is conditional on the held state: once it matches, the state is confirmed.
        plan.after = Held {
            balance: funds.balance,
            held: funds.held,
            version,
            fence,
            owner: held.owner.clone(),
            rules,
            from_note: false,
        };
    }
    plan
}

/// One leg of a movement of money between wallets, against its wallet as its writer holds it:
/// `amount` out of the wallet (`debit`) or into it, written under `fence`.
#[derive(Debug, Clone, Copy)]
pub struct Leg<'a> {
    pub wallet: &'a WalletId,
    pub funds: Funds,
    pub version: i64,
    pub fence: i64,
    pub amount: Amount,
    pub debit: bool,
}

impl Leg<'_> {
    /// What the leg moves into its wallet: negative for a debit.
    pub fn signed(&self) -> i64 {
        if self.debit { -self.amount.get() } else { self.amount.get() }
    }
}

/// What a movement's entries say of it besides their legs.
#[derive(Debug, Clone, Copy)]
pub struct Links<'a> {
    /// The movement the entries are legs of (a transfer's id).
    pub movement: Option<Uuid>,
    pub reference: Option<&'a str>,
    pub metadata: &'a Metadata,
    /// The `pay` entry a `refund` entry returns money for.
    pub refund_of: Option<Uuid>,
    pub now: DateTime<Utc>,
}

/// Decides a movement of money: each debit leg must be covered by its wallet's available balance
/// (what no hold reserves), each credit held by its balance without overflow. The entries, one a
/// leg, in the legs' order (`out` for a debit, `into` for a credit); or the first leg that
/// cannot be, and why, and then nothing of the movement applies. A movement of two or more legs
/// moves money between its wallets: its legs sum to zero, which the caller has checked.
pub fn decide_legs(
    legs: &[Leg<'_>],
    (out, into): (EntryKind, EntryKind),
    links: Links<'_>,
) -> Result<Vec<Entry>, (usize, Refusal)> {
    debug_assert!(legs.len() < 2 || legs.iter().map(Leg::signed).sum::<i64>() == 0);
    legs.iter()
        .enumerate()
        .map(|(n, leg)| {
            let (kind, balance) = if leg.debit {
                (out, leg.funds.pay(leg.amount))
            } else {
                (into, leg.funds.deposit(leg.amount))
            };
            let balance = balance.map_err(|refusal| (n, refusal))?;
            Ok(Entry {
                id: ledger::new_entry_id(),
                wallet_id: leg.wallet.as_str().to_owned(),
                kind,
                amount: leg.amount.get(),
                balance,
                version: leg.version + 1,
                fence: leg.fence,
                reference: links.reference.map(str::to_owned),
                metadata: links.metadata.clone(),
                transfer_id: links.movement,
                refund_of: links.refund_of,
                hold_id: None,
                created_at: links.now,
            })
        })
        .collect()
}

/// A decided outcome as its write left it: itself once written (`Ok(true)`), `lease_lost` when the
/// write matched nothing (nothing of it was written), or the write's failure.
fn as_written<T>(
    outcome: Result<T, WalletError>,
    written: Result<bool, &WalletError>,
) -> Result<T, WalletError> {
    match written {
        Ok(true) => outcome,
        Ok(false) => Err(WalletError::LeaseLost),
        Err(failure) => Err(failure.clone()),
    }
}

fn settled(hold: Uuid, status: HoldStatus, captured: i64, capture_entry: Option<Uuid>) -> Settled {
    Settled { hold, status, captured, capture_entry }
}

/// Whether `hold` may still be captured or voided now: held and not expired. One that is held
/// past its expiry is released here (settled `expired`, its amount no longer held) and refused.
fn standing(
    hold: &Hold,
    status_now: &mut HashMap<Uuid, HoldStatus>,
    (funds, rules): (&mut Funds, &mut Rules),
    plan: &mut Plan,
    now: DateTime<Utc>,
) -> Result<(), Refusal> {
    let status = status_now.get(&hold.id).copied().unwrap_or(hold.status);
    if let Some(refusal) = status.refusal() {
        return Err(refusal);
    }
    if hold.expires_at <= now {
        funds.held -= hold.amount;
        rules.velocity.give_back(hold.created_at, hold.amount, 1, now);
        status_now.insert(hold.id, HoldStatus::Expired);
        plan.settle(&hold.wallet_id, settled(hold.id, HoldStatus::Expired, 0, None));
        return Err(Refusal::HoldExpired);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{
        HoldLife, LimitKind, Limits, LimitsSet, Monitor, Monitors, Per, Velocities, VelocityLimit,
    };
    use crate::idempotency::{IdempotencyKey, Scope};
    use crate::ledger::idempotency::ResponseRow;
    use proptest::prelude::*;

    const OWNER: &str = "shop";

    fn wallet() -> WalletId {
        WalletId::parse("w").unwrap()
    }

    fn amount(n: i64) -> Amount {
        Amount::new(n).unwrap()
    }

    fn held(balance: i64, held: i64) -> Held {
        Held::of_tests(balance, held, OWNER)
    }

    fn render(outcome: &MovementOutcome) -> StoredResponse {
        let body = match outcome {
            Ok(moved) => moved.entry().map(|entry| entry.amount.to_string()).unwrap_or_default(),
            Err(refusal) => refusal.code().to_owned(),
        };
        StoredResponse { status: 200, content_type: "text/plain".into(), body: body.into_bytes() }
    }

    fn op(movement: Movement) -> Op {
        Op { movement, access: Access::own_wallets(OWNER), key: None }
    }

    /// `movement` with the key `key`, for the request whose fingerprint is all `request`.
    fn keyed(movement: Movement, key: &str, request: u8) -> Op {
        let key = Keyed {
            scope: Scope::wallet(OWNER, &wallet()),
            key: IdempotencyKey::parse(key.as_bytes()).unwrap(),
            fingerprint: [request; 32],
            render,
        };
        Op { key: Some(key), ..op(movement) }
    }

    fn pay(n: i64) -> Movement {
        Movement::Pay { amount: amount(n), reference: None, metadata: Metadata::default() }
    }

    fn hold_of(amount: i64, expired: bool, now: DateTime<Utc>) -> Hold {
        let expires_at = now + chrono::Duration::seconds(if expired { -1 } else { 60 });
        Hold {
            id: Uuid::now_v7(),
            wallet_id: wallet().as_str().to_owned(),
            amount,
            captured: 0,
            status: HoldStatus::Held,
            expires_at,
            reference: None,
            metadata: Metadata::default(),
            created_at: now,
            settled_at: None,
            capture_entry: None,
            movement_id: None,
            fence: 1,
        }
    }

    /// What a round knows, with nothing stored: keys and holds as given.
    struct World {
        keys: FoundKeys,
        holds: HashMap<Uuid, Hold>,
        expired_read: HashSet<String>,
        refunded: Refunds,
        now: DateTime<Utc>,
    }

    impl World {
        fn new() -> Self {
            let now = Utc::now();
            Self {
                keys: FoundKeys::new(),
                holds: HashMap::new(),
                expired_read: HashSet::new(),
                refunded: Refunds::new(),
                now,
            }
        }

        fn known(&self) -> Known<'_> {
            Known {
                keys: &self.keys,
                holds: &self.holds,
                expired_read: &self.expired_read,
                refunded: &self.refunded,
                now: self.now,
            }
        }

        /// Decides one wallet's batch, reading its expired holds when the decision asks for them,
        /// as the rounds do.
        fn decide(&mut self, held: &Held, ops: &[Op]) -> Plan {
            let id = wallet();
            let batch = Batch { id: &id, fence: 9, held, ops };
            match decide_round(&[batch], self.known()) {
                Ok(mut plans) => plans.remove(0),
                Err(short) => {
                    assert_eq!(short, vec![id.as_str().to_owned()]);
                    self.expired_read.insert(id.as_str().to_owned());
                    decide_round(&[batch], self.known())
                        .expect("decided once expired holds are read")
                        .remove(0)
                }
            }
        }
    }

    #[test]
    fn a_payment_that_does_not_fit_is_refused_alone_and_the_rest_go_through() {
        let plan = World::new().decide(&held(100, 0), &[op(pay(60)), op(pay(50)), op(pay(40))]);
        assert!(matches!(
            plan.decisions[1],
            Decision::Refused(Refusal::InsufficientFunds { available: 40, .. })
        ));
        let balances: Vec<i64> = plan.entries.iter().map(|e| e.balance).collect();
        assert_eq!(balances, [40, 0]);
        assert_eq!((plan.after.balance, plan.after.version, plan.after.fence), (0, 7, 9));
    }

    #[test]
    fn a_key_sent_twice_in_a_batch_runs_once_and_a_key_stored_before_runs_not_at_all() {
        let mut world = World::new();
        let ops = [keyed(pay(10), "k", 1), keyed(pay(10), "k", 1), keyed(pay(20), "k", 2)];
        let plan = world.decide(&held(100, 0), &ops);
        assert!(matches!(plan.decisions[1], Decision::SameAs(0)), "the double tap waits for the first");
        assert!(matches!(plan.decisions[2], Decision::Prior(Prior::Reused)), "another request");
        assert_eq!((plan.entries.len(), plan.responses.len(), plan.after.balance), (1, 1, 90));

        let at = (OWNER.to_owned(), wallet().scope(), "k".to_owned());
        let response = plan.responses[0].1.clone();
        let StoredResponse { status, content_type, body } = response.clone();
        let row = ResponseRow { status, content_type, body };
        world.keys.insert(at, FoundKey { fingerprint: vec![1; 32], response: Some(row) });
        let again = world.decide(&held(90, 0), &ops[..1]);
        assert!(matches!(&again.decisions[0], Decision::Prior(Prior::Replay(r)) if *r == response));
        assert!(!again.runs(), "nothing to write");
    }

    #[test]
    fn a_caller_who_may_not_use_the_wallet_is_told_it_does_not_exist_and_moves_nothing() {
        let stranger = Op { access: Access::own_wallets("stranger"), ..op(pay(10)) };
        let plan = World::new().decide(&held(100, 0), &[stranger]);
        assert!(plan.hides() && !plan.runs());
        assert_eq!(plan.after, held(100, 0));
    }

    #[test]
    fn short_of_funds_while_something_is_held_the_expired_holds_are_read_and_released_first() {
        let mut world = World::new();
        let expired = hold_of(70, true, world.now);
        world.holds.insert(expired.id, expired.clone());
        let id = wallet();
        let wallet_held = held(100, 70);
        let ops = [op(pay(50))];
        let batch = Batch { id: &id, fence: 9, held: &wallet_held, ops: &ops };
        assert_eq!(decide_round(&[batch], world.known()).unwrap_err(), vec!["w".to_owned()]);
        let plan = world.decide(&wallet_held, &ops);
        assert_eq!(plan.settled, [settled(expired.id, HoldStatus::Expired, 0, None)]);
        assert_eq!((plan.after.balance, plan.after.held), (50, 0));
    }

    #[test]
    fn a_capture_charges_once_and_releases_the_rest() {
        let mut world = World::new();
        let hold = hold_of(40, false, world.now);
        world.holds.insert(hold.id, hold.clone());
        let capture = Movement::Capture { hold: hold.id, amount: Some(amount(25)) };
        let plan = world.decide(&held(100, 40), &[op(capture.clone()), op(capture)]);
        assert!(matches!(plan.decisions[1], Decision::Refused(Refusal::HoldCaptured)));
        assert_eq!((plan.after.balance, plan.after.held), (75, 0));
        assert_eq!(plan.entries[0].hold_id, Some(hold.id));
    }

    fn with_monitors(balance: i64, monitors: &[Monitor]) -> Held {
        let rules = Rules { monitors: Monitors::new(monitors.iter().copied()), ..Rules::NONE };
        Held { rules, ..held(balance, 0) }
    }

    fn deposit(n: i64) -> Movement {
        Movement::Deposit { amount: amount(n), metadata: Metadata::default() }
    }

    /// The balance events of a plan: (type, monitor, the entry that crossed it).
    fn crossings(plan: &Plan) -> Vec<(EventType, i64, Uuid)> {
        let balance_events = plan.events.iter().filter(|e| e.monitor.is_some());
        balance_events.map(|e| (e.kind, e.monitor.unwrap(), e.entry_id.unwrap())).collect()
    }

    #[test]
    fn a_movement_that_crosses_a_monitor_writes_its_event_right_after_its_own() {
        let start = with_monitors(100, &[Monitor::Below(50), Monitor::Above(120)]);
        let ops = [
            op(pay(60)),                                  // 100 → 40: below 50
            op(pay(10)),                                  // 40 → 30: still below, nothing
            op(deposit(100)),                             // 30 → 130: above 120
            op(pay(90)),                                  // 130 → 40: below 50 again
            op(Movement::AddMonitor(Monitor::Below(35))), // no event: it is not crossed
            op(pay(10)),                                  // 40 → 30: below 35
        ];
        let plan = World::new().decide(&start, &ops);
        let entry = |n: usize| plan.entry_of(n).unwrap().id;
        assert_eq!(
            crossings(&plan),
            [
                (EventType::BalanceBelow, 50, entry(0)),
                (EventType::BalanceAbove, 120, entry(2)),
                (EventType::BalanceBelow, 50, entry(3)),
                (EventType::BalanceBelow, 35, entry(5)),
            ]
        );
        for (n, event) in plan.events.iter().enumerate().filter(|(_, e)| e.monitor.is_some()) {
            assert_eq!(plan.events[n - 1].entry_id, event.entry_id, "right after its entry's event");
        }
        assert_eq!(
            plan.after.rules.monitors.list(),
            [Monitor::Below(35), Monitor::Below(50), Monitor::Above(120)]
        );
        assert_eq!((plan.after.balance, plan.after.version), (30, 10), "a monitor set writes no entry");
    }

    #[test]
    fn a_ninth_monitor_or_removing_one_not_set_is_refused_and_changes_nothing() {
        let eight: Vec<Monitor> = (0..8).map(Monitor::Above).collect();
        let ops =
            [op(Movement::AddMonitor(Monitor::Below(1))), op(Movement::RemoveMonitor(Monitor::Below(2)))];
        let plan = World::new().decide(&with_monitors(100, &eight), &ops);
        assert!(matches!(plan.decisions[0], Decision::Refused(Refusal::TooManyMonitors { most: 8 })));
        assert!(matches!(plan.decisions[1], Decision::Refused(Refusal::MonitorNotFound)));
        assert_eq!(plan.after.rules.monitors.list(), eight, "the monitors are as they were");
        assert!(plan.events.is_empty() && plan.entries.is_empty());

        let ops = [op(Movement::RemoveMonitor(Monitor::Above(3))), op(pay(100))];
        let plan = World::new().decide(&with_monitors(100, &[Monitor::Above(3), Monitor::Below(1)]), &ops);
        assert_eq!(plan.after.rules.monitors.list(), [Monitor::Below(1)]);
        assert_eq!(crossings(&plan), [(EventType::BalanceBelow, 1, plan.entries[0].id)]);
    }

    #[test]
    fn limits_set_in_a_batch_hold_for_every_movement_after_it_and_none_before() {
        let limits = Limits { overdraft: 100, per_payment: Some(80) };
        let ops = [
            op(pay(90)), // 100 → 10: no cap yet
            op(Movement::SetLimits(LimitsSet { limits, ..LimitsSet::default() })),
            op(pay(81)), // over the cap
            op(pay(80)), // 10 → -70: into the overdraft
            op(pay(31)), // 30 available
            op(Movement::SetLimits(LimitsSet {
                limits: Limits { overdraft: 69, per_payment: None },
                ..LimitsSet::default()
            })), // owes 70
        ];
        let plan = World::new().decide(&held(100, 0), &ops);
        let over_cap = Refusal::LimitExceeded { limit: LimitKind::PerPayment, left: 80, resets_at: None };
        assert!(matches!(plan.decisions[2], Decision::Refused(refusal) if refusal == over_cap));
        assert!(matches!(
            plan.decisions[4],
            Decision::Refused(Refusal::InsufficientFunds { balance: -70, available: 30 })
        ));
        assert!(matches!(
            plan.decisions[5],
            Decision::Refused(Refusal::LimitBelowUsed { limit: LimitKind::Overdraft, used: 70 })
        ));
        let balances: Vec<i64> = plan.entries.iter().map(|e| e.balance).collect();
        assert_eq!(balances, [10, -70]);
        assert_eq!(
            (plan.after.balance, plan.after.rules.limits),
            (-70, limits),
            "the refused change changed nothing"
        );
    }

    #[test]
    fn a_velocity_limit_set_in_a_batch_counts_the_debits_decided_before_it() {
        let day = VelocityLimit { per: Per::Day, amount: Some(100), count: None };
        let set = LimitsSet { velocity: vec![day], ..LimitsSet::default() };
        let hold = Movement::Hold {
            amount: amount(20),
            life: HoldLife::DEFAULT,
            reference: None,
            metadata: Metadata::default(),
        };
        let ops =
            [op(pay(30)), op(hold), op(deposit(500)), op(Movement::SetLimits(set)), op(pay(51)), op(pay(50))];
        let plan = World::new().decide(&held(1_000, 0), &ops);
        assert!(
            matches!(
                plan.decisions[4],
                Decision::Refused(Refusal::LimitExceeded {
                    limit: LimitKind::Amount(Per::Day),
                    left: 50,
                    ..
                })
            ),
            "51 does not fit: the 50 before the limit count"
        );
        let used = plan.after.rules.velocity.velocity[0].used;
        assert_eq!((used.amount, used.count), (100, 3), "30 and 20 before it, 50 after");
    }

    /// A movement for the property tests: holds are named by their index among the known ones.
    #[derive(Debug, Clone)]
    enum Step {
        Deposit(i64),
        Pay(i64),
        Hold(i64),
        Capture(usize, Option<i64>),
        Void(usize),
        ReleaseExpired,
        Stranger(i64),
    }

    /// A step, with a key from a pool of three for one of two requests, or none.
    type KeyedStep = (Step, Option<(u8, u8)>);

    fn step() -> impl Strategy<Value = KeyedStep> {
        let step = prop_oneof![
            (1..500_i64).prop_map(Step::Deposit),
            (1..500_i64).prop_map(Step::Pay),
            (1..300_i64).prop_map(Step::Hold),
            (0..3_usize, proptest::option::of(1..200_i64)).prop_map(|(h, a)| Step::Capture(h, a)),
            (0..3_usize).prop_map(Step::Void),
            Just(Step::ReleaseExpired),
            (1..100_i64).prop_map(Step::Stranger),
        ];
        (step, proptest::option::weighted(0.4, (0..3_u8, 1..3_u8)))
    }

    fn to_op(step: &Step, key: Option<(u8, u8)>, holds: &[Hold]) -> Op {
        let movement = match *step {
            Step::Deposit(n) => Movement::Deposit { amount: amount(n), metadata: Metadata::default() },
            Step::Pay(n) | Step::Stranger(n) => pay(n),
            Step::Hold(n) => Movement::Hold {
                amount: amount(n),
                life: HoldLife::DEFAULT,
                reference: None,
                metadata: Metadata::default(),
            },
            Step::Capture(h, a) => Movement::Capture { hold: holds[h].id, amount: a.map(amount) },
            Step::Void(h) => Movement::Void { hold: holds[h].id },
            Step::ReleaseExpired => Movement::ReleaseExpired,
        };
        let op = match key {
            Some((key, request)) => keyed(movement, &format!("key-{key}"), request),
            None => op(movement),
        };
        match step {
            Step::Stranger(_) => Op { access: Access::own_wallets("stranger"), ..op },
            _ => op,
        }
    }

    /// A wallet with three holds (each expired or not) within its balance, and a batch for it.
    fn case() -> impl Strategy<Value = (i64, [(i64, bool); 3], Vec<KeyedStep>)> {
        let holds = [(1..200_i64, any::<bool>()), (1..200_i64, any::<bool>()), (1..200_i64, any::<bool>())];
        (0..1_000_i64, holds, proptest::collection::vec(step(), 0..24))
    }

    /// The money a decided batch moves into the wallet (negative: out), by its accepted movements.
    fn moved_by(plan: &Plan) -> i64 {
        plan.entries.iter().map(|e| if e.kind.is_debit() { -e.amount } else { e.amount }).sum()
    }

    /// Legs on distinct wallets that sum to zero: (balance, held, amount in or out).
    fn movement() -> impl Strategy<Value = Vec<(i64, i64, i64)>> {
        proptest::collection::vec((0..1_000_i64, 0..100_i64, 1..600_i64), 1..16)
            .prop_flat_map(|debits| {
                let total: i64 = debits.iter().map(|&(_, _, out)| out).sum();
                (Just(debits), proptest::collection::vec((0..1_000_i64, 0..100_i64), 1..=4), Just(total))
            })
            .prop_map(|(debits, credits, total)| {
                // The credits split the total between them; each wallet's held is within its balance.
                let mut legs: Vec<(i64, i64, i64)> = debits
                    .into_iter()
                    .map(|(balance, held, out)| (balance, held.min(balance), -out))
                    .collect();
                let n = credits.len() as i64;
                for (i, (balance, held)) in credits.into_iter().enumerate() {
                    let share = total / n + if (i as i64) < total % n { 1 } else { 0 };
                    if share > 0 {
                        legs.push((balance, held.min(balance), share));
                    }
                }
                legs
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_movement_conserves_money_or_names_the_leg_it_cannot_make_and_moves_nothing(
            specs in movement(),
        ) {
            let ids: Vec<WalletId> = (0..specs.len()).map(|n| WalletId::parse(&format!("w{n}")).unwrap()).collect();
            let legs: Vec<Leg<'_>> = specs
                .iter()
                .zip(&ids)
                .map(|(&(balance, held, amount), wallet)| Leg {
                    wallet,
                    funds: Funds::new(balance, held),
                    version: 3,
                    fence: 7,
                    amount: Amount::new(amount.abs()).unwrap(),
                    debit: amount < 0,
                })
                .collect();
            prop_assert_eq!(legs.iter().map(Leg::signed).sum::<i64>(), 0);
            let links = Links {
                movement: Some(Uuid::now_v7()),
                reference: None,
                metadata: &Metadata::default(),
                refund_of: None,
                now: Utc::now(),
            };
            match decide_legs(&legs, (EntryKind::TransferOut, EntryKind::TransferIn), links) {
                Ok(entries) => {
                    prop_assert_eq!(entries.len(), legs.len());
                    let before: i64 = legs.iter().map(|leg| leg.funds.balance).sum();
                    let after: i64 = entries.iter().map(|e| e.balance).sum();
                    prop_assert_eq!(before, after, "money is conserved");
                    for (leg, entry) in legs.iter().zip(&entries) {
                        prop_assert_eq!(entry.balance - leg.funds.balance, leg.signed());
                        prop_assert!(entry.balance - leg.funds.held >= 0, "no available balance below zero");
                        prop_assert_eq!((entry.version, entry.fence), (4, 7));
                        prop_assert_eq!(entry.kind.is_debit(), leg.debit);
                    }
                }
                Err((n, refusal)) => {
                    // The leg named is a debit its wallet's available balance does not cover, and
                    // every leg before it could be made.
                    let leg = legs[n];
                    prop_assert!(leg.debit && leg.funds.available() < leg.amount.get());
                    prop_assert_eq!(refusal, Refusal::InsufficientFunds { balance: leg.funds.balance, available: leg.funds.available() });
                    prop_assert!(legs[..n].iter().all(|l| !l.debit || l.funds.available() >= l.amount.get()));
                }
            }
        }

        #[test]
        fn a_monitor_fires_once_for_each_time_the_balance_goes_past_it(
            start in 0..1_000_i64,
            thresholds in proptest::collection::vec((any::<bool>(), 0..1_000_i64), 0..=Monitors::MOST),
            moves in proptest::collection::vec((any::<bool>(), 1..400_i64), 0..24),
        ) {
            let monitors: Vec<Monitor> = thresholds
                .iter()
                .map(|&(below, at)| if below { Monitor::Below(at) } else { Monitor::Above(at) })
                .collect();
            let ops: Vec<Op> = moves.iter().map(|&(out, n)| op(if out { pay(n) } else { deposit(n) })).collect();
            let plan = World::new().decide(&with_monitors(start, &monitors), &ops);
            // Every step of the balance, entry by entry, and the monitors each step went past.
            let mut expected = Vec::new();
            let mut balance = start;
            for entry in &plan.entries {
                for monitor in Monitors::new(monitors.iter().copied()).list() {
                    let (passed, kind) = match *monitor {
                        Monitor::Below(at) => (balance >= at && entry.balance < at, EventType::BalanceBelow),
                        Monitor::Above(at) => (balance <= at && entry.balance > at, EventType::BalanceAbove),
                    };
                    if passed {
                        expected.push((kind, monitor.amount(), entry.id));
                    }
                }
                balance = entry.balance;
            }
            prop_assert_eq!(crossings(&plan), expected);
        }

        #[test]
        fn no_velocity_window_takes_more_than_its_limit_and_each_counts_exactly_what_was_decided(
            (spare, hold_specs, steps) in case(),
            (day, times) in (1..1_500_i64, 1..12_i64),
        ) {
            let mut world = World::new();
            let holds: Vec<Hold> = hold_specs.iter().map(|&(a, expired)| hold_of(a, expired, world.now)).collect();
            for hold in &holds {
                world.holds.insert(hold.id, hold.clone());
            }
            let reserved: i64 = holds.iter().map(|h| h.amount).sum();
            // The limit was set a minute before the known holds were placed: they count in it.
            let per = Per::Every(Per::LONGEST);
            let set_at = world.now - chrono::Duration::minutes(1);
            let limit = VelocityLimit { per, amount: Some(reserved + day), count: Some(3 + times) };
            let mut velocity = Velocities::NONE.replaced(&[limit], None, set_at, (0, 0));
            (velocity.velocity[0].used.amount, velocity.velocity[0].used.count) = (reserved, 3);
            let rules = Rules { velocity, ..Rules::NONE };
            let before = Held { rules, ..held(reserved + spare, reserved) };
            let ops: Vec<Op> = steps.iter().map(|(step, key)| to_op(step, *key, &holds)).collect();
            let plan = world.decide(&before, &ops);

            let used = plan.after.rules.velocity.used_at(&plan.after.rules.velocity.velocity[0], world.now);
            prop_assert!(used.amount <= reserved + day && used.count <= 3 + times, "{:?}", used);
            // What the window took: the payments (not the captures: their holds counted), the holds
            // placed, less what the holds settled did not take.
            let payments: Vec<i64> = plan.entries.iter().filter(|e| e.hold_id.is_none() && e.kind.is_debit()).map(|e| e.amount).collect();
            let placed: i64 = plan.placed.iter().map(|h| h.amount).sum();
            let back: i64 = plan.settled.iter().map(|s| world.holds[&s.hold].amount - s.captured).sum();
            let uncounted = plan.settled.iter().filter(|s| s.status != HoldStatus::Captured).count() as i64;
            let expected_amount = reserved + payments.iter().sum::<i64>() + placed - back;
            let expected_count = 3 + payments.len() as i64 + plan.placed.len() as i64 - uncounted;
            if plan.runs() {
                prop_assert_eq!((used.amount, used.count), (expected_amount, expected_count));
            }
            // A refusal of a velocity limit is one the window could not take.
            for (n, decision) in plan.decisions.iter().enumerate() {
                if let Decision::Refused(Refusal::LimitExceeded { limit: LimitKind::Count(_), left, .. }) = decision {
                    prop_assert_eq!(*left, 0, "op {}", n);
                }
            }
        }

        #[test]
        fn a_decided_batch_conserves_money_keeps_what_is_held_and_decides_each_key_once(
            (spare, hold_specs, steps) in case(),
        ) {
            let mut world = World::new();
            let holds: Vec<Hold> = hold_specs.iter().map(|&(a, expired)| hold_of(a, expired, world.now)).collect();
            for hold in &holds {
                world.holds.insert(hold.id, hold.clone());
            }
            let reserved: i64 = holds.iter().map(|h| h.amount).sum();
            let before = held(reserved + spare, reserved);
            let ops: Vec<Op> = steps.iter().map(|(step, key)| to_op(step, *key, &holds)).collect();
            let plan = world.decide(&before, &ops);

            // Money is conserved: the balance moves by exactly what the entries say, and each entry
            // follows the one before it, one version at a time, in the batch's order.
            prop_assert_eq!(plan.after.balance, before.balance + moved_by(&plan));
            let mut balance = before.balance;
            for (n, entry) in plan.entries.iter().enumerate() {
                balance += if entry.kind.is_debit() { -entry.amount } else { entry.amount };
                prop_assert_eq!(entry.balance, balance);
                prop_assert_eq!(entry.version, before.version + n as i64 + 1);
                prop_assert!(entry.balance >= 0);
            }
            let ops_with_entries: Vec<usize> = (0..ops.len()).filter(|&n| plan.entry_of(n).is_some()).collect();
            prop_assert_eq!(ops_with_entries.len(), plan.entries.len());
            for (entry, &n) in plan.entries.iter().zip(&ops_with_entries) {
                prop_assert_eq!(Some(entry), plan.entry_of(n), "entries in the order of their movements");
            }

            // What is held is what the holds still held reserve, and never more than the balance.
            let placed: i64 = plan.placed.iter().map(|h| h.amount).sum();
            let released: i64 = plan.settled.iter().map(|s| world.holds[&s.hold].amount).sum();
            if plan.runs() {
                prop_assert_eq!(plan.after.held, before.held + placed - released);
            }
            prop_assert!(0 <= plan.after.held && plan.after.held <= plan.after.balance);
            let settled_ids: HashSet<Uuid> = plan.settled.iter().map(|s| s.hold).collect();
            prop_assert_eq!(settled_ids.len(), plan.settled.len(), "a hold settles once");

            // An event for each change, in order: each entry's (in the order of the entries), each
            // hold placed, and each settlement that wrote no entry; nothing else.
            prop_assert!(plan.events.iter().all(|e| e.wallet_id == wallet().as_str()));
            let of_entries: Vec<Uuid> = plan.events.iter().filter_map(|e| e.entry_id).collect();
            prop_assert_eq!(of_entries, plan.entries.iter().map(|e| e.id).collect::<Vec<_>>());
            for entry_event in plan.events.iter().filter(|e| e.entry_id.is_some()) {
                let entry = plan.entries.iter().find(|e| Some(e.id) == entry_event.entry_id).unwrap();
                prop_assert_eq!(entry_event.hold_id, entry.hold_id);
                prop_assert_eq!(entry_event.kind, EventType::of_entry(entry.kind, entry.hold_id.is_some(), EventType::MovementAccepted));
            }
            let of_holds: Vec<(Uuid, EventType)> =
                plan.events.iter().filter(|e| e.entry_id.is_none()).map(|e| (e.hold_id.unwrap(), e.kind)).collect();
            let mut expected: Vec<(Uuid, EventType)> =
                plan.placed.iter().map(|h| (h.id, EventType::HoldPlaced)).collect();
            expected.extend(
                plan.settled.iter().filter(|s| s.capture_entry.is_none()).map(|s| (s.hold, EventType::of_settled(s.status))),
            );
            let sorted = |mut events: Vec<(Uuid, EventType)>| {
                events.sort_by_key(|(id, kind)| (*id, kind.as_str()));
                events
            };
            prop_assert_eq!(sorted(of_holds.clone()), sorted(expected));
            // A hold placed in this batch and settled in it: placed first.
            for (n, (id, kind)) in of_holds.iter().enumerate() {
                if *kind != EventType::HoldPlaced {
                    let placed_at = of_holds.iter().position(|(other, k)| other == id && *k == EventType::HoldPlaced);
                    prop_assert!(placed_at.is_none_or(|at| at < n), "hold {} settled before placed", id);
                }
            }

            // A key decides once: one response per key, and only its first request can run.
            let mut keys_answered = HashSet::new();
            for (n, _) in &plan.responses {
                let key = ops[*n].key.as_ref().unwrap().key.as_str();
                prop_assert!(keys_answered.insert(key), "{} answered twice", key);
            }
            let mut first_of_key = HashMap::new();
            for (n, op) in ops.iter().enumerate() {
                let Some(key) = &op.key else { continue };
                if matches!(plan.decisions[n], Decision::Hidden) {
                    continue;
                }
                let first = *first_of_key.entry(key.key.as_str()).or_insert(n);
                if first != n {
                    prop_assert!(matches!(plan.decisions[n], Decision::SameAs(_) | Decision::Prior(_)));
                }
            }

            // Refusals change nothing: with only the movements that ran (and those refused for an
            // expired hold, which release it), the same entries and the same wallet.
            let kept: Vec<Op> = steps
                .iter()
                .zip(&plan.decisions)
                .filter(|(_, d)| {
                    matches!(d, Decision::Accepted(_) | Decision::Hidden | Decision::Refused(Refusal::HoldExpired))
                })
                .map(|((step, key), _)| to_op(step, *key, &holds))
                .collect();
            let without = world.decide(&before, &kept);
            let shape = |plan: &Plan| -> Vec<(EntryKind, i64, i64)> {
                plan.entries.iter().map(|e| (e.kind, e.amount, e.balance)).collect()
            };
            prop_assert_eq!(shape(&without), shape(&plan));
            prop_assert_eq!((without.after.balance, without.after.held), (plan.after.balance, plan.after.held));
        }
    }
}
