//! Metadata (docs/api/history.md): the caller's own key-value pairs on every movement of money,
//! kept with each entry the movement writes, returned with it, part of the request an idempotency
//! key stands for, and a filter of a wallet's entries.

use crate::support::TestEnv;
use crate::support::fleet::Fleet;
use crate::support::load::open_wallets;
use serde_json::{Value, json};

/// `POST path` with `body` and a fresh idempotency key through nginx: the status and the body.
async fn post(fleet: &Fleet, path: &str, body: Value) -> (u16, Value) {
    post_keyed(fleet, path, body, &uuid::Uuid::new_v4().to_string()).await
}

async fn post_keyed(fleet: &Fleet, path: &str, body: Value, key: &str) -> (u16, Value) {
    let response =
        fleet.client.post(fleet.url(path)).header("idempotency-key", key).json(&body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn tagged(tag: &str) -> Value {
    json!({ "order_id": format!("o-{tag}"), "channel": "web" })
}

/// The entries of `wallet` whose metadata has `order_id` `o-<tag>` and `channel` `web`.
async fn selected(fleet: &Fleet, wallet: &str, tag: &str) -> Vec<Value> {
    let path = format!("/wallets/{wallet}/entries?metadata[order_id]=o-{tag}&metadata[channel]=web");
    let page = fleet.read(&path).await;
    page["entries"].as_array().unwrap_or_else(|| panic!("{path}: {page}")).clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_movement_keeps_its_metadata_in_each_entry_it_writes_and_its_entries_are_selected_by_it() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["ma", "mb", "mc"], 10_000).await;
    let ok = |(status, body): (u16, Value), what: &str| {
        assert!(status == 200 || status == 201, "{what}: {status} {body}");
        body
    };

    let deposit = ok(
        post(&fleet, "/wallets/ma/deposit", json!({ "amount": 100, "metadata": tagged("deposit") })).await,
        "deposit",
    );
    assert_eq!(deposit["metadata"], tagged("deposit"));
    let paid =
        ok(post(&fleet, "/wallets/ma/pay", json!({ "amount": 10, "metadata": tagged("pay") })).await, "pay");
    assert_eq!(paid["metadata"], tagged("pay"));
    let hold = ok(
        post(&fleet, "/wallets/ma/holds", json!({ "amount": 20, "metadata": tagged("hold") })).await,
        "hold",
    );
    assert_eq!(hold["metadata"], tagged("hold"));
    let hold_id = hold["id"].as_str().unwrap();
    let captured = ok(post(&fleet, &format!("/holds/{hold_id}/capture"), json!({})).await, "capture");
    assert_eq!(captured["entry"]["metadata"], tagged("hold"), "a capture's entry keeps its hold's metadata");
    let transfer = json!({ "from": "ma", "to": "mb", "amount": 30, "metadata": tagged("transfer") });
    let transfer = ok(post(&fleet, "/transfers", transfer).await, "transfer");
    for field in ["metadata", "from_entry", "to_entry"] {
        let metadata = if field == "metadata" { &transfer[field] } else { &transfer[field]["metadata"] };
        assert_eq!(metadata, &tagged("transfer"), "the transfer's {field}");
    }
    let legs = json!([{ "wallet_id": "ma", "amount": -40 }, { "wallet_id": "mb", "amount": 25 },
                      { "wallet_id": "mc", "amount": 15 }]);
    let split =
        ok(post(&fleet, "/movements", json!({ "legs": legs, "metadata": tagged("split") })).await, "split");
    assert_eq!(split["metadata"], tagged("split"));
    assert!(split["legs"].as_array().unwrap().iter().all(|leg| leg["metadata"] == tagged("split")));
    let refund = json!({ "payment": paid["id"], "amount": 5, "metadata": tagged("refund") });
    ok(post(&fleet, "/wallets/ma/refunds", refund).await, "payment refund");
    let path = format!("/transfers/{}/refund", transfer["id"].as_str().unwrap());
    ok(
        post(&fleet, &path, json!({ "amount": 3, "metadata": tagged("transfer-refund") })).await,
        "transfer refund",
    );
    let path = format!("/movements/{}/refund", split["id"].as_str().unwrap());
    ok(
        post(&fleet, &path, json!({ "amount": 4, "metadata": tagged("split-refund") })).await,
        "movement refund",
    );

    // Each movement's entries, and only they, on every wallet it touched.
    let touched: [(&str, &[&str]); 8] = [
        ("deposit", &["ma"]),
        ("pay", &["ma"]),
        ("hold", &["ma"]),
        ("transfer", &["ma", "mb"]),
        ("split", &["ma", "mb", "mc"]),
        ("refund", &["ma"]),
        ("transfer-refund", &["ma", "mb"]),
        ("split-refund", &["ma", "mb", "mc"]),
    ];
    for (tag, wallets) in touched {
        for wallet in ["ma", "mb", "mc"] {
            let entries = selected(&fleet, wallet, tag).await;
            let expected = usize::from(wallets.contains(&wallet));
            assert_eq!(entries.len(), expected, "{tag} on {wallet}: {entries:?}");
            assert!(entries.iter().all(|entry| entry["metadata"] == tagged(tag)), "{tag}: {entries:?}");
        }
    }
    let other_channel =
        fleet.read("/wallets/ma/entries?metadata[order_id]=o-pay&metadata[channel]=app").await;
    assert_eq!(other_channel["entries"], json!([]), "every pair must match");
    let opened = fleet.read("/wallets/ma/entries?limit=1").await;
    assert!(opened["entries"][0].get("metadata").is_none(), "an entry without metadata shows none: {opened}");

    // Exports carry it: NDJSON as the entry's field, CSV as a JSON object in its own column.
    let export = |accept: &'static str| {
        let url = fleet.url("/wallets/ma/entries?metadata[order_id]=o-pay");
        let request = fleet.client.get(url).header("accept", accept);
        async move { request.send().await.unwrap().text().await.unwrap() }
    };
    let ndjson = export("application/x-ndjson").await;
    let line: Value = serde_json::from_str(ndjson.lines().next().unwrap()).unwrap();
    assert_eq!(line["metadata"], tagged("pay"));
    let csv = export("text/csv").await;
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let column = header.iter().position(|name| *name == "metadata").expect("a metadata column");
    let row = rows.next().expect("the payment's row");
    assert!(row.contains(r#""{""channel"":""web"",""order_id"":""o-pay""}""#), "{row}");
    assert_eq!(rows.next(), None, "one entry selected");
    assert_eq!(column, 8, "{header:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_metadata_is_a_400_that_changes_nothing_and_a_key_sent_again_with_other_metadata_is_refused() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    open_wallets(&fleet, &["mm"], 1_000).await;
    let version = || async { fleet.read("/wallets/mm").await["version"].as_i64().unwrap() };
    let before = version().await;

    let many: serde_json::Map<String, Value> = (0..17).map(|n| (format!("k{n}"), json!("v"))).collect();
    let bad = [
        Value::Object(many),
        json!({ "count": 1 }),
        json!({ "gone": null }),
        json!({ "": "empty key" }),
        json!({ "k".repeat(65): "a key too long" }),
        json!({ "long": "v".repeat(257) }),
        json!({ "nul": "a\u{0}b" }),
    ];
    for metadata in bad {
        for (path, body) in [
            ("/wallets/mm/pay", json!({ "amount": 1, "metadata": metadata })),
            ("/wallets/mm/deposit", json!({ "amount": 1, "metadata": metadata })),
            ("/wallets/mm/holds", json!({ "amount": 1, "metadata": metadata })),
        ] {
            let (status, problem) = post(&fleet, path, body).await;
            assert_eq!(
                (status, problem["code"].as_str()),
                (400, Some("invalid_metadata")),
                "{path} {metadata}"
            );
            assert_eq!(problem["field"], "metadata");
        }
    }
    let (status, problem) = post(&fleet, "/wallets/mm/pay", json!({ "amount": 1, "metadata": ["a"] })).await;
    assert_eq!(status, 400, "metadata that is not an object: {problem}");
    assert_eq!(version().await, before, "no bad request moved anything");

    // The bounds are inclusive: 16 keys of 64 characters, each value 256.
    let widest: serde_json::Map<String, Value> =
        (0..16).map(|n| (format!("{n:0>64}"), json!("é".repeat(256)))).collect();
    let (status, body) = post(&fleet, "/wallets/mm/pay", json!({ "amount": 1, "metadata": widest })).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["metadata"], Value::Object(widest));

    // The metadata is part of the request a key stands for.
    let first = json!({ "amount": 2, "metadata": { "order_id": "o-1" } });
    let (status, paid) = post_keyed(&fleet, "/wallets/mm/pay", first.clone(), "meta-key").await;
    assert_eq!(status, 200);
    let (status, replayed) = post_keyed(&fleet, "/wallets/mm/pay", first, "meta-key").await;
    assert_eq!((status, &replayed), (200, &paid), "the same request replays the same answer");
    let other = json!({ "amount": 2, "metadata": { "order_id": "o-2" } });
    let (status, problem) = post_keyed(&fleet, "/wallets/mm/pay", other, "meta-key").await;
    assert_eq!((status, problem["code"].as_str()), (422, Some("idempotency_key_reused")));
    assert_eq!(version().await, before + 2, "two payments, not three");

    // A filter is held to the same rule; a parameter `metadata` alone is unknown.
    let too_many: String = (0..17).map(|n| format!("&metadata[k{n}]=v")).collect();
    for (query, code) in [
        ("metadata[]=x".to_owned(), "invalid_metadata"),
        (format!("metadata[{}]=x", "k".repeat(65)), "invalid_metadata"),
        (format!("limit=5{too_many}"), "invalid_metadata"),
        ("metadata[a]=1&metadata[a]=2".to_owned(), "invalid_metadata"),
        ("metadata=x".to_owned(), "invalid_query"),
    ] {
        let response =
            fleet.client.get(fleet.url(&format!("/wallets/mm/entries?{query}"))).send().await.unwrap();
        assert_eq!(response.status(), 400, "{query}");
        assert_eq!(response.json::<Value>().await.unwrap()["code"], code, "{query}");
    }
}

/// The same under Postgres alone: with Redis gone, a payment, a transfer and a split are decided
/// by the one core under row locks, and their entries keep their metadata all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_postgres_alone_every_movement_keeps_its_metadata_too() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 1, &[]).await;
    open_wallets(&fleet, &["pa", "pb", "pc"], 1_000).await;
    env.own_redis().kill();

    let (status, body) =
        post(&fleet, "/wallets/pa/pay", json!({ "amount": 1, "metadata": tagged("alone") })).await;
    assert_eq!(status, 200, "{body}");
    let transfer = json!({ "from": "pa", "to": "pb", "amount": 2, "metadata": tagged("alone-transfer") });
    let (status, body) = post(&fleet, "/transfers", transfer).await;
    assert_eq!(status, 200, "{body}");
    let legs = json!([{ "wallet_id": "pa", "amount": -3 }, { "wallet_id": "pc", "amount": 3 }]);
    let (status, body) =
        post(&fleet, "/movements", json!({ "legs": legs, "metadata": tagged("alone-split") })).await;
    assert_eq!(status, 201, "{body}");
    let by_path = fleet.read("/readyz").await;
    assert_eq!(by_path["payments"], "postgres_only", "{by_path}");
    for (tag, wallets) in
        [("alone", &["pa"][..]), ("alone-transfer", &["pa", "pb"]), ("alone-split", &["pa", "pc"])]
    {
        for wallet in wallets {
            let entries = selected(&fleet, wallet, tag).await;
            assert_eq!(entries.len(), 1, "{tag} on {wallet}");
        }
    }
    env.own_redis().start_again();
}
