//! `POST /batches`: up to 1,000 movements in one request, through nginx to three replicas. Each
//! item is answered exactly as its single route answers it (status and body, the same bytes its
//! key replays), items on one wallet are decided in the batch's order, a batch retried whole (even
//! after its replica was killed mid-batch, or through a FLUSHALL or a Redis outage) charges every
//! item once, and a batch that cannot be read
//! is refused whole with nothing applied. Each ends with the bank check or `walletlock audit`.

use crate::support::TestEnv;
use crate::support::fleet::{Fleet, audit, audit_books};
use crate::support::load::{Outcome, open_wallets, opened, told};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// POSTs `body` to `url` with the test's token: the status and the JSON answer.
async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let response = client.post(url).json(body).send().await.expect("an answer");
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// Sends a batch of `items` through nginx: the status and the answer.
pub(crate) async fn batch(fleet: &Fleet, items: &[Value]) -> (u16, Value) {
    post(&fleet.client, &fleet.url("/batches"), &json!({ "items": items })).await
}

/// Sends a batch that must be read, and answers its items' answers.
async fn batch_items(fleet: &Fleet, items: &[Value]) -> Vec<Value> {
    let (status, answer) = batch(fleet, items).await;
    assert_eq!(status, 200, "{answer}");
    let answers = answer["items"].as_array().expect("items").clone();
    assert_eq!(answers.len(), items.len(), "one answer per item, in order");
    answers
}

/// A single keyed request through nginx: status and body.
async fn single(fleet: &Fleet, path: &str, key: &str, body: Option<&Value>) -> (u16, Value, bool) {
    let mut request = fleet.client.post(fleet.url(path)).header("idempotency-key", key);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.expect("an answer");
    let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null), replayed)
}

pub(crate) fn pay(wallet: &str, amount: i64, key: &str) -> Value {
    json!({ "op": "pay", "wallet_id": wallet, "amount": amount, "idempotency_key": key })
}

pub(crate) async fn balance(fleet: &Fleet, wallet: &str) -> (i64, i64) {
    let wallet = fleet.read(&format!("/wallets/{wallet}")).await;
    (wallet["balance"].as_i64().expect("a balance"), wallet["version"].as_i64().expect("a version"))
}

