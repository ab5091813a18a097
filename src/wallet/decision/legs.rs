//! The decision of movements between wallets: transfers and movements of many legs, decided in
//! arrival order against the wallets they touch, as read under the leases of every one of them.
//!
//! A round carries them as one job per set of wallets (a transfer alone; a payee's transfers from
//! many payers; a movement of 2 to 16 legs), decided here with no I/O. Each movement applies every
//! leg or none ([`decide_legs`]) and each leg sees what the movements before it left, so a payer
//! paying twice in one job pays from its new balance. A refusal changes nothing; a key decides
//! once, as in a wallet's batch ([`super::decide_round`]).

use super::{Held, Known, Leg, Links, Settled, as_written, decide_legs, settled};
use crate::domain::{Funds, HoldStatus, LegRefusal, Parties};
use crate::idempotency::{Keyed, Prior};
use crate::ledger::idempotency::StoredResponse;
use crate::ledger::transfer::{MovementRecord, Transfer};
use crate::ledger::{Entry, EntryKind};
use crate::wallet::transfer::{Done, MovementRecordOutcome, TransferOutcome};
use crate::wallet::{Access, Amount, Field, Legs, Refusal, WalletError, WalletId};
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
        key: Option<Keyed<TransferOutcome>>,
    },
    /// Money between 2 to 16 wallets at once, its legs summing to zero.
    Movement {
        access: Access,
        legs: Legs,
        reference: Option<String>,
        key: Option<Keyed<MovementRecordOutcome>>,
    },
}

impl LegsOp {
    /// Each leg: its wallet, its amount, and whether it takes money out of the wallet.
    pub fn legs(&self) -> Vec<(&WalletId, Amount, bool)> {
        match self {
            LegsOp::Transfer { parties, amount, .. } => {
                vec![(&parties.from, *amount, true), (&parties.to, *amount, false)]
            }
            LegsOp::Movement { legs, .. } => {
                legs.iter().map(|(id, amount, debit)| (id, *amount, *debit)).collect()
            }
        }
    }

    /// Whether the caller may take money out of (`debit`) or pay into a wallet owned by `owner`.
    fn may_touch(&self, debit: bool, owner: Option<&str>) -> bool {
        let (LegsOp::Transfer { access, .. } | LegsOp::Movement { access, .. }) = self;
        if debit { access.may_use(owner) } else { access.may_pay_into(owner) }
    }

    /// The answer when the wallet of leg `n` does not exist, or is not the caller's to touch.
    fn missing(&self, n: usize) -> WalletError {
        match self {
            LegsOp::Transfer { .. } => {
                WalletError::PartyNotFound { field: if n == 0 { Field::From } else { Field::To } }
            }
            LegsOp::Movement { .. } => WalletError::LegNotFound { leg: n },
        }
    }

