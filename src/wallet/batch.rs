//! Deciding one wallet's batch of movements: each on its own, in arrival order, against the
//! balance and holds the previous ones left, and each idempotency key looked up first. Pure: the
//! round that runs it ([`super::group`]) reads before and writes after.
//!
//! A payment that does not fit is refused alone; the rest go through. A request whose key is
//! already stored does not run: it gets the stored response (or `idempotency_key_reused`). A
//! request whose key an earlier request of the same batch carries waits for that one and gets its
//! response too, so a double tap that lands in one batch charges once. A request from a caller
//! that may not use the wallet ([`Access`]) is answered as if the wallet did not exist.
//!
//! Holds: a payment, or a new hold, spends the available balance (the balance less what is held).
//! A hold is only ever treated as expired when the write that relies on it also releases it: a
//! movement short of funds while something is held asks for the wallet's expired holds first
//! ([`Plan::needs_expired`]), and the batch then releases them all before its movements. So a hold
//! a payment spent past is settled `expired` by that payment's own write, and no capture on any
//! replica can charge it afterwards, whatever its clock says.

use super::{Access, Moved, MovementOutcome, WalletError, WalletId};
use crate::domain::{FenceStanding, Funds, HoldStatus, capture_amount};
use crate::idempotency::{Keyed, Prior};
use crate::ledger::group::FoundKey;
use crate::ledger::hold::Hold;
use crate::ledger::idempotency::StoredResponse;
use crate::ledger::{self, Entry, EntryKind};
use crate::wallet::{Movement, Refusal};
use chrono::{DateTime, Utc};
use std::collections::HashMap;
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
    /// Only the lease's note says so (see [`Held::from_note`]): no write of this holder has matched
    /// it yet, so a write that does not match means the note was stale, not that the lease was lost.
    pub from_note: bool,
}

/// The version of the notes' layout: a note of another layout is not read.
const NOTE_LAYOUT: &str = "w2";

impl Held {
    /// The note a holder leaves for the wallet's next one when it releases the lease
    /// ([`crate::lease::Lease::release_with_note`]): this state,
    /// `w2:balance:held:version:fence:owner`.
    pub fn to_note(&self) -> String {
        let owner = self.owner.as_deref().unwrap_or_default();
        format!("{NOTE_LAYOUT}:{}:{}:{}:{}:{owner}", self.balance, self.held, self.version, self.fence)
    }

    /// The wallet as `note` says it was left, for the lease holding `fence`; `None` if it is not a
    /// note of this layout, or names a fence the lease's does not stand plausibly above (Redis's
    /// fence counter went backwards, or was moved: the holder reads the row, which says how far). Advice only: the holder's write is
    /// conditional on every field of it (see [`crate::ledger::group::commit`]), so a stale or forged
    /// note moves nothing and costs a read.
    pub fn from_note(note: &str, fence: i64) -> Option<Held> {
        let mut fields = note.splitn(6, ':');
        if fields.next() != Some(NOTE_LAYOUT) {
            return None;
        }
        let mut number = || fields.next().and_then(|field| field.parse::<i64>().ok());
        let (balance, held, version, written_by) = (number()?, number()?, number()?, number()?);
        let owner = fields.next()?;
        let owner = (!owner.is_empty()).then(|| Arc::from(owner));
        let plausible = FenceStanding::of(fence, written_by) == FenceStanding::Above;
        (plausible && (0..=balance).contains(&held) && version >= 1).then_some(Held {
            balance,
            held,
            version,
            fence: written_by,
            owner,
            from_note: true,
        })
    }

    fn funds(&self) -> Funds {
        Funds { balance: self.balance, held: self.held }
    }
}

/// Stored keys by `(caller, scope, key)`.
pub type FoundKeys = HashMap<(String, String, String), FoundKey>;

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
    /// The wallet after them.
    pub after: Held,
    /// The response to store for each op with a key that ran: (op index, response).
    pub responses: Vec<(usize, StoredResponse)>,
    /// A movement was short of funds while something is held, and the wallet's expired holds were
    /// not read: nothing of this plan may be written; decide again with them.
    pub needs_expired: bool,
}

impl Plan {
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
        let ran = |outcome: Result<Moved, WalletError>| match written {
            Ok(true) => outcome,
            Ok(false) => Err(WalletError::LeaseLost),
            Err(failure) => Err(failure.clone()),
        };
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

/// What a batch decides on besides the wallet: the keys already stored, the holds its captures and
/// voids name (as read under the lease), and, once read, the wallet's expired holds.
#[derive(Debug, Clone, Copy)]
pub struct Known<'a> {
    pub keys: &'a FoundKeys,
    pub holds: &'a HashMap<Uuid, Hold>,
    /// Whether `holds` has every hold of this wallet still held that expired by `now`.
    pub expired_read: bool,
    /// The time of the batch's entries, and what "expired" is decided against.
    pub now: DateTime<Utc>,
}

