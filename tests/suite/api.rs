//! The HTTP API against the real router, with real Redis and Postgres: every status code, the
//! problem format, and bad input that changes nothing. And through the real nginx: the errors nginx
//! makes itself are problems of the same shape, and the replicas' own pass through untouched.

use crate::support::app::{TestApp, spawn_app, spawn_app_with};
use crate::support::fleet::Fleet;
use crate::support::hold_row;
use crate::support::{TestEnv, books, eventually};
use nix::sys::signal::Signal;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reads a problem+json response and checks the RFC 9457 members.
async fn problem(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(response.status().as_u16(), status, "for {code}");
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    assert_eq!(content_type, "application/problem+json");
    let body: Value = response.json().await.unwrap();
    problem_members(&body, status, code);
    body
}

/// The RFC 9457 members of a problem document, `status` equal to the HTTP status.
fn problem_members(body: &Value, status: u16, code: &str) {
    assert_eq!(body["status"], status, "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["type"], format!("urn:walletlock:problem:{code}"));
    assert!(body["title"].is_string() && body["detail"].is_string(), "{body}");
}

/// Everything about a wallet that a request could change.
async fn snapshot(app: &TestApp, id: &str) -> (i64, i64, i64, i64) {
    let books = books(&app.db, id).await;
    let version: i64 = sqlx::query_scalar("select version from wallet where id = $1")
        .bind(id)
        .fetch_one(&app.db)
        .await
        .unwrap();
    (books.balance, books.ledger_sum, books.pays, version)
}

#[tokio::test]
async fn a_wallet_is_opened_read_and_paid_from() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;

    let created = app.post_json("/wallets", json!({ "id": "alice", "balance": 100 })).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let wallet: Value = created.json().await.unwrap();
    assert_eq!(
        (wallet["id"].as_str(), wallet["balance"].as_i64(), wallet["version"].as_i64()),
        (Some("alice"), Some(100), Some(1))
    );

    let paid = app.post_json("/wallets/alice/pay", json!({ "amount": 30, "reference": "order-7" })).await;
    assert_eq!(paid.status(), StatusCode::OK);
    let payment: Value = paid.json().await.unwrap();
    assert_eq!(payment["kind"], "pay");
    assert_eq!(payment["wallet_id"], "alice");
    assert_eq!(
        (payment["amount"].as_i64(), payment["balance"].as_i64(), payment["version"].as_i64()),
        (Some(30), Some(70), Some(2))
    );
    assert_eq!(payment["reference"], "order-7");
    assert!(payment["fence"].as_i64().unwrap() >= 1);
    for field in ["id", "created_at"] {
        assert!(payment[field].is_string(), "{field} in {payment}");
    }

    let deposited: Value =
        app.post_json("/wallets/alice/deposit", json!({ "amount": 5 })).await.json().await.unwrap();
    assert_eq!((deposited["kind"].as_str(), deposited["balance"].as_i64()), (Some("deposit"), Some(75)));

    let read: Value = app.get("/wallets/alice").await.json().await.unwrap();
    assert_eq!((read["balance"].as_i64(), read["version"].as_i64()), (Some(75), Some(3)));
    assert!(read["updated_at"].is_string());
}

#[tokio::test]
async fn a_wallet_without_an_id_gets_a_uuid_and_an_existing_id_is_refused() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;

    let wallet: Value = app.post_json("/wallets", json!({})).await.json().await.unwrap();
    let id = wallet["id"].as_str().unwrap();
    assert!(uuid::Uuid::parse_str(id).is_ok(), "{id}");
    assert_eq!(wallet["balance"], 0);

    app.open_wallet("bob", 10).await;
    problem(app.post_json("/wallets", json!({ "id": "bob", "balance": 99 })).await, 409, "wallet_exists")
        .await;
    assert_eq!(snapshot(&app, "bob").await, (10, 10, 0, 1), "the first wallet is untouched");
}

