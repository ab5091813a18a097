//! Money between wallets: transfers under two leases that never deadlock, and refunds that never
//! add up to more than what they refund.

use crate::support::app::{TestApp, spawn_app};
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::transfers::{
    Outcome, TransferAttempt, TransferLoad, check_books, goes_through_at_once, settle, tally, transfer,
    transfer_one,
};
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with, books};
use reqwest::Response;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;
use walletlock::ledger::StoreError;
use walletlock::ledger::storage::Storage;
use walletlock::ledger::transfer as ledger;

async fn problem(response: Response) -> (u16, Value) {
    let status = response.status().as_u16();
    assert_eq!(
        response.headers().get("content-type").and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "a {status} is a problem document"
    );
    (status, response.json().await.unwrap())
}

async fn transfer_count(app: &TestApp) -> i64 {
    transfer_count_in(&app.db).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_transferring_both_ways_never_deadlock_and_the_books_balance() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    let wallets = ["ta", "tb", "tc", "td", "te"];
    let opening = 2_000;
    open_wallets(&fleet, &wallets, opening).await;

    // A count, not a time: the same work on an idle or a loaded machine. A deadlock would show
    // as transfers that wait a whole lease wait and give up (`lock_timeout`), or never end.
    let started = Instant::now();
    let load = TransferLoad::each(&fleet, &wallets, 16, 12);
    let mut attempts = tokio::time::timeout(Duration::from_secs(90), load.done())
        .await
        .expect("16 clients sent 12 transfers each within 90 s");
    let took = started.elapsed();
    settle(&fleet, &mut attempts).await;
    let counts = tally(&attempts);
    eprintln!("16 clients, 12 transfers each, {took:?}: {counts:?}");
    let applied = counts.get("applied").copied().unwrap_or(0);
    assert!(applied * 2 >= attempts.len(), "most transfers applied, both ways: {counts:?}");
    // A transfer that waited a whole lease wait for a wallet gives up holding nothing (`lock_timeout`,
    // nothing applied, retry). How many do depends on how busy the machine is, so the bound is
    // on the outcome: each one, retried with its key as the answer says, is decided on its merits
    // within a few tries, which a deadlock (a wait that never ends) would never let happen.
    for attempt in attempts.iter_mut() {
        for _ in 0..5 {
            if !matches!(&attempt.outcome, Outcome::NotApplied(code) if code == "lock_timeout") {
                break;
            }
            let pair = (attempt.from.as_str(), attempt.to.as_str());
            attempt.outcome =
                transfer(&fleet.client, &fleet.url(""), pair, attempt.amount, &attempt.key).await;
        }
    }
    settle(&fleet, &mut attempts).await;
    let retried = tally(&attempts);
    assert!(
        !retried.contains_key("lock_timeout"),
        "a transfer stalled through five tries: {counts:?} then {retried:?}"
    );
    for code in counts.keys() {
        assert!(
            ["applied", "insufficient_funds", "lock_timeout"].contains(&code.as_str()),
            "a transfer neither applied nor refused on its merits nor timed out: {counts:?}"
        );
    }
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, opening)).collect();
    check_books(&fleet, &opening, &attempts).await;

    // Nothing is wedged: a transfer right after goes through at once.
    goes_through_at_once(&fleet, ("ta", "tb")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_moves_money_between_two_wallets_in_both_ledgers() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("alice", 1_000).await;
    app.open_wallet("bob", 10).await;

    let response = app
        .post_json("/transfers", json!({ "from": "alice", "to": "bob", "amount": 250, "reference": "inv-7" }))
        .await;
    assert_eq!(response.status(), 200);
    let transfer: Value = response.json().await.unwrap();
    let id = transfer["id"].as_str().unwrap();
    assert_eq!((transfer["from"].as_str(), transfer["to"].as_str()), (Some("alice"), Some("bob")));
    assert_eq!((transfer["amount"].as_i64(), transfer["reference"].as_str()), (Some(250), Some("inv-7")));
    let (out, into) = (&transfer["from_entry"], &transfer["to_entry"]);
    assert_eq!((out["kind"].as_str(), out["wallet_id"].as_str()), (Some("transfer_out"), Some("alice")));
    assert_eq!((into["kind"].as_str(), into["wallet_id"].as_str()), (Some("transfer_in"), Some("bob")));
    assert_eq!((out["balance"].as_i64(), into["balance"].as_i64()), (Some(750), Some(260)));
    assert_eq!((out["version"].as_i64(), into["version"].as_i64()), (Some(2), Some(2)));
    assert_eq!((out["transfer_id"].as_str(), into["transfer_id"].as_str()), (Some(id), Some(id)));
    assert!(out["fence"].as_i64().unwrap() >= 1 && into["fence"].as_i64().unwrap() >= 1);

    let read: Value = app.get(&format!("/transfers/{id}")).await.json().await.unwrap();
    assert_eq!(read["from_entry"], transfer["from_entry"], "GET returns what POST did");
    assert_eq!(read["refunded"], 0);
    let history: Value = app.get("/wallets/bob/transactions").await.json().await.unwrap();
    assert_eq!(history["transactions"][0], transfer["to_entry"], "the leg is in bob's ledger");
    assert_eq!((books(&app.db, "alice").await.balance, books(&app.db, "bob").await.balance), (750, 260));
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_transfer_has_its_code_and_changes_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("payer", 1_000).await;
    app.open_wallet("payee", 0).await;
    app.open_wallet("full", 0).await;
    // A balance one deposit cannot grow, set by hand: no API reaches it in a test's time.
    sqlx::query("update wallet set balance = 9223372036854775000 where id = 'full'")
        .execute(&app.db)
        .await
        .unwrap();

    let cases: Vec<(Value, u16, &str, Option<&str>)> = vec![
        (json!({ "from": "payer", "to": "payer", "amount": 1 }), 400, "same_wallet", Some("to")),
        (json!({ "from": "ghost", "to": "payee", "amount": 1 }), 404, "wallet_not_found", Some("from")),
        (json!({ "from": "payer", "to": "ghost", "amount": 1 }), 404, "wallet_not_found", Some("to")),
        (json!({ "from": "payer", "to": "payee", "amount": 1_001 }), 422, "insufficient_funds", None),
        (json!({ "from": "payer", "to": "full", "amount": 900 }), 422, "balance_overflow", None),
        (json!({ "from": "a/b", "to": "payee", "amount": 1 }), 400, "invalid_wallet_id", Some("from")),
        (json!({ "from": "payer", "to": "", "amount": 1 }), 400, "invalid_wallet_id", Some("to")),
        (json!({ "from": "payer", "to": "payee", "amount": 0 }), 400, "invalid_amount", Some("amount")),
        (json!({ "from": "payer", "to": "payee", "amount": -5 }), 400, "invalid_amount", Some("amount")),
        (
            json!({ "from": "payer", "to": "payee", "amount": 1, "reference": "x".repeat(257) }),
            400,
            "invalid_reference",
            Some("reference"),
        ),
        (json!({ "from": "payer", "to": "payee", "amount": 1.5 }), 400, "invalid_body", None),
        (json!({ "from": "payer", "to": "payee", "amount": "1" }), 400, "invalid_body", None),
        (json!({ "from": "payer", "amount": 1 }), 400, "invalid_body", None),
        (json!({ "from": "payer", "to": "payee", "amount": 1, "extra": true }), 400, "invalid_body", None),
    ];
    for (body, status, code, field) in cases {
        let (got, problem) = problem(app.post_json("/transfers", body.clone()).await).await;
        assert_eq!((got, problem["code"].as_str()), (status, Some(code)), "{body}");
        assert_eq!(problem["status"], status);
        assert_eq!(problem["field"].as_str(), field, "{body}");
    }
    let (_, insufficient) = problem(
        app.post_json("/transfers", json!({ "from": "payer", "to": "payee", "amount": 1_001 })).await,
    )
    .await;
    assert_eq!(insufficient["balance"], 1_000, "insufficient_funds says what `from` has");

    let malformed = app
        .client
        .post(app.url("/transfers"))
        .header("content-type", "application/json")
        .body("{\"from\":")
        .send()
        .await
        .unwrap();
    assert_eq!(problem(malformed).await.1["code"], "malformed_json");
    let not_json = app.client.post(app.url("/transfers")).body("from=payer").send().await.unwrap();
    let (status, not_json) = problem(not_json).await;
    assert_eq!((status, not_json["code"].as_str()), (415, Some("unsupported_media_type")));
    let anonymous = reqwest::Client::new()
        .post(app.url("/transfers"))
        .json(&json!({ "from": "payer", "to": "payee", "amount": 1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    assert!(anonymous.headers().contains_key("www-authenticate"));
    let bad_key = app
        .client
        .post(app.url("/transfers"))
        .header("idempotency-key", "")
        .json(&json!({ "from": "payer", "to": "payee", "amount": 1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(problem(bad_key).await.1["code"], "invalid_idempotency_key");

    let (status, missing) = problem(app.get(&format!("/transfers/{}", uuid::Uuid::new_v4())).await).await;
    assert_eq!((status, missing["code"].as_str()), (404, Some("transfer_not_found")));
    let (status, bad) = problem(app.get("/transfers/not-a-uuid").await).await;
    assert_eq!((status, bad["code"].as_str()), (400, Some("invalid_transfer_id")));

    assert_eq!(transfer_count(&app).await, 0, "nothing was recorded");
    assert_eq!((books(&app.db, "payer").await.balance, books(&app.db, "payee").await.balance), (1_000, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_retried_with_its_key_moves_money_once() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("kfrom", 100).await;
    app.open_wallet("kto", 0).await;
    let send = |body: Value, key: &'static str| {
        app.client.post(app.url("/transfers")).header("idempotency-key", key).json(&body).send()
    };
    let body = json!({ "from": "kfrom", "to": "kto", "amount": 30 });

    let first = send(body.clone(), "move-1").await.unwrap();
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = first.bytes().await.unwrap();
    // The retry, with the body rebuilt in another key order.
    let retry = send(json!({ "amount": 30, "to": "kto", "from": "kfrom" }), "move-1").await.unwrap();
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(retry.bytes().await.unwrap(), first, "byte for byte the same response");

    let reused = send(json!({ "from": "kfrom", "to": "kto", "amount": 31 }), "move-1").await.unwrap();
    assert_eq!(problem(reused).await.1["code"], "idempotency_key_reused");

    // A refusal is stored and replayed too, even once the money is there.
    let refused = send(json!({ "from": "kfrom", "to": "kto", "amount": 500 }), "move-2").await.unwrap();
    assert_eq!(problem(refused).await.1["code"], "insufficient_funds");
    let deposited = app.post_json("/wallets/kfrom/deposit", json!({ "amount": 1_000 })).await;
    assert_eq!(deposited.status(), 200);
    let replayed = send(json!({ "from": "kfrom", "to": "kto", "amount": 500 }), "move-2").await.unwrap();
    assert_eq!(replayed.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(problem(replayed).await.1["code"], "insufficient_funds");

    assert_eq!(transfer_count(&app).await, 1, "moved once");
    assert_eq!((books(&app.db, "kfrom").await.balance, books(&app.db, "kto").await.balance), (1_070, 30));
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

/// Sends `count` refunds of `amount` at once, alternating between the two replicas. A refund
/// answered `lock_timeout` (the others held its wallets for the whole wait, as on a slow machine
/// they may: nothing was applied) is sent again, as the answer tells clients to, at most five
/// times: each is to be decided on its merits.
async fn race(fleet: &Fleet, path: &str, body: Value, count: usize) -> Vec<(u16, Value)> {
    let start = Arc::new(Barrier::new(count));
    let requests: Vec<_> = (0..count)
        .map(|n| {
            let (client, url, body, start) =
                (fleet.client.clone(), fleet.replicas[n % 2].url(path), body.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let mut tries = 0;
                loop {
                    let response = client.post(&url).json(&body).send().await.unwrap();
                    let answer = (response.status().as_u16(), response.json::<Value>().await.unwrap());
                    tries += 1;
                    if answer.1["code"] != "lock_timeout" || tries == 5 {
                        return answer;
                    }
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_racing_on_two_replicas_never_exceed_the_payment() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["shopper", "merchant"], 1_000).await;
    let paid: Value = fleet
        .client
        .post(fleet.url("/wallets/shopper/pay"))
        .json(&json!({ "amount": 100 }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let payment = paid["id"].as_str().unwrap();

    let answers =
        race(&fleet, "/wallets/shopper/refunds", json!({ "payment": payment, "amount": 30 }), 12).await;
    let accepted: Vec<_> = answers.iter().filter(|(status, _)| *status == 200).collect();
    assert_eq!(accepted.len(), 3, "3 refunds of 30 fit in 100: {answers:?}");
    for (_, entry) in &accepted {
        assert_eq!((entry["kind"].as_str(), entry["refund_of"].as_str()), (Some("refund"), Some(payment)));
    }
    for (status, body) in answers.iter().filter(|(status, _)| *status != 200) {
        assert_eq!((*status, body["code"].as_str()), (422, Some("refund_exceeds_payment")), "{body}");
        assert_eq!(body["refundable"], 10);
    }
    // Without an amount: the rest, then nothing.
    let rest: Value = fleet
        .client
        .post(fleet.url("/wallets/shopper/refunds"))
        .json(&json!({ "payment": payment }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((rest["amount"].as_i64(), rest["balance"].as_i64()), (Some(10), Some(1_000)));
    let none = fleet
        .client
        .post(fleet.url("/wallets/shopper/refunds"))
        .json(&json!({ "payment": payment }))
        .send()
        .await
        .unwrap();
    let (status, none) = problem(none).await;
    assert_eq!(
        (status, none["code"].as_str(), none["refundable"].as_i64()),
        (422, Some("refund_exceeds_payment"), Some(0))
    );
    // Only a payment of this wallet can be refunded here.
    let elsewhere = fleet
        .client
        .post(fleet.url("/wallets/merchant/refunds"))
        .json(&json!({ "payment": payment }))
        .send()
        .await
        .unwrap();
    let (status, elsewhere) = problem(elsewhere).await;
    assert_eq!((status, elsewhere["code"].as_str()), (404, Some("payment_not_found")));
    let malformed = fleet
        .client
        .post(fleet.url("/wallets/shopper/refunds"))
        .json(&json!({ "payment": "nope" }))
        .send()
        .await
        .unwrap();
    assert_eq!(problem(malformed).await.1["code"], "invalid_payment_id");

    // A transfer's refunds race the same way: money moves back from `to` to `from`.
    let moved: Value = fleet
        .client
        .post(fleet.url("/transfers"))
        .json(&json!({ "from": "shopper", "to": "merchant", "amount": 100 }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let transfer = moved["id"].as_str().unwrap();
    let path = format!("/transfers/{transfer}/refund");
    let answers = race(&fleet, &path, json!({ "amount": 30 }), 12).await;
    let accepted: Vec<_> = answers.iter().filter(|(status, _)| *status == 200).collect();
    assert_eq!(accepted.len(), 3, "3 refunds of 30 fit in 100: {answers:?}");
    for (_, refund) in &accepted {
        assert_eq!((refund["from"].as_str(), refund["to"].as_str()), (Some("merchant"), Some("shopper")));
        assert_eq!(refund["refund_of"].as_str(), Some(transfer));
    }
    for (status, body) in answers.iter().filter(|(status, _)| *status != 200) {
        assert_eq!((*status, body["code"].as_str()), (422, Some("refund_exceeds_payment")), "{body}");
    }
    let state = fleet.read(&format!("/transfers/{transfer}")).await;
    assert_eq!(state["refunded"], 90);

    assert_eq!(
        (books(&fleet.db, "shopper").await.balance, books(&fleet.db, "merchant").await.balance),
        (990, 1_010)
    );
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

/// POSTs `body` to `path` with `client`'s token: the response.
async fn post_as(client: &reqwest::Client, app: &TestApp, path: &str, body: Value) -> Response {
    client.post(app.url(path)).json(&body).send().await.unwrap()
}

/// The id of what a successful POST of `body` to `path` made.
async fn made(app: &TestApp, path: &str, body: Value) -> String {
    let response = app.post_json(path, body).await;
    assert_eq!(response.status(), 200, "{path}");
    response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
}

async fn entry_count(db: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from ledger_entry").fetch_one(db).await.unwrap()
}

/// A request and how it must be refused: who sends it, where, what; the status, code and `field`.
type Refused<'a> = (&'a reqwest::Client, &'a str, Value, u16, &'a str, Option<&'a str>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_refund_has_its_code_and_changes_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("buyer", 1_000).await;
    app.open_wallet("seller", 0).await;
    let other = api_client_with(OTHER_TOKEN);
    let opened = post_as(&other, &app, "/wallets", json!({ "id": "outsider", "balance": 100 })).await;
    assert_eq!(opened.status(), 201);
    let payment = made(&app, "/wallets/buyer/pay", json!({ "amount": 100 })).await;
    let deposit = made(&app, "/wallets/buyer/deposit", json!({ "amount": 50 })).await;
    let moved = app.post_json("/transfers", json!({ "from": "buyer", "to": "seller", "amount": 300 })).await;
    let moved: Value = moved.json().await.unwrap();
    let transfer = moved["id"].as_str().unwrap();
    let transfer_out = moved["from_entry"]["id"].as_str().unwrap();
    // The seller spends most of what it was paid; and the buyer pays into another caller's wallet
    // (`grant tester pays-into other`), which only that caller may refund.
    made(&app, "/wallets/seller/pay", json!({ "amount": 250 })).await;
    let into_outsider =
        made(&app, "/transfers", json!({ "from": "buyer", "to": "outsider", "amount": 20 })).await;
    let balances = || async {
        let mut balances = Vec::new();
        for wallet in ["buyer", "seller", "outsider"] {
            balances.push(books(&app.db, wallet).await.balance);
        }
        balances
    };
    assert_eq!(balances().await, [630, 50, 120]);
    let (entries, transfers) = (entry_count(&app.db).await, transfer_count(&app).await);

    let tester = &app.client;
    let unknown = uuid::Uuid::new_v4();
    let (buyer, seller, ghost) =
        ("/wallets/buyer/refunds", "/wallets/seller/refunds", "/wallets/ghost/refunds");
    let refund_of = |id: &str| format!("/transfers/{id}/refund");
    let (moved_back, no_transfer, not_a_uuid, theirs) = (
        refund_of(transfer),
        refund_of(&unknown.to_string()),
        refund_of("not-a-uuid"),
        refund_of(&into_outsider),
    );
    let cases: Vec<Refused> = vec![
        // A payment's refund: of a `pay` entry of the caller's wallet named, of no more than was paid.
        (tester, buyer, json!({ "payment": unknown }), 404, "payment_not_found", Some("payment")),
        (tester, buyer, json!({ "payment": deposit }), 404, "payment_not_found", Some("payment")),
        (tester, buyer, json!({ "payment": transfer_out }), 404, "payment_not_found", Some("payment")),
        (tester, seller, json!({ "payment": payment }), 404, "payment_not_found", Some("payment")),
        (tester, ghost, json!({ "payment": payment }), 404, "wallet_not_found", None),
        (&other, buyer, json!({ "payment": payment }), 404, "wallet_not_found", None),
        (tester, buyer, json!({ "payment": payment, "amount": 0 }), 400, "invalid_amount", Some("amount")),
        (tester, buyer, json!({ "payment": payment, "amount": -5 }), 400, "invalid_amount", Some("amount")),
        (tester, buyer, json!({ "payment": payment, "amount": 101 }), 422, "refund_exceeds_payment", None),
        (tester, buyer, json!({ "payment": "nope" }), 400, "invalid_payment_id", Some("payment")),
        (tester, buyer, json!({ "payment": payment, "amount": 1.5 }), 400, "invalid_body", None),
        (tester, buyer, json!({ "payment": payment, "amount": "10" }), 400, "invalid_body", None),
        (tester, buyer, json!({ "amount": 10 }), 400, "invalid_body", None),
        (tester, buyer, json!({ "payment": payment, "to": "seller" }), 400, "invalid_body", None),
        // A transfer's refund: of one that exists and is the caller's to refund (it may use the
        // wallet paid into), of no more than it moved, from a payee that still has the money.
        (tester, &no_transfer, json!({}), 404, "transfer_not_found", None),
        (&other, &moved_back, json!({}), 404, "transfer_not_found", None),
        (tester, &theirs, json!({}), 404, "transfer_not_found", None),
        (tester, &not_a_uuid, json!({}), 400, "invalid_transfer_id", Some("transfer_id")),
        (tester, &moved_back, json!({ "amount": 100 }), 422, "insufficient_funds", None),
        (tester, &moved_back, json!({}), 422, "insufficient_funds", None),
        (tester, &moved_back, json!({ "amount": 0 }), 400, "invalid_amount", Some("amount")),
        (tester, &moved_back, json!({ "amount": -1 }), 400, "invalid_amount", Some("amount")),
        (tester, &moved_back, json!({ "amount": 301 }), 422, "refund_exceeds_payment", None),
        (tester, &moved_back, json!({ "amount": "5" }), 400, "invalid_body", None),
        (tester, &moved_back, json!({ "amount": 5, "to": "buyer" }), 400, "invalid_body", None),
    ];
    for (client, path, body, status, code, field) in cases {
        let response = post_as(client, &app, path, body.clone()).await;
        assert_eq!(response.status(), status, "{path} {body}");
        let (_, problem) = problem(response).await;
        assert_eq!(problem["code"].as_str(), Some(code), "{path} {body}");
        assert_eq!(problem["status"], status, "{path} {body}");
        assert_eq!(problem["field"].as_str(), field, "{path} {body}");
        match code {
            "refund_exceeds_payment" => {
                let paid = if path.starts_with("/wallets") { 100 } else { 300 };
                assert_eq!(problem["refundable"], paid, "nothing refunded yet: {path} {body}");
            }
            "insufficient_funds" => assert_eq!(problem["balance"], 50, "what the payee has left: {body}"),
            _ => {}
        }
    }
    for path in [buyer, &moved_back] {
        let malformed = tester
            .post(app.url(path))
            .header("content-type", "application/json")
            .body("{\"amount\":")
            .send()
            .await
            .unwrap();
        let (status, malformed) = problem(malformed).await;
        assert_eq!((status, malformed["code"].as_str()), (400, Some("malformed_json")), "{path}");
    }

    assert_eq!(balances().await, [630, 50, 120], "no money moved");
    assert_eq!(
        (entry_count(&app.db).await, transfer_count(&app).await),
        (entries, transfers),
        "nothing recorded"
    );
    let state: Value = app.get(&format!("/transfers/{transfer}")).await.json().await.unwrap();
    assert_eq!(state["refunded"], 0);
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_retried_with_its_key_is_replayed_and_moves_money_once() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("rfrom", 1_000).await;
    app.open_wallet("rto", 0).await;
    let payment = made(&app, "/wallets/rfrom/pay", json!({ "amount": 100 })).await;
    let transfer = made(&app, "/transfers", json!({ "from": "rfrom", "to": "rto", "amount": 200 })).await;
    let send = |path: &str, key: &str, body: Value| {
        app.client.post(app.url(path)).header("idempotency-key", key).json(&body).send()
    };
    let replayed = |response: &Response| {
        response.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_owned())
    };

    // Each refund route: a request, the same rebuilt in another key order, another request (10),
    // and one asking more than is left once 30 is refunded (70 of the payment, 170 of the transfer).
    let routes = [
        (
            "/wallets/rfrom/refunds".to_owned(),
            json!({ "payment": payment, "amount": 30 }),
            json!({ "amount": 30, "payment": payment }),
            json!({ "payment": payment, "amount": 10 }),
            json!({ "payment": payment, "amount": 71 }),
            70,
        ),
        (
            format!("/transfers/{transfer}/refund"),
            json!({ "amount": 30 }),
            json!({ "amount": 30 }),
            json!({ "amount": 10 }),
            json!({ "amount": 171 }),
            170,
        ),
    ];
    for (path, body, rebuilt, another, too_much, refundable) in routes {
        let first = send(&path, "refund-1", body).await.unwrap();
        assert_eq!((first.status().as_u16(), replayed(&first)), (200, None), "{path}");
        let first = first.bytes().await.unwrap();
        let retry = send(&path, "refund-1", rebuilt).await.unwrap();
        assert_eq!((retry.status().as_u16(), replayed(&retry)), (200, Some("true".into())), "{path}");
        assert_eq!(retry.bytes().await.unwrap(), first, "{path}: byte for byte the same response");

        let reused = send(&path, "refund-1", another.clone()).await.unwrap();
        let (status, reused) = problem(reused).await;
        assert_eq!((status, reused["code"].as_str()), (422, Some("idempotency_key_reused")), "{path}");

        // A refusal is stored and replayed as it was told, even once less is left to refund.
        let refused = send(&path, "refund-2", too_much.clone()).await.unwrap();
        assert_eq!((refused.status().as_u16(), replayed(&refused)), (422, None), "{path}");
        let refused = refused.bytes().await.unwrap();
        let told: Value = serde_json::from_slice(&refused).unwrap();
        assert_eq!(
            (told["code"].as_str(), told["refundable"].as_i64()),
            (Some("refund_exceeds_payment"), Some(refundable)),
            "{path}"
        );
        assert_eq!(app.post_json(&path, another).await.status(), 200, "{path}: without the key it runs");
        let again = send(&path, "refund-2", too_much).await.unwrap();
        assert_eq!((again.status().as_u16(), replayed(&again)), (422, Some("true".into())), "{path}");
        assert_eq!(again.bytes().await.unwrap(), refused, "{path}: the refusal as it was first told");
    }

    // Each refunded once with its key (30) and once without (10).
    let payment_refunds: i64 = sqlx::query_scalar("select count(*) from ledger_entry where kind = 'refund'")
        .fetch_one(&app.db)
        .await
        .unwrap();
    let transfer_refunds: i64 =
        sqlx::query_scalar("select count(*) from transfer where refund_of is not null")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!((payment_refunds, transfer_refunds), (2, 2));
    assert_eq!((books(&app.db, "rfrom").await.balance, books(&app.db, "rto").await.balance), (780, 160));
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

/// Appends an entry to `wallet`'s ledger as a writer that keeps each wallet's own books straight
/// would: the next number, the balance after it, the wallet's fence, its event, and the wallet row moved
/// with it. Its id.
async fn append_entry(
    db: &sqlx::PgPool,
    wallet: &str,
    kind: &str,
    amount: i64,
    transfer: Option<uuid::Uuid>,
    refund_of: Option<uuid::Uuid>,
) -> uuid::Uuid {
    sqlx::query_scalar(
        "with moved as (
             update wallet
             set balance = balance
                           + case when $2::text in ('pay', 'transfer_out') then -$3::int8 else $3::int8 end,
                 version = version + 1,
                 event_seq = event_seq + 1,
                 event_position = greatest(event_position, pg_current_xact_id())
             where id = $1
             returning id, balance, version, fence, event_seq, event_position),
         entry as (
             insert into ledger_entry
                 (id, wallet_id, seq, kind, amount, balance_after, fence, transfer_id, refund_of)
             select gen_random_uuid(), id, version, $2::text, $3::int8, balance, fence, $4, $5 from moved
             returning id, created_at),
         event as (
             insert into event (wallet_id, seq, position, type, entry_id, created_at)
             select moved.id, event_seq, event_position, 'transfer.accepted', entry.id, entry.created_at
             from moved, entry)
         select id from entry",
    )
    .bind(wallet)
    .bind(kind)
    .bind(amount)
    .bind(transfer)
    .bind(refund_of)
    .fetch_one(db)
    .await
    .unwrap()
}

/// Records a transfer row of `amount` from `from` to `to` (refunding `refund_of`), without legs.
async fn record_transfer(
    db: &sqlx::PgPool,
    (from, to): (&str, &str),
    amount: i64,
    refund_of: Option<uuid::Uuid>,
) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    sqlx::query(
        "insert into transfer (id, from_wallet, to_wallet, amount, refund_of) values ($1, $2, $3, $4, $5)",
    )
    .bind(id)
    .bind(from)
    .bind(to)
    .bind(amount)
    .bind(refund_of)
    .execute(db)
    .await
    .unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_a_transfer_off_its_legs_refunds_beyond_what_they_refund_and_money_not_conserved() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("alice", 1_000).await;
    app.open_wallet("bob", 0).await;
    let payment = made(&app, "/wallets/alice/pay", json!({ "amount": 100 })).await;
    made(&app, "/wallets/alice/refunds", json!({ "payment": payment, "amount": 40 })).await;
    let first = made(&app, "/transfers", json!({ "from": "alice", "to": "bob", "amount": 300 })).await;
    let refund = made(&app, &format!("/transfers/{first}/refund"), json!({ "amount": 100 })).await;
    let untouched = made(&app, "/transfers", json!({ "from": "alice", "to": "bob", "amount": 200 })).await;
    let (ok, report) = audit(&app._schema.url);
    assert!(ok && report.starts_with("audit OK"), "{report}");

    // Behind the service's back (as the schema's owner), the books a buggy writer would leave:
    // each wallet's own ledger straight (every entry follows from the one before, every balance
    // equals its ledger), so only the checks across wallets and entries can tell.
    let db = &app.db;
    // A transfer whose legs differ: 50 out of alice, 80 into bob.
    let uneven = record_transfer(db, ("alice", "bob"), 50, None).await;
    append_entry(db, "alice", "transfer_out", 50, Some(uneven), None).await;
    append_entry(db, "bob", "transfer_in", 80, Some(uneven), None).await;
    // A transfer with one leg: 20 out of alice, into nobody.
    let one_legged = record_transfer(db, ("alice", "bob"), 20, None).await;
    append_entry(db, "alice", "transfer_out", 20, Some(one_legged), None).await;
    // The payment of 100, refunded 40 then 70.
    let payment: uuid::Uuid = payment.parse().unwrap();
    append_entry(db, "alice", "refund", 70, None, Some(payment)).await;
    // The transfer of 300, refunded 100 then 250.
    let first: uuid::Uuid = first.parse().unwrap();
    let over_refund = record_transfer(db, ("bob", "alice"), 250, Some(first)).await;
    append_entry(db, "bob", "transfer_out", 250, Some(over_refund), None).await;
    append_entry(db, "alice", "transfer_in", 250, Some(over_refund), None).await;
    // A refund entry of alice's for what was no payment: her part of the transfer of 300.
    let leg: uuid::Uuid =
        sqlx::query_scalar("select id from ledger_entry where transfer_id = $1 and kind = 'transfer_out'")
            .bind(first)
            .fetch_one(db)
            .await
            .unwrap();
    let stray = append_entry(db, "alice", "refund", 5, None, Some(leg)).await;

    let (ok, report) = audit(&app._schema.url);
    assert!(!ok, "{report}");
    for problem in [
        format!("transfer {uneven}: 2 ledger legs, 1 matching transfer_out and 0 matching transfer_in"),
        format!("transfer {one_legged}: 1 ledger legs, 1 matching transfer_out and 0 matching transfer_in"),
        format!("payment {payment}: its refunds add up to 110, more than its 100"),
        format!("transfer {first}: its refunds add up to 350, more than its 300"),
        format!("refund entry {stray}: does not refund a payment of its own wallet"),
        // Out: 300, 100 and 200 through the API, then 50, 20 and 250; in: the same but 80 for 50,
        // and nothing for 20. Alice holds 795 and Bob 230, of 1,000 opened, 100 paid, 115 refunded.
        "money not conserved: transfers took out 920 but put in 930".to_owned(),
        "money not conserved: the balances add up to 1025, but opening balances plus deposits minus payments \
         plus refunds are 1015"
            .to_owned(),
    ] {
        assert!(report.contains(&problem), "the audit reports `{problem}`:\n{report}");
    }
    assert!(report.contains("audit FAILED: 7 problems"), "and nothing else:\n{report}");
    assert!(!report.contains("wallet alice") && !report.contains("wallet bob"), "{report}");
    for fine in [untouched, refund] {
        assert!(!report.contains(&fine), "{fine} is fine: {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_waits_for_a_wallet_held_elsewhere_and_times_out_holding_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("w1", 100).await;
    app.open_wallet("w2", 100).await;
    // Another holder keeps `w2` for longer than the lease wait (2 s in test replicas).
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:w2").await.unwrap();
    let taken_before = lease_acquisitions(&app).await;
    let started = Instant::now();
    let request =
        app.client.post(app.url("/transfers")).json(&json!({ "from": "w1", "to": "w2", "amount": 1 }));
    let transfer = tokio::spawn(request.send());
    // The payee's worker asks for `w1`'s lease with `w2`'s, in one round trip, and takes it; `w2`'s
    // busy, it gives `w1`'s back at once rather than wait holding it (a transfer out of `w2` could
    // be waiting for it: a cycle). So `w1` is free while the transfer still waits.
    let probe = env.leases(Duration::from_secs(10), Duration::from_secs(1));
    while lease_acquisitions(&app).await == taken_before {
        assert!(!transfer.is_finished(), "the worker never took w1's lease with w2's ask");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let w1 = loop {
        if let Some(w1) = probe.try_acquire("wallet:w1").await.unwrap() {
            break w1;
        }
        assert!(!transfer.is_finished(), "w1 stayed leased while its worker waited for w2");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(!transfer.is_finished(), "w1 was free only once the transfer gave up");
    w1.release().await.unwrap();
    let response = transfer.await.unwrap().unwrap();
    let waited = started.elapsed();
    let (status, body) = problem(response).await;
    assert_eq!((status, body["code"].as_str()), (503, Some("lock_timeout")));
    assert!(waited < Duration::from_secs(4), "bounded by the lease wait: {waited:?}");
    // `w1`'s lease was not left held (released on the way out, or never taken): another holder
    // takes it without waiting, and a payment from it goes through.
    let probe = env.leases(Duration::from_secs(10), Duration::from_secs(1));
    let w1 = probe.try_acquire("wallet:w1").await.unwrap().expect("w1 was left leased");
    w1.release().await.unwrap();
    let paid = app.post_json("/wallets/w1/pay", json!({ "amount": 1 })).await;
    assert_eq!(paid.status(), 200);
    holder.release().await.unwrap();
    assert_eq!(transfer_count(&app).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_transfer_applies_it_whole_or_not_at_all_and_the_retry_tells() {
    for (failpoint, committed) in [("before_commit", false), ("after_commit", true)] {
        let env = TestEnv::new();
        let settings = [("WALLETLOCK_FAILPOINT", failpoint), ("LEASE_TTL", "1s")];
        let mut fleet = Fleet::start(&env, 1, &settings).await;
        open_wallets(&fleet, &["kill-from", "kill-to"], 100).await;
        let url = fleet.replicas[0].url("");

        let pair = ("kill-from", "kill-to");
        let died = crate::support::transfers::transfer(&fleet.client, &url, pair, 40, "k").await;
        assert!(matches!(died, Outcome::Unknown(_)), "{failpoint}: no answer, the replica died: {died:?}");
        let recorded = || async { transfer_count_in(&fleet.db).await };
        assert_eq!(recorded().await, i64::from(committed), "{failpoint}: whole or nothing");

        fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
        fleet.replicas[0].start();
        // The dead replica's leases expire within their TTL; the retry with the key settles it.
        let retried = crate::support::transfers::transfer(&fleet.client, &url, pair, 40, "k").await;
        assert!(matches!(retried, Outcome::Applied(_)), "{failpoint}: {retried:?}");
        let again = crate::support::transfers::transfer(&fleet.client, &url, pair, 40, "k").await;
        assert_eq!(again, retried, "{failpoint}: the same transfer, replayed");
        assert_eq!(recorded().await, 1, "{failpoint}: moved once");
        let balances =
            (books(&fleet.db, "kill-from").await.balance, books(&fleet.db, "kill-to").await.balance);
        assert_eq!(balances, (60, 140), "{failpoint}");
        let (ok, report) = audit(&fleet.database_url);
        assert!(ok, "{failpoint}: {report}");
    }
}

/// `walletlock_lease_acquisitions_total` as the replica's `/metrics` reports it.
async fn lease_acquisitions(app: &TestApp) -> u64 {
    let metrics = app.get("/metrics").await.text().await.unwrap();
    let line = metrics.lines().find(|line| line.starts_with("walletlock_lease_acquisitions_total "));
    line.and_then(|line| line.split(' ').nth(1)?.parse().ok()).unwrap_or(0)
}

async fn transfer_count_in(db: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from transfer").fetch_one(db).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stalled_inside_a_transfer_frees_both_wallets_within_about_a_lease() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 2, &[("LEASE_TTL", "1s")]).await;
    let pair = ("stall-from", "stall-to");
    open_wallets(&fleet, &[pair.0, pair.1], 100).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("before_commit:stop"));
    fleet.replicas[0].start();

    // replica-1 stops itself inside the transfer's transaction: both rows locked, COMMIT unsent.
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let mut stalled =
        tokio::spawn(
            async move { crate::support::transfers::transfer(&client, &url, pair, 40, "stalled").await },
        );
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped in its transfer", &mut stalled).await;
    let stalled_at = Instant::now();

    // The other replica pays from both wallets once Postgres has ended the stalled session (idle in
    // its transaction for 2 s) and the stalled holder's leases have expired (1 s).
    let other = fleet.replicas[1].url("");
    for wallet in [pair.0, pair.1] {
        let key = format!("after-{wallet}");
        loop {
            let paid = crate::support::load::pay(&fleet.client, &other, wallet, 1, &key).await;
            if matches!(paid, crate::support::load::Outcome::Applied(_)) {
                break;
            }
            assert!(stalled_at.elapsed() < Duration::from_secs(8), "{wallet} still held: {paid:?}");
        }
    }
    let freed = stalled_at.elapsed();
    assert!(freed <= Duration::from_secs(4), "both wallets were held {freed:?} after the stall");

    // The stalled replica wakes: its commit cannot have happened; its key's retry settles it once.
    fleet.replicas[0].signal(nix::sys::signal::Signal::SIGCONT);
    let woke = stalled.await.unwrap();
    assert!(
        !matches!(woke, Outcome::Applied(_)),
        "the stalled transfer was not committed: {woke:?}; replica-1 logged:\n{}",
        fleet.replicas[0].log()
    );
    let retried = crate::support::transfers::transfer(&fleet.client, &other, pair, 40, "stalled").await;
    assert!(matches!(retried, Outcome::Applied(_)), "{retried:?}");
    assert_eq!(transfer_count_in(&fleet.db).await, 1, "moved once");
    let balances = (books(&fleet.db, pair.0).await.balance, books(&fleet.db, pair.1).await.balance);
    assert_eq!(balances, (59, 139), "the transfer and one payment from each");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
    eprintln!("stalled inside a transfer: both wallets paid again {freed:?} after the stall");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_continue_through_a_flushall_and_the_books_balance() {
    let env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 3, &[("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")]).await;
    let wallets = ["flush-a", "flush-b", "flush-c", "flush-d", "flush-e"];
    let opening = 2_000;
    open_wallets(&fleet, &wallets, opening).await;
    let load = TransferLoad::start(&fleet, &wallets, 8);
    tokio::time::sleep(Duration::from_millis(700)).await;

    // Every lease, fence counter and note gone at once: the fences start over below what the rows
    // have seen, so each holder lifts its lease's fence past the row's before it writes.
    env.redis_cmd::<()>(&["FLUSHALL"]).await;
    // Resuming is an outcome, not a time (the machine may be slow): each probe waits for its lease
    // behind the load's clients on the same pair, so it is applied or refused as busy, and one of
    // the first three is applied.
    let flushed_at = Instant::now();
    let mut probes = Vec::new();
    while !probes.iter().any(|probe: &TransferAttempt| matches!(probe.outcome, Outcome::Applied(_))) {
        assert!(probes.len() < 3, "no transfer applied since the flush: {probes:?}");
        let probe = transfer_one(&fleet.client, &fleet.url(""), ("flush-a", "flush-b"), 1).await;
        assert!(
            matches!(&probe.outcome, Outcome::Applied(_))
                || matches!(&probe.outcome, Outcome::NotApplied(code) if code == "lock_timeout"),
            "a probe after the flush: {probe:?}"
        );
        probes.push(probe);
    }
    let resumed = flushed_at.elapsed();
    tokio::time::sleep(Duration::from_millis(700)).await;

    let mut attempts = load.finish().await;
    attempts.extend(probes);
    settle(&fleet, &mut attempts).await;
    let counts = tally(&attempts);
    eprintln!("8 clients through a FLUSHALL: {counts:?}; transfers resumed {resumed:?} after it");
    for code in counts.keys() {
        assert!(
            ["applied", "insufficient_funds", "lock_timeout", "lease_lost"].contains(&code.as_str()),
            "a transfer neither applied nor refused with nothing applied: {counts:?}"
        );
    }
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, opening)).collect();
    check_books(&fleet, &opening, &attempts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_holder_paused_past_its_leases_applies_nothing_when_it_wakes() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 2, &[("LEASE_TTL", "1s")]).await;
    let pair = ("paused-from", "paused-to");
    open_wallets(&fleet, &[pair.0, pair.1], 100).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("transfer_leases_held:stop"));
    fleet.replicas[0].start();

    // replica-1 stops itself holding both leases, before its transaction: no row is locked, so
    // only the fences can stop its write when it wakes.
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let mut paused =
        tokio::spawn(
            async move { crate::support::transfers::transfer(&client, &url, pair, 40, "paused").await },
        );
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped holding both leases", &mut paused).await;
    let paused_at = Instant::now();

    // Its leases lapse (1 s); the other replica takes them and pays from both wallets, so each row
    // now carries a fence above the paused holder's.
    let other = fleet.replicas[1].url("");
    for wallet in [pair.0, pair.1] {
        let key = format!("meanwhile-{wallet}");
        loop {
            let paid = crate::support::load::pay(&fleet.client, &other, wallet, 1, &key).await;
            if matches!(paid, crate::support::load::Outcome::Applied(_)) {
                break;
            }
            assert!(paused_at.elapsed() < Duration::from_secs(5), "{wallet} still held: {paid:?}");
        }
    }
    let freed = paused_at.elapsed();
    assert!(freed <= Duration::from_millis(2_500), "both wallets were held {freed:?} after the pause");

    // Woken, the stale holder is refused: 409 lease_lost, nothing moved.
    fleet.replicas[0].signal(nix::sys::signal::Signal::SIGCONT);
    let woke = paused.await.unwrap();
    assert_eq!(
        woke,
        Outcome::NotApplied("lease_lost".into()),
        "replica-1 logged:\n{}",
        fleet.replicas[0].log()
    );
    assert_eq!(transfer_count_in(&fleet.db).await, 0, "the stale holder wrote nothing");
    let balances = (books(&fleet.db, pair.0).await.balance, books(&fleet.db, pair.1).await.balance);
    assert_eq!(balances, (99, 99), "one payment from each, no transfer");

    // Its key was not used up: the retry moves the money, once.
    let retried = crate::support::transfers::transfer(&fleet.client, &other, pair, 40, "paused").await;
    assert!(matches!(retried, Outcome::Applied(_)), "{retried:?}");
    assert_eq!(transfer_count_in(&fleet.db).await, 1, "moved once");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
    eprintln!("a transfer holder paused past its leases: both wallets paid again {freed:?} after the pause");
}

/// The ids of the transfers committed so far.
async fn committed(db: &sqlx::PgPool) -> HashSet<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("select id from transfer").fetch_all(db).await.unwrap();
    ids.into_iter().collect()
}

/// The settings of the fault fleets: a one-second lease, and keys of dead replicas freed after two.
const FAULT_SETTINGS: [(&str, &str); 2] = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];

/// What a transfer under the load may end as once settled: applied, or refused with nothing
/// applied (a wallet held by a dead or frozen replica is a bounded wait, then `lock_timeout`).
fn assert_decided_on_merits(counts: &std::collections::BTreeMap<String, usize>) {
    for code in counts.keys() {
        assert!(
            ["applied", "insufficient_funds", "lock_timeout", "lease_lost"].contains(&code.as_str()),
            "a transfer neither applied nor refused with nothing applied: {counts:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_the_transfer_load_loses_nothing_and_applies_nothing_twice() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 3, &FAULT_SETTINGS).await;
    let wallets = ["ka", "kb", "kc", "kd", "ke"];
    let opening = 2_000;
    open_wallets(&fleet, &wallets, opening).await;
    let started = Instant::now();
    let load = TransferLoad::each(&fleet, &wallets, 16, 12);

    // Mid-load, replica-1 is SIGKILLed (by its pid) wherever it is: nginx answers its transfers in
    // flight 502 and sends the rest elsewhere. It comes back armed to stop itself right after its
    // next commit, and is SIGKILLed there: a transfer committed whose answer never left.
    let mid_load = || async { transfer_count_in(&fleet.db).await >= 16 };
    crate::support::eventually("the load committed 16 transfers", Duration::from_secs(20), mid_load).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("after_commit:stop"));
    fleet.replicas[0].start();
    // One transfer straight to it, in case nginx sends it none before the load ends.
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let doomed = tokio::spawn(async move { transfer_one(&client, &url, ("kc", "kd"), 7).await });
    let pid = fleet.replicas[0].pid();
    crate::support::eventually("replica-1 stopped after a commit", Duration::from_secs(10), || async {
        crate::support::fleet::is_stopped(pid)
    })
    .await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();
    let back = started.elapsed();

    let mut attempts = tokio::time::timeout(Duration::from_secs(40), load.done())
        .await
        .expect("16 clients sent 12 transfers each within 40 s, through the kills");
    attempts.push(doomed.await.unwrap());
    let took = started.elapsed();
    let undecided: HashSet<String> =
        attempts.iter().filter(|a| matches!(a.outcome, Outcome::Unknown(_))).map(|a| a.key.clone()).collect();
    assert!(!undecided.is_empty(), "the kills left transfers undecided: {:?}", tally(&attempts));
    let before_retries = committed(&fleet.db).await;

    // Each undecided transfer is settled by retrying it with its key: one committed before the
    // kill is replayed (the same transfer, not a second), one that was not is applied now or
    // refused, once.
    settle(&fleet, &mut attempts).await;
    let replayed = attempts
        .iter()
        .filter(|a| undecided.contains(&a.key))
        .filter(|a| matches!(a.outcome, Outcome::Applied(id) if before_retries.contains(&id)))
        .count();
    assert!(replayed >= 1, "the transfer committed at the kill was replayed by its key's retry");
    let counts = tally(&attempts);
    eprintln!(
        "16 clients, 12 transfers each, replica-1 killed twice and back {back:?} in, {took:?}: \
         {counts:?}; {} undecided, {replayed} of them committed before the kill",
        undecided.len()
    );
    assert_decided_on_merits(&counts);
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, opening)).collect();
    check_books(&fleet, &opening, &attempts).await;
    goes_through_at_once(&fleet, ("ka", "kb")).await;
}

async fn version(db: &sqlx::PgPool, wallet: &str) -> i64 {
    sqlx::query_scalar("select version from wallet where id = $1").bind(wallet).fetch_one(db).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_paused_past_its_leases_under_the_transfer_load_is_refused_when_it_wakes() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 3, &FAULT_SETTINGS).await;
    let wallets = ["pa", "pb", "pc", "pd", "pe"];
    let opening = 2_000;
    open_wallets(&fleet, &wallets, opening).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("transfer_leases_held:stop"));
    fleet.replicas[0].start();

    // replica-1 stops itself (a GC pause, a frozen VM) holding the leases of `pa` and `pb`, before
    // its transaction: no row is locked, so only the fences can refuse its write when it wakes.
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let mut stale = tokio::spawn(async move { transfer_one(&client, &url, ("pa", "pb"), 40).await });
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped holding both leases", &mut stale).await;
    let (paused_at, paused_clock) = (Instant::now(), chrono::Utc::now());
    let read = (version(&fleet.db, "pa").await, version(&fleet.db, "pb").await);

    // The load through nginx to all three replicas (what nginx sends to replica-1 waits for it).
    // Its leases lapse (1 s); the load's transfers between `pa` and `pb` on the other replicas
    // take them over and commit, so each row now carries a fence above the paused holder's.
    let load = TransferLoad::each(&fleet, &wallets, 16, 12);
    let written = || async { (version(&fleet.db, "pa").await, version(&fleet.db, "pb").await) };
    crate::support::eventually("pa and pb written by the others", Duration::from_secs(30), || async {
        let now = written().await;
        now.0 > read.0 && now.1 > read.1
    })
    .await;
    // Both were free by the time another replica decided a transfer of each (its first entry after
    // the pause: the time taken under the leases it got), not only when the test saw the rows: on
    // a busy machine the test's own polling is not the path bounded.
    let mut freed = Duration::ZERO;
    for (wallet, seen) in [("pa", read.0), ("pb", read.1)] {
        let decided: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
            "select created_at from ledger_entry where wallet_id = $1 and seq > $2 order by seq limit 1",
        )
        .bind(wallet)
        .bind(seen)
        .fetch_one(&fleet.db)
        .await
        .unwrap();
        freed = freed.max((decided - paused_clock).to_std().unwrap_or_default());
    }
    assert!(freed <= Duration::from_secs(3), "both wallets were held {freed:?} after the pause");

    // Woken, the stale holder is refused: 409 lease_lost, nothing moved.
    fleet.replicas[0].signal(nix::sys::signal::Signal::SIGCONT);
    let stale = stale.await.unwrap();
    assert_eq!(
        stale.outcome,
        Outcome::NotApplied("lease_lost".into()),
        "replica-1 logged:\n{}",
        fleet.replicas[0].log()
    );
    let mut attempts = tokio::time::timeout(Duration::from_secs(40), load.done())
        .await
        .expect("16 clients sent 12 transfers each within 40 s, through the pause");
    let took = paused_at.elapsed();
    attempts.push(stale);
    settle(&fleet, &mut attempts).await;
    let counts = tally(&attempts);
    eprintln!(
        "16 clients, 12 transfers each, replica-1 paused: pa and pb written again {freed:?} after the \
         pause, {took:?}: {counts:?}"
    );
    assert_decided_on_merits(&counts);
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, opening)).collect();
    check_books(&fleet, &opening, &attempts).await;
    goes_through_at_once(&fleet, ("pa", "pb")).await;
}

/// A sample of a replica's /metrics with no labels: its value.
async fn scraped(fleet: &Fleet, replica: usize, name: &str) -> f64 {
    let url = fleet.replicas[replica].url("/metrics");
    let scrape = fleet.client.get(url).send().await.unwrap().text().await.unwrap();
    let value = scrape.lines().find_map(|line| line.strip_prefix(&format!("{name} ")));
    value.and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_from_many_payers_into_one_payee_commit_together_and_a_busy_payer_goes_alone() {
    let env = TestEnv::new();
    // A lease wait long enough that the held payer's transfer outlasts a slow machine's batches.
    let fleet = Fleet::start(&env, 1, &[("LEASE_WAIT", "10s")]).await;
    let payers: Vec<String> = (0..48).map(|n| format!("payer-{n}")).collect();
    let mut wallets: Vec<&str> = payers.iter().map(String::as_str).collect();
    wallets.push("merchant");
    open_wallets(&fleet, &wallets, 1_000).await;

    // 48 payers into one merchant at once, on one replica; the first 8 payers paying elsewhere at
    // the same time, so their leases are now and then held by their own wallets' workers; and the
    // last payer's lease held by another holder until its transfer has been sent on alone.
    let held =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:payer-47").await.unwrap();
    let url = fleet.replicas[0].url("");
    let start = Arc::new(Barrier::new(48 + 8 * 5));
    let mut transfers = Vec::new();
    for (n, payer) in payers.iter().enumerate() {
        let (client, url, start, payer) = (fleet.client.clone(), url.clone(), start.clone(), payer.clone());
        transfers.push(tokio::spawn(async move {
            start.wait().await;
            transfer_one(&client, &url, (&payer, "merchant"), n as i64 + 1).await
        }));
    }
    let mut payments = Vec::new();
    for n in 0..8 * 5 {
        let (client, url, start) = (fleet.client.clone(), url.clone(), start.clone());
        payments.push(tokio::spawn(async move {
            start.wait().await;
            let payer = format!("payer-{}", n % 8);
            crate::support::load::pay(&client, &url, &payer, 1, &format!("busy-{n}")).await
        }));
    }
    // The merchant's worker cannot have payer-47's lease: that transfer goes alone, and waits for
    // its payer (up to the lease wait) while the others commit.
    crate::support::eventually("payer-47's transfer sent on alone", Duration::from_secs(8), || async {
        scraped(&fleet, 0, "walletlock_payee_batch_alone_total").await >= 1.0
    })
    .await;
    assert!(!transfers[47].is_finished(), "payer-47's transfer waits for its payer");
    held.release().await.unwrap();
    for transfer in transfers {
        let transfer = transfer.await.unwrap();
        assert!(matches!(transfer.outcome, Outcome::Applied(_)), "{transfer:?}");
    }
    for payment in payments {
        let payment = payment.await.unwrap();
        assert!(matches!(payment, crate::support::load::Outcome::Applied(_)), "{payment:?}");
    }

    let merchant = books(&fleet.db, "merchant").await;
    assert_eq!(merchant.balance, 1_000 + (1..=48).sum::<i64>(), "every transfer in, once");
    for (n, payer) in payers.iter().enumerate() {
        let paid = if n < 8 { 5 } else { 0 };
        assert_eq!(books(&fleet.db, payer).await.balance, 1_000 - (n as i64 + 1) - paid, "{payer}");
    }
    assert_eq!(transfer_count_in(&fleet.db).await, 48);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");

    // The merchant's worker took all 48, in fewer transactions than transfers.
    let taken = scraped(&fleet, 0, "walletlock_payee_batch_transfers_sum").await;
    let batches = scraped(&fleet, 0, "walletlock_payee_batch_transfers_count").await;
    assert_eq!(taken, 48.0);
    assert!(batches < taken, "48 transfers into one payee in {batches} batches");
    let alone = scraped(&fleet, 0, "walletlock_payee_batch_alone_total").await;
    assert!(alone >= 1.0, "the transfer whose payer was held went alone");
    eprintln!(
        "48 transfers into one payee, 40 payments from 8 of its payers: {batches} batches, {alone} alone"
    );
}

/// Four wallets for two transfers that share none: under Citus the third on a shard of the first
/// (what a transfer writes there must not hold up the other), on one Postgres any four.
async fn two_disjoint_pairs(db: &sqlx::PgPool) -> [String; 4] {
    let mut conn = db.acquire().await.unwrap();
    let names = |n: i32| format!("dp{n}");
    if Storage::of(&mut conn).await.unwrap() == Storage::OnePostgres {
        return [names(0), names(1), names(2), names(3)];
    }
    let on_the_shard_of_dp0: i32 = sqlx::query_scalar(
        "select n from generate_series(2, 10000) n
         where get_shard_id_for_distribution_column('wallet', 'dp' || n)
             = get_shard_id_for_distribution_column('wallet', 'dp0')
         limit 1",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("a wallet name among 10,000 on the shard of dp0");
    let last = if on_the_shard_of_dp0 == 3 { 4 } else { 3 };
    [names(0), names(1), names(on_the_shard_of_dp0), names(last)]
}

/// Writes `pair` in `tx` as a transfer does (its rows locked in id order first, then the rounds'
/// one write, of both rows), balances unchanged, and leaves `tx` open; how many rows it wrote.
async fn write_pair(tx: &mut sqlx::PgConnection, pair: [&str; 2]) -> Result<usize, StoreError> {
    use walletlock::ledger::group::{self, GroupWrite, WalletWrite};
    let locked = ledger::lock_wallets(&mut *tx, &pair, Duration::from_secs(1)).await?;
    let wallets: Vec<WalletWrite> = pair
        .iter()
        .map(|id| {
            let row = &locked[*id];
            WalletWrite {
                id,
                group: 0,
                fence: row.fence,
                read_fence: row.fence,
                read_version: row.version,
                read_balance: row.balance,
                read_held: row.held,
                owner: row.owner.as_deref(),
                balance: row.balance,
                held: row.held,
                version: row.version + 1,
            }
        })
        .collect();
    let storage = Storage::of(&mut *tx).await?;
    let write = GroupWrite { ..GroupWrite::of(wallets) };
    let committed =
        group::commit(&mut *tx, storage, None, None, &write, chrono::Utc::now(), Duration::from_secs(60))
            .await?;
    Ok(committed.moved.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_in_flight_holds_up_no_transfer_between_two_other_wallets() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let [a, b, c, d] = two_disjoint_pairs(&app.db).await;
    for wallet in [&a, &b, &c, &d] {
        app.open_wallet(wallet, 100).await;
    }

    let mut first = app.db.begin().await.unwrap();
    assert_eq!(write_pair(&mut first, [&a, &b]).await.unwrap(), 2);
    // The first is still open, its rows locked: the second writes its own, whatever shards (under
    // Citus) the two share. Had it to wait for the first, it would give up after its lock_timeout
    // (55P03), the first being held open until after.
    let mut second = app.db.begin().await.unwrap();
    assert_eq!(write_pair(&mut second, [&c, &d]).await.unwrap(), 2, "the second transfer's write");
    // Rolled back: the writes move no money and write no entry, which the books would not allow.
    second.rollback().await.unwrap();
    first.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_never_waits_for_a_second_connection_while_it_holds_its_transaction() {
    // One pooled connection: a transfer that held its transaction and asked the pool for another
    // (to learn where the tables live, say) would wait for itself until the acquire timeout, and
    // under load every transfer would wait for the others' (a bench run lost 343 transfers so).
    let env = TestEnv::new();
    let settings = [("PG_POOL_SIZE", "1"), ("PG_ACQUIRE_TIMEOUT", "2s")];
    let mut fleet = Fleet::start(&env, 1, &settings).await;
    let wallets = ["one-a", "one-b", "one-c", "one-d"];
    open_wallets(&fleet, &wallets, 1_000).await;
    // A fresh process, which has learnt nothing of the database yet, takes the transfers at once.
    fleet.replicas[0].start();
    let url = fleet.replicas[0].url("");
    let pairs = [("one-a", "one-b"), ("one-c", "one-d"), ("one-b", "one-c"), ("one-d", "one-a")];
    let sent: Vec<_> = pairs
        .iter()
        .map(|&pair| {
            let (client, url) = (fleet.client.clone(), url.clone());
            let pair = (pair.0.to_owned(), pair.1.to_owned());
            tokio::spawn(async move { transfer_one(&client, &url, (&pair.0, &pair.1), 10).await })
        })
        .collect();
    let mut attempts = Vec::new();
    for transfer in sent {
        attempts.push(transfer.await.unwrap());
    }
    for attempt in &attempts {
        assert!(matches!(attempt.outcome, Outcome::Applied(_)), "{attempt:?}");
    }
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, 1_000)).collect();
    check_books(&fleet, &opening, &attempts).await;
}