fn audit_ok(fleet: &Fleet) {
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "walletlock audit: {report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_every_kind_of_item_answers_each_as_its_single_route_does() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["mix-a", "mix-b", "mix-c"], 10_000).await;
    let id = |(status, body, _): (u16, Value, bool)| {
        assert!(status == 200 || status == 201, "{status} {body}");
        body["id"].as_str().expect("an id").to_owned()
    };
    // What the capture, void and refund items name, made by the single routes.
    let hold_to_capture =
        id(single(&fleet, "/wallets/mix-a/holds", "h1", Some(&json!({"amount": 300}))).await);
    let hold_to_void = id(single(&fleet, "/wallets/mix-a/holds", "h2", Some(&json!({"amount": 200}))).await);
    let held = json!({"legs": [{"wallet_id": "mix-a", "amount": -100}, {"wallet_id": "mix-b", "amount": 100}],
                      "hold": {}});
    let movement_to_capture = id(single(&fleet, "/movements", "m1", Some(&held)).await);
    let movement_to_void = id(single(&fleet, "/movements", "m2", Some(&held)).await);
    let posted =
        json!({"legs": [{"wallet_id": "mix-a", "amount": -50}, {"wallet_id": "mix-c", "amount": 50}]});
    let movement_to_refund = id(single(&fleet, "/movements", "m3", Some(&posted)).await);
    let transfer = json!({"from": "mix-a", "to": "mix-b", "amount": 70});
    let transfer_to_refund = id(single(&fleet, "/transfers", "t1", Some(&transfer)).await);
    let payment_to_refund =
        id(single(&fleet, "/wallets/mix-a/pay", "p1", Some(&json!({"amount": 40}))).await);

    // Each item, and the single request it is: path and body (none for a void).
    let cases: Vec<(Value, String, Option<Value>, u16)> = vec![
        (
            json!({"op": "deposit", "wallet_id": "mix-a", "amount": 500, "metadata": {"run": "7"}, "idempotency_key": "b-dep"}),
            "/wallets/mix-a/deposit".into(),
            Some(json!({"amount": 500, "metadata": {"run": "7"}})),
            200,
        ),
        (
            json!({"op": "pay", "wallet_id": "mix-b", "amount": 25, "reference": "order-1", "idempotency_key": "b-pay"}),
            "/wallets/mix-b/pay".into(),
            Some(json!({"amount": 25, "reference": "order-1"})),
            200,
        ),
        (
            json!({"op": "transfer", "from": "mix-b", "to": "mix-c", "amount": 15, "idempotency_key": "b-tr"}),
            "/transfers".into(),
            Some(json!({"from": "mix-b", "to": "mix-c", "amount": 15})),
            200,
        ),
        (
            json!({"op": "movement", "legs": [{"wallet_id": "mix-c", "amount": -30}, {"wallet_id": "mix-a", "amount": 20},
                                            {"wallet_id": "mix-b", "amount": 10}], "idempotency_key": "b-mv"}),
            "/movements".into(),
            Some(
                json!({"legs": [{"wallet_id": "mix-c", "amount": -30}, {"wallet_id": "mix-a", "amount": 20},
                                                   {"wallet_id": "mix-b", "amount": 10}]}),
            ),
            201,
        ),
        (
            json!({"op": "hold", "wallet_id": "mix-c", "amount": 60, "expires_in": 600, "idempotency_key": "b-hold"}),
            "/wallets/mix-c/holds".into(),
            Some(json!({"amount": 60, "expires_in": 600})),
            201,
        ),
        (
            json!({"op": "capture", "hold_id": hold_to_capture, "amount": 120, "idempotency_key": "b-cap-h"}),
            format!("/holds/{hold_to_capture}/capture"),
            Some(json!({"amount": 120})),
            200,
        ),
        (
            json!({"op": "capture", "movement_id": movement_to_capture, "idempotency_key": "b-cap-m"}),
            format!("/movements/{movement_to_capture}/capture"),
            None,
            200,
        ),
        (
            json!({"op": "void", "hold_id": hold_to_void, "idempotency_key": "b-void-h"}),
            format!("/holds/{hold_to_void}/void"),
            None,
            200,
        ),
        (
            json!({"op": "void", "movement_id": movement_to_void, "idempotency_key": "b-void-m"}),
            format!("/movements/{movement_to_void}/void"),
            None,
            200,
        ),
        (
            json!({"op": "refund", "wallet_id": "mix-a", "payment": payment_to_refund, "amount": 10, "idempotency_key": "b-ref-p"}),
            "/wallets/mix-a/refunds".into(),
            Some(json!({"payment": payment_to_refund, "amount": 10})),
            200,
        ),
        (
            json!({"op": "refund", "transfer_id": transfer_to_refund, "amount": 7, "idempotency_key": "b-ref-t"}),
            format!("/transfers/{transfer_to_refund}/refund"),
            Some(json!({"amount": 7})),
            200,
        ),
        (
            json!({"op": "refund", "movement_id": movement_to_refund, "idempotency_key": "b-ref-m"}),
            format!("/movements/{movement_to_refund}/refund"),
            None,
            201,
        ),
        // Refusals are the item's own, as its route gives them; the other items go on.
        (
            json!({"op": "pay", "wallet_id": "mix-b", "amount": 1_000_000, "idempotency_key": "b-broke"}),
            "/wallets/mix-b/pay".into(),
            Some(json!({"amount": 1_000_000})),
            422,
        ),
        (
            json!({"op": "pay", "wallet_id": "mix-b", "amount": 0, "idempotency_key": "b-zero"}),
            "/wallets/mix-b/pay".into(),
            Some(json!({"amount": 0})),
            400,
        ),
        (
            json!({"op": "deposit", "wallet_id": "no-such", "amount": 5, "idempotency_key": "b-none"}),
            "/wallets/no-such/deposit".into(),
            Some(json!({"amount": 5})),
            404,
        ),
    ];
    let items: Vec<Value> = cases.iter().map(|(item, ..)| item.clone()).collect();
    let answers = batch_items(&fleet, &items).await;
    for ((item, path, body, status), answer) in cases.iter().zip(&answers) {
        assert_eq!(answer["status"], *status, "{item}: {answer}");
        assert!(answer.get("replayed").is_none(), "{answer}");
        // The same request to the single route, with the item's key: what the item was answered,
        // byte for byte (a stored outcome replays; a 400 or 404 is answered again the same way).
        let key = item["idempotency_key"].as_str().unwrap();
        let (single_status, single_body, replayed) = single(&fleet, path, key, body.as_ref()).await;
        assert_eq!((single_status, &single_body), (*status, &answer["body"]), "{item}");
        if *status < 300 || *status == 422 {
            assert!(replayed, "{item}: the single route replays the item's stored outcome");
        }
    }
    assert_eq!(answers[12]["body"]["code"], "insufficient_funds");
    assert_eq!(answers[13]["body"]["code"], "invalid_amount");
    assert_eq!(answers[14]["body"]["code"], "wallet_not_found");
    assert_eq!(answers[0]["body"]["metadata"], json!({"run": "7"}));
    audit_ok(&fleet);
}

