//! Movements of many legs (`POST /movements`): money between 2 to 16 wallets at once, every leg or
//! none, under every wallet's lease, with the same keys, fences and books as a transfer.

use crate::support::app::{TestApp, spawn_app};
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::movements::{
    Outcome, SplitAttempt, SplitLoad, check_split_books, send_movement, settle_splits, tally_splits,
};
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with, books, parse_metrics};
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::time::Duration;

fn legs(spec: &[(&str, i64)]) -> Value {
    json!({ "legs": spec.iter().map(|(id, amount)| json!({ "wallet_id": id, "amount": amount })).collect::<Vec<_>>() })
}

async fn balances(db: &sqlx::PgPool, wallets: &[&str]) -> Vec<i64> {
    let mut out = Vec::new();
    for wallet in wallets {
        out.push(books(db, wallet).await.balance);
    }
    out
}

async fn movement_rows(db: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from movement").fetch_one(db).await.unwrap()
}

async fn keyed(app: &TestApp, key: &str, body: &Value) -> reqwest::Response {
    app.client.post(app.url("/movements")).header("idempotency-key", key).json(body).send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_moves_every_leg_or_none_and_a_retry_with_its_key_replays_it() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let wallets = ["payer", "merchant", "fee", "tax"];
    app.open_wallet("payer", 10_000).await;
    for wallet in &wallets[1..] {
        app.open_wallet(wallet, 0).await;
    }
    let split = legs(&[("payer", -1_000), ("merchant", 850), ("fee", 100), ("tax", 50)]);
    let made = keyed(&app, "split-1", &split).await;
    assert_eq!(made.status(), 201);
    let made: Value = made.json().await.unwrap();
    let after: Vec<i64> =
        made["legs"].as_array().unwrap().iter().map(|leg| leg["balance"].as_i64().unwrap()).collect();
    assert_eq!(after, [9_000, 850, 100, 50], "each leg's entry, with its wallet's balance after it");
    assert_eq!(made["legs"][0]["kind"], "transfer_out");
    assert_eq!(made["legs"][3]["kind"], "transfer_in");
    assert!(made["legs"].as_array().unwrap().iter().all(|leg| leg["transfer_id"] == made["id"]));

    let replayed = keyed(&app, "split-1", &split).await;
    assert_eq!(replayed.status(), 201);
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(replayed.json::<Value>().await.unwrap()["id"], made["id"], "the same movement, once");
    assert_eq!(balances(&app.db, &wallets).await, [9_000, 850, 100, 50]);

    let read = app.get(&format!("/movements/{}", made["id"].as_str().unwrap())).await;
    assert_eq!(read.status(), 200);
    let read: Value = read.json().await.unwrap();
    let mut legs_read: Vec<i64> =
        read["legs"].as_array().unwrap().iter().map(|leg| leg["amount"].as_i64().unwrap()).collect();
    legs_read.sort_unstable();
    assert_eq!(legs_read, [50, 100, 850, 1_000]);

    // One leg that cannot be made refuses the whole movement, naming the leg.
    let too_much = legs(&[("merchant", -100), ("payer", -10_000), ("tax", 10_100)]);
    let refused = keyed(&app, "split-2", &too_much).await;
    assert_eq!(refused.status(), 422);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!((problem["code"].as_str(), problem["leg"].as_i64()), (Some("insufficient_funds"), Some(1)));
    assert_eq!(problem["balance"], 9_000, "the balance of that leg's wallet");
    assert_eq!(balances(&app.db, &wallets).await, [9_000, 850, 100, 50], "no leg applied");
    let again = keyed(&app, "split-2", &too_much).await;
    assert_eq!(again.status(), 422);
    assert_eq!(again.headers()["idempotent-replayed"], "true", "the refusal is replayed too");

    // A key is one request's, whichever route between wallets it was sent to.
    let transfer = app
        .client
        .post(app.url("/transfers"))
        .header("idempotency-key", "split-1")
        .json(&json!({ "from": "payer", "to": "fee", "amount": 1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(transfer.status(), 422);
    assert_eq!(transfer.json::<Value>().await.unwrap()["code"], "idempotency_key_reused");
    assert_eq!(movement_rows(&app.db).await, 1);
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_movement_is_a_clear_4xx_and_changes_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let wallets = ["ma", "mb", "mc"];
    for wallet in &wallets {
        app.open_wallet(wallet, 1_000).await;
    }
    // `tester` may pay into `other`'s wallets (the test token file grants it), not into `ops`'s.
    for (token, wallet) in [(OTHER_TOKEN, "theirs"), ("ops-token-0123456789", "ops")] {
        let opened = api_client_with(token)
            .post(app.url("/wallets"))
            .json(&json!({ "id": wallet, "balance": 1_000 }))
            .send()
            .await;
        assert_eq!(opened.unwrap().status(), 201);
    }
    let seventeen: Vec<(String, i64)> =
        (0..17).map(|n| (format!("w{n}"), if n == 0 { -16 } else { 1 })).collect();
    let seventeen: Vec<(&str, i64)> = seventeen.iter().map(|(id, amount)| (id.as_str(), *amount)).collect();
    let cases: Vec<(Value, u16, &str, Option<i64>)> = vec![
        (legs(&[("ma", -10), ("mb", 9)]), 400, "invalid_legs", None),
        (legs(&[("ma", -10), ("ma", 10)]), 400, "invalid_legs", None),
        (legs(&[]), 400, "invalid_legs", None),
        (legs(&[("ma", 0)]), 400, "invalid_legs", None),
        (legs(&[("ma", -5)]), 400, "invalid_legs", None),
        (legs(&seventeen), 400, "invalid_legs", None),
        (legs(&[("ma", 0), ("mb", 0)]), 400, "invalid_legs", None),
        (legs(&[("ma", -10), ("m/b", 10)]), 400, "invalid_legs", None),
        (legs(&[("ma", -2_000_000_000_000), ("mb", 2_000_000_000_000)]), 400, "invalid_legs", None),
        (
            json!({ "legs": [{ "wallet_id": "ma", "amount": -1 }, { "wallet_id": "mb", "amount": 1, "x": 1 }] }),
            400,
            "invalid_body",
            None,
        ),
        (
            json!({ "legs": [{ "wallet_id": "ma", "amount": -1 }, { "wallet_id": "mb", "amount": 1 }], "reference": "a\u{0}b" }),
            400,
            "invalid_reference",
            None,
        ),
        (legs(&[("ma", -10), ("nobody", 10)]), 404, "wallet_not_found", Some(1)),
        (legs(&[("theirs", -10), ("ma", 10)]), 404, "wallet_not_found", Some(0)),
        (legs(&[("ma", -10), ("ops", 10)]), 404, "wallet_not_found", Some(1)),
        (legs(&[("ma", -10), ("theirs", 10)]), 201, "", None),
        (legs(&[("mc", 5), ("ma", -10), ("mb", 5)]), 201, "", None),
    ];
    for (body, status, code, leg) in cases {
        let response = app.post_json("/movements", body.clone()).await;
        assert_eq!(response.status().as_u16(), status, "{body}");
        if status == 201 {
            continue;
        }
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["code"], code, "{body}: {problem}");
        assert_eq!(problem["leg"].as_i64(), leg, "{body}: {problem}");
    }
    assert_eq!(balances(&app.db, &wallets).await, [980, 1_005, 1_005], "only the good movements moved money");
    assert_eq!(balances(&app.db, &["theirs", "ops"]).await, [1_010, 1_000]);
    assert_eq!(movement_rows(&app.db).await, 2);
    let missing = app.get("/movements/00000000-0000-0000-0000-000000000000").await;
    assert_eq!(missing.status(), 404);
    assert_eq!(app.get("/movements/not-a-uuid").await.status(), 400);
}

/// How one keyed movement through the fleet ended: applied (201 or replayed), refused on its
/// merits or for a busy wallet (nothing applied), or not known yet (retry with its key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Applied,
    NotApplied,
    Unknown,
}

async fn send(fleet: &Fleet, key: &str, body: &Value) -> Ended {
    let request = fleet.client.post(fleet.url("/movements")).header("idempotency-key", key).json(body);
    let Ok(response) = request.timeout(Duration::from_secs(15)).send().await else { return Ended::Unknown };
    let status = response.status().as_u16();
    let problem: Value = response.json().await.unwrap_or(Value::Null);
    match (status, problem["code"].as_str().unwrap_or("")) {
        (201, _) => Ended::Applied,
        (422, "insufficient_funds")
        | (409, "lease_lost")
        | (503, "lock_timeout" | "overloaded")
        | (429, _) => Ended::NotApplied,
        (409, "idempotency_key_in_flight")
        | (503, "request_timeout" | "outcome_unknown")
        | (502 | 504, _) => Ended::Unknown,
        other => panic!("an answer the API does not give: {other:?} {problem}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splits_whose_legs_overlap_in_every_order_never_deadlock_and_conserve_money() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    let wallets = ["sa", "sb", "sc", "sd"];
    let opening = 1_000;
    open_wallets(&fleet, &wallets, opening).await;

    // 12 clients, 10 splits each: one of the four wallets pays 2, split between two others, the
    // three picked and ordered at random, so every order of overlapping legs meets every other.
    let fleet = std::sync::Arc::new(fleet);
    let clients: Vec<_> = (0..12)
        .map(|client| {
            let fleet = fleet.clone();
            tokio::spawn(async move {
                let mut sent = Vec::new();
                for n in 0..10 {
                    let mut order = wallets.to_vec();
                    order.shuffle(&mut rand::rng());
                    let body = legs(&[(order[0], -2), (order[1], 1), (order[2], 1)]);
                    let key = format!("split-{client}-{n}");
                    let ended = send(&fleet, &key, &body).await;
                    sent.push((key, body, ended));
                }
                sent
            })
        })
        .collect();
    let mut sent = Vec::new();
    for client in clients {
        sent.extend(
            tokio::time::timeout(Duration::from_secs(120), client).await.expect("no deadlock").unwrap(),
        );
    }
    // Every unknown outcome is settled by its key: applied once, or not at all.
    for (key, body, ended) in &mut sent {
        while *ended == Ended::Unknown {
            *ended = send(&fleet, key, body).await;
        }
    }
    let applied = sent.iter().filter(|(_, _, ended)| *ended == Ended::Applied).count() as i64;
    assert!(applied * 2 >= sent.len() as i64, "most splits applied: {applied} of {}", sent.len());
    assert_eq!(movement_rows(&fleet.db).await, applied, "each split acknowledged is recorded once");
    let total: i64 = balances(&fleet.db, &wallets).await.iter().sum();
    assert_eq!(total, opening * wallets.len() as i64, "money is conserved");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

/// The settings of the fault fleets: a one-second lease, and keys of dead replicas freed after two.
const FAULT_SETTINGS: [(&str, &str); 2] = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];

/// Enough that no wallet of the fault tests runs short: 12 clients x 15 splits of at most 50.
const FAULT_OPENING: i64 = 10_000;

/// What a split under the faults may end as once settled: applied, or refused with nothing
/// applied: a wallet held by a dead or frozen replica is a bounded wait, then `lock_timeout`; a
/// replica whose every pooled connection waits on rows (under Postgres alone, each split's
/// transaction holds one while it waits for its rows) answers `dependency_unavailable` after
/// `PG_ACQUIRE_TIMEOUT`. That nothing of these was applied is [`check_split_books`]'s to prove.
fn assert_decided_on_merits(counts: &std::collections::BTreeMap<String, usize>) {
    for code in counts.keys() {
        assert!(
            ["applied", "lock_timeout", "lease_lost", "dependency_unavailable"].contains(&code.as_str()),
            "a split neither applied nor refused with nothing applied: {counts:?}"
        );
    }
}

fn opening_of<'a>(wallets: &[&'a str]) -> Vec<(&'a str, i64)> {
    wallets.iter().map(|w| (*w, FAULT_OPENING)).collect()
}

async fn movement_ids(db: &sqlx::PgPool) -> HashSet<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("select id from movement").fetch_all(db).await.unwrap();
    ids.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_the_split_load_loses_nothing_and_applies_nothing_twice() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 3, &FAULT_SETTINGS).await;
    let wallets = ["ka", "kb", "kc", "kd", "ke"];
    open_wallets(&fleet, &wallets, FAULT_OPENING).await;
    let load = SplitLoad::each(&fleet, &wallets, 12, 10);

    // Mid-load, replica-1 is SIGKILLed (by its pid) wherever it is, and comes back armed to stop
    // itself right after its next commit, and is SIGKILLed there: a split committed whose answer
    // never left.
    let mid_load = || async { movement_rows(&fleet.db).await >= 12 };
    crate::support::eventually("the load committed 12 splits", Duration::from_secs(20), mid_load).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("after_commit:stop"));
    fleet.replicas[0].start();
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let doomed = tokio::spawn(async move {
        let legs = vec![("kc".to_owned(), -7), ("kd".to_owned(), 4), ("ke".to_owned(), 3)];
        let key = "doomed-split".to_owned();
        let outcome = send_movement(&client, &url, &legs, &key).await;
        SplitAttempt { legs, key, outcome }
    });
    let pid = fleet.replicas[0].pid();
    crate::support::eventually("replica-1 stopped after a commit", Duration::from_secs(10), || async {
        crate::support::fleet::is_stopped(pid)
    })
    .await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();

    let mut attempts = tokio::time::timeout(Duration::from_secs(60), load.done())
        .await
        .expect("12 clients sent 10 splits each within 60 s, through the kills");
    attempts.push(doomed.await.unwrap());
    let undecided: HashSet<String> =
        attempts.iter().filter(|a| matches!(a.outcome, Outcome::Unknown(_))).map(|a| a.key.clone()).collect();
    assert!(!undecided.is_empty(), "the kills left splits undecided: {:?}", tally_splits(&attempts));
    let before_retries = movement_ids(&fleet.db).await;

    // Each undecided split is settled by retrying it with its key: one committed before the kill
    // is replayed (the same movement, not a second), one that was not is applied now, once.
    settle_splits(&fleet, &mut attempts).await;
    let replayed = attempts
        .iter()
        .filter(|a| undecided.contains(&a.key))
        .filter(|a| matches!(a.outcome, Outcome::Applied(id) if before_retries.contains(&id)))
        .count();
    assert!(replayed >= 1, "the split committed at the kill was replayed by its key's retry");
    let counts = tally_splits(&attempts);
    eprintln!("12 clients, 10 splits each, replica-1 killed twice: {counts:?}; {replayed} replayed");
    assert_decided_on_merits(&counts);
    check_split_books(&fleet, &opening_of(&wallets), &attempts).await;
}

