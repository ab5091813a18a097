//! Deciding one wallet's batch of movements: each on its own, in arrival order, against the
//! balance the previous ones left, and each idempotency key looked up first. Pure: the round that
//! runs it ([`super::group`]) reads before and writes after.
//!
//! A payment that does not fit is refused alone; the rest go through. A request whose key is
//! already stored does not run: it gets the stored response (or `idempotency_key_reused`). A
//! request whose key an earlier request of the same batch carries waits for that one and gets its
//! response too, so a double tap that lands in one batch charges once. A request from a caller
//! that may not use the wallet ([`Access`]) is answered as if the wallet did not exist.

use super::{Access, MovementOutcome, WalletError, WalletId};
use crate::idempotency::{Keyed, Prior};
use crate::ledger::group::FoundKey;
use crate::ledger::idempotency::StoredResponse;
use crate::ledger::{self, Entry, EntryKind};
use crate::wallet::{Movement, Refusal};
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::sync::Arc;

/// One movement to apply for a caller, with its idempotency key if the request had one.
#[derive(Debug)]
pub struct Op {
    pub movement: Movement,
    pub access: Access,
    pub key: Option<Keyed<MovementOutcome>>,
}

/// The wallet as its lease holder last read or wrote it, or as the last holder's note says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub balance: i64,
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
const NOTE_LAYOUT: &str = "w1";

impl Held {
    /// The note a holder leaves for the wallet's next one when it releases the lease
    /// ([`crate::lease::Lease::release_with_note`]): this state, `w1:balance:version:fence:owner`.
    pub fn to_note(&self) -> String {
        let owner = self.owner.as_deref().unwrap_or_default();
        format!("{NOTE_LAYOUT}:{}:{}:{}:{owner}", self.balance, self.version, self.fence)
    }

    /// The wallet as `note` says it was left, for the lease holding `fence`; `None` if it is not a
    /// note of this layout, or names a fence at or above the lease's (Redis's fence counter went
    /// backwards: the holder reads the row, which says how far). Advice only: the holder's write is
    /// conditional on every field of it (see [`crate::ledger::group::commit`]), so a stale or forged
    /// note moves nothing and costs a read.
    pub fn from_note(note: &str, fence: i64) -> Option<Held> {
        let mut fields = note.splitn(5, ':');
        if fields.next() != Some(NOTE_LAYOUT) {
            return None;
        }
        let mut number = || fields.next().and_then(|field| field.parse::<i64>().ok());
        let (balance, version, written_by) = (number()?, number()?, number()?);
        let owner = fields.next()?;
        let owner = (!owner.is_empty()).then(|| Arc::from(owner));
        (written_by < fence && balance >= 0 && version >= 1).then_some(Held {
            balance,
            version,
            fence: written_by,
            owner,
            from_note: true,
        })
    }
}

/// Stored keys by `(caller, scope, key)`.
pub type FoundKeys = HashMap<(String, String, String), FoundKey>;

/// How one op fared.
#[derive(Debug)]
enum Decision {
    /// Runs; its ledger entry is the n-th of the batch.
    Accepted(usize),
    Refused(Refusal),
    /// Its key was used before this batch.
    Prior(Prior),
    /// Its key is the one an earlier op of this batch (the n-th) carries, for the same request.
    SameAs(usize),
    /// Its caller may not use the wallet: answered as if the wallet did not exist.
    Hidden,
}

/// A batch decided: what to write, and how to answer each op once the write is known.
#[derive(Debug)]
pub struct Plan {
    decisions: Vec<Decision>,
    /// The ledger entries of the accepted ops, in order.
    pub entries: Vec<Entry>,
    /// The wallet after them.
    pub after: Held,
    /// The response to store for each op with a key that ran: (op index, response).
    pub responses: Vec<(usize, StoredResponse)>,
}

impl Plan {
    /// Whether any op runs: then the batch must be written (or, with only refusals, its hold
    /// checked) before it is answered.
    pub fn runs(&self) -> bool {
        self.decisions.iter().any(|d| matches!(d, Decision::Accepted(_) | Decision::Refused(_)))
    }

