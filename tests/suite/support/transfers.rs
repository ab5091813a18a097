//! Concurrent transfers through the fleet, remembering what each client was told, and the bank
//! check generalized to transfers: after every unknown outcome has been settled by retrying with
//! its idempotency key, the transfers acknowledged are exactly those recorded, each once, with one
//! leg in each wallet's ledger; every balance equals its opening balance minus what it sent plus
//! what it received, equals its ledger, is not negative; money is conserved; `walletlock audit`
//! agrees.

use super::fleet::{Fleet, audit};
pub use super::load::Outcome;
use super::load::send_keyed;
use rand::Rng;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct TransferAttempt {
    pub from: String,
    pub to: String,
    pub amount: i64,
    pub key: String,
    pub outcome: Outcome,
    pub took: Duration,
}

/// Sends one keyed transfer through `url` and classifies the answer.
pub async fn transfer(
    client: &reqwest::Client,
    url: &str,
    (from, to): (&str, &str),
    amount: i64,
    key: &str,
) -> Outcome {
    let request =
        client.post(format!("{url}/transfers")).json(&json!({ "from": from, "to": to, "amount": amount }));
    send_keyed(request, key).await
}

/// One keyed transfer, timed.
pub async fn transfer_one(
    client: &reqwest::Client,
    url: &str,
    pair: (&str, &str),
    amount: i64,
) -> TransferAttempt {
    let key = uuid::Uuid::new_v4().to_string();
    let sent = Instant::now();
    let outcome = transfer(client, url, pair, amount, &key).await;
    TransferAttempt {
        from: pair.0.to_owned(),
        to: pair.1.to_owned(),
        amount,
        key,
        outcome,
        took: sent.elapsed(),
    }
}

/// Clients transferring among `wallets` until stopped (or each has sent its count): client 0, 3,
/// 6... always from the first wallet to the second, client 1, 4, 7... always back, the others
/// between random pairs; amounts from 1 to 50, each transfer with its own key.
pub struct TransferLoad {
    stop: Arc<AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<Vec<TransferAttempt>>>,
}

impl TransferLoad {
    pub fn start(fleet: &Fleet, wallets: &[&str], clients: usize) -> Self {
        Self::spawn(fleet, wallets, clients, usize::MAX)
    }

    /// Clients that each send `count` transfers, one after the other, and stop: the same work
    /// however fast or slow the machine is.
    pub fn each(fleet: &Fleet, wallets: &[&str], clients: usize, count: usize) -> Self {
        Self::spawn(fleet, wallets, clients, count)
    }

    fn spawn(fleet: &Fleet, wallets: &[&str], clients: usize, count: usize) -> Self {
        assert!(wallets.len() >= 2);
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..clients)
            .map(|n| {
                let (client, url, stop) = (fleet.client.clone(), fleet.url(""), stop.clone());
                let wallets: Vec<String> = wallets.iter().map(|w| w.to_string()).collect();
                tokio::spawn(async move {
                    let mut attempts = Vec::new();
                    while !stop.load(Ordering::Relaxed) && attempts.len() < count {
                        let (from, to, amount) = {
                            let mut rng = rand::rng();
                            let (from, to) = match n % 3 {
                                0 => (0, 1),
                                1 => (1, 0),
                                _ => {
                                    let from = rng.random_range(0..wallets.len());
                                    let to = (from + rng.random_range(1..wallets.len())) % wallets.len();
                                    (from, to)
                                }
                            };
                            (from, to, rng.random_range(1..=50))
                        };
                        let pair = (wallets[from].as_str(), wallets[to].as_str());
                        attempts.push(transfer_one(&client, &url, pair, amount).await);
                    }
                    attempts
                })
            })
            .collect();
        Self { stop, clients }
    }

    pub async fn finish(self) -> Vec<TransferAttempt> {
        self.stop.store(true, Ordering::Relaxed);
        self.done().await
    }

    /// Waits for every client to send its count (see [`TransferLoad::each`]).
    pub async fn done(self) -> Vec<TransferAttempt> {
        let mut attempts = Vec::new();
        for client in self.clients {
            attempts.extend(client.await.expect("a transfer client"));
        }
        attempts
    }
}