async fn versions(db: &sqlx::PgPool, wallets: &[&str]) -> Vec<i64> {
    let mut out = Vec::new();
    for wallet in wallets {
        let version = sqlx::query_scalar("select version from wallet where id = $1").bind(wallet);
        out.push(version.fetch_one(db).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_holder_paused_past_its_leases_applies_nothing_when_it_wakes() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 3, &FAULT_SETTINGS).await;
    let wallets = ["pa", "pb", "pc", "pd", "pe"];
    open_wallets(&fleet, &wallets, FAULT_OPENING).await;
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("transfer_leases_held:stop"));
    fleet.replicas[0].start();

    // replica-1 stops itself (a GC pause, a frozen VM) holding the leases of all three legs, before
    // its transaction: no row is locked, so only the fences can refuse its write when it wakes.
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let mut stale = tokio::spawn(async move {
        let legs = vec![("pa".to_owned(), -40), ("pb".to_owned(), 30), ("pc".to_owned(), 10)];
        send_movement(&client, &url, &legs, "stale-split").await
    });
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped holding the leases", &mut stale).await;
    let read = versions(&fleet.db, &wallets[..3]).await;

    // The load through nginx to all three replicas: the paused holder's leases lapse (1 s), and
    // the others' splits take them over and write every one of its three wallets.
    let load = SplitLoad::each(&fleet, &wallets, 12, 10);
    crate::support::eventually("pa, pb and pc written by the others", Duration::from_secs(10), || async {
        let now = versions(&fleet.db, &wallets[..3]).await;
        now.iter().zip(&read).all(|(now, read)| now > read)
    })
    .await;

    // Woken, the stale holder is refused: 409 lease_lost, nothing moved.
    fleet.replicas[0].signal(nix::sys::signal::Signal::SIGCONT);
    let stale = stale.await.unwrap();
    assert_eq!(
        stale,
        Outcome::NotApplied("lease_lost".into()),
        "replica-1 logged:\n{}",
        fleet.replicas[0].log()
    );
    let mut attempts = tokio::time::timeout(Duration::from_secs(60), load.done())
        .await
        .expect("12 clients sent 10 splits each within 60 s, through the pause");
    settle_splits(&fleet, &mut attempts).await;
    let counts = tally_splits(&attempts);
    eprintln!("12 clients, 10 splits each, replica-1 paused past its leases: {counts:?}");
    assert_decided_on_merits(&counts);
    check_split_books(&fleet, &opening_of(&wallets), &attempts).await;
}