    /// Whether an op is answered as if the wallet did not exist (its caller may not use it).
    pub fn hides(&self) -> bool {
        self.decisions.iter().any(|d| matches!(d, Decision::Hidden))
    }

    /// The ledger entry op `n` wrote, if it ran and was accepted.
    pub fn entry_of(&self, n: usize) -> Option<&Entry> {
        match self.decisions.get(n) {
            Some(Decision::Accepted(entry)) => self.entries.get(*entry),
            _ => None,
        }
    }

    /// Each op's result, given whether the batch's write matched (`false`: the lease was lost and
    /// nothing of it was written) or failed with `failure`.
    pub fn results(&self, written: Result<bool, &WalletError>) -> Vec<Result<Entry, WalletError>> {
        let ran = |outcome: Result<Entry, WalletError>| match written {
            Ok(true) => outcome,
            Ok(false) => Err(WalletError::LeaseLost),
            Err(failure) => Err(failure.clone()),
        };
        let mut results: Vec<Result<Entry, WalletError>> = Vec::with_capacity(self.decisions.len());
        for decision in &self.decisions {
            let result = match decision {
                Decision::Accepted(entry) => ran(Ok(self.entries[*entry].clone())),
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

/// Decides `ops` for wallet `id`, held at `held` under the lease holding `fence`; `found` has the
/// keys already stored, `now` is the entries' time.
pub fn decide(
    id: &WalletId,
    fence: i64,
    held: &Held,
    ops: &[Op],
    found: &FoundKeys,
    now: DateTime<Utc>,
) -> Plan {
    let mut balance = held.balance;
    let mut entries = Vec::new();
    let mut responses = Vec::new();
    // The ops of this batch that carry each key: (op index, fingerprint).
    let mut first_with_key: HashMap<(&str, &str, &str), (usize, &[u8; 32])> = HashMap::new();
    let mut decisions = Vec::with_capacity(ops.len());
    for (n, op) in ops.iter().enumerate() {
        if !op.access.may_use(held.owner.as_deref()) {
            decisions.push(Decision::Hidden);
            continue;
        }
        if let Some(key) = &op.key {
            let at = key.at();
            let stored = found.get(&(at.caller.to_owned(), at.scope.to_owned(), at.key.to_owned()));
            if let Some(stored) = stored {
                decisions.push(Decision::Prior(Prior::of(stored, &key.fingerprint)));
                continue;
            }
            if let Some((first, fingerprint)) = first_with_key.get(&(at.caller, at.scope, at.key)) {
                decisions.push(if *fingerprint == &key.fingerprint {
                    Decision::SameAs(*first)
                } else {
                    Decision::Prior(Prior::Reused)
                });
                continue;
            }
            first_with_key.insert((at.caller, at.scope, at.key), (n, &key.fingerprint));
        }
        let outcome: MovementOutcome = match op.movement.apply_to(balance) {
            Ok(after) => {
                balance = after;
                let (kind, reference) = match &op.movement {
                    Movement::Deposit { .. } => (EntryKind::Deposit, None),
                    Movement::Pay { reference, .. } => (EntryKind::Pay, reference.clone()),
                };
                entries.push(Entry {
                    id: ledger::new_entry_id(),
                    wallet_id: id.as_str().to_owned(),
                    kind,
                    amount: op.movement.amount().get(),
                    balance: after,
                    version: held.version + entries.len() as i64 + 1,
                    fence,
                    reference,
                    transfer_id: None,
                    refund_of: None,
                    created_at: now,
                });
                decisions.push(Decision::Accepted(entries.len() - 1));
                Ok(entries[entries.len() - 1].clone())
            }
            Err(refusal) => {
                decisions.push(Decision::Refused(refusal));
                Err(refusal)
            }
        };
        if let Some(key) = &op.key {
            responses.push((n, (key.render)(&outcome)));
        }
    }
    let mut plan = Plan { decisions, entries, after: held.clone(), responses };
    // Only a batch that is written raises the row's fence to the lease's.
    if plan.runs() {
        let version = held.version + plan.entries.len() as i64;
        // The write is conditional on the held state: once it matches, the state is confirmed.
        plan.after = Held { balance, version, fence, owner: held.owner.clone(), from_note: false };
    }
    plan
}
