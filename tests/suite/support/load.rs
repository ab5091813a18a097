//! Concurrent payments through the fleet, remembering what each client was told, and the bank
//! check at the end (Jepsen's bank workload): after every unknown outcome has been settled by
//! retrying with its idempotency key, the payments acknowledged are exactly the ledger's, each
//! once; every balance equals its opening balance minus them, equals its ledger, is not negative;
//! and `walletlock audit` agrees.

use super::fleet::{Fleet, audit_books};
use serde_json::{Value, json};
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Where the clients pay (through nginx) and where the bank check reads the books: the test's
/// own fleet, or the docker compose stack.
pub trait Bank {
    /// An HTTP client with the API token.
    fn client(&self) -> &reqwest::Client;
    /// A URL through nginx.
    fn url(&self, path: &str) -> String;
    /// The database, as its owner.
    fn db(&self) -> &PgPool;
    /// The same, for `walletlock audit`.
    fn database_url(&self) -> &str;
}

impl Bank for Fleet {
    fn client(&self) -> &reqwest::Client {
        &self.client
    }
    fn url(&self, path: &str) -> String {
        Fleet::url(self, path)
    }
    fn db(&self) -> &PgPool {
        &self.db
    }
    fn database_url(&self) -> &str {
        &self.database_url
    }
}

/// What a client learned from one payment or transfer.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 200 or 201: this ledger entry (a payment), transfer or movement.
    Applied(uuid::Uuid),
    /// A definite "nothing was applied" (insufficient funds, lock timeout, lease lost, ...).
    NotApplied(String),
    /// No answer, or one that leaves it open (502, 504, request_timeout, outcome_unknown, in flight).
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub wallet: String,
    pub amount: i64,
    pub key: String,
    pub outcome: Outcome,
    pub sent: Instant,
    pub took: Duration,
}

/// Pays 1 from `wallet` with a fresh idempotency key, timed: one attempt for the bank check.
pub async fn pay_one(client: &reqwest::Client, url: &str, wallet: &str) -> Attempt {
    let key = uuid::Uuid::new_v4().to_string();
    let sent = Instant::now();
    let outcome = pay(client, url, wallet, 1, &key).await;
    Attempt { wallet: wallet.to_owned(), amount: 1, key, outcome, sent, took: sent.elapsed() }
}

/// Sends one payment and classifies the answer.
pub async fn pay(client: &reqwest::Client, url: &str, wallet: &str, amount: i64, key: &str) -> Outcome {
    let request = client.post(format!("{url}/wallets/{wallet}/pay")).json(&json!({ "amount": amount }));
    send_keyed(request, key).await
}

/// Sends one movement of money (a payment, a transfer) with `key` and classifies the answer; a
/// 200 is `Applied` with the answer's `id`.
pub async fn send_keyed(request: reqwest::RequestBuilder, key: &str) -> Outcome {
    let request = request.header("idempotency-key", key).timeout(Duration::from_secs(15));
    let response = match request.send().await {
        Ok(response) => response,
        Err(err) => return Outcome::Unknown(format!("no answer: {err}")),
    };
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let code = body["code"].as_str().unwrap_or("").to_owned();
    match (status, code.as_str()) {
        (200 | 201, _) => {
            Outcome::Applied(body["id"].as_str().and_then(|id| id.parse().ok()).expect("an id"))
        }
        (422, "insufficient_funds")
        | (409, "lease_lost")
        | (503, "lock_timeout" | "overloaded" | "dependency_unavailable")
        | (429, _) => Outcome::NotApplied(code),
        (409, "idempotency_key_in_flight")
        | (503, "request_timeout" | "outcome_unknown")
        | (502, "bad_gateway")
        | (504, "gateway_timeout") => Outcome::Unknown(format!("{status} {code}")),
        _ => panic!("an answer the API does not give: {status} {body}"),
    }
}

/// Clients paying 1 at a time from the given wallets, round robin, each payment with its own key.
pub struct Load {
    stop: Arc<AtomicBool>,
    /// How many payments have been answered 200 so far.
    acknowledged: Arc<AtomicUsize>,
    clients: Vec<tokio::task::JoinHandle<Vec<Attempt>>>,
}

impl Load {
    /// Clients paying through the fleet's nginx.
    pub fn start(fleet: &impl Bank, wallets: &[&str], clients: usize) -> Self {
        Self::start_at(fleet, &[fleet.url("")], wallets, clients)
    }

    /// Clients paying at the given addresses, the clients spread over them.
    pub fn start_at(fleet: &impl Bank, urls: &[String], wallets: &[&str], clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let acknowledged = Arc::new(AtomicUsize::new(0));
        let clients = (0..clients)
            .map(|n| {
                let (client, url, stop) =
                    (fleet.client().clone(), urls[n % urls.len()].clone(), stop.clone());
                let acknowledged = acknowledged.clone();
                let wallets: Vec<String> = wallets.iter().map(|w| w.to_string()).collect();
                tokio::spawn(async move {
                    let mut attempts = Vec::new();
                    let mut i = n;
                    while !stop.load(Ordering::Relaxed) {
                        let wallet = &wallets[i % wallets.len()];
                        i += 1;
                        let attempt = pay_one(&client, &url, wallet).await;
                        if matches!(attempt.outcome, Outcome::Applied(_)) {
                            acknowledged.fetch_add(1, Ordering::Relaxed);
                        }
                        attempts.push(attempt);
                    }
                    attempts
                })
            })
            .collect();
        Self { stop, acknowledged, clients }
    }

