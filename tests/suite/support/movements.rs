//! Concurrent splits (`POST /movements` of three legs) through the fleet, remembering what each
//! client was told, and their bank check: after every unknown outcome has been settled by retrying
//! with its key, the movements acknowledged are exactly those recorded, each once, with each leg
//! in its wallet's ledger once (`walletlock audit --acks`).

use super::fleet::Fleet;
pub use super::load::Outcome;
use super::load::send_keyed;
use rand::Rng;
use rand::seq::SliceRandom;
use serde_json::json;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SplitAttempt {
    /// Each leg: its wallet and what it moves into it (negative: out of it), in the order sent.
    pub legs: Vec<(String, i64)>,
    pub key: String,
    pub outcome: Outcome,
}

/// Sends one keyed movement of `legs` through `url` and classifies the answer.
pub async fn send_movement(
    client: &reqwest::Client,
    url: &str,
    legs: &[(String, i64)],
    key: &str,
) -> Outcome {
    let legs: Vec<_> =
        legs.iter().map(|(wallet, amount)| json!({ "wallet_id": wallet, "amount": amount })).collect();
    send_keyed(client.post(format!("{url}/movements")).json(&json!({ "legs": legs })), key).await
}

/// A split of 2 to 50 out of one of `wallets`, into two others, the three picked and their legs
/// ordered at random, so every order of overlapping legs meets every other.
fn random_split(wallets: &[String]) -> Vec<(String, i64)> {
    let mut rng = rand::rng();
    let mut picked: Vec<&String> = wallets.iter().collect();
    picked.shuffle(&mut rng);
    let amount = rng.random_range(2..=50);
    let first = rng.random_range(1..amount);
    let mut legs =
        vec![(picked[0].clone(), -amount), (picked[1].clone(), first), (picked[2].clone(), amount - first)];
    legs.shuffle(&mut rng);
    legs
}

/// `clients` clients that each send `count` random splits among `wallets`, one after the other,
/// each with its own key: the same work however fast or slow the machine is.
pub struct SplitLoad {
    clients: Vec<tokio::task::JoinHandle<Vec<SplitAttempt>>>,
}

impl SplitLoad {
    pub fn each(fleet: &Fleet, wallets: &[&str], clients: usize, count: usize) -> Self {
        assert!(wallets.len() >= 3);
        let clients = (0..clients)
            .map(|client| {
                let (http, url) = (fleet.client.clone(), fleet.url(""));
                let wallets: Vec<String> = wallets.iter().map(|w| w.to_string()).collect();
                tokio::spawn(async move {
                    let mut attempts = Vec::with_capacity(count);
                    for n in 0..count {
                        let legs = random_split(&wallets);
                        let key = format!("split-{client}-{n}-{}", uuid::Uuid::new_v4());
                        let outcome = send_movement(&http, &url, &legs, &key).await;
                        attempts.push(SplitAttempt { legs, key, outcome });
                    }
                    attempts
                })
            })
            .collect();
        Self { clients }
    }

    /// Waits for every client to send its count.
    pub async fn done(self) -> Vec<SplitAttempt> {
        let mut attempts = Vec::new();
        for client in self.clients {
            attempts.extend(client.await.expect("a split client"));
        }
        attempts
    }
}

/// Retries every unknown outcome with its key until the answer is definite (a key a dead replica
/// left in flight is freed after `IDEMPOTENCY_STALE_AFTER`).
pub async fn settle_splits(fleet: &Fleet, attempts: &mut [SplitAttempt]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in attempts.iter_mut() {
        while let Outcome::Unknown(_) = attempt.outcome {
            assert!(Instant::now() < deadline, "could not settle {attempt:?}");
            attempt.outcome = send_movement(&fleet.client, &fleet.url(""), &attempt.legs, &attempt.key).await;
            if matches!(attempt.outcome, Outcome::Unknown(_)) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// How many attempts ended each way, by code.
pub fn tally_splits(attempts: &[SplitAttempt]) -> std::collections::BTreeMap<String, usize> {
    super::load::tally_outcomes(attempts.iter().map(|a| &a.outcome))
}

/// The bank check of splits, after [`settle_splits`]: `opening` is each wallet's opening balance,
/// and the wallets see no other movement than `attempts` (`walletlock audit --acks`).
pub async fn check_split_books(fleet: &Fleet, opening: &[(&str, i64)], attempts: &[SplitAttempt]) {
    let mut acks = super::load::opened(opening);
    for attempt in attempts {
        let legs: Vec<(&str, i64)> =
            attempt.legs.iter().map(|(wallet, amount)| (wallet.as_str(), *amount)).collect();
        acks.push(super::load::told(&attempt.key, &attempt.outcome, &legs));
    }
    super::fleet::audit_books(&fleet.database_url, &acks);
}
