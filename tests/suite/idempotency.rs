//! A retried payment is charged once: the Idempotency-Key, across replicas, crashes and time.

use crate::support::app::{spawn_app, spawn_app_with};
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::{TestEnv, books, eventually};
use reqwest::{Client, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// Sends one keyed payment; an error when no response came back.
async fn send_pay(client: &Client, url: &str, key: &str, amount: i64) -> reqwest::Result<Response> {
    client.post(url).header("idempotency-key", key).json(&json!({ "amount": amount })).send().await
}

async fn pay(client: &Client, url: &str, key: &str, amount: i64) -> Response {
    send_pay(client, url, key, amount).await.unwrap()
}

/// Sends until the key's first request has finished: a 409 in flight means "ask again shortly".
async fn pay_until_settled(client: &Client, url: &str, key: &str, amount: i64) -> (u16, bool, Vec<u8>) {
    for _ in 0..100 {
        let response = pay(client, url, key, amount).await;
        let status = response.status().as_u16();
        if status != 409 {
            let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            return (status, replayed, response.bytes().await.unwrap().to_vec());
        }
        assert!(response.headers().contains_key("retry-after"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the key stayed in flight");
}

fn payment_id(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body).unwrap()["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_tap_on_two_replicas_charges_once_and_both_see_one_payment() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["tap"], 100).await;

    let both = Arc::new(Barrier::new(2));
    let taps: Vec<_> = fleet
        .replicas
        .iter()
        .map(|replica| {
            let (client, url, both) = (fleet.client.clone(), replica.url("/wallets/tap/pay"), both.clone());
            tokio::spawn(async move {
                both.wait().await;
                pay_until_settled(&client, &url, "tap-1", 10).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for tap in taps {
        outcomes.push(tap.await.unwrap());
    }

    assert!(outcomes.iter().all(|(status, _, _)| *status == 200), "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|(_, replayed, _)| *replayed).count(), 1, "one ran, one was replayed");
    assert_eq!(outcomes[0].2, outcomes[1].2, "byte for byte the same response");
    assert_eq!(payment_id(&outcomes[0].2), payment_id(&outcomes[1].2));
    let books = books(&fleet.db, "tap").await;
    assert_eq!((books.balance, books.pays), (90, 1));
    assert!(audit(&fleet.database_url).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_requests_with_one_key_charge_once() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["twenty"], 1_000).await;

    let start = Arc::new(Barrier::new(20));
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let (client, url, start) =
                (fleet.client.clone(), fleet.url("/wallets/twenty/pay"), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let response = pay(&client, &url, "one-key", 25).await;
                let replayed = response.headers().get("idempotent-replayed").is_some();
                (response.status().as_u16(), replayed, response.bytes().await.unwrap().to_vec())
            })
        })
        .collect();
    let mut first = None;
    for request in requests {
        let (status, replayed, body) = request.await.unwrap();
        match status {
            200 => {
                let id = payment_id(&body);
                assert_eq!(first.get_or_insert(id.clone()), &id, "every 200 reports the one payment");
                let _ = replayed;
            }
            409 => assert_eq!(
                serde_json::from_slice::<Value>(&body).unwrap()["code"],
                "idempotency_key_in_flight"
            ),
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&body)),
        }
    }
    assert!(first.is_some(), "someone got the payment");
    let books = books(&fleet.db, "twenty").await;
    assert_eq!((books.balance, books.pays), (975, 1));
    assert!(audit(&fleet.database_url).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_client_gave_up_gets_the_late_payment_replayed() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["late"], 100).await;
    // The wallet is busy, so the first request outlives its client's patience.
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:late").await.unwrap();
    let impatient = fleet
        .client
        .post(fleet.url("/wallets/late/pay"))
        .header("idempotency-key", "late-1")
        .json(&json!({ "amount": 40 }))
        .timeout(Duration::from_millis(200));
    assert!(impatient.send().await.is_err(), "the client timed out");
    holder.release().await.unwrap();
    eventually("the abandoned request committed", Duration::from_secs(5), || async {
        books(&fleet.db, "late").await.pays == 1
    })
    .await;

    let (status, replayed, body) =
        pay_until_settled(&fleet.client, &fleet.url("/wallets/late/pay"), "late-1", 40).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["balance"], 60);
    assert_eq!(books(&fleet.db, "late").await.pays, 1, "charged once");
    assert!(audit(&fleet.database_url).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_between_commit_and_response_has_its_payment_replayed() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 1, &[("WALLETLOCK_FAILPOINT", "after_commit")]).await;
    open_wallets(&fleet, &["crash-late"], 100).await;

    let url = fleet.replicas[0].url("/wallets/crash-late/pay");
    assert!(send_pay(&fleet.client, &url, "k", 10).await.is_err(), "no response: the replica died");
    let replica = &mut fleet.replicas[0];
    crate::support::servers::wait_until("the replica died", Duration::from_secs(30), || replica.exited());
    assert_eq!(books(&fleet.db, "crash-late").await.pays, 1, "the payment committed before the crash");

    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();
    let (status, replayed, body) = pay_until_settled(&fleet.client, &url, "k", 10).await;
    assert_eq!((status, replayed), (200, true), "{}", String::from_utf8_lossy(&body));
    assert_eq!(books(&fleet.db, "crash-late").await.pays, 1, "and the retry charged nothing");
    assert!(audit(&fleet.database_url).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_before_commit_lets_the_retry_run_once() {
    let env = TestEnv::new();
    let settings = [("WALLETLOCK_FAILPOINT", "before_commit"), ("IDEMPOTENCY_STALE_AFTER", "1s")];
    let mut fleet = Fleet::start(&env, 1, &settings).await;
    open_wallets(&fleet, &["crash-early"], 100).await;

    let url = fleet.replicas[0].url("/wallets/crash-early/pay");
    assert!(send_pay(&fleet.client, &url, "k", 10).await.is_err(), "no response: the replica died");
    assert_eq!(books(&fleet.db, "crash-early").await.pays, 0, "nothing committed");

    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();
    // The dead replica's claim holds the key until it is stale; then the retry runs, once.
    let (status, replayed, _) = pay_until_settled(&fleet.client, &url, "k", 10).await;
    assert_eq!((status, replayed), (200, false));
    let (status, replayed, _) = pay_until_settled(&fleet.client, &url, "k", 10).await;
    assert_eq!((status, replayed), (200, true));
    let books = books(&fleet.db, "crash-early").await;
    assert_eq!((books.balance, books.pays), (90, 1));
    assert!(audit(&fleet.database_url).0);
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_a_422_and_bad_keys_are_400() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("reuse", 100).await;
    assert_eq!(pay(&app.client, &app.url("/wallets/reuse/pay"), "k1", 10).await.status(), 200);

    let reused = pay(&app.client, &app.url("/wallets/reuse/pay"), "k1", 11).await;
    assert_eq!(reused.status(), 422);
    assert_eq!(reused.json::<Value>().await.unwrap()["code"], "idempotency_key_reused");
    let other_route = app
        .client
        .post(app.url("/wallets/reuse/deposit"))
        .header("idempotency-key", "k1")
        .json(&json!({ "amount": 10 }));
    assert_eq!(other_route.send().await.unwrap().status(), 422, "another path is another request");
    app.open_wallet("elsewhere", 100).await;
    let other_wallet = pay(&app.client, &app.url("/wallets/elsewhere/pay"), "k1", 10).await;
    assert_eq!(other_wallet.status(), 200, "keys are scoped per wallet");

    for bad in ["k".repeat(256), "tab\there".to_owned(), String::new()] {
        let response = app
            .client
            .post(app.url("/wallets/reuse/pay"))
            .header("idempotency-key", bad.as_str())
            .json(&json!({ "amount": 1 }));
        let response = response.send().await.unwrap();
        assert_eq!(response.status(), 400, "{bad:?}");
        assert_eq!(response.json::<Value>().await.unwrap()["code"], "invalid_idempotency_key");
    }
    let twice = app
        .client
        .post(app.url("/wallets/reuse/pay"))
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .json(&json!({ "amount": 1 }));
    assert_eq!(twice.send().await.unwrap().status(), 400);
    let books = books(&app.db, "reuse").await;
    assert_eq!((books.balance, books.pays), (90, 1), "one payment, nothing else");
}

#[tokio::test]
async fn a_refusal_is_replayed_but_a_transient_failure_is_not() {
    let env = TestEnv::new();
    let app = spawn_app_with(&env, &["--lease-wait", "200ms"]).await;
    app.open_wallet("refuse", 5).await;

    // Insufficient funds is deterministic: stored, and replayed even after a deposit.
    let first = pay(&app.client, &app.url("/wallets/refuse/pay"), "big", 10).await;
    assert_eq!(first.status(), 422);
    let first_body = first.bytes().await.unwrap();
    app.post_json("/wallets/refuse/deposit", json!({ "amount": 100 })).await;
    let again = pay(&app.client, &app.url("/wallets/refuse/pay"), "big", 10).await;
    assert_eq!(
        (again.status().as_u16(), again.headers()["idempotent-replayed"].to_str().unwrap()),
        (422, "true")
    );
    assert_eq!(again.bytes().await.unwrap(), first_body);

    // A lock timeout is transient: not stored, so the retry runs.
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:refuse").await.unwrap();
    assert_eq!(pay(&app.client, &app.url("/wallets/refuse/pay"), "busy", 10).await.status(), 503);
    holder.release().await.unwrap();
    let retried = pay(&app.client, &app.url("/wallets/refuse/pay"), "busy", 10).await;
    assert_eq!(retried.status(), 200);
    assert!(retried.headers().get("idempotent-replayed").is_none());
    let books = books(&app.db, "refuse").await;
    assert_eq!((books.balance, books.pays), (95, 1));
}

#[tokio::test]
async fn wallet_creation_with_a_key_is_replayed() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let create = || {
        app.client
            .post(app.url("/wallets"))
            .header("idempotency-key", "new-1")
            .json(&json!({ "balance": 50 }))
    };
    let first = create().send().await.unwrap();
    assert_eq!(first.status(), 201);
    let first_body = first.bytes().await.unwrap();
    let second = create().send().await.unwrap();
    assert_eq!(
        (second.status().as_u16(), second.headers()["idempotent-replayed"].to_str().unwrap()),
        (201, "true")
    );
    assert_eq!(second.bytes().await.unwrap(), first_body, "the same generated id, not a second wallet");
    let wallets: i64 = sqlx::query_scalar("select count(*) from wallet").fetch_one(&app.db).await.unwrap();
    assert_eq!(wallets, 1);
}

#[tokio::test]
async fn an_expired_key_is_purged_and_behaves_as_new() {
    let env = TestEnv::new();
    let app = spawn_app_with(&env, &["--idempotency-retention", "1s"]).await;
    app.open_wallet("expire", 100).await;
    assert_eq!(pay(&app.client, &app.url("/wallets/expire/pay"), "old", 10).await.status(), 200);
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let keys = walletlock::idempotency::Keys::new(app.db.clone(), Default::default());
    let purged = keys.purge_expired().await.unwrap();
    assert_eq!(purged, 1);
    let again = pay(&app.client, &app.url("/wallets/expire/pay"), "old", 10).await;
    assert_eq!(again.status(), 200);
    assert!(again.headers().get("idempotent-replayed").is_none(), "a new payment, not a replay");
    assert_eq!(books(&app.db, "expire").await.pays, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_passes_after_a_burst_and_fails_on_books_broken_on_purpose() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["audited"], 100).await;
    let burst: Vec<_> = (0..30)
        .map(|n| {
            let request = fleet
                .client
                .post(fleet.url("/wallets/audited/pay"))
                .header("idempotency-key", format!("k{}", n % 10));
            tokio::spawn(request.json(&json!({ "amount": 7 })).send())
        })
        .collect();
    for request in burst {
        request.await.unwrap().unwrap();
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
    assert!(report.starts_with("audit OK"), "{report}");
    assert!(books(&fleet.db, "audited").await.pays <= 10, "ten keys, at most ten charges");

    sqlx::query("update wallet set balance = balance + 1 where id = 'audited'")
        .execute(&fleet.db)
        .await
        .unwrap();
    let (ok, report) = audit(&fleet.database_url);
    assert!(!ok);
    assert!(report.contains("wallet audited: balance"), "{report}");
}