/// The movements the fleet applied under Postgres alone, as the replicas count them.
async fn moved_under_postgres_alone(fleet: &Fleet) -> f64 {
    let mut total = 0.0;
    for replica in &fleet.replicas {
        let scrape = fleet.client.get(replica.url("/metrics")).send().await.unwrap().text().await.unwrap();
        total += parse_metrics(&scrape)
            .into_iter()
            .filter(|(name, labels, _)| {
                name == "walletlock_movements_by_path_total"
                    && labels.get("path").map(String::as_str) == Some("postgres_only")
            })
            .map(|(_, _, value)| value)
            .sum::<f64>();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splits_go_on_through_a_flushall_and_a_redis_outage_and_the_books_balance() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 3, &FAULT_SETTINGS).await;
    let wallets = ["fa", "fb", "fc", "fd", "fe"];
    open_wallets(&fleet, &wallets, FAULT_OPENING).await;
    let load = SplitLoad::each(&fleet, &wallets, 12, 15);
    // Each fault strikes once the load has committed a few more splits since the last one.
    let advanced = |since: i64| {
        let db = fleet.db.clone();
        move || {
            let db = db.clone();
            async move { movement_rows(&db).await >= since + 8 }
        }
    };
    crate::support::eventually("splits before the faults", Duration::from_secs(20), advanced(0)).await;

    // Every lease, fence counter and note gone at once: each holder lifts its fences past the rows'.
    env.redis_cmd::<()>(&["FLUSHALL"]).await;
    let flushed = movement_rows(&fleet.db).await;
    crate::support::eventually("splits after the flush", Duration::from_secs(20), advanced(flushed)).await;

    // Redis gone: splits go on under Postgres alone (row locks), then back on leases.
    env.own_redis().kill();
    let killed = movement_rows(&fleet.db).await;
    crate::support::eventually("splits under Postgres alone", Duration::from_secs(20), advanced(killed))
        .await;
    assert!(moved_under_postgres_alone(&fleet).await > 0.0, "some splits moved under Postgres alone");
    env.own_redis().start_again();

    let mut attempts = tokio::time::timeout(Duration::from_secs(60), load.done())
        .await
        .expect("12 clients sent 15 splits each within 60 s, through the faults");
    settle_splits(&fleet, &mut attempts).await;
    let counts = tally_splits(&attempts);
    eprintln!("12 clients, 15 splits each, through a FLUSHALL and a Redis outage: {counts:?}");
    assert_decided_on_merits(&counts);
    check_split_books(&fleet, &opening_of(&wallets), &attempts).await;
}