#[tokio::test(flavor = "multi_thread")]
async fn items_on_one_wallet_are_decided_in_the_batchs_order() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["order-a", "order-b"], 10).await;

    // 10, then pay 6 and pay 6: the first is paid, the second refused; never the other way round.
    let answers = batch_items(&fleet, &[pay("order-a", 6, "o1"), pay("order-a", 6, "o2")]).await;
    assert_eq!(answers[0]["status"], 200, "{}", answers[0]);
    assert_eq!(answers[0]["body"]["balance"], 4);
    assert_eq!(answers[1]["status"], 422, "{}", answers[1]);
    assert_eq!(answers[1]["body"]["code"], "insufficient_funds");
    assert_eq!(answers[1]["body"]["balance"], 4);

    // A deposit then a payment it pays for: in the other order the payment would be refused.
    let deposit = json!({"op": "deposit", "wallet_id": "order-b", "amount": 5, "idempotency_key": "o3"});
    let answers = batch_items(&fleet, &[deposit, pay("order-b", 15, "o4")]).await;
    assert_eq!((answers[0]["status"].as_i64(), answers[1]["status"].as_i64()), (Some(200), Some(200)));
    assert_eq!(answers[1]["body"]["balance"], 0);

    // Many items on a few wallets, interleaved with transfers between them: each wallet's entries
    // are written in the batch's order (each version one past the last, each balance the last's
    // less what moved), and its payments stop exactly where its money runs out.
    let wallets = ["seq-1", "seq-2", "seq-3"];
    open_wallets(&fleet, &wallets, 100).await;
    let mut items = Vec::new();
    for n in 0..150 {
        let wallet = wallets[n % 3];
        if n % 10 == 9 {
            let to = wallets[(n + 1) % 3];
            items.push(json!({"op": "transfer", "from": wallet, "to": to, "amount": 1, "idempotency_key": format!("s{n}")}));
        } else {
            items.push(pay(wallet, 3, &format!("s{n}")));
        }
    }
    let answers = batch_items(&fleet, &items).await;
    let mut last: BTreeMap<&str, (i64, i64)> = wallets.iter().map(|w| (*w, (100, 1))).collect();
    for (item, answer) in items.iter().zip(&answers) {
        let entries: Vec<(&str, i64, &Value)> = if item["op"] == "pay" {
            vec![(item["wallet_id"].as_str().unwrap(), -3, &answer["body"])]
        } else {
            vec![
                (item["from"].as_str().unwrap(), -1, &answer["body"]["from_entry"]),
                (item["to"].as_str().unwrap(), 1, &answer["body"]["to_entry"]),
            ]
        };
        let (wallet, amount, _) = entries[0];
        let (balance, _) = last[wallet];
        if balance + amount < 0 {
            assert_eq!(answer["status"], 422, "{item}: {answer}");
            assert_eq!(
                answer["body"]["balance"], balance,
                "{item}: refused at the balance the items before it left"
            );
            continue;
        }
        assert_eq!(answer["status"], 200, "{item}: {answer}");
        for (wallet, amount, entry) in entries {
            let (balance, version) = last[wallet];
            assert_eq!(
                (entry["balance"].as_i64(), entry["version"].as_i64()),
                (Some(balance + amount), Some(version + 1)),
                "{item}: {wallet} decided after every earlier item on it"
            );
            last.insert(wallet, (balance + amount, version + 1));
        }
    }
    for wallet in wallets {
        assert_eq!(balance(&fleet, wallet).await, last[wallet]);
    }

    // Deposits and payments of one wallet join its queue in the batch's order, each once the one
    // before it is queued: decided in order, and many in a group commit, not one a turn.
    open_wallets(&fleet, &["burst"], 0).await;
    let items: Vec<Value> = (0..60)
        .map(|n| match n % 3 {
            0 => json!({"op": "deposit", "wallet_id": "burst", "amount": 2, "idempotency_key": format!("b{n}")}),
            _ => pay("burst", 1, &format!("b{n}")),
        })
        .collect();
    let commits_before = group_commits(&fleet).await;
    let answers = batch_items(&fleet, &items).await;
    let commits = group_commits(&fleet).await - commits_before;
    for (n, answer) in answers.iter().enumerate() {
        assert_eq!(
            answer["status"], 200,
            "item {n}: every payment is paid for by the deposit before it: {answer}"
        );
        assert_eq!(
            answer["body"]["version"],
            n as i64 + 2,
            "item {n} decided in the batch's order: {answer}"
        );
    }
    assert_eq!(balance(&fleet, "burst").await, (0, 61));
    assert!(commits < 30, "60 movements of one wallet in {commits} group commits");
    audit_ok(&fleet);
}

