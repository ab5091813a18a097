//! Holds: reserve now, capture or void later, or let expire; the available balance never goes
//! negative, a hold settles once, and an expired hold frees its amount by itself.

use crate::support::app::{TestApp, spawn_app};
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::{TestEnv, eventually};
use nix::sys::signal::Signal;
use reqwest::Response;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

async fn body(response: Response) -> (u16, Value) {
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// POSTs `request` to `url`: the status and the body.
async fn post(client: &reqwest::Client, url: String, request: Value) -> (u16, Value) {
    body(client.post(url).json(&request).send().await.unwrap()).await
}

/// The balance and available balance of `wallet`, through `fleet`'s nginx.
async fn fleet_available(fleet: &Fleet, wallet: &str) -> (Option<i64>, Option<i64>) {
    let (_, wallet) =
        body(fleet.client.get(fleet.url(&format!("/wallets/{wallet}"))).send().await.unwrap()).await;
    (wallet["balance"].as_i64(), wallet["available"].as_i64())
}

async fn hold(app: &TestApp, wallet: &str, request: Value) -> (u16, Value) {
    body(app.post_json(&format!("/wallets/{wallet}/holds"), request).await).await
}

async fn available(app: &TestApp, wallet: &str) -> (i64, i64) {
    let wallet: Value = app.get(&format!("/wallets/{wallet}")).await.json().await.unwrap();
    (wallet["balance"].as_i64().unwrap(), wallet["available"].as_i64().unwrap())
}

fn books_balance(app: &TestApp) {
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "the books balance: {report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_reserves_the_available_balance_and_a_partial_capture_charges_once_and_releases_the_rest() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("rider", 100).await;

    let (status, placed) = hold(&app, "rider", json!({ "amount": 60, "reference": "ride-77" })).await;
    assert_eq!(status, 201, "{placed}");
    assert_eq!(
        (placed["status"].as_str(), placed["amount"].as_i64(), placed["captured"].as_i64()),
        (Some("held"), Some(60), Some(0))
    );
    assert_eq!(available(&app, "rider").await, (100, 40), "the balance stays, 60 of it is held");

    // What is held cannot be spent: a payment, another hold or a transfer of more than 40 is refused.
    let (status, refused) = body(app.post_json("/wallets/rider/pay", json!({ "amount": 41 })).await).await;
    assert_eq!(
        (status, refused["code"].as_str(), refused["available"].as_i64()),
        (422, Some("insufficient_funds"), Some(40))
    );
    let (status, refused) = hold(&app, "rider", json!({ "amount": 41 })).await;
    assert_eq!((status, refused["code"].as_str()), (422, Some("insufficient_funds")));
    app.open_wallet("driver", 0).await;
    let transfer = json!({ "from": "rider", "to": "driver", "amount": 41 });
    let (status, refused) = body(app.post_json("/transfers", transfer).await).await;
    assert_eq!((status, refused["code"].as_str()), (422, Some("insufficient_funds")));
    assert_eq!(available(&app, "rider").await, (100, 40), "nothing changed");

    let id = placed["id"].as_str().unwrap();
    let (status, captured) =
        body(app.post_json(&format!("/holds/{id}/capture"), json!({ "amount": 45 })).await).await;
    assert_eq!(status, 200, "{captured}");
    assert_eq!((captured["status"].as_str(), captured["captured"].as_i64()), (Some("captured"), Some(45)));
    let entry = &captured["entry"];
    assert_eq!(
        (entry["kind"].as_str(), entry["amount"].as_i64(), entry["balance"].as_i64()),
        (Some("pay"), Some(45), Some(55))
    );
    assert_eq!((entry["hold_id"].as_str(), entry["reference"].as_str()), (Some(id), Some("ride-77")));
    assert_eq!(available(&app, "rider").await, (55, 55), "45 charged, the other 15 released");

    // Settled once: a second capture, a void, are 409 and change nothing.
    let (status, again) = body(app.post_json(&format!("/holds/{id}/capture"), json!({})).await).await;
    assert_eq!((status, again["code"].as_str()), (409, Some("hold_captured")));
    let (status, void) = body(app.post_json(&format!("/holds/{id}/void"), json!({})).await).await;
    assert_eq!((status, void["code"].as_str()), (409, Some("hold_captured")));
    let (status, read) = body(app.get(&format!("/holds/{id}")).await).await;
    assert_eq!(
        (status, read["status"].as_str(), read["capture_entry"].as_str()),
        (200, Some("captured"), entry["id"].as_str())
    );
    assert_eq!(available(&app, "rider").await, (55, 55));
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_void_releases_everything_and_charges_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("guest", 500).await;
    let (_, placed) = hold(&app, "guest", json!({ "amount": 300, "expires_in": 3600 })).await;
    let id = placed["id"].as_str().unwrap();

    let (status, voided) = body(app.post_json(&format!("/holds/{id}/void"), json!({})).await).await;
    assert_eq!(
        (status, voided["status"].as_str(), voided["captured"].as_i64()),
        (200, Some("voided"), Some(0))
    );
    assert!(voided.get("entry").is_none(), "a void writes no entry: {voided}");
    assert_eq!(available(&app, "guest").await, (500, 500));
    let (status, capture) = body(app.post_json(&format!("/holds/{id}/capture"), json!({})).await).await;
    assert_eq!((status, capture["code"].as_str()), (409, Some("hold_voided")));
    let history: Value = app.get("/wallets/guest/transactions").await.json().await.unwrap();
    assert_eq!(history["transactions"].as_array().unwrap().len(), 1, "only the open entry: {history}");
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_hold_request_has_its_code_and_changes_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("w", 100).await;
    let (_, placed) = hold(&app, "w", json!({ "amount": 50 })).await;
    let id = placed["id"].as_str().unwrap();

    for (request, status, code) in [
        (json!({ "amount": 0 }), 400, "invalid_amount"),
        (json!({ "amount": 10, "expires_in": 0 }), 400, "invalid_expires_in"),
        (json!({ "amount": 10, "expires_in": 604_801 }), 400, "invalid_expires_in"),
        (json!({ "amount": 10, "reference": "x".repeat(257) }), 400, "invalid_reference"),
        (json!({ "amount": 10, "extra": 1 }), 400, "invalid_body"),
        (json!({ "amount": 51 }), 422, "insufficient_funds"),
    ] {
        let (got, problem) = hold(&app, "w", request.clone()).await;
        assert_eq!((got, problem["code"].as_str()), (status, Some(code)), "{request}");
    }
    let (got, problem) = hold(&app, "nobody", json!({ "amount": 1 })).await;
    assert_eq!((got, problem["code"].as_str()), (404, Some("wallet_not_found")));
    let (got, problem) = body(app.post_json("/holds/not-a-uuid/capture", json!({})).await).await;
    assert_eq!((got, problem["code"].as_str()), (400, Some("invalid_hold_id")));
    let unknown = uuid::Uuid::new_v4();
    let (got, problem) = body(app.post_json(&format!("/holds/{unknown}/void"), json!({})).await).await;
    assert_eq!((got, problem["code"].as_str()), (404, Some("hold_not_found")));
    let (got, problem) =
        body(app.post_json(&format!("/holds/{id}/capture"), json!({ "amount": 51 })).await).await;
    assert_eq!(
        (got, problem["code"].as_str(), problem["held"].as_i64()),
        (422, Some("capture_exceeds_hold"), Some(50))
    );

    // Another caller's hold does not exist to it.
    let other = crate::support::api_client_with(crate::support::OTHER_TOKEN);
    let response = other.get(app.url(&format!("/holds/{id}"))).send().await.unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(available(&app, "w").await, (100, 50), "none of it changed anything");
    let (_, read) = body(app.get(&format!("/holds/{id}")).await).await;
    assert_eq!(read["status"].as_str(), Some("held"));
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_expires_by_itself_frees_its_amount_and_cannot_be_captured() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("pump", 100).await;
    let (_, placed) = hold(&app, "pump", json!({ "amount": 80, "expires_in": 1 })).await;
    let id = placed["id"].as_str().unwrap().to_owned();
    assert_eq!(available(&app, "pump").await, (100, 20));

    // Within a second of its expiry, its amount is available, with no sweeper needed: a payment
    // of all of it goes through, and its write releases the hold.
    let expires_at: chrono::DateTime<chrono::Utc> = placed["expires_at"].as_str().unwrap().parse().unwrap();
    let wait = (expires_at - chrono::Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(wait).await;
    eventually("available again within a second of expires_at", Duration::from_secs(1), || async {
        available(&app, "pump").await == (100, 100)
    })
    .await;
    let (status, paid) = body(app.post_json("/wallets/pump/pay", json!({ "amount": 100 })).await).await;
    assert_eq!((status, paid["balance"].as_i64()), (200, Some(0)), "{paid}");

    let (status, capture) = body(app.post_json(&format!("/holds/{id}/capture"), json!({})).await).await;
    assert_eq!((status, capture["code"].as_str()), (409, Some("hold_expired")));
    let (_, read) = body(app.get(&format!("/holds/{id}")).await).await;
    assert_eq!((read["status"].as_str(), read["settled_at"].is_string()), (Some("expired"), true), "{read}");
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_releases_an_expired_hold_that_no_movement_needed() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("idle", 100).await;
    let (_, placed) = hold(&app, "idle", json!({ "amount": 30, "expires_in": 1 })).await;
    let id = placed["id"].as_str().unwrap().to_owned();
    let held = || async {
        sqlx::query_as::<_, (i64, String)>(
            "select w.held, h.status from wallet w join hold h on h.wallet_id = w.id where h.id = $1",
        )
        .bind(uuid::Uuid::parse_str(&id).unwrap())
        .fetch_one(&app.db)
        .await
        .unwrap()
    };
    assert_eq!(held().await, (30, "held".to_owned()));
    // Expiry (1 s), the sweeper's grace (1 s), one sweep period (5 s).
    eventually("the sweeper released it", Duration::from_secs(10), || async {
        held().await == (0, "expired".to_owned())
    })
    .await;
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_racing_a_void_on_two_replicas_settles_the_hold_exactly_once() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    let wallets: Vec<String> = (0..20).map(|n| format!("race{n}")).collect();
    let ids: Vec<&str> = wallets.iter().map(String::as_str).collect();
    open_wallets(&fleet, &ids, 100).await;
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for wallet in &ids {
        let url = fleet.replicas[0].url(&format!("/wallets/{wallet}/holds"));
        let (_, placed) = post(&fleet.client, url, json!({ "amount": 70 })).await;
        let id = placed["id"].as_str().unwrap();
        // The capture on one replica, the void on the other, at once.
        let capture =
            fleet.client.post(fleet.replicas[0].url(&format!("/holds/{id}/capture"))).json(&json!({})).send();
        let void =
            fleet.client.post(fleet.replicas[1].url(&format!("/holds/{id}/void"))).json(&json!({})).send();
        let (capture, void) = tokio::join!(capture, void);
        let (capture, void) = (body(capture.unwrap()).await, body(void.unwrap()).await);
        let won = match (capture.0, void.0) {
            (200, 409) => {
                assert_eq!(void.1["code"].as_str(), Some("hold_captured"));
                "capture"
            }
            (409, 200) => {
                assert_eq!(capture.1["code"].as_str(), Some("hold_voided"));
                "void"
            }
            other => panic!("exactly one of a capture and a void wins: {other:?} {capture:?} {void:?}"),
        };
        *outcomes.entry(won.to_owned()).or_default() += 1;
        let left = if won == "capture" { 30 } else { 100 };
        assert_eq!(fleet_available(&fleet, wallet).await, (Some(left), Some(left)));
    }
    eprintln!("capture against void, 20 holds: {outcomes:?}");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_racing_the_expiry_either_charges_before_it_or_is_refused_after_it() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    let wallets: Vec<String> = (0..20).map(|n| format!("late{n}")).collect();
    let ids: Vec<&str> = wallets.iter().map(String::as_str).collect();
    open_wallets(&fleet, &ids, 100).await;
    let mut placed = Vec::new();
    for wallet in &ids {
        let url = fleet.url(&format!("/wallets/{wallet}/holds"));
        let (_, hold) = post(&fleet.client, url, json!({ "amount": 60, "expires_in": 3 })).await;
        placed.push(hold);
    }
    // Around the expiry, on two replicas: a capture of the hold on one, a payment that needs its
    // amount on the other. Either the capture came first (charged, and the payment is short), or the
    // hold had expired (the capture is `hold_expired`, and the payment went through if it came
    // after the expiry, or was short if before); never a charged hold and a paid payment. The
    // race for the n-th hold starts from 100 ms before its expiry to 90 ms after, 10 ms later each.
    for replica in &fleet.replicas {
        fleet.client.get(replica.url("/wallets/late0")).send().await.unwrap();
    }
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for (n, (wallet, hold)) in ids.iter().zip(&placed).enumerate() {
        let expires_at: chrono::DateTime<chrono::Utc> = hold["expires_at"].as_str().unwrap().parse().unwrap();
        let start = expires_at + chrono::Duration::milliseconds(10 * n as i64 - 100);
        tokio::time::sleep((start - chrono::Utc::now()).to_std().unwrap_or_default()).await;
        let id = hold["id"].as_str().unwrap();
        let capture =
            fleet.client.post(fleet.replicas[0].url(&format!("/holds/{id}/capture"))).json(&json!({})).send();
        let pay = fleet
            .client
            .post(fleet.replicas[1].url(&format!("/wallets/{wallet}/pay")))
            .json(&json!({ "amount": 100 }))
            .send();
        let (capture, pay) = tokio::join!(capture, pay);
        let (capture, pay) = (body(capture.unwrap()).await, body(pay.unwrap()).await);
        let (won, left) = match (capture.0, pay.0) {
            (200, 422) => ("capture", 40),
            (409, paid @ (200 | 422)) => {
                assert_eq!(capture.1["code"].as_str(), Some("hold_expired"));
                ("expiry", if paid == 200 { 0 } else { 100 })
            }
            other => panic!("the capture or the expiry wins, never both: {other:?} {capture:?} {pay:?}"),
        };
        *outcomes.entry(won.to_owned()).or_default() += 1;
        assert_eq!(fleet_available(&fleet, wallet).await, (Some(left), Some(left)), "{wallet}");
    }
    eprintln!("capture against expiry, 20 holds: {outcomes:?}");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_capture_with_its_key_replays_and_charges_once() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("keyed", 100).await;
    let (_, placed) = hold(&app, "keyed", json!({ "amount": 40 })).await;
    let id = placed["id"].as_str().unwrap();
    let capture = || {
        app.client
            .post(app.url(&format!("/holds/{id}/capture")))
            .header("idempotency-key", "capture-1")
            .json(&json!({ "amount": 25 }))
            .send()
    };
    let first = capture().await.unwrap();
    assert_eq!(first.status(), 200);
    let first = first.text().await.unwrap();
    let again = capture().await.unwrap();
    assert_eq!(again.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(again.text().await.unwrap(), first, "byte for byte");
    assert_eq!(available(&app, "keyed").await, (75, 75), "charged once");
    books_balance(&app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_between_a_hold_and_its_capture_or_inside_the_capture_loses_nothing() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["ride"], 1_000).await;
    // The hold is placed on replica-0, which is then killed: nothing of the hold lived in it.
    let (status, placed) =
        post(&fleet.client, fleet.replicas[0].url("/wallets/ride/holds"), json!({ "amount": 400 })).await;
    assert_eq!(status, 201, "{placed}");
    fleet.replicas[0].stop(Signal::SIGKILL);
    let id = placed["id"].as_str().unwrap().to_owned();

    // replica-1 captures it, and dies right after its commit, before it answers.
    fleet.replicas[1].stop(Signal::SIGTERM);
    fleet.replicas[1].set_env("WALLETLOCK_FAILPOINT", Some("after_commit"));
    fleet.replicas[1].start();
    let capture = |url: String| {
        fleet
            .client
            .post(url)
            .header("idempotency-key", "capture-ride")
            .json(&json!({ "amount": 250 }))
            .send()
    };
    assert!(capture(fleet.replicas[1].url(&format!("/holds/{id}/capture"))).await.is_err(), "no answer");
    let replica = &mut fleet.replicas[1];
    crate::support::servers::wait_until("replica-1 died", Duration::from_secs(30), || replica.exited());

    // The retry, on replica-0 started again, learns the capture's outcome and charges nothing more.
    fleet.replicas[0].start();
    let retried = capture(fleet.replicas[0].url(&format!("/holds/{id}/capture"))).await.unwrap();
    assert_eq!(retried.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    let (status, captured) = body(retried).await;
    assert_eq!((status, captured["captured"].as_i64()), (200, Some(250)), "{captured}");
    assert_eq!(
        fleet_available(&fleet, "ride").await,
        (Some(750), Some(750)),
        "charged once, the rest released"
    );
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holds_captures_voids_and_payments_on_one_wallet_never_spend_what_is_held() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    // Well under what the clients' 400 operations (amounts of 1 to 400) ask for in all, so the
    // wallet runs short of available money in the run's second half, however they interleave
    // (with 30,000 it did not, one run in a few: 28,821 charged and kept in one).
    let opening = 20_000;
    open_wallets(&fleet, &["busy"], opening).await;
    let stop = Arc::new(AtomicBool::new(false));

    // Watching all along, through nginx: the available balance is never negative, nor above the
    // balance.
    let watcher = {
        let (client, url, stop) = (fleet.client.clone(), fleet.url("/wallets/busy"), stop.clone());
        tokio::spawn(async move {
            let mut seen = 0;
            while !stop.load(Ordering::Relaxed) {
                let wallet: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
                let (balance, available) =
                    (wallet["balance"].as_i64().unwrap(), wallet["available"].as_i64().unwrap());
                assert!(
                    (0..=balance).contains(&available),
                    "available {available} of a balance of {balance}"
                );
                seen += 1;
            }
            seen
        })
    };
    // Sixteen clients, each placing holds of 1 to 400 and capturing (part of), voiding or keeping
    // them, and paying 1 to 400 between, 25 operations each; every one with its own key.
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (client, base) = (fleet.client.clone(), fleet.url(""));
            tokio::spawn(async move { hold_client(&client, &base, n, 25).await })
        })
        .collect();
    let mut tally = Tally::default();
    for client in clients {
        tally.add(client.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    let watched = watcher.await.unwrap();
    eprintln!("16 clients on one wallet: {tally:?}; the available balance read {watched} times");
    assert!(tally.held > 0 && tally.captured > 0 && tally.voided > 0 && tally.paid > 0, "{tally:?}");
    assert!(tally.short > 0, "the wallet ran short of available money at times: {tally:?}");

    // The books: what was charged is what the clients were told; what is held is what they kept.
    let charged = tally.captured_amount + tally.paid_amount;
    let (balance, available) = fleet_available(&fleet, "busy").await;
    assert_eq!(balance, Some(opening - charged), "{tally:?}");
    assert_eq!(available, Some(opening - charged - tally.kept_amount), "{tally:?}");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

/// What the clients of the concurrent-holds test were told.
#[derive(Debug, Default)]
struct Tally {
    held: usize,
    captured: usize,
    voided: usize,
    paid: usize,
    /// Holds and payments refused with `insufficient_funds`.
    short: usize,
    captured_amount: i64,
    paid_amount: i64,
    /// What the holds neither captured nor voided still reserve.
    kept_amount: i64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.held += other.held;
        self.captured += other.captured;
        self.voided += other.voided;
        self.paid += other.paid;
        self.short += other.short;
        self.captured_amount += other.captured_amount;
        self.paid_amount += other.paid_amount;
        self.kept_amount += other.kept_amount;
    }
}

/// Sends `request` to `url` with `key` until the answer is definite (a movement that timed out, or
/// whose lease was lost, applied nothing; one whose outcome is unknown is sent again with its key).
pub(crate) async fn until_definite(
    client: &reqwest::Client,
    url: &str,
    request: &Value,
    key: &str,
) -> (u16, Value) {
    for _ in 0..50 {
        let sent = client.post(url).header("idempotency-key", key).json(request).send().await;
        let Ok(response) = sent else { continue };
        let (status, answer) = body(response).await;
        match (status, answer["code"].as_str().unwrap_or("")) {
            (503, _) | (409, "lease_lost" | "idempotency_key_in_flight") | (502 | 504, _) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => return (status, answer),
        }
    }
    panic!("{url}: no definite answer for {key}");
}

async fn hold_client(client: &reqwest::Client, base: &str, n: usize, operations: usize) -> Tally {
    use rand::Rng;
    let mut tally = Tally::default();
    let mut open: Vec<(String, i64)> = Vec::new();
    for op in 0..operations {
        let (choice, amount) = {
            let mut rng = rand::rng();
            (rng.random_range(0..5), rng.random_range(1..=400))
        };
        let key = format!("c{n}-{op}");
        match (choice, open.pop()) {
            (0 | 1, Some((hold, held))) => {
                let part = if choice == 0 { json!({}) } else { json!({ "amount": (held / 2).max(1) }) };
                let (status, answer) =
                    until_definite(client, &format!("{base}/holds/{hold}/capture"), &part, &key).await;
                assert_eq!(status, 200, "{answer}");
                tally.captured += 1;
                tally.captured_amount += answer["captured"].as_i64().unwrap();
            }
            (2, Some((hold, _))) => {
                let (status, answer) =
                    until_definite(client, &format!("{base}/holds/{hold}/void"), &json!({}), &key).await;
                assert_eq!(status, 200, "{answer}");
                tally.voided += 1;
            }
            (3, kept) => {
                open.extend(kept);
                let (status, answer) = until_definite(
                    client,
                    &format!("{base}/wallets/busy/pay"),
                    &json!({ "amount": amount }),
                    &key,
                )
                .await;
                match status {
                    200 => (tally.paid, tally.paid_amount) = (tally.paid + 1, tally.paid_amount + amount),
                    422 => tally.short += 1,
                    _ => panic!("{answer}"),
                }
            }
            (_, kept) => {
                open.extend(kept);
                let (status, answer) = until_definite(
                    client,
                    &format!("{base}/wallets/busy/holds"),
                    &json!({ "amount": amount }),
                    &key,
                )
                .await;
                match status {
                    201 => {
                        tally.held += 1;
                        open.push((answer["id"].as_str().unwrap().to_owned(), amount));
                    }
                    422 => tally.short += 1,
                    _ => panic!("{answer}"),
                }
            }
        }
    }
    tally.kept_amount = open.iter().map(|(_, amount)| amount).sum();
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_a_held_amount_off_its_holds_and_a_capture_without_its_entry() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("audited", 100).await;
    let (_, first) = hold(&app, "audited", json!({ "amount": 30 })).await;
    let (_, second) = hold(&app, "audited", json!({ "amount": 20 })).await;
    books_balance(&app);

    // Behind the service's back (as the schema's owner): the wallet forgets what it holds, and a
    // hold is marked captured with no entry charging it.
    sqlx::query("update wallet set held = 10 where id = 'audited'").execute(&app.db).await.unwrap();
    let second: uuid::Uuid = second["id"].as_str().unwrap().parse().unwrap();
    sqlx::query(
        "update hold set status = 'captured', captured = 20, capture_entry = $2, settled_at = now()
         where id = $1",
    )
    .bind(second)
    .bind(uuid::Uuid::new_v4())
    .execute(&app.db)
    .await
    .unwrap();
    let (ok, report) = audit(&app._schema.url);
    assert!(!ok, "{report}");
    assert!(report.contains("wallet audited: holds 10 but its active holds add up to 30"), "{report}");
    assert!(report.contains(&format!("hold {second} (captured, captured 20): 0 ledger entries")), "{report}");
    assert!(!report.contains(first["id"].as_str().unwrap()), "the untouched hold is fine: {report}");
}