/// Decides `ops` for wallet `id`, held at `held` under the lease holding `fence`.
pub fn decide(id: &WalletId, fence: i64, held: &Held, ops: &[Op], known: Known<'_>) -> Plan {
    let now = known.now;
    let mut funds = held.funds();
    let mut plan = Plan {
        decisions: Vec::with_capacity(ops.len()),
        entries: Vec::new(),
        placed: Vec::new(),
        settled: Vec::new(),
        after: held.clone(),
        responses: Vec::new(),
        needs_expired: false,
    };
    // What this batch settled so far, by hold: a second capture of one hold in the batch sees it.
    let mut status_now: HashMap<Uuid, HoldStatus> = HashMap::new();
    if known.expired_read {
        for hold in known.holds.values().filter(|h| h.wallet_id == id.as_str()) {
            if hold.status == HoldStatus::Held && hold.expires_at <= now {
                funds.held -= hold.amount;
                status_now.insert(hold.id, HoldStatus::Expired);
                plan.settled.push(settled(hold.id, HoldStatus::Expired, 0, None));
            }
        }
    }
    // The ops of this batch that carry each key: (op index, fingerprint).
    let mut first_with_key: HashMap<(&str, &str, &str), (usize, &[u8; 32])> = HashMap::new();
    for (n, op) in ops.iter().enumerate() {
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
        let entry = |kind, amount, balance, reference, hold_id| Entry {
            id: ledger::new_entry_id(),
            wallet_id: id.as_str().to_owned(),
            kind,
            amount,
            balance,
            version: held.version + plan.entries.len() as i64 + 1,
            fence,
            reference,
            transfer_id: None,
            refund_of: None,
            hold_id,
            created_at: now,
        };
        let outcome: MovementOutcome = match &op.movement {
            Movement::Deposit { amount } => funds.deposit(*amount).map(|after| {
                funds.balance = after;
                Moved::Entry(entry(EntryKind::Deposit, amount.get(), after, None, None))
            }),
            Movement::Pay { amount, reference } => funds.pay(*amount).map(|after| {
                funds.balance = after;
                Moved::Entry(entry(EntryKind::Pay, amount.get(), after, reference.clone(), None))
            }),
            Movement::Hold { amount, life, reference } => funds.hold(*amount).map(|after| {
                funds.held = after;
                let expires_at =
                    now + chrono::Duration::from_std(life.get()).unwrap_or(chrono::Duration::MAX);
                let hold = Hold {
                    id: ledger::new_entry_id(),
                    wallet_id: id.as_str().to_owned(),
                    amount: amount.get(),
                    captured: 0,
                    status: HoldStatus::Held,
                    expires_at,
                    reference: reference.clone(),
                    created_at: now,
                    settled_at: None,
                    capture_entry: None,
                    fence,
                };
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
                match standing(hold, &mut status_now, &mut funds, &mut plan.settled, now) {
                    Err(refusal) => Err(refusal),
                    Ok(()) => capture_amount(*amount, hold.amount).map(|charged| {
                        funds.balance -= charged;
                        funds.held -= hold.amount;
                        status_now.insert(hold.id, HoldStatus::Captured);
                        let paid = entry(
                            EntryKind::Pay,
                            charged,
                            funds.balance,
                            hold.reference.clone(),
                            Some(hold.id),
                        );
                        plan.settled.push(settled(hold.id, HoldStatus::Captured, charged, Some(paid.id)));
                        let hold = Hold {
                            captured: charged,
                            status: HoldStatus::Captured,
                            settled_at: Some(now),
                            capture_entry: Some(paid.id),
                            ..hold.clone()
                        };
                        Moved::Hold { hold, entry: Some(paid) }
                    }),
                }
            }
            Movement::Void { hold: hold_id } => {
                let hold = &known.holds[hold_id];
                standing(hold, &mut status_now, &mut funds, &mut plan.settled, now).map(|()| {
                    funds.held -= hold.amount;
                    status_now.insert(hold.id, HoldStatus::Voided);
                    plan.settled.push(settled(hold.id, HoldStatus::Voided, 0, None));
                    let hold = Hold { status: HoldStatus::Voided, settled_at: Some(now), ..hold.clone() };
                    Moved::Hold { hold, entry: None }
                })
            }
            Movement::ReleaseExpired if !known.expired_read => {
                plan.needs_expired = true;
                return plan;
            }
            Movement::ReleaseExpired => Ok(Moved::Released),
        };
        if let Some(entry) = outcome.as_ref().ok().and_then(Moved::entry) {
            plan.entries.push(entry.clone());
        }
        // Short of funds while something is held: the holds that expired may cover it, and only a
        // write that releases them may count on that.
        if matches!(outcome, Err(Refusal::InsufficientFunds { .. })) && funds.held > 0 && !known.expired_read
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
            from_note: false,
        };
    }
    plan
}

fn settled(hold: Uuid, status: HoldStatus, captured: i64, capture_entry: Option<Uuid>) -> Settled {
    Settled { hold, status, captured, capture_entry }
}

/// Whether `hold` may still be captured or voided now: held and not expired. One that is held
/// past its expiry is released here (settled `expired`, its amount no longer held) and refused.
fn standing(
    hold: &Hold,
    status_now: &mut HashMap<Uuid, HoldStatus>,
    funds: &mut Funds,
    settled_so_far: &mut Vec<Settled>,
    now: DateTime<Utc>,
) -> Result<(), Refusal> {
    let status = status_now.get(&hold.id).copied().unwrap_or(hold.status);
    if let Some(refusal) = status.refusal() {
        return Err(refusal);
    }
    if hold.expires_at <= now {
        funds.held -= hold.amount;
        status_now.insert(hold.id, HoldStatus::Expired);
        settled_so_far.push(settled(hold.id, HoldStatus::Expired, 0, None));
        return Err(Refusal::HoldExpired);
    }
    Ok(())
}