/// What the wallet row holds: (balance, held).
async fn balance_and_held(db: &sqlx::PgPool, wallet: &str) -> (i64, i64) {
    sqlx::query_as("select balance, held from wallet where id = $1").bind(wallet).fetch_one(db).await.unwrap()
}

fn held_split(spec: &[(&str, i64)], expires_in: i64) -> Value {
    let mut body = legs(spec);
    body["hold"] = json!({ "expires_in": expires_in });
    body
}

async fn post_code(client: &reqwest::Client, url: String) -> (u16, Value) {
    let response = client.post(url).send().await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_split_reserves_every_debit_and_is_captured_or_voided_as_a_whole() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("hp", 10_000).await;
    app.open_wallet("hq", 1_000).await;
    for wallet in ["hm", "hf"] {
        app.open_wallet(wallet, 0).await;
    }
    // Two payers, two payees: both debits are held, nothing is written to anyone yet.
    let split = held_split(&[("hp", -1_000), ("hq", -200), ("hm", 1_100), ("hf", 100)], 600);
    let placed = keyed(&app, "held-1", &split).await;
    assert_eq!(placed.status(), 201);
    let placed: Value = placed.json().await.unwrap();
    assert_eq!(placed["status"], "held");
    assert_eq!(placed["legs"], json!([]), "no entry until the capture");
    let held_legs = placed["hold"]["legs"].as_array().unwrap();
    assert!(held_legs[0]["hold_id"].is_string() && held_legs[1]["hold_id"].is_string());
    assert!(held_legs[2].get("hold_id").is_none(), "a credit leg holds nothing");
    assert_eq!(balance_and_held(&app.db, "hp").await, (10_000, 1_000));
    assert_eq!(balance_and_held(&app.db, "hq").await, (1_000, 200));
    assert_eq!(balances(&app.db, &["hm", "hf"]).await, [0, 0]);
    let replayed = keyed(&app, "held-1", &split).await;
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(balance_and_held(&app.db, "hp").await, (10_000, 1_000), "placed once");

    // A leg's hold is settled with its movement, never alone.
    let leg_hold = held_legs[0]["hold_id"].as_str().unwrap();
    let alone = app.client.post(app.url(&format!("/holds/{leg_hold}/capture"))).json(&json!({})).send();
    let alone = alone.await.unwrap();
    let status = alone.status().as_u16();
    let problem: Value = alone.json().await.unwrap();
    assert_eq!((status, problem["code"].as_str()), (409, Some("hold_of_movement")), "{problem}");

    let id = placed["id"].as_str().unwrap();
    let captured = app.client.post(app.url(&format!("/movements/{id}/capture"))).send().await.unwrap();
    assert_eq!(captured.status(), 200);
    let captured: Value = captured.json().await.unwrap();
    assert_eq!(captured["status"], "captured");
    let after: Vec<i64> =
        captured["legs"].as_array().unwrap().iter().map(|e| e["balance"].as_i64().unwrap()).collect();
    assert_eq!(after, [9_000, 800, 1_100, 100], "every leg's entry, in the legs' order");
    assert_eq!(captured["legs"][0]["hold_id"].as_str(), Some(leg_hold), "a debit's entry names its hold");
    assert_eq!(balance_and_held(&app.db, "hp").await, (9_000, 0));
    assert_eq!(balance_and_held(&app.db, "hq").await, (800, 0));
    for settle in ["capture", "void"] {
        let (status, problem) = post_code(&app.client, app.url(&format!("/movements/{id}/{settle}"))).await;
        assert_eq!((status, problem["code"].as_str()), (409, Some("hold_captured")), "{settle}: {problem}");
    }
    let read: Value = app.get(&format!("/movements/{id}")).await.json().await.unwrap();
    assert_eq!((read["status"].as_str(), read["legs"].as_array().map(Vec::len)), (Some("captured"), Some(4)));

    // Voided: every hold released, nothing charged.
    let voided_split = held_split(&[("hp", -500), ("hm", 500)], 600);
    let placed: Value = keyed(&app, "held-2", &voided_split).await.json().await.unwrap();
    let id = placed["id"].as_str().unwrap();
    let voided = app.client.post(app.url(&format!("/movements/{id}/void"))).send().await.unwrap();
    assert_eq!(voided.status(), 200);
    assert_eq!(voided.json::<Value>().await.unwrap()["status"], "voided");
    assert_eq!(balance_and_held(&app.db, "hp").await, (9_000, 0));
    let (status, problem) = post_code(&app.client, app.url(&format!("/movements/{id}/capture"))).await;
    assert_eq!((status, problem["code"].as_str()), (409, Some("hold_voided")), "{problem}");

    // Past its expiry a capture is refused and releases every hold.
    let brief = held_split(&[("hp", -300), ("hq", -100), ("hf", 400)], 1);
    let placed: Value = keyed(&app, "held-3", &brief).await.json().await.unwrap();
    let id = placed["id"].as_str().unwrap().to_owned();
    assert_eq!(balance_and_held(&app.db, "hq").await, (800, 100));
    let expired = || {
        let (app, id) = (&app, &id);
        async move {
            let read: Value = app.get(&format!("/movements/{id}")).await.json().await.unwrap();
            read["status"] == "expired"
        }
    };
    crate::support::eventually("the held movement expired", Duration::from_secs(20), expired).await;
    let (status, problem) = post_code(&app.client, app.url(&format!("/movements/{id}/capture"))).await;
    assert_eq!((status, problem["code"].as_str()), (409, Some("hold_expired")), "{problem}");
    assert_eq!(balance_and_held(&app.db, "hp").await, (9_000, 0));
    assert_eq!(balance_and_held(&app.db, "hq").await, (800, 0));
    assert_eq!(balances(&app.db, &["hf"]).await, [100], "nothing paid in");

    // What cannot be: a hold beyond a debit's available balance, a bad life, a posted movement.
    let too_much = keyed(&app, "held-4", &held_split(&[("hq", -900), ("hm", 900)], 60)).await;
    assert_eq!(too_much.status(), 422);
    let problem: Value = too_much.json().await.unwrap();
    assert_eq!((problem["code"].as_str(), problem["leg"].as_i64()), (Some("insufficient_funds"), Some(0)));
    for life in [0, 604_801] {
        let bad = app.post_json("/movements", held_split(&[("hp", -1), ("hm", 1)], life)).await;
        assert_eq!(bad.status(), 400, "expires_in {life}");
        assert_eq!(bad.json::<Value>().await.unwrap()["code"], "invalid_expires_in");
    }
    let posted: Value =
        app.post_json("/movements", legs(&[("hp", -1), ("hm", 1)])).await.json().await.unwrap();
    let (status, problem) =
        post_code(&app.client, app.url(&format!("/movements/{}/void", posted["id"].as_str().unwrap()))).await;
    assert_eq!((status, problem["code"].as_str()), (409, Some("movement_not_held")), "{problem}");
    assert_eq!(balance_and_held(&app.db, "hq").await, (800, 0), "refusals change nothing");
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_split_captured_on_one_replica_while_another_voids_it_settles_exactly_once() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    let wallets = ["ra", "rb", "rc"];
    open_wallets(&fleet, &wallets, 10_000).await;
    let rounds = 12;
    let mut captured = 0;
    for n in 0..rounds {
        let body = held_split(&[("ra", -100), ("rb", -50), ("rc", 150)], 600);
        let placed = fleet.client.post(fleet.url("/movements")).json(&body).send().await.unwrap();
        assert_eq!(placed.status(), 201);
        let id = placed.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
        // The capture on one replica, the void on another, at once.
        let capture =
            post_code(&fleet.client, fleet.replicas[n % 3].url(&format!("/movements/{id}/capture")));
        let void =
            post_code(&fleet.client, fleet.replicas[(n + 1) % 3].url(&format!("/movements/{id}/void")));
        let ((capture_status, capture_problem), (void_status, void_problem)) = tokio::join!(capture, void);
        let read = fleet.read(&format!("/movements/{id}")).await;
        match (capture_status, void_status) {
            (200, 409) => {
                assert_eq!(void_problem["code"], "hold_captured", "{void_problem}");
                assert_eq!(read["status"], "captured");
                captured += 1;
            }
            (409, 200) => {
                assert_eq!(capture_problem["code"], "hold_voided", "{capture_problem}");
                assert_eq!(read["status"], "voided");
            }
            other => {
                panic!("exactly one of a capture and a void wins: {other:?} {capture_problem} {void_problem}")
            }
        }
    }
    assert_eq!(
        balances(&fleet.db, &wallets).await,
        [10_000 - 100 * captured, 10_000 - 50 * captured, 10_000 + 150 * captured],
        "every leg of each captured movement, none of a voided one"
    );
    for wallet in ["ra", "rb"] {
        assert_eq!(balance_and_held(&fleet.db, wallet).await.1, 0, "nothing left held");
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

async fn refund(app: &TestApp, id: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    let request = app.client.post(app.url(&format!("/movements/{id}/refund"))).header("idempotency-key", key);
    let request = match body {
        Some(body) => request.json(&body),
        None => request,
    };
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// Each leg of a movement: (wallet, signed amount), in its order.
fn moved(movement: &Value) -> Vec<(String, i64)> {
    let legs = movement["legs"].as_array().unwrap();
    legs.iter()
        .map(|e| {
            let amount = e["amount"].as_i64().unwrap();
            let signed = if e["kind"] == "transfer_out" { -amount } else { amount };
            (e["wallet_id"].as_str().unwrap().to_owned(), signed)
        })
        .collect()
}

fn of(spec: &[(&str, i64)]) -> Vec<(String, i64)> {
    spec.iter().map(|(id, amount)| ((*id).to_owned(), *amount)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_is_refunded_every_leg_by_its_share_in_part_then_the_rest_and_never_past_it() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let wallets = ["sp", "sm", "sf"];
    app.open_wallet("sp", 10_000).await;
    app.open_wallet("sm", 0).await;
    app.open_wallet("sf", 0).await;
    let made: Value = keyed(&app, "refunded-split", &legs(&[("sp", -1_000), ("sm", 900), ("sf", 100)]))
        .await
        .json()
        .await
        .unwrap();
    let id = made["id"].as_str().unwrap();

    // Half of it: each leg back by its share, the money moving the other way.
    let (status, half) = refund(&app, id, "refund-1", Some(json!({ "amount": 500 }))).await;
    assert_eq!(status, 201, "{half}");
    assert_eq!(half["refund_of"].as_str(), Some(id));
    assert_eq!(moved(&half), of(&[("sp", 500), ("sm", -450), ("sf", -50)]));
    assert_eq!(balances(&app.db, &wallets).await, [9_500, 450, 50]);
    let (status, again) = refund(&app, id, "refund-1", Some(json!({ "amount": 500 }))).await;
    assert_eq!((status, &again["id"]), (201, &half["id"]), "a retry with its key replays it");

    // More than is left is refused, naming what is left; then the rest, then nothing.
    let (status, beyond) = refund(&app, id, "refund-2", Some(json!({ "amount": 501 }))).await;
    assert_eq!(
        (status, beyond["code"].as_str(), beyond["refundable"].as_i64()),
        (422, Some("refund_exceeds_payment"), Some(500))
    );
    let (status, rest) = refund(&app, id, "refund-3", None).await;
    assert_eq!(status, 201, "{rest}");
    assert_eq!(moved(&rest), of(&[("sp", 500), ("sm", -450), ("sf", -50)]));
    assert_eq!(balances(&app.db, &wallets).await, [10_000, 0, 0], "every leg back where it started");
    let (status, nothing) = refund(&app, id, "refund-4", None).await;
    assert_eq!((status, nothing["refundable"].as_i64()), (422, Some(0)), "{nothing}");

    // A held split captured in part: each leg takes its share, every hold is released, and only
    // what was captured can be refunded.
    let placed: Value =
        keyed(&app, "held-part", &held_split(&[("sp", -1_000), ("sm", 900), ("sf", 100)], 600))
            .await
            .json()
            .await
            .unwrap();
    let held = placed["id"].as_str().unwrap();
    let (status, problem) = refund(&app, held, "refund-held", None).await;
    assert_eq!((status, problem["code"].as_str()), (409, Some("movement_not_captured")), "{problem}");
    let capture = |amount: i64| {
        let url = app.url(&format!("/movements/{held}/capture"));
        app.client.post(url).json(&json!({ "amount": amount })).send()
    };
    let too_much = capture(1_001).await.unwrap();
    assert_eq!(too_much.status(), 422);
    assert_eq!(too_much.json::<Value>().await.unwrap()["code"], "capture_exceeds_hold");
    let captured: Value = capture(300).await.unwrap().json().await.unwrap();
    assert_eq!(captured["status"], "captured", "{captured}");
    assert_eq!(moved(&captured), of(&[("sp", -300), ("sm", 270), ("sf", 30)]));
    assert_eq!(balance_and_held(&app.db, "sp").await, (9_700, 0), "the rest of the hold released");
    let (status, beyond) = refund(&app, held, "refund-part", Some(json!({ "amount": 301 }))).await;
    assert_eq!((status, beyond["refundable"].as_i64()), (422, Some(300)), "{beyond}");

    // A refund takes money only from wallets the caller may use: `tester` may pay into `other`'s
    // wallet, not take it back; another caller does not see the movement at all.
    let opened =
        api_client_with(OTHER_TOKEN).post(app.url("/wallets")).json(&json!({ "id": "sx", "balance": 0 }));
    assert_eq!(opened.send().await.unwrap().status(), 201);
    let into_theirs: Value =
        app.post_json("/movements", legs(&[("sp", -10), ("sx", 10)])).await.json().await.unwrap();
    let (status, problem) = refund(&app, into_theirs["id"].as_str().unwrap(), "refund-theirs", None).await;
    assert_eq!((status, problem["code"].as_str()), (404, Some("movement_not_found")), "{problem}");
    let stranger = api_client_with(OTHER_TOKEN).post(app.url(&format!("/movements/{id}/refund"))).send();
    assert_eq!(stranger.await.unwrap().status(), 404);
    assert_eq!(balances(&app.db, &["sp", "sx"]).await, [9_690, 10], "refusals change nothing");
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_of_a_split_racing_on_three_replicas_never_give_back_more_than_a_leg_moved() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    let wallets = ["qa", "qb", "qc"];
    open_wallets(&fleet, &wallets, 1_000).await;
    let made =
        fleet.client.post(fleet.url("/movements")).json(&legs(&[("qa", -100), ("qb", 60), ("qc", 40)]));
    let made: Value = made.send().await.unwrap().json().await.unwrap();
    let id = made["id"].as_str().unwrap().to_owned();
    let sends = (0..12).map(|n| {
        let (client, url) =
            (fleet.client.clone(), fleet.replicas[n % 3].url(&format!("/movements/{id}/refund")));
        async move {
            // A `lock_timeout` applied nothing: sent again, as clients are told, at most five times.
            let mut tries = 0;
            loop {
                let response = client.post(&url).json(&json!({ "amount": 30 })).send().await.unwrap();
                let answer = (response.status().as_u16(), response.json::<Value>().await.unwrap());
                tries += 1;
                if answer.1["code"] != "lock_timeout" || tries == 5 {
                    return answer;
                }
            }
        }
    });
    let answers = futures::future::join_all(sends).await;
    let accepted = answers.iter().filter(|(status, _)| *status == 201).count();
    assert_eq!(accepted, 3, "3 refunds of 30 fit in 100: {answers:?}");
    for (status, body) in answers.iter().filter(|(status, _)| *status != 201) {
        assert_eq!(
            (*status, body["code"].as_str(), body["refundable"].as_i64()),
            (422, Some("refund_exceeds_payment"), Some(10)),
            "{body}"
        );
    }
    // 90 of 100 back: 54 of qb's 60 and 36 of qc's 40, each refund taking its share of each leg.
    assert_eq!(balances(&fleet.db, &wallets).await, [990, 1_006, 1_004]);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_one_requests_whichever_route_it_is_sent_to() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let wallets = ["ka", "kb", "kc"];
    app.open_wallet("ka", 1_000).await;
    app.open_wallet("kb", 0).await;
    app.open_wallet("kc", 0).await;
    let send = |path: &'static str, key: &'static str, body: Value| {
        let request = app.client.post(app.url(path)).header("idempotency-key", key).json(&body);
        async move {
            let response = request.send().await.unwrap();
            let replayed = response.headers().get("idempotent-replayed").is_some();
            (response.status().as_u16(), replayed, response.json::<Value>().await.unwrap())
        }
    };
    let reused = |(status, _, body): (u16, bool, Value)| {
        assert_eq!((status, body["code"].as_str()), (422, Some("idempotency_key_reused")), "{body}");
    };

    // A payment's key, sent again for a movement or a transfer out of the same wallet.
    assert_eq!(send("/wallets/ka/pay", "k-pay", json!({ "amount": 10 })).await.0, 200);
    reused(send("/movements", "k-pay", legs(&[("ka", -5), ("kb", 5)])).await);
    reused(send("/transfers", "k-pay", json!({ "from": "ka", "to": "kb", "amount": 5 })).await);

    // A movement's key, sent again for a payment or a deposit on a wallet it took money out of;
    // and for itself, replayed.
    let split = legs(&[("ka", -20), ("kb", 15), ("kc", 5)]);
    let (status, _, made) = send("/movements", "k-split", split.clone()).await;
    assert_eq!(status, 201, "{made}");
    reused(send("/wallets/ka/pay", "k-split", json!({ "amount": 1 })).await);
    reused(send("/wallets/ka/deposit", "k-split", json!({ "amount": 1 })).await);
    let (status, replayed, again) = send("/movements", "k-split", split).await;
    assert_eq!((status, replayed, &again["id"]), (201, true, &made["id"]));
    // A transfer's key, the same way.
    let (status, _, _) =
        send("/transfers", "k-transfer", json!({ "from": "ka", "to": "kc", "amount": 7 })).await;
    assert_eq!(status, 200);
    reused(send("/wallets/ka/pay", "k-transfer", json!({ "amount": 7 })).await);

    assert_eq!(balances(&app.db, &wallets).await, [963, 15, 12], "each ran once, the refused not at all");
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");
}