/// Retries every unknown outcome with its key until the answer is definite.
pub async fn settle(fleet: &Fleet, attempts: &mut [TransferAttempt]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in attempts.iter_mut() {
        while let Outcome::Unknown(_) = attempt.outcome {
            assert!(Instant::now() < deadline, "could not settle {attempt:?}");
            let pair = (attempt.from.as_str(), attempt.to.as_str());
            attempt.outcome =
                transfer(&fleet.client, &fleet.url(""), pair, attempt.amount, &attempt.key).await;
            if matches!(attempt.outcome, Outcome::Unknown(_)) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Nothing is wedged after a load: a transfer of 1 between `pair` through nginx goes through at
/// once (under 500 ms), or, if the first wallet cannot cover it, one the other way does.
pub async fn goes_through_at_once(fleet: &Fleet, (a, b): (&str, &str)) {
    let after = transfer_one(&fleet.client, &fleet.url(""), (a, b), 1).await;
    let after = match after.outcome {
        Outcome::Applied(_) => after,
        _ => transfer_one(&fleet.client, &fleet.url(""), (b, a), 1).await,
    };
    assert!(matches!(after.outcome, Outcome::Applied(_)), "the transfer after: {after:?}");
    assert!(after.took < Duration::from_millis(500), "the transfer after took {:?}", after.took);
}

/// How many attempts ended each way, by code.
pub fn tally(attempts: &[TransferAttempt]) -> std::collections::BTreeMap<String, usize> {
    super::load::tally_outcomes(attempts.iter().map(|a| &a.outcome))
}

/// The bank check, after [`settle`]: `opening` is each wallet's opening balance, and the wallets
/// see no other movement than `attempts`.
pub async fn check_books(fleet: &Fleet, opening: &[(&str, i64)], attempts: &[TransferAttempt]) {
    let applied: Vec<(uuid::Uuid, &TransferAttempt)> = attempts
        .iter()
        .filter_map(|a| match a.outcome {
            Outcome::Applied(id) => Some((id, a)),
            Outcome::NotApplied(_) => None,
            Outcome::Unknown(_) => panic!("settle the attempts first: {a:?}"),
        })
        .collect();
    let acknowledged: HashSet<uuid::Uuid> = applied.iter().map(|(id, _)| *id).collect();
    assert_eq!(acknowledged.len(), applied.len(), "two keys were answered with one transfer");

    let wallets: Vec<String> = opening.iter().map(|(w, _)| w.to_string()).collect();
    let recorded: Vec<(uuid::Uuid, String, String, i64)> = sqlx::query_as(
        "select id, from_wallet, to_wallet, amount from transfer
         where from_wallet = any($1) or to_wallet = any($1)",
    )
    .bind(&wallets)
    .fetch_all(&fleet.db)
    .await
    .unwrap();
    let in_books: HashSet<uuid::Uuid> = recorded.iter().map(|(id, ..)| *id).collect();
    let lost: Vec<_> = acknowledged.difference(&in_books).collect();
    let unacknowledged: Vec<_> = in_books.difference(&acknowledged).collect();
    assert!(lost.is_empty(), "acknowledged transfers missing from the books: {lost:?}");
    assert!(unacknowledged.is_empty(), "transfers recorded that no client was told of: {unacknowledged:?}");
    for (id, from, to, amount) in &recorded {
        let (_, attempt) = applied.iter().find(|(applied, _)| applied == id).expect("acknowledged");
        assert_eq!((from, to, *amount), (&attempt.from, &attempt.to, attempt.amount), "transfer {id}");
    }

    let moved: Vec<(uuid::Uuid, Vec<(String, i64)>)> = applied
        .iter()
        .map(|(id, a)| (*id, vec![(a.from.clone(), -a.amount), (a.to.clone(), a.amount)]))
        .collect();
    check_legs_and_balances(fleet, opening, &moved).await;
}

/// The bank check of movements between wallets (a transfer is one of two legs), after every
/// outcome is settled: `applied` is each acknowledged movement's id and legs (wallet, signed
/// amount), and the wallets of `opening` see no other movement. Each leg is in its wallet's ledger
/// exactly once (a `transfer_out` or `transfer_in` carrying the movement's id), no entry of a
/// movement no client was told of; every balance is its opening plus its legs, equals its ledger,
/// is not negative; money is conserved; `walletlock audit` agrees.
pub async fn check_legs_and_balances(
    fleet: &Fleet,
    opening: &[(&str, i64)],
    applied: &[(uuid::Uuid, Vec<(String, i64)>)],
) {
    let wallets: Vec<String> = opening.iter().map(|(w, _)| w.to_string()).collect();
    let entries: Vec<(uuid::Uuid, String, String, i64)> = sqlx::query_as(
        "select transfer_id, wallet_id, kind, amount from ledger_entry where wallet_id = any($1) and transfer_id is not null",
    )
    .bind(&wallets)
    .fetch_all(&fleet.db)
    .await
    .unwrap();
    let mut entries_of: HashMap<uuid::Uuid, Vec<(String, String, i64)>> = HashMap::new();
    for (movement, wallet, kind, amount) in entries {
        entries_of.entry(movement).or_default().push((kind, wallet, amount));
    }
    for (id, legs) in applied {
        let mut found = entries_of.remove(id).unwrap_or_default();
        found.sort();
        let mut want: Vec<(String, String, i64)> = legs
            .iter()
            .map(|(wallet, signed)| {
                let kind = if *signed < 0 { "transfer_out" } else { "transfer_in" };
                (kind.to_owned(), wallet.clone(), signed.abs())
            })
            .collect();
        want.sort();
        assert_eq!(found, want, "movement {id}: each leg in its wallet's ledger once");
    }
    assert!(entries_of.is_empty(), "legs of movements no client was told of: {entries_of:?}");

    let mut total = (0, 0);
    for (wallet, opening) in opening {
        let moved: i64 =
            applied.iter().flat_map(|(_, legs)| legs).filter(|(w, _)| w == wallet).map(|(_, n)| n).sum();
        let books = super::books(&fleet.db, wallet).await;
        assert_eq!(books.balance, opening + moved, "{wallet}: balance = opening + its legs");
        assert_eq!(books.balance, books.ledger_sum, "{wallet}: balance = ledger");
        assert!(books.balance >= 0, "{wallet}: negative");
        total = (total.0 + opening, total.1 + books.balance);
    }
    assert_eq!(total.0, total.1, "money is conserved among the wallets");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "walletlock audit: {report}");
}
