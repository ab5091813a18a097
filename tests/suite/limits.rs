//! Limits (docs/api/limits.md): an overdraft that moves a wallet's floor, and a cap on each debit,
//! set under the wallet's lease and enforced by the one decision for every debit, through nginx to
//! a fleet, on leases and under Postgres alone, with the floor enforced by the database too.

use crate::events::read_all;
use crate::outage::fleet_by_path;
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

async fn send(
    fleet: &Fleet,
    client: &reqwest::Client,
    method: &str,
    path: &str,
    body: Value,
) -> (u16, Value) {
    let mut request = client
        .request(method.parse().unwrap(), fleet.url(path))
        .header("idempotency-key", uuid::Uuid::new_v4().to_string());
    if !body.is_null() {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn wallet(fleet: &Fleet, id: &str) -> Value {
    fleet.client.get(fleet.url(&format!("/wallets/{id}"))).send().await.unwrap().json().await.unwrap()
}

/// A failure a concurrent client may meet with nothing applied: the wallet busy for the whole
/// wait, or (under a fault) its lease lost or Redis gone for a moment.
fn transient(status: u16, body: &Value) -> bool {
    matches!(
        (status, body["code"].as_str()),
        (409, Some("lease_lost")) | (503, Some("lock_timeout" | "dependency_unavailable"))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_overdraft_lets_the_balance_go_to_minus_it_and_no_further_under_concurrent_payments_and_transfers()
{
    let env = TestEnv::new();
    let fleet = Arc::new(Fleet::start(&env, 3, &[]).await);
    open_wallets(&*fleet, &["credit", "sink"], 100).await;
    let (status, limits) =
        send(&fleet, &fleet.client, "PUT", "/wallets/credit/limits", json!({ "overdraft": 500 })).await;
    assert_eq!((status, &limits), (200, &json!({ "overdraft": 500, "per_payment": null })));
    let read = wallet(&fleet, "credit").await;
    assert_eq!((read["available"].as_i64(), &read["limits"]["overdraft"]), (Some(600), &json!(500)));

    // 16 clients spend from it at once, by payments of 7 and transfers of 5, until each is refused.
    let spent = Arc::new(AtomicI64::new(0));
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (fleet, spent) = (fleet.clone(), spent.clone());
            tokio::spawn(async move {
                let (path, body, amount) = if n % 2 == 0 {
                    ("/wallets/credit/pay", json!({ "amount": 7 }), 7)
                } else {
                    ("/transfers", json!({ "from": "credit", "to": "sink", "amount": 5 }), 5)
                };
                loop {
                    let (status, answer) = send(&fleet, &fleet.client, "POST", path, body.clone()).await;
                    match (status, answer["code"].as_str()) {
                        (200 | 201, _) => _ = spent.fetch_add(amount, Ordering::Relaxed),
                        (422, Some("insufficient_funds")) => return,
                        _ => assert!(transient(status, &answer), "{path}: {status} {answer}"),
                    }
                }
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    let read = wallet(&fleet, "credit").await;
    let balance = read["balance"].as_i64().unwrap();
    assert_eq!(balance, 100 - spent.load(Ordering::Relaxed), "every accepted debit, and nothing else");
    assert!(balance >= -500, "never below minus the overdraft: {balance}");
    assert!(balance + 500 < 5, "and down to it: {balance} leaves room for a transfer of 5");
    assert_eq!(read["available"].as_i64(), Some(balance + 500));
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");

    // A deposit pays the debt back; shrinking the overdraft below what it owes is refused whole.
    let owed = -balance;
    let (status, refused) =
        send(&fleet, &fleet.client, "PUT", "/wallets/credit/limits", json!({ "overdraft": owed - 1 })).await;
    assert_eq!((status, refused["code"].as_str()), (422, Some("limit_below_used")), "{refused}");
    assert_eq!(wallet(&fleet, "credit").await["limits"]["overdraft"], 500, "nothing changed");
    assert_eq!(
        send(&fleet, &fleet.client, "POST", "/wallets/credit/deposit", json!({ "amount": owed })).await.0,
        200
    );
    let (status, _) = send(&fleet, &fleet.client, "PUT", "/wallets/credit/limits", json!({})).await;
    assert_eq!(status, 200, "no overdraft once nothing is owed");
    assert_eq!(wallet(&fleet, "credit").await["limits"], json!({ "overdraft": 0, "per_payment": null }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_per_payment_refuses_every_debit_over_it_on_every_route_and_nothing_else() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["capped", "other"], 1_000).await;
    let cap = json!({ "per_payment": 50 });
    assert_eq!(send(&fleet, &fleet.client, "PUT", "/wallets/capped/limits", cap).await.0, 200);
    let (status, limits) = send(&fleet, &fleet.client, "GET", "/wallets/capped/limits", Value::Null).await;
    assert_eq!((status, limits), (200, json!({ "overdraft": 0, "per_payment": 50 })));

    let events_before = read_all(&fleet, "&wallet_id=capped").await.len();
    let refused: [(&str, Value, Option<u64>); 4] = [
        ("/wallets/capped/pay", json!({ "amount": 51 }), None),
        ("/wallets/capped/holds", json!({ "amount": 51 }), None),
        ("/transfers", json!({ "from": "capped", "to": "other", "amount": 51 }), None),
        (
            "/movements",
            json!({ "legs": [{ "wallet_id": "other", "amount": 51 },
                                        { "wallet_id": "capped", "amount": -51 }] }),
            Some(1),
        ),
    ];
    for (path, body, leg) in refused {
        let (status, problem) = send(&fleet, &fleet.client, "POST", path, body).await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["limit"].as_str(), problem["left"].as_i64()),
            (422, Some("limit_exceeded"), Some("per_payment"), Some(50)),
            "{path}: {problem}"
        );
        assert_eq!(problem["leg"].as_u64(), leg, "{path}: {problem}");
    }
    assert_eq!(wallet(&fleet, "capped").await["balance"], 1_000, "nothing applied");
    assert_eq!(read_all(&fleet, "&wallet_id=capped").await.len(), events_before, "no event of a refusal");
    // Up to the cap it pays; credits are not debits; a hold's capture is not a second debit.
    for (path, body) in [
        ("/wallets/capped/pay", json!({ "amount": 50 })),
        ("/wallets/capped/deposit", json!({ "amount": 5_000 })),
        ("/transfers", json!({ "from": "other", "to": "capped", "amount": 500 })),
    ] {
        let (status, answer) = send(&fleet, &fleet.client, "POST", path, body).await;
        assert!(status == 200 || status == 201, "{path}: {answer}");
    }
    let (status, hold) =
        send(&fleet, &fleet.client, "POST", "/wallets/capped/holds", json!({ "amount": 50 })).await;
    assert_eq!(status, 201, "{hold}");
    let capture = format!("/holds/{}/capture", hold["id"].as_str().unwrap());
    assert_eq!(send(&fleet, &fleet.client, "POST", &capture, json!({})).await.0, 200);
    assert_eq!(wallet(&fleet, "capped").await["balance"], 1_000 - 50 + 5_000 + 500 - 50);

    // Every bad ask is a 4xx with nothing changed.
    let other_caller = api_client_with(OTHER_TOKEN);
    for (client, body, status, code) in [
        (&fleet.client, json!({ "overdraft": -1 }), 400, "invalid_limits"),
        (&fleet.client, json!({ "per_payment": 0 }), 400, "invalid_limits"),
        (&fleet.client, json!({ "overdraft": 1_000_000_000_001_i64 }), 400, "invalid_limits"),
        (&fleet.client, json!({ "overdraft": "5" }), 400, "invalid_body"),
        (&fleet.client, json!({ "per_payment": 5, "monthly": 9 }), 400, "invalid_body"),
        (&other_caller, json!({ "per_payment": 5 }), 404, "wallet_not_found"),
    ] {
        let (answered, problem) = send(&fleet, client, "PUT", "/wallets/capped/limits", body.clone()).await;
        assert_eq!((answered, problem["code"].as_str()), (status, Some(code)), "{body}: {problem}");
    }
    let (status, _) = send(&fleet, &fleet.client, "PUT", "/wallets/nobody/limits", json!({})).await;
    assert_eq!(status, 404);
    assert_eq!(wallet(&fleet, "capped").await["limits"], json!({ "overdraft": 0, "per_payment": 50 }));
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_set_on_leases_hold_under_postgres_alone_and_the_database_keeps_the_floor() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["line"], 10).await;
    let limits = json!({ "overdraft": 100, "per_payment": 60 });
    assert_eq!(send(&fleet, &fleet.client, "PUT", "/wallets/line/limits", limits).await.0, 200);
    // On leases, from the lease's note: the limits are in it.
    assert_eq!(
        send(&fleet, &fleet.client, "POST", "/wallets/line/pay", json!({ "amount": 60 })).await.0,
        200
    ); // -50
    env.own_redis().kill();
    let (status, problem) =
        send(&fleet, &fleet.client, "POST", "/wallets/line/pay", json!({ "amount": 61 })).await;
    assert_eq!((status, problem["code"].as_str()), (422, Some("limit_exceeded")), "{problem}");
    assert_eq!(
        send(&fleet, &fleet.client, "POST", "/wallets/line/pay", json!({ "amount": 50 })).await.0,
        200
    ); // -100
    let (status, problem) =
        send(&fleet, &fleet.client, "POST", "/wallets/line/pay", json!({ "amount": 1 })).await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["available"].as_i64()),
        (422, Some("insufficient_funds"), Some(0))
    );
    let (on_leases, alone) = fleet_by_path(&fleet).await;
    assert!(
        on_leases > 0.0 && alone > 0.0,
        "moved on leases ({on_leases}) and under Postgres alone ({alone})"
    );
    env.own_redis().start_again();

    // The floor is the database's too: a write past it, however it comes, is refused.
    let pool = sqlx::PgPool::connect(&fleet.database_url).await.unwrap();
    let err =
        sqlx::query("update wallet set balance = -101 where id = 'line'").execute(&pool).await.unwrap_err();
    let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("23514"), "a check violation: {err}");
    assert_eq!(wallet(&fleet, "line").await["balance"], -100);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}
