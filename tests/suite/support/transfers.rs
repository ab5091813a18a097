//! Concurrent transfers through the fleet, remembering what each client was told, and the bank
//! check generalized to transfers: after every unknown outcome has been settled by retrying with
//! its idempotency key, the transfers acknowledged are exactly those recorded, each once, with one
//! leg in each wallet's ledger; every balance equals its opening balance minus what it sent plus
//! what it received, equals its ledger, is not negative; money is conserved; `walletlock audit`
//! agrees.

use super::fleet::Fleet;
pub use super::load::Outcome;
use super::load::send_keyed;
use rand::Rng;
use serde_json::json;
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
/// see no other movement than `attempts` (`walletlock audit --acks`).
pub async fn check_books(fleet: &Fleet, opening: &[(&str, i64)], attempts: &[TransferAttempt]) {
    let mut acks = super::load::opened(opening);
    for a in attempts {
        acks.push(super::load::told(
            &a.key,
            &a.outcome,
            &[(a.from.as_str(), -a.amount), (a.to.as_str(), a.amount)],
        ));
    }
    super::fleet::audit_books(&fleet.database_url, &acks);
}