#[tokio::test]
async fn not_enough_money_is_a_422_with_the_balance_and_charges_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("carol", 25).await;

    let body = problem(
        app.post_json("/wallets/carol/pay", json!({ "amount": 26 })).await,
        422,
        "insufficient_funds",
    )
    .await;
    assert_eq!(body["balance"], 25);
    assert_eq!(snapshot(&app, "carol").await, (25, 25, 0, 1));
}

#[tokio::test]
async fn a_deposit_that_would_overflow_is_a_422() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("rich", 0).await;
    // Nearly i64::MAX: unreachable through the API in practice, so set it directly.
    sqlx::query("update wallet set balance = 9223372036854775000 where id = 'rich'")
        .execute(&app.db)
        .await
        .unwrap();

    problem(
        app.post_json("/wallets/rich/deposit", json!({ "amount": 1_000_000 })).await,
        422,
        "balance_overflow",
    )
    .await;
    let balance: i64 =
        sqlx::query_scalar("select balance from wallet where id = 'rich'").fetch_one(&app.db).await.unwrap();
    assert_eq!(balance, 9223372036854775000);
}

#[tokio::test]
async fn unknown_wallets_and_routes_are_404_and_wrong_methods_405() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    problem(app.get("/wallets/nobody").await, 404, "wallet_not_found").await;
    problem(app.post_json("/wallets/nobody/pay", json!({ "amount": 1 })).await, 404, "wallet_not_found")
        .await;
    problem(app.get("/wallets/nobody/transactions").await, 404, "wallet_not_found").await;
    problem(app.get("/nowhere").await, 404, "not_found").await;
    problem(app.client.delete(app.url("/wallets/x")).send().await.unwrap(), 405, "method_not_allowed").await;
}

