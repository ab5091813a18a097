//! Limits (docs/api/limits.md): an overdraft that moves a wallet's floor, and a cap on each debit,
//! set under the wallet's lease and enforced by the one decision for every debit, through nginx to
//! a fleet, on leases and under Postgres alone, with the floor enforced by the database too.

use crate::events::read_all;
use crate::holds::until_definite;
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

/// A wallet's limits as read, with an overdraft and a cap per payment only.
fn spend_limits(overdraft: i64, per_payment: Option<i64>) -> Value {
    json!({ "overdraft": overdraft, "per_payment": per_payment, "velocity": [], "timezone": "UTC" })
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
    assert_eq!((status, &limits), (200, &spend_limits(500, None)));
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
    assert_eq!(wallet(&fleet, "credit").await["limits"], spend_limits(0, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_per_payment_refuses_every_debit_over_it_on_every_route_and_nothing_else() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["capped", "other"], 1_000).await;
    let cap = json!({ "per_payment": 50 });
    assert_eq!(send(&fleet, &fleet.client, "PUT", "/wallets/capped/limits", cap).await.0, 200);
    let (status, limits) = send(&fleet, &fleet.client, "GET", "/wallets/capped/limits", Value::Null).await;
    assert_eq!((status, limits), (200, spend_limits(0, Some(50))));

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
    assert_eq!(wallet(&fleet, "capped").await["limits"], spend_limits(0, Some(50)));
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

/// Payments of `amount` from `wallet` by client `client`, each with a key of its own and sent again
/// with it until its answer is definite, until one is refused `limit_exceeded`: the entries of
/// those accepted, and that refusal. `accepted` counts them across clients as they go.
async fn pay_until_refused(
    fleet: &Fleet,
    wallet: &str,
    amount: i64,
    client: usize,
    accepted: &AtomicI64,
) -> (Vec<Value>, Value) {
    let url = fleet.url(&format!("/wallets/{wallet}/pay"));
    let mut entries = Vec::new();
    for n in 0.. {
        let key = format!("{wallet}-{client}-{n}");
        let (status, answer) = until_definite(&fleet.client, &url, &json!({ "amount": amount }), &key).await;
        match (status, answer["code"].as_str()) {
            (200, _) => {
                entries.push(answer);
                accepted.fetch_add(1, Ordering::Relaxed);
            }
            (422, Some("limit_exceeded")) => return (entries, answer),
            _ => panic!("{wallet}: {status} {answer}"),
        }
    }
    unreachable!()
}

/// Waits until `accepted` counts at least `n` payments.
async fn until_accepted(accepted: &AtomicI64, n: i64) {
    let what = format!("{n} payments accepted");
    crate::support::eventually(&what, std::time::Duration::from_secs(60), || {
        let accepted = accepted.load(Ordering::Relaxed);
        async move { accepted >= n }
    })
    .await;
}

/// The entries among `entries` stamped in the window that ends at `resets_at` and lasts `length`.
fn in_window<'a>(entries: &'a [Value], resets_at: &str, length: chrono::Duration) -> Vec<&'a Value> {
    let end = chrono::DateTime::parse_from_rfc3339(resets_at).unwrap();
    entries
        .iter()
        .filter(|entry| {
            let at = chrono::DateTime::parse_from_rfc3339(entry["created_at"].as_str().unwrap()).unwrap();
            end - length <= at && at < end
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_clients_take_exactly_a_daily_amount_and_count_through_a_replica_sigkill_and_a_redis_outage()
{
    let mut env = TestEnv::with_own_redis();
    let fleet = Arc::new(Fleet::start(&env, 3, &[]).await);
    open_wallets(&*fleet, &["by-amount", "by-count"], 1_000_000).await;
    let daily = [
        ("by-amount", json!([{ "per": "day", "amount": 1_000 }, { "per": "month", "amount": 50_000 }])),
        ("by-count", json!([{ "per": "day", "count": 50 }, { "per": "1h", "amount": 1_000_000 }])),
    ];
    for (wallet, velocity) in &daily {
        let path = format!("/wallets/{wallet}/limits");
        let (status, set) = send(&fleet, &fleet.client, "PUT", &path, json!({ "velocity": velocity })).await;
        assert_eq!(status, 200, "{set}");
        assert_eq!(set["velocity"][0]["used"], json!({ "amount": 0, "count": 0 }), "{set}");
    }

    // Eight clients pay 7 from one wallet, eight pay 1 from the other, each until it is refused;
    // a replica is killed once 30 are accepted, Redis once 60 are.
    let accepted = Arc::new(AtomicI64::new(0));
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (fleet, accepted) = (fleet.clone(), accepted.clone());
            let (wallet, amount) = if n % 2 == 0 { ("by-amount", 7) } else { ("by-count", 1) };
            tokio::spawn(
                async move { (wallet, pay_until_refused(&fleet, wallet, amount, n, &accepted).await) },
            )
        })
        .collect();
    until_accepted(&accepted, 30).await;
    // (The fleet is shared with the clients: a replica is stopped through its pid.)
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(fleet.replicas[0].pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    until_accepted(&accepted, 60).await;
    env.own_redis().kill();
    let mut entries: std::collections::HashMap<&str, Vec<Value>> = Default::default();
    let mut refusals: std::collections::HashMap<&str, Vec<Value>> = Default::default();
    for client in clients {
        let (wallet, (accepted, refusal)) = client.await.unwrap();
        entries.entry(wallet).or_default().extend(accepted);
        refusals.entry(wallet).or_default().push(refusal);
    }
    env.own_redis().start_again();
    let mut paths = (0.0, 0.0);
    for replica in 1..3 {
        let (on_leases, alone) = crate::outage::moved_by_path(&fleet, replica).await;
        paths = (paths.0 + on_leases, paths.1 + alone);
    }
    assert!(paths.0 > 0.0 && paths.1 > 0.0, "moved on leases and under Postgres alone: {paths:?}");

    // Each refusal names the day's limit and when the day ends; in that day, the wallet took the
    // most that fits and not one more.
    let day = chrono::Duration::days(1);
    for (wallet, limit, most, step) in
        [("by-amount", "velocity_amount", 1_000, 7), ("by-count", "velocity_count", 50, 1)]
    {
        let refusals = &refusals[wallet];
        for refusal in refusals {
            assert_eq!(
                (refusal["limit"].as_str(), refusal["per"].as_str()),
                (Some(limit), Some("day")),
                "{refusal}"
            );
        }
        let resets_at = refusals.iter().map(|r| r["resets_at"].as_str().unwrap()).max().unwrap();
        let taken = in_window(&entries[wallet], resets_at, day);
        let (amount, count) =
            (taken.iter().map(|e| e["amount"].as_i64().unwrap()).sum::<i64>(), taken.len() as i64);
        let used = if step == 7 { amount } else { count };
        assert!(most - step < used && used <= most, "{wallet}: {used} of {most} ({count} payments)");
        let limits = fleet.read(&format!("/wallets/{wallet}/limits")).await;
        let window = &limits["velocity"][0];
        if window["resets_at"].as_str() == Some(resets_at) {
            assert_eq!(window["used"], json!({ "amount": amount, "count": count }), "{limits}");
        }
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_window_of_two_seconds_on_the_real_clock_takes_its_count_each_time_and_never_one_more() {
    let env = TestEnv::new();
    let fleet = Arc::new(Fleet::start(&env, 3, &[]).await);
    open_wallets(&*fleet, &["ticking"], 1_000_000).await;
    let velocity = json!({ "velocity": [{ "per": "2s", "count": 3 }] });
    assert_eq!(send(&fleet, &fleet.client, "PUT", "/wallets/ticking/limits", velocity).await.0, 200);

    // Eight clients pay 1 at once, again and again, until four windows have each refused one.
    let full_windows = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::<String>::new()));
    let clients: Vec<_> = (0..8)
        .map(|n| {
            let (fleet, full_windows) = (fleet.clone(), full_windows.clone());
            tokio::spawn(async move {
                let url = fleet.url("/wallets/ticking/pay");
                let mut entries = Vec::new();
                for k in 0.. {
                    if full_windows.lock().unwrap().len() >= 4 {
                        break;
                    }
                    let key = format!("tick-{n}-{k}");
                    let (status, answer) =
                        until_definite(&fleet.client, &url, &json!({ "amount": 1 }), &key).await;
                    match (status, answer["code"].as_str()) {
                        (200, _) => entries.push(answer),
                        (422, Some("limit_exceeded")) => {
                            assert_eq!(
                                (answer["per"].as_str(), answer["left"].as_i64()),
                                (Some("2s"), Some(0))
                            );
                            full_windows
                                .lock()
                                .unwrap()
                                .insert(answer["resets_at"].as_str().unwrap().to_owned());
                        }
                        _ => panic!("{status} {answer}"),
                    }
                }
                entries
            })
        })
        .collect();
    let mut entries = Vec::new();
    for client in clients {
        entries.extend(
            tokio::time::timeout(std::time::Duration::from_secs(120), client).await.unwrap().unwrap(),
        );
    }
    // No window took more than 3, and each that refused one had taken exactly 3.
    let two = chrono::Duration::seconds(2);
    let mut by_window = std::collections::BTreeMap::<i64, usize>::new();
    for entry in &entries {
        let at = chrono::DateTime::parse_from_rfc3339(entry["created_at"].as_str().unwrap()).unwrap();
        *by_window.entry(at.timestamp().div_euclid(2)).or_default() += 1;
    }
    assert!(by_window.values().all(|&n| n <= 3), "{by_window:?}");
    for resets_at in full_windows.lock().unwrap().iter() {
        assert_eq!(
            in_window(&entries, resets_at, two).len(),
            3,
            "the window ending {resets_at}: {by_window:?}"
        );
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_count_when_placed_voids_and_expiries_give_back_and_every_bad_limit_changes_nothing() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["metered", "shop"], 10_000).await;
    let limits =
        json!({ "velocity": [{ "per": "week", "amount": 1_000, "count": 10 }], "timezone": "Europe/Paris" });
    let (status, set) = send(&fleet, &fleet.client, "PUT", "/wallets/metered/limits", limits).await;
    assert_eq!((status, set["timezone"].as_str()), (200, Some("Europe/Paris")), "{set}");
    let used = || async {
        let limits = fleet.read("/wallets/metered/limits").await;
        (
            limits["velocity"][0]["used"]["amount"].as_i64().unwrap(),
            limits["velocity"][0]["used"]["count"].as_i64().unwrap(),
        )
    };
    let post = |path: &'static str, body: Value| send(&fleet, &fleet.client, "POST", path, body);

    // A payment, a transfer and a movement's debit leg each count; what comes in does not.
    assert_eq!(post("/wallets/metered/pay", json!({ "amount": 100 })).await.0, 200);
    assert_eq!(post("/transfers", json!({ "from": "metered", "to": "shop", "amount": 50 })).await.0, 200);
    let legs =
        json!({ "legs": [{ "wallet_id": "metered", "amount": -25 }, { "wallet_id": "shop", "amount": 25 }] });
    let (status, movement) = post("/movements", legs).await;
    assert_eq!(status, 201, "{movement}");
    assert_eq!(post("/transfers", json!({ "from": "shop", "to": "metered", "amount": 500 })).await.0, 200);
    assert_eq!(post("/wallets/metered/deposit", json!({ "amount": 5 })).await.0, 200);
    assert_eq!(used().await, (175, 3));
    // A refund gives nothing back.
    let refund = format!("/movements/{}/refund", movement["id"].as_str().unwrap());
    assert_eq!(send(&fleet, &fleet.client, "POST", &refund, json!({})).await.0, 201);
    assert_eq!(used().await, (175, 3));

    // A hold counts when placed; its void gives all of it back, a capture what it did not take.
    let hold = |amount: i64, expires_in: Option<u64>| {
        let mut body = json!({ "amount": amount });
        if let Some(seconds) = expires_in {
            body["expires_in"] = json!(seconds);
        }
        post("/wallets/metered/holds", body)
    };
    let (status, voided) = hold(300, None).await;
    assert_eq!(status, 201, "{voided}");
    assert_eq!(used().await, (475, 4));
    let void = format!("/holds/{}/void", voided["id"].as_str().unwrap());
    assert_eq!(send(&fleet, &fleet.client, "POST", &void, json!({})).await.0, 200);
    assert_eq!(used().await, (175, 3));
    let (_, captured) = hold(400, None).await;
    let capture = format!("/holds/{}/capture", captured["id"].as_str().unwrap());
    assert_eq!(send(&fleet, &fleet.client, "POST", &capture, json!({ "amount": 150 })).await.0, 200);
    assert_eq!(used().await, (325, 4), "the capture counts 150 once, and the 250 it left comes back");

    // Past the limit, a debit is refused naming it, what is left and when the week ends.
    let (status, refused) = post("/wallets/metered/pay", json!({ "amount": 676 })).await;
    assert_eq!(
        (status, refused["limit"].as_str(), refused["per"].as_str(), refused["left"].as_i64()),
        (422, Some("velocity_amount"), Some("week"), Some(675)),
        "{refused}"
    );
    let limits = fleet.read("/wallets/metered/limits").await;
    assert_eq!(refused["resets_at"], limits["velocity"][0]["resets_at"], "{limits}");
    assert_eq!(limits["velocity"][0]["left"], json!({ "amount": 675, "count": 6 }));
    // A hold that expires gives back what it counted once the wallet releases it.
    let (_, expiring) = hold(600, Some(1)).await;
    assert_eq!(used().await, (925, 5));
    let expired = format!("/holds/{}", expiring["id"].as_str().unwrap());
    crate::support::eventually("the hold expires", std::time::Duration::from_secs(20), || async {
        fleet.read(&expired).await["status"] == "expired"
    })
    .await;
    assert_eq!(post("/wallets/metered/pay", json!({ "amount": 675 })).await.0, 200, "its 600 came back");
    assert_eq!(used().await, (1_000, 5));

    // A new limit on the same window keeps what it took; one below it is refused, as is every
    // bad ask, with nothing changed.
    let before = fleet.read("/wallets/metered/limits").await;
    for (body, status, code) in [
        (
            json!({ "velocity": [{ "per": "week", "amount": 999 }], "timezone": "Europe/Paris" }),
            422,
            "limit_below_used",
        ),
        (
            json!({ "velocity": [{ "per": "week", "count": 4 }], "timezone": "Europe/Paris" }),
            422,
            "limit_below_used",
        ),
        (json!({ "velocity": [{ "per": "week", "amount": -1 }] }), 400, "invalid_limits"),
        (json!({ "velocity": [{ "per": "week" }] }), 400, "invalid_limits"),
        (json!({ "velocity": [{ "per": "fortnight", "count": 1 }] }), 400, "invalid_limits"),
        (json!({ "velocity": [{ "per": "0s", "count": 1 }] }), 400, "invalid_limits"),
        (
            json!({ "velocity": [{ "per": "day", "count": 1 }, { "per": "day", "amount": 1 }] }),
            400,
            "invalid_limits",
        ),
        (json!({ "velocity": [], "timezone": "Mars/Olympus_Mons" }), 400, "invalid_limits"),
        (json!({ "velocity": [{ "per": "day", "count": 1, "every": 2 }] }), 400, "invalid_body"),
    ] {
        let (answered, problem) =
            send(&fleet, &fleet.client, "PUT", "/wallets/metered/limits", body.clone()).await;
        assert_eq!((answered, problem["code"].as_str()), (status, Some(code)), "{body}: {problem}");
    }
    assert_eq!(fleet.read("/wallets/metered/limits").await, before, "nothing changed");
    let wider =
        json!({ "velocity": [{ "per": "week", "amount": 2_000, "count": 20 }], "timezone": "Europe/Paris" });
    let (status, widened) = send(&fleet, &fleet.client, "PUT", "/wallets/metered/limits", wider).await;
    assert_eq!(
        (status, &widened["velocity"][0]["used"]),
        (200, &json!({ "amount": 1_000, "count": 5 })),
        "{widened}"
    );
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");

    // The audit recomputes each window from the ledger: a counter moved by hand is found.
    let pool = sqlx::PgPool::connect(&fleet.database_url).await.unwrap();
    sqlx::query(
        "update wallet set rules = jsonb_set(rules, '{velocity,0,used,amount}', '999') where id = 'metered'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (ok, report) = audit(&fleet.database_url);
    assert!(
        !ok && report.contains("wallet metered: its velocity limit per week counts 999 in 5 debits"),
        "{report}"
    );
    assert!(report.contains("but the ledger has 1000 in 5"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_changed_mid_load_holds_for_every_payment_decided_after_it() {
    let env = TestEnv::new();
    let fleet = Arc::new(Fleet::start(&env, 3, &[]).await);
    open_wallets(&*fleet, &["changing"], 1_000_000).await;
    let loose = json!({ "velocity": [{ "per": "day", "count": 100_000 }] });
    assert_eq!(send(&fleet, &fleet.client, "PUT", "/wallets/changing/limits", loose).await.0, 200);
    let accepted = Arc::new(AtomicI64::new(0));
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (fleet, accepted) = (fleet.clone(), accepted.clone());
            tokio::spawn(async move { pay_until_refused(&fleet, "changing", 1, n, &accepted).await })
        })
        .collect();
    until_accepted(&accepted, 50).await;
    // Tightened to 200 a day, in the queue of the wallet's payments: every payment after it is
    // decided against it, so the day ends with exactly 200.
    let tight = json!({ "velocity": [{ "per": "day", "count": 200 }] });
    let (status, set) = send(&fleet, &fleet.client, "PUT", "/wallets/changing/limits", tight).await;
    assert_eq!(status, 200, "{set}");
    let mut entries = Vec::new();
    let mut resets = Vec::new();
    for client in clients {
        let (accepted, refusal) = client.await.unwrap();
        assert_eq!((refusal["limit"].as_str(), refusal["left"].as_i64()), (Some("velocity_count"), Some(0)));
        entries.extend(accepted);
        resets.push(refusal["resets_at"].as_str().unwrap().to_owned());
    }
    let resets_at = resets.iter().max().unwrap();
    assert_eq!(in_window(&entries, resets_at, chrono::Duration::days(1)).len(), 200);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}