    /// How many payments the clients have been told were applied (a 200) so far.
    pub fn acknowledged(&self) -> usize {
        self.acknowledged.load(Ordering::Relaxed)
    }

    pub async fn finish(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::Relaxed);
        let mut attempts = Vec::new();
        for client in self.clients {
            attempts.extend(client.await.expect("a load client"));
        }
        attempts
    }
}

/// Retries every unknown outcome with its key until the answer is definite.
pub async fn settle(fleet: &impl Bank, attempts: &mut [Attempt]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in attempts.iter_mut() {
        while let Outcome::Unknown(_) = attempt.outcome {
            assert!(Instant::now() < deadline, "could not settle {attempt:?}");
            attempt.outcome =
                pay(fleet.client(), &fleet.url(""), &attempt.wallet, attempt.amount, &attempt.key).await;
            if matches!(attempt.outcome, Outcome::Unknown(_)) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// How many attempts ended each way, by code.
pub fn tally(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    tally_outcomes(attempts.iter().map(|a| &a.outcome))
}

/// How many of `outcomes` ended each way: `applied`, a refusal's code, or `unknown ...`.
pub fn tally_outcomes<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>) -> BTreeMap<String, usize> {
    let mut tally = BTreeMap::new();
    for outcome in outcomes {
        let label = match outcome {
            Outcome::Applied(_) => "applied".to_owned(),
            Outcome::NotApplied(code) => code.clone(),
            Outcome::Unknown(what) => format!("unknown {what}"),
        };
        *tally.entry(label).or_default() += 1;
    }
    tally
}

/// The acknowledgement of each opening balance, as `walletlock audit --acks` reads it.
pub fn opened(opening: &[(&str, i64)]) -> Vec<Value> {
    opening
        .iter()
        .map(|(wallet, balance)| json!({ "ack": "opened", "wallet": wallet, "balance": balance }))
        .collect()
}

/// The acknowledgement of a movement with `key` that ended in `outcome`, with `legs` (each wallet
/// and what moved into it) if it applied: its ledger entry, for one leg; its id, for a transfer or
/// a movement of many legs (`walletlock audit --acks` finds their legs by it).
pub fn told(key: &str, outcome: &Outcome, legs: &[(&str, i64)]) -> Value {
    match outcome {
        Outcome::Applied(id) if legs.len() == 1 => {
            let (wallet, amount) = legs[0];
            json!({ "ack": "applied", "key": key, "legs": [{ "wallet": wallet, "amount": amount, "entry": id }] })
        }
        Outcome::Applied(id) => {
            let legs: Vec<Value> =
                legs.iter().map(|(wallet, amount)| json!({ "wallet": wallet, "amount": amount })).collect();
            json!({ "ack": "applied", "key": key, "movement": id, "legs": legs })
        }
        Outcome::NotApplied(_) => json!({ "ack": "refused", "key": key }),
        Outcome::Unknown(_) => panic!("settle the attempts first: {key} {outcome:?}"),
    }
}

/// The bank check, after [`settle`]: `opening` is each wallet's opening balance, and its wallets
/// see no other movement than the payments of `attempts` (`walletlock audit --acks`).
pub async fn check_books(fleet: &impl Bank, opening: &[(&str, i64)], attempts: &[Attempt]) {
    let mut acks = opened(opening);
    acks.extend(attempts.iter().map(|a| told(&a.key, &a.outcome, &[(a.wallet.as_str(), -a.amount)])));
    audit_books(fleet.database_url(), &acks);
}

/// Opens `wallets` through the fleet, each with `balance`.
pub async fn open_wallets(fleet: &impl Bank, wallets: &[&str], balance: i64) {
    for wallet in wallets {
        let created = fleet
            .client()
            .post(fleet.url("/wallets"))
            .json(&json!({ "id": wallet, "balance": balance }))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201, "open {wallet}");
    }
}

/// How long until a payment on `wallet` through nginx is applied again, trying every 50 ms; the
/// probes are added to `attempts`, so the bank check counts them.
pub async fn time_to_recover(
    fleet: &impl Bank,
    wallet: &str,
    limit: Duration,
    attempts: &mut Vec<Attempt>,
) -> Duration {
    let started = Instant::now();
    loop {
        let attempt = pay_one(fleet.client(), &fleet.url(""), wallet).await;
        let applied = matches!(attempt.outcome, Outcome::Applied(_));
        attempts.push(attempt);
        if applied {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "{wallet}: no payment went through within {limit:?}; last answer {:?}",
            attempts.last().map(|a| &a.outcome)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