#[tokio::test]
async fn every_bad_payment_is_a_4xx_that_changes_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("dave", 1_000).await;
    let before = snapshot(&app, "dave").await;

    let bad_bodies: Vec<(&str, u16, &str)> = vec![
        (r#"{"amount":0}"#, 400, "invalid_amount"),
        (r#"{"amount":-1}"#, 400, "invalid_amount"),
        (r#"{"amount":1000000000001}"#, 400, "invalid_amount"),
        (r#"{"amount":1.5}"#, 400, "invalid_body"),
        (r#"{"amount":"10"}"#, 400, "invalid_body"),
        (r#"{"amount":1e30}"#, 400, "invalid_body"),
        (r#"{"amount":9223372036854775808}"#, 400, "invalid_body"),
        (r#"{"amount":null}"#, 400, "invalid_body"),
        (r#"{"amount":true}"#, 400, "invalid_body"),
        (r#"{"amount":[]}"#, 400, "invalid_body"),
        (r#"{"amount":{}}"#, 400, "invalid_body"),
        (r#"{}"#, 400, "invalid_body"),
        (r#"{"amount":1,"amount":2}"#, 400, "invalid_body"),
        (r#"{"amount":1,"extra":true}"#, 400, "invalid_body"),
        (r#"{"amount":10,"reference":7}"#, 400, "invalid_body"),
        (r#"[10]"#, 400, "invalid_body"),
        (r#"{"amount":"#, 400, "malformed_json"),
        (r#"not json"#, 400, "malformed_json"),
        ("", 400, "malformed_json"),
    ];
    for (body, status, code) in bad_bodies {
        let response = app
            .client
            .post(app.url("/wallets/dave/pay"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let problem = problem(response, status, code).await;
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()), "{body}: {problem}");
    }

    let long_reference = json!({ "amount": 1, "reference": "r".repeat(257) });
    problem(app.post_json("/wallets/dave/pay", long_reference).await, 400, "invalid_reference").await;

    let wrong_type = app
        .client
        .post(app.url("/wallets/dave/pay"))
        .header("content-type", "text/plain")
        .body(r#"{"amount":1}"#);
    problem(wrong_type.send().await.unwrap(), 415, "unsupported_media_type").await;
    let no_type = app.client.post(app.url("/wallets/dave/pay")).body(r#"{"amount":1}"#);
    problem(no_type.send().await.unwrap(), 415, "unsupported_media_type").await;

    let huge = format!(r#"{{"amount":1,"reference":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let too_large =
        app.client.post(app.url("/wallets/dave/pay")).header("content-type", "application/json").body(huge);
    problem(too_large.send().await.unwrap(), 413, "payload_too_large").await;

    for id in ["a%2Fb", "..", "%2e%2e", "a%00b", "a%0D%0Ab", "%C3%A9", &"x".repeat(65), "a.b"] {
        let response = app.post_json(&format!("/wallets/{id}/pay"), json!({ "amount": 1 })).await;
        let status = response.status().as_u16();
        assert!(status == 400 || status == 404, "{id}: {status}");
        if status == 400 {
            problem(response, 400, "invalid_wallet_id").await;
        }
    }

    assert_eq!(snapshot(&app, "dave").await, before, "no bad request changed the wallet");
}

#[tokio::test]
async fn bad_wallet_creations_are_4xx_and_create_nothing() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let cases: Vec<(Value, &str)> = vec![
        (json!({ "id": "", "balance": 1 }), "invalid_wallet_id"),
        (json!({ "id": "a/b" }), "invalid_wallet_id"),
        (json!({ "id": "x".repeat(65) }), "invalid_wallet_id"),
        (json!({ "id": "ok", "balance": -1 }), "invalid_balance"),
        (json!({ "id": "ok", "balance": 1_000_000_000_001i64 }), "invalid_balance"),
        (json!({ "id": "ok", "balance": 1.5 }), "invalid_body"),
        (json!({ "id": 7 }), "invalid_body"),
        (json!({ "id": "ok", "owner": "me" }), "invalid_body"),
    ];
    for (body, code) in cases {
        problem(app.post_json("/wallets", body).await, 400, code).await;
    }
    let wallets: i64 = sqlx::query_scalar("select count(*) from wallet").fetch_one(&app.db).await.unwrap();
    assert_eq!(wallets, 0);
}

#[tokio::test]
async fn transactions_come_newest_first_in_pages_with_a_cursor() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("erin", 100).await;
    for amount in 1..=4 {
        assert_eq!(app.post_json("/wallets/erin/pay", json!({ "amount": amount })).await.status(), 200);
    }

    let mut seen = Vec::new();
    let mut path = "/wallets/erin/transactions?limit=2".to_owned();
    loop {
        let page: Value = app.get(&path).await.json().await.unwrap();
        for entry in page["transactions"].as_array().unwrap() {
            seen.push((entry["kind"].as_str().unwrap().to_owned(), entry["version"].as_i64().unwrap()));
        }
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/wallets/erin/transactions?limit=2&before={cursor}"),
            None => break,
        }
    }
    let expected: Vec<(String, i64)> = [("pay", 5), ("pay", 4), ("pay", 3), ("pay", 2), ("open", 1)]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    assert_eq!(seen, expected);

    for query in ["limit=0", "limit=501", "limit=-1", "limit=abc", "limit=99999999999999999999"] {
        let code = if query == "limit=abc" || query.starts_with("limit=9999") {
            "invalid_query"
        } else {
            "invalid_limit"
        };
        problem(app.get(&format!("/wallets/erin/transactions?{query}")).await, 400, code).await;
    }
    for cursor in ["abc", "0", "-5", "1.5", "%00"] {
        problem(app.get(&format!("/wallets/erin/transactions?before={cursor}")).await, 400, "invalid_cursor")
            .await;
    }
}

#[tokio::test]
async fn every_response_carries_a_request_id_and_the_replica_name() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let given =
        app.client.get(app.url("/healthz")).header("x-request-id", "trace-me-42").send().await.unwrap();
    assert_eq!(given.headers()["x-request-id"], "trace-me-42");
    assert_eq!(given.headers()["x-served-by"], "test-replica");

    let made = app.get("/wallets/nobody").await;
    let id = made.headers()["x-request-id"].to_str().unwrap();
    assert!(uuid::Uuid::parse_str(id).is_ok(), "{id}");
    assert_eq!(made.headers()["x-served-by"], "test-replica");
}

#[tokio::test]
async fn without_redis_readiness_is_degraded_when_payments_go_on_under_postgres_and_a_503_when_they_are_refused()
 {
    let mut env = TestEnv::with_own_redis();
    let goes_on = spawn_app(&env).await;
    let refuses = spawn_app_with(&env, &["--redis-outage", "refuse"]).await;
    for app in [&goes_on, &refuses] {
        let ready = app.get("/readyz").await;
        assert_eq!(ready.status(), 200);
        let body: Value = ready.json().await.unwrap();
        assert_eq!((body["status"].as_str(), body["payments"].as_str()), (Some("ready"), Some("lease")));
    }

    let redis = env.redis.take().expect("own redis");
    drop(redis); // killed by pid
    let degraded = goes_on.get("/readyz").await;
    assert_eq!(degraded.status(), 200, "payments go on under Postgres alone");
    let body: Value = degraded.json().await.unwrap();
    assert_eq!(
        (body["status"].as_str(), body["redis"].as_str(), body["postgres"].as_str()),
        (Some("degraded"), Some("unavailable"), Some("ok"))
    );
    let not_ready = refuses.get("/readyz").await;
    assert_eq!(not_ready.status(), 503);
    let body: Value = not_ready.json().await.unwrap();
    assert_eq!(
        (body["status"].as_str(), body["redis"].as_str(), body["postgres"].as_str()),
        (Some("unavailable"), Some("unavailable"), Some("ok"))
    );
    for app in [&goes_on, &refuses] {
        assert_eq!(app.get("/healthz").await.status(), 200, "alive, whatever Redis does");
    }
}

#[tokio::test]
async fn a_wallet_held_for_the_whole_wait_is_a_503_lock_timeout() {
    let env = TestEnv::new();
    let app = spawn_app_with(&env, &["--lease-wait", "300ms"]).await;
    app.open_wallet("busy", 100).await;
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:busy").await.unwrap();

    let started = std::time::Instant::now();
    let response = app.post_json("/wallets/busy/pay", json!({ "amount": 10 })).await;
    assert_eq!(response.headers()["retry-after"], "1");
    problem(response, 503, "lock_timeout").await;
    assert!(started.elapsed() < Duration::from_secs(2), "gave up after the configured wait");
    holder.release().await.unwrap();
    assert_eq!(snapshot(&app, "busy").await, (100, 100, 0, 1));
}

#[tokio::test]
async fn a_lease_lost_before_the_commit_is_a_409_and_applies_nothing() {
    let env = TestEnv::new();
    let app = spawn_app_with(&env, &["--lease-ttl", "300ms"]).await;
    app.open_wallet("frank", 100).await;

    // Hold the wallet's row so the payment is stuck at its fenced commit, then make Redis lose its lease
    // (as a failover would): the watchdog notices and the payment gives up.
    let blocker = hold_row(&app.db, "frank").await;
    let pay = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/wallets/frank/pay"));
        async move { client.post(url).json(&json!({ "amount": 10 })).send().await.unwrap() }
    });
    let key = env.lease_key("wallet:frank");
    eventually("the payment holds the lease", Duration::from_secs(2), || async {
        env.redis_cmd::<i64>(&["EXISTS", &key]).await == 1
    })
    .await;
    let _: () = env.redis_cmd(&["DEL", &key]).await;

    problem(pay.await.unwrap(), 409, "lease_lost").await;
    blocker.rollback().await.unwrap();
    assert_eq!(snapshot(&app, "frank").await, (100, 100, 0, 1));
}

#[tokio::test]
async fn with_redis_outage_refuse_an_unreachable_redis_is_a_503_dependency_unavailable() {
    let mut env = TestEnv::with_own_redis();
    let app = spawn_app_with(&env, &["--lease-wait", "500ms", "--redis-outage", "refuse"]).await;
    app.open_wallet("gina", 100).await;

    drop(env.redis.take());
    let response = app.post_json("/wallets/gina/pay", json!({ "amount": 10 })).await;
    assert_eq!(response.headers()["retry-after"], "1");
    let body = problem(response, 503, "dependency_unavailable").await;
    assert!(!body.to_string().to_lowercase().contains("redis"), "no internals in a 5xx: {body}");
    assert_eq!(snapshot(&app, "gina").await, (100, 100, 0, 1));
}

#[tokio::test]
async fn postgres_unreachable_is_a_503_too() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let closed_port = crate::support::servers::free_port();
    let url = format!("postgres://postgres@127.0.0.1:{closed_port}/postgres");
    let app = crate::support::app::spawn_app_on(&env, schema, db, &["--database-url", &url]).await;
    let response = app.post_json("/wallets", json!({ "id": "x" })).await;
    problem(response, 503, "dependency_unavailable").await;
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status(), 503);
}

#[tokio::test]
async fn a_payment_whose_client_hung_up_still_commits_and_releases() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("hank", 100).await;
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:hank").await.unwrap();

    let impatient = app
        .client
        .post(app.url("/wallets/hank/pay"))
        .json(&json!({ "amount": 10 }))
        .timeout(Duration::from_millis(100));
    assert!(impatient.send().await.is_err(), "the client gave up");
    holder.release().await.unwrap();

    eventually("the payment committed after its client left", Duration::from_secs(3), || async {
        books(&app.db, "hank").await.pays == 1
    })
    .await;
    let key = env.lease_key("wallet:hank");
    eventually("and released its lease", Duration::from_secs(3), || async {
        env.redis_cmd::<i64>(&["EXISTS", &key]).await == 0
    })
    .await;
    assert_eq!(snapshot(&app, "hank").await, (90, 90, 1, 2));
}

#[tokio::test]
async fn shutdown_finishes_the_payment_in_flight() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("ivy", 100).await;
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire("wallet:ivy").await.unwrap();
    let pay = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/wallets/ivy/pay"));
        async move { client.post(url).json(&json!({ "amount": 10 })).send().await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let db = app.db.clone();
    let stopping = tokio::spawn(app.stop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.release().await.unwrap();

    assert_eq!(pay.await.unwrap().status(), 200, "the payment in flight finished");
    stopping.await.unwrap();
    assert_eq!(books(&db, "ivy").await.pays, 1);
}

/// Sends `request` to nginx as raw bytes (what no HTTP client would send) and returns the
/// answer's status, its headers (names lowercased) and its body as JSON.
async fn raw_exchange(port: u16, request: &str) -> (u16, Vec<(String, String)>, Value) {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .expect("nginx answers and closes the connection")
        .unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let mut lines = head.lines();
    let status = lines.next().and_then(|line| line.split(' ').nth(1)).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    (status, headers, serde_json::from_str(body).unwrap_or_else(|_| panic!("{answer}")))
}

/// An answer nginx made itself: a problem with a request id, and no replica named.
async fn nginx_problem(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert!(response.headers().get("x-served-by").is_none(), "{code}: nginx answered, not a replica");
    assert!(response.headers().contains_key("x-request-id"), "{code}");
    problem(response, status, code).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_answers_the_errors_it_makes_itself_as_problems() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    let client = &fleet.client;

    // A request line nginx cannot parse, and a Transfer-Encoding it does not implement.
    for (request, status, code) in [
        ("GARBAGE\r\n\r\n", 400, "bad_request"),
        ("POST /wallets HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not_implemented"),
    ] {
        let (got, headers, body) = raw_exchange(fleet.nginx_port, request).await;
        assert_eq!(got, status, "{request:?}: {body}");
        let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(header("content-type"), Some("application/problem+json"), "{request:?}");
        assert!(header("x-request-id").is_some() && header("x-served-by").is_none(), "{request:?}");
        problem_members(&body, status, code);
    }

    // A header line over nginx's 8 KiB buffer, and a request line over it.
    let oversized_header = client.get(fleet.url("/wallets/alice")).header("x-padding", "p".repeat(9 * 1024));
    nginx_problem(oversized_header.send().await.unwrap(), 400, "bad_request").await;
    let long_path = fleet.url(&format!("/wallets/{}", "a".repeat(9 * 1024)));
    nginx_problem(client.get(long_path).send().await.unwrap(), 414, "uri_too_long").await;

    // A body over client_max_body_size (64 KiB): refused before a replica sees it.
    let huge = format!(r#"{{"amount":1,"reference":"{}"}}"#, "x".repeat(100 * 1024));
    let too_large = client.post(fleet.url("/wallets/alice/pay")).header("content-type", "application/json");
    let body = nginx_problem(too_large.body(huge).send().await.unwrap(), 413, "payload_too_large").await;
    assert!(body["detail"].as_str().unwrap().contains("16 KiB"), "it names the API's limit: {body}");

    // TRACE, which nginx refuses itself, and /metrics, which it keeps off the public side.
    let trace = client.request(reqwest::Method::TRACE, fleet.url("/wallets"));
    nginx_problem(trace.send().await.unwrap(), 405, "method_not_allowed").await;
    nginx_problem(client.get(fleet.url("/metrics")).send().await.unwrap(), 404, "not_found").await;
    // The page nginx renders its errors with is not a route.
    nginx_problem(client.get(fleet.url("/_problem")).send().await.unwrap(), 404, "not_found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replicas_own_problems_pass_through_nginx_untouched() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    let served_by_replica = |response: &reqwest::Response| {
        assert_eq!(response.headers()["x-served-by"], "replica-1");
    };

    // Statuses nginx has an error page for (404, 413), answered by the replica: its body, not nginx's.
    let missing = fleet.client.get(fleet.url("/wallets/nobody")).send().await.unwrap();
    served_by_replica(&missing);
    problem(missing, 404, "wallet_not_found").await;
    let no_route = fleet.client.get(fleet.url("/nowhere")).send().await.unwrap();
    served_by_replica(&no_route);
    problem(no_route, 404, "not_found").await;
    // Over the replicas' 16 KiB, under nginx's 64 KiB.
    let large = format!(r#"{{"amount":1,"reference":"{}"}}"#, "x".repeat(20 * 1024));
    let too_large = fleet
        .client
        .post(fleet.url("/wallets/nobody/pay"))
        .header("content-type", "application/json")
        .body(large)
        .send()
        .await
        .unwrap();
    served_by_replica(&too_large);
    let body = problem(too_large, 413, "payload_too_large").await;
    assert_eq!(body["detail"], "the request body is larger than 16384 bytes", "{body}");
    let unauthorized = reqwest::Client::new().get(fleet.url("/wallets/nobody")).send().await.unwrap();
    served_by_replica(&unauthorized);
    problem(unauthorized, 401, "unauthorized").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replica_to_answer_is_a_502_problem_from_nginx() {
    let env = TestEnv::new();
    let mut fleet = Fleet::start(&env, 1, &[]).await;
    assert_eq!(fleet.client.get(fleet.url("/readyz")).send().await.unwrap().status(), 200);
    fleet.replicas[0].stop(Signal::SIGKILL);

    // Its port now refuses connections: nginx has no replica to send anything to.
    nginx_problem(fleet.client.get(fleet.url("/wallets/alice")).send().await.unwrap(), 502, "bad_gateway")
        .await;
    let pay = fleet.client.post(fleet.url("/wallets/alice/pay")).json(&json!({ "amount": 1 }));
    let body = nginx_problem(pay.send().await.unwrap(), 502, "bad_gateway").await;
    assert!(body["detail"].as_str().unwrap().contains("Idempotency-Key"), "it says how to learn the outcome");
}