/// Group commits of one wallet's movements, summed over the fleet's replicas.
async fn group_commits(fleet: &Fleet) -> u64 {
    let mut commits = 0;
    for replica in &fleet.replicas {
        let metrics = fleet.client.get(replica.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let line = metrics.lines().find(|line| line.starts_with("walletlock_batch_movements_count "));
        commits += line.and_then(|line| line.split(' ').nth(1)?.parse::<u64>().ok()).unwrap_or(0);
    }
    commits
}

/// Resends the batch `items` through nginx until every item's outcome is definite (applied or
/// refused, not 503, not in flight), each time whole: answers each item's last answer.
pub(crate) async fn settle_batch(fleet: &Fleet, items: &[Value]) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, answer) = batch(fleet, items).await;
        if status == 200 {
            let answers = answer["items"].as_array().unwrap().clone();
            let open = |a: &Value| a["status"] == 503 || a["body"]["code"] == "idempotency_key_in_flight";
            if !answers.iter().any(open) {
                return answers;
            }
        } else {
            assert!([502, 503, 504].contains(&status), "{status} {answer}");
        }
        assert!(Instant::now() < deadline, "the batch did not settle: {status} {answer}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the client was told of `wallets` opened with their balances, then of the payments `items`,
/// every one of them answered 200 in `answers`: the acknowledgements `audit_books` checks.
pub(crate) fn paid(wallets: &[(&str, i64)], items: &[Value], answers: &[Value]) -> Vec<Value> {
    let mut acks = opened(wallets);
    for (item, answer) in items.iter().zip(answers) {
        assert_eq!(answer["status"], 200, "{item}: {answer}");
        let entry = answer["body"]["id"].as_str().unwrap().parse().unwrap();
        let (wallet, amount) = (item["wallet_id"].as_str().unwrap(), item["amount"].as_i64().unwrap());
        let key = item["idempotency_key"].as_str().unwrap();
        acks.push(told(key, &Outcome::Applied(entry), &[(wallet, -amount)]));
    }
    acks
}

/// An `X-Request-Id` that nginx sends to `replica`: requests about no wallet (a batch) are routed
/// by it.
pub(crate) async fn request_id_served_by(fleet: &Fleet, replica: &str) -> String {
    for n in 0..1000 {
        let id = format!("route-{n}");
        let response =
            fleet.client.get(fleet.url("/healthz")).header("x-request-id", &id).send().await.unwrap();
        if response.headers()["x-served-by"] == replica {
            return id;
        }
    }
    panic!("no request id routed to {replica}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_retried_whole_after_its_replica_was_killed_mid_batch_charges_every_item_once() {
    let env = TestEnv::new();
    let settings = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];
    let mut fleet = Fleet::start(&env, 3, &settings).await;
    let wallets: Vec<String> = (0..40).map(|n| format!("kill-{n}")).collect();
    let names: Vec<&str> = wallets.iter().map(String::as_str).collect();
    open_wallets(&fleet, &names, 1_000).await;
    // 200 payments, 5 on each wallet, amounts that tell them apart.
    let items: Vec<Value> =
        (0..200).map(|n| pay(&wallets[n % 40], 1 + (n / 40) as i64, &format!("kill-item-{n}"))).collect();

    // Replica 1 kills itself right after its first round commits: some items are in the ledger,
    // the rest never ran, and the client gets no answer for any of them.
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("after_commit"));
    fleet.replicas[0].start();
    let request_id = request_id_served_by(&fleet, "replica-1").await;
    let response = fleet
        .client
        .post(fleet.url("/batches"))
        .header("x-request-id", &request_id)
        .json(&json!({ "items": items }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502, "nginx lost the replica mid-batch");
    // Its sockets close as it dies, so nginx may answer a moment before the process is gone.
    let dying = Instant::now();
    while !fleet.replicas[0].exited() {
        assert!(dying.elapsed() < Duration::from_secs(10), "the failpoint killed replica-1");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_entry WHERE kind = 'pay'")
        .fetch_one(&fleet.db)
        .await
        .unwrap_or(-1);
    assert!(committed > 0 && committed < 200, "mid-batch: {committed} of 200 committed");
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();

    // Retried whole through nginx: the committed items replay, the others apply, each once.
    let answers = settle_batch(&fleet, &items).await;
    let acks = paid(&names.iter().map(|w| (*w, 1_000)).collect::<Vec<_>>(), &items, &answers);
    let replayed = answers.iter().filter(|answer| answer["replayed"] == true).count();
    assert!(replayed as i64 >= committed, "{replayed} replayed, {committed} were committed before the kill");
    for (n, wallet) in wallets.iter().enumerate() {
        let charged: i64 = (0..5).map(|round| 1 + round).sum();
        assert_eq!(balance(&fleet, wallet).await.0, 1_000 - charged, "{wallet} ({n})");
    }
    audit_books(&fleet.database_url, &acks);
    fleet.replicas[0].stop(Signal::SIGKILL);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_retried_replays_every_item_and_charges_nothing_more() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    let wallets = ["again-1", "again-2", "again-3", "again-4"];
    open_wallets(&fleet, &wallets, 100).await;
    let items: Vec<Value> = (0..40).map(|n| pay(wallets[n % 4], 2, &format!("again-{n}"))).collect();
    let first = batch_items(&fleet, &items).await;
    let second = batch_items(&fleet, &items).await;
    for ((item, first), second) in items.iter().zip(&first).zip(&second) {
        assert_eq!(first["status"], 200, "{item}: {first}");
        assert_eq!((&second["status"], &second["body"]), (&first["status"], &first["body"]), "{item}");
        assert_eq!(second["replayed"], true, "{item}: {second}");
    }
    for wallet in wallets {
        assert_eq!(balance(&fleet, wallet).await, (80, 11), "{wallet}: ten payments of 2, once each");
    }
    // A key sent again with another request is that item's refusal, not the batch's.
    let changed = [pay("again-1", 3, "again-0"), pay("again-1", 1, "again-new")];
    let answers = batch_items(&fleet, &changed).await;
    assert_eq!(answers[0]["status"], 422, "{}", answers[0]);
    assert_eq!(answers[0]["body"]["code"], "idempotency_key_reused");
    assert_eq!(answers[1]["status"], 200, "{}", answers[1]);
    assert_eq!(balance(&fleet, "again-1").await, (79, 12));
    audit_ok(&fleet);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_that_cannot_be_read_is_refused_whole_and_applies_nothing() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["whole"], 1_000).await;
    let good = |n: usize| pay("whole", 1, &format!("whole-{n}"));
    let many: Vec<Value> = (0..1001).map(good).collect();
    let cases: Vec<(&str, Value, Option<i64>)> = vec![
        ("no items", json!({"items": []}), None),
        ("1,001 items", json!({"items": many}), None),
        ("no items field", json!({"payments": [good(0)]}), None),
        ("a field beside items", json!({"items": [good(0)], "atomic": true}), None),
        (
            "an item without a key",
            json!({"items": [good(0), {"op": "pay", "wallet_id": "whole", "amount": 1}]}),
            Some(1),
        ),
        ("a key twice", json!({"items": [good(0), good(1), good(0)]}), Some(2)),
        (
            "an unknown op",
            json!({"items": [good(0), {"op": "withdraw", "wallet_id": "whole", "amount": 1, "idempotency_key": "x"}]}),
            Some(1),
        ),
        (
            "a malformed item among good ones",
            json!({"items": [good(0), {"op": "pay", "wallet_id": "whole", "amount": "ten", "idempotency_key": "x"}, good(2)]}),
            Some(1),
        ),
        (
            "a field its route does not take",
            json!({"items": [good(0), {"op": "pay", "wallet_id": "whole", "amount": 1, "to": "b", "idempotency_key": "x"}]}),
            Some(1),
        ),
        (
            "a pay without its wallet",
            json!({"items": [{"op": "pay", "amount": 1, "idempotency_key": "x"}]}),
            Some(0),
        ),
        (
            "a void with a field",
            json!({"items": [{"op": "void", "hold_id": "9a1f4bd2-6c11-4a52-9d6e-0b0d3a9f2e11", "amount": 1, "idempotency_key": "x"}]}),
            Some(0),
        ),
        ("an item not an object", json!({"items": [good(0), "pay whole 1"]}), Some(1)),
    ];
    for (what, body, item) in cases {
        let (status, answer) = post(&fleet.client, &fleet.url("/batches"), &body).await;
        assert_eq!((status, answer["code"].as_str()), (400, Some("invalid_batch")), "{what}: {answer}");
        assert_eq!(answer["item"].as_i64(), item, "{what}: {answer}");
    }

    // Not JSON; a field twice; a key for the batch itself; no token; not JSON's content type; a
    // body over 1 MiB.
    let raw = |body: &'static str| {
        fleet.client.post(fleet.url("/batches")).header("content-type", "application/json").body(body)
    };
    let refused = [
        ("not JSON", raw(r#"{"items": [{"op": "pay""#), 400, "malformed_json"),
        (
            "a field twice",
            raw(
                r#"{"items": [{"op": "pay", "wallet_id": "whole", "amount": 1, "amount": 2, "idempotency_key": "x"}]}"#,
            ),
            400,
            "invalid_batch",
        ),
        (
            "a key for the batch",
            raw(r#"{"items": []}"#).header("idempotency-key", "batch-1"),
            400,
            "invalid_idempotency_key",
        ),
        (
            "no token",
            reqwest::Client::new().post(fleet.url("/batches")).json(&json!({"items": [good(0)]})),
            401,
            "unauthorized",
        ),
        (
            "text",
            fleet.client.post(fleet.url("/batches")).header("content-type", "text/plain").body("{}"),
            415,
            "unsupported_media_type",
        ),
        (
            "over 1 MiB",
            fleet
                .client
                .post(fleet.url("/batches"))
                .json(&json!({"items": [good(0)], "pad": "x".repeat(1_100_000)})),
            413,
            "payload_too_large",
        ),
    ];
    for (what, request, status, code) in refused {
        let response = request.send().await.unwrap();
        let got = response.status().as_u16();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!((got, answer["code"].as_str()), (status, Some(code)), "{what}: {answer}");
    }
    assert_eq!(balance(&fleet, "whole").await, (1_000, 1), "nothing applied");

    // What can be read is the items' to answer: a value that breaks its rule is that item's 400,
    // and the others apply; 1,000 items is a batch.
    let answers = batch_items(&fleet, &[good(0), pay("whole", 0, "zero"), pay("bad/id", 1, "slash")]).await;
    assert_eq!(answers.iter().map(|a| a["status"].as_i64().unwrap()).collect::<Vec<_>>(), [200, 400, 400]);
    assert_eq!(answers[1]["body"]["code"], "invalid_amount");
    assert_eq!(answers[2]["body"]["code"], "invalid_wallet_id");
    assert_eq!(balance(&fleet, "whole").await, (999, 2));
    let spread: Vec<String> = (0..100).map(|n| format!("whole-{n}")).collect();
    open_wallets(&fleet, &spread.iter().map(String::as_str).collect::<Vec<_>>(), 10).await;
    let most: Vec<Value> = (0..1000).map(|n| pay(&spread[n % 100], 1, &format!("most-{n}"))).collect();
    // Ten items a wallet take ten turns: on a slow path (Citus, a busy machine) the tail may not
    // finish within REQUEST_TIMEOUT, and is answered 503 to be retried with its key, as the batch
    // is here, whole, until every item is paid (each charged once: the balances below).
    for attempt in 1.. {
        let answers = batch_items(&fleet, &most).await;
        let unpaid: Vec<&Value> = answers.iter().filter(|a| a["status"] != 200).collect();
        if unpaid.is_empty() {
            break;
        }
        for answer in &unpaid {
            let code = answer["body"]["code"].as_str();
            let retry =
                matches!(code, Some("request_timeout" | "overloaded")) && answer["retry_after"].is_number();
            assert!(retry, "only what a retry settles is left: {answer}");
        }
        assert!(attempt < 10, "{} items still unpaid after {attempt} attempts", unpaid.len());
    }
    for wallet in &spread {
        assert_eq!(balance(&fleet, wallet).await, (0, 11), "{wallet}");
    }
    audit_ok(&fleet);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_short_of_room_runs_a_batch_in_a_narrower_window_and_answers_its_tail_overloaded() {
    let env = TestEnv::new();
    // Room for two requests at once, and a short request bound: the batch holds one permit and
    // takes the other, so it never sheds its own items for want of room; the items it cannot
    // start before its deadline are answered `overloaded`, nothing of them applied.
    let settings = [("MAX_IN_FLIGHT", "2"), ("REQUEST_TIMEOUT", "1s"), ("LEASE_WAIT", "500ms")];
    let fleet = Fleet::start(&env, 3, &settings).await;
    open_wallets(&fleet, &["narrow"], 1_000).await;
    let items: Vec<Value> = (0..1000).map(|n| pay("narrow", 1, &format!("narrow-{n}"))).collect();
    let answers = batch_items(&fleet, &items).await;
    let mut applied = answers.iter().take_while(|a| a["status"] == 200).count();
    assert!(applied > 0, "{}", answers[0]);
    // The item running at the deadline (one at most: they take turns on one wallet) is answered
    // `request_timeout` and may apply: sent again with its key, it is decided once.
    let mut tail = &answers[applied..];
    if tail.first().is_some_and(|a| a["body"]["code"] == "request_timeout") {
        let item = &items[applied];
        let again = settle_batch(&fleet, std::slice::from_ref(item)).await;
        assert_eq!(again[0]["status"], 200, "{item}: {}", again[0]);
        applied += 1;
        tail = &tail[1..];
    }
    assert!(!tail.is_empty(), "1,000 payments in a row on one wallet should not fit in a second");
    for answer in tail {
        assert_eq!(answer["status"], 503, "{answer}");
        assert_eq!(answer["body"]["code"], "overloaded", "{answer}");
        assert_eq!(answer["retry_after"], 1, "{answer}");
    }
    let (balance, version) = balance(&fleet, "narrow").await;
    assert_eq!(
        (balance, version),
        (1_000 - applied as i64, 1 + applied as i64),
        "only the items answered 200"
    );
    audit_ok(&fleet);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_shed_at_its_arrival_is_a_503_and_leaves_its_replica_in_rotation() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[("MAX_IN_FLIGHT", "1")]).await;
    open_wallets(&fleet, &["shed-busy", "shed-a"], 1_000).await;
    // A payment stalled on its wallet's row holds the replica's one permit.
    let row = crate::support::hold_row(&fleet.db, "shed-busy").await;
    let (client, url) = (fleet.client.clone(), fleet.url("/wallets/shed-busy/pay"));
    let stalled = tokio::spawn(async move {
        client.post(url).header("idempotency-key", "stalled").json(&json!({"amount": 1})).send().await
    });
    crate::support::eventually("the payment holds the permit", Duration::from_secs(5), || async {
        let scrape =
            fleet.client.get(fleet.replicas[0].url("/metrics")).send().await.unwrap().text().await.unwrap();
        scrape
            .lines()
            .any(|line| line.starts_with("walletlock_lease_acquisitions_total") && !line.ends_with(" 0"))
    })
    .await;
    // The batch finds no room: shed whole, nothing of it applied.
    let items: Vec<Value> = (0..1000).map(|n| pay("shed-a", 1, &format!("shed-{n}"))).collect();
    let (status, answer) = batch(&fleet, &items).await;
    assert_eq!((status, answer["code"].as_str()), (503, Some("overloaded")), "{answer}");
    drop(row);
    let paid = stalled.await.unwrap().unwrap();
    assert_eq!(paid.status(), 200);
    // The replica answered the 503 itself and stays in rotation: the next batch is served.
    let log = fleet.access_log();
    let shed = log.iter().find(|line| line["uri"] == "/batches").expect("the batch in nginx's log");
    assert_eq!(shed["upstream_status"], "503", "{shed}");
    let answers = batch_items(&fleet, &items[..10]).await;
    assert!(answers.iter().all(|a| a["status"] == 200), "{answers:?}");
    assert_eq!(balance(&fleet, "shed-a").await, (990, 11));
    audit_ok(&fleet);
}

/// What Redis loses mid-batch.
enum RedisLoss {
    /// Every lease, fence counter and note, at once.
    FlushAll,
    /// Redis itself: SIGKILL, so the replicas go on under Postgres alone, then a new, empty one.
    Outage,
}

/// A batch of 1,000 payments over 50 wallets (20 turns each, so it runs a while) through nginx,
/// with `loss` striking once its first items are in the ledger; then the batch retried whole until
/// every item is answered: every item charged exactly once, and the audit clean.
async fn a_batch_goes_on_through(loss: RedisLoss) {
    let mut env = TestEnv::with_own_redis();
    let settings = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];
    let fleet = Fleet::start(&env, 3, &settings).await;
    let wallets: Vec<String> = (0..50).map(|n| format!("lost-{n}")).collect();
    open_wallets(&fleet, &wallets.iter().map(String::as_str).collect::<Vec<_>>(), 1_000).await;
    let items: Vec<Value> =
        (0..1000).map(|n| pay(&wallets[n % 50], 1 + (n / 50) as i64, &format!("lost-item-{n}"))).collect();

    let (client, url, body) = (fleet.client.clone(), fleet.url("/batches"), json!({ "items": items }));
    let first = tokio::spawn(async move { post(&client, &url, &body).await });
    let paid = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger_entry WHERE kind = 'pay'")
            .fetch_one(&fleet.db)
            .await
            .unwrap()
    };
    while paid().await == 0 {
        assert!(!first.is_finished(), "the batch answered before any item was in the ledger");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!first.is_finished(), "Redis is lost mid-batch, not after it");
    match loss {
        RedisLoss::FlushAll => env.redis_cmd::<()>(&["FLUSHALL"]).await,
        RedisLoss::Outage => env.own_redis().kill(),
    }
    let (status, answer) = first.await.unwrap();
    assert!([200, 502, 503, 504].contains(&status), "{status} {answer}");
    if let RedisLoss::Outage = loss {
        env.own_redis().start_again();
    }

    let answers = settle_batch(&fleet, &items).await;
    for (item, answer) in items.iter().zip(&answers) {
        assert_eq!(answer["status"], 200, "{item}: {answer}");
    }
    for wallet in &wallets {
        let charged: i64 = (1..=20).sum();
        assert_eq!(balance(&fleet, wallet).await, (1_000 - charged, 21), "{wallet}: each payment once");
    }
    audit_ok(&fleet);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_goes_on_through_a_flushall_mid_batch_and_charges_every_item_once() {
    a_batch_goes_on_through(RedisLoss::FlushAll).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_goes_on_through_a_redis_outage_mid_batch_and_charges_every_item_once() {
    a_batch_goes_on_through(RedisLoss::Outage).await;
}