    /// The key's reference and the request's fingerprint, if it had one.
    pub fn key(&self) -> Option<(crate::ledger::idempotency::KeyRef<'_>, &[u8; 32])> {
        match self {
            LegsOp::Transfer { key: Some(key), .. } => Some((key.at(), &key.fingerprint)),
            LegsOp::Movement { key: Some(key), .. } => Some((key.at(), &key.fingerprint)),
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
    /// The expired holds released (the index of their wallet in the job, and the settlement).
    pub settled: Vec<(usize, Settled)>,
    /// Each wallet after the movements, in the job's order (`None`: no such wallet).
    pub after: Vec<Option<Held>>,
    pub transfers: Vec<Transfer>,
    pub movements: Vec<MovementRecord>,
    /// The response to store for each keyed movement that ran: (index, response, its first entry).
    pub responses: Vec<(usize, StoredResponse, Option<Uuid>)>,
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
    // Each wallet as the movements decided so far leave it.
    let mut state: Vec<Option<Held>> = wallets.iter().map(|w| w.held.cloned()).collect();
    let mut plan = LegsPlan {
        decisions: Vec::with_capacity(ops.len()),
        entries: Vec::new(),
        settled: Vec::new(),
        after: Vec::new(),
        transfers: Vec::new(),
        movements: Vec::new(),
        responses: Vec::new(),
    };
    // A hold is only treated as expired by the write that releases it (see the module doc of
    // `decision`): every expired hold read of a wallet is released with its movements.
    for (n, wallet) in wallets.iter().enumerate() {
        let Some(held) = state[n].as_mut().filter(|_| known.expired_read.contains(wallet.id.as_str())) else {
            continue;
        };
        for hold in known.holds.values().filter(|h| h.wallet_id == wallet.id.as_str()) {
            if hold.status == HoldStatus::Held && hold.expires_at <= now {
                held.held -= hold.amount;
                plan.settled.push((n, settled(hold.id, HoldStatus::Expired, 0, None)));
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
                    .filter(|&w| state[w].as_ref().is_some_and(|h| op.may_touch(*debit, h.owner.as_deref())))
                    .ok_or_else(|| op.missing(leg))
            })
            .collect();
        let touched = match touched {
            Ok(touched) => touched,
            Err(missing) => {
                plan.decisions.push(LegsDecision::Answered(missing));
                continue;
            }
        };
        if let Some((at, fingerprint)) = op.key() {
            let at: KeyAt<'_> = (at.caller, at.scope, at.key);
            if let Some(stored) = known.keys.get(&(at.0.to_owned(), at.1.to_owned(), at.2.to_owned())) {
                plan.decisions
                    .push(LegsDecision::Answered(WalletError::AlreadyRan(Prior::of(stored, fingerprint))));
                continue;
            }
            if let Some((first, first_fingerprint)) = first_with_key.get(&at) {
                plan.decisions.push(if *first_fingerprint == fingerprint {
                    LegsDecision::SameAs(*first)
                } else {
                    LegsDecision::Answered(WalletError::AlreadyRan(Prior::Reused))
                });
                continue;
            }
            first_with_key.insert(at, (n, fingerprint));
        }
        let decided: Vec<Leg<'_>> = legs
            .iter()
            .zip(&touched)
            .map(|(&(wallet, amount, debit), &w)| {
                let held = state[w].as_ref().expect("touched wallets exist");
                Leg {
                    wallet,
                    funds: Funds { balance: held.balance, held: held.held },
                    version: held.version,
                    fence: wallets[w].fence,
                    amount,
                    debit,
                }
            })
            .collect();
        let id = Uuid::new_v4();
        let reference = match op {
            LegsOp::Transfer { reference, .. } | LegsOp::Movement { reference, .. } => reference.as_deref(),
        };
        let links = Links { movement: Some(id), reference, refund_of: None, now };
        let decided = decide_legs(&decided, (EntryKind::TransferOut, EntryKind::TransferIn), links);
        if let Err((leg, Refusal::InsufficientFunds { .. })) = decided {
            let wallet = wallets[touched[leg]].id.as_str();
            let held = state[touched[leg]].as_ref().map_or(0, |h| h.held);
            if held > 0 && !known.expired_read.contains(wallet) {
                short.push(wallet.to_owned());
                plan.decisions.push(LegsDecision::Answered(WalletError::internal("decided again")));
                continue;
            }
        }
        if let Ok(entries) = &decided {
            for (entry, &w) in entries.iter().zip(&touched) {
                let held = state[w].as_mut().expect("touched wallets exist");
                (held.balance, held.version) = (entry.balance, entry.version);
            }
            plan.entries.extend(entries.iter().cloned());
        }
        let first_entry = decided.as_ref().ok().and_then(|entries| entries.first()).map(|e| e.id);
        let (decision, response) = match op {
            LegsOp::Transfer { parties, amount, reference, key, .. } => {
                let outcome: TransferOutcome = decided.map_err(|(_, refusal)| refusal).map(|entries| {
                    let [from_entry, to_entry]: [Entry; 2] =
                        entries.try_into().expect("two legs, two entries");
                    Transfer {
                        id,
                        from: parties.from.as_str().to_owned(),
                        to: parties.to.as_str().to_owned(),
                        amount: amount.get(),
                        reference: reference.clone(),
                        refund_of: None,
                        from_entry,
                        to_entry,
                        created_at: now,
                    }
                });
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let decision = match outcome {
                    Ok(transfer) => {
                        plan.transfers.push(transfer.clone());
                        LegsDecision::Accepted(Done::Transfer(Box::new(transfer)))
                    }
                    Err(refusal) => LegsDecision::Refused(WalletError::Refused(refusal)),
                };
                (decision, response)
            }
            LegsOp::Movement { reference, key, .. } => {
                let outcome: MovementRecordOutcome = decided
                    .map(|legs| MovementRecord { id, reference: reference.clone(), legs, created_at: now })
                    .map_err(|(leg, refusal)| LegRefusal { leg, refusal });
                let response = key.as_ref().map(|key| (key.render)(&outcome));
                let decision = match outcome {
                    Ok(movement) => {
                        plan.movements.push(movement.clone());
                        LegsDecision::Accepted(Done::Movement(Box::new(movement)))
                    }
                    Err(LegRefusal { leg, refusal }) => {
                        LegsDecision::Refused(WalletError::LegRefused { leg, refusal })
                    }
                };
                (decision, response)
            }
        };
        plan.decisions.push(decision);
        if let Some(response) = response {
            plan.responses.push((n, response, first_entry));
        }
    }
    if !short.is_empty() {
        return Err(short);
    }
    // The wallets written raise their rows' fences to the leases'.
    plan.after = state
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
    use chrono::Utc;
    use proptest::prelude::*;
    use std::sync::Arc;

    const OWNER: &str = "shop";

    fn id(n: usize) -> WalletId {
        WalletId::parse(&format!("w{n}")).unwrap()
    }

    fn held(balance: i64, held: i64) -> Held {
        Held { balance, held, version: 5, fence: 3, owner: Some(Arc::from(OWNER)), from_note: false }
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
            key: None,
        }
    }

    fn keyed(op: LegsOp, key: &str, request: u8) -> LegsOp {
        let LegsOp::Transfer { access, parties, amount, reference, .. } = op else { unreachable!() };
        let key = Keyed {
            scope: Scope::transfers(OWNER),
            key: IdempotencyKey::parse(key.as_bytes()).unwrap(),
            fingerprint: [request; 32],
            render,
        };
        LegsOp::Transfer { access, parties, amount, reference, key: Some(key) }
    }

    struct Fixture {
        ids: Vec<WalletId>,
        held: Vec<Option<Held>>,
        keys: HashMap<(String, String, String), FoundKey>,
        holds: HashMap<Uuid, Hold>,
        expired_read: HashSet<String>,
    }

    impl Fixture {
        fn of(wallets: &[Option<(i64, i64)>]) -> Self {
            Fixture {
                ids: (0..wallets.len()).map(id).collect(),
                held: wallets.iter().map(|w| w.map(|(balance, h)| held(balance, h))).collect(),
                keys: HashMap::new(),
                holds: HashMap::new(),
                expired_read: HashSet::new(),
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
        let stored = StoredResponse { status: 200, content_type: "text/plain".into(), body: b"7".to_vec() };
        let at = (OWNER.to_owned(), "transfers".to_owned(), "old".to_owned());
        fixture.keys.insert(at, FoundKey { fingerprint: vec![1; 32], response: Some(stored.clone()) });
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
    fn a_debit_short_while_something_is_held_asks_for_the_expired_holds_and_then_releases_them() {
        let mut fixture = Fixture::of(&[Some((100, 80)), Some((0, 0))]);
        assert_eq!(fixture.decide(&[transfer(0, 1, 50)]).unwrap_err(), ["w0"]);
        let expired = Hold {
            id: Uuid::new_v4(),
            wallet_id: "w0".into(),
            amount: 80,
            captured: 0,
            status: HoldStatus::Held,
            expires_at: Utc::now() - chrono::Duration::seconds(1),
            reference: None,
            created_at: Utc::now(),
            settled_at: None,
            capture_entry: None,
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

    /// Wallets as (balance, held), and movements among them as (from, to, amount).
    type Job = (Vec<(i64, i64)>, Vec<(usize, usize, i64)>);

    /// A job: wallets and movements among them.
    fn job() -> impl Strategy<Value = Job> {
        prop::collection::vec((0i64..1_000, 0i64..300), 2..6).prop_flat_map(|wallets| {
            let n = wallets.len();
            let movement = (0..n, 0..n, 1i64..600).prop_filter("two wallets", |(a, b, _)| a != b);
            (Just(wallets), prop::collection::vec(movement, 0..24))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_job_conserves_money_keeps_every_available_balance_at_or_above_zero_and_decides_in_order(
            (wallets, movements) in job(),
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
            let mut funds: Vec<Funds> = fixture.held.iter().flatten().map(|h| Funds { balance: h.balance, held: h.held }).collect();
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
    }
}
