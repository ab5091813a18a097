//! Access: every /wallets route needs a bearer token, checked before anything is read or stored;
//! a wallet belongs to the caller that opened it; idempotency keys belong to their caller; health
//! stays open; secrets stay out of logs.

use crate::support::app::spawn_app;
use crate::support::fleet::Fleet;
use crate::support::load::open_wallets;
use crate::support::receiver::Receiver;
use crate::support::servers::{OwnedChild, RedisServer};
use crate::support::{OPS_TOKEN, OTHER_TOKEN, TestEnv, api_client_with, books, eventually};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_missing_or_wrong_token_is_a_401_before_anything_is_read() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("guarded", 100).await;
    let anonymous = reqwest::Client::new();

    let cases = [
        (None, "no token"),
        (Some("Bearer not-a-known-token-000"), "an unknown token"),
        (Some("Basic dGVzdGVyOnRlc3QtdG9rZW4tMDEyMzQ1Njc4OQ=="), "another scheme"),
        (Some("Bearer"), "an empty token"),
    ];
    for (authorization, what) in cases {
        for (method, path, body) in [
            ("POST", "/wallets", r#"{"id":"intruder"}"#),
            ("GET", "/wallets/guarded", ""),
            ("POST", "/wallets/guarded/pay", r#"{"amount":10}"#),
            ("POST", "/wallets/guarded/deposit", "this is not even JSON"),
            ("GET", "/wallets/guarded/transactions", ""),
            ("POST", "/wallets/..%2Fetc/pay", r#"{"amount":10}"#),
        ] {
            let mut request = anonymous
                .request(method.parse().unwrap(), app.url(path))
                .header("content-type", "application/json")
                .body(body);
            if let Some(authorization) = authorization {
                request = request.header("authorization", authorization);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 401, "{what}: {method} {path}");
            assert_eq!(response.headers()["www-authenticate"], r#"Bearer realm="walletlock""#);
            let problem: Value = response.json().await.unwrap();
            assert_eq!(
                (problem["code"].as_str(), problem["status"].as_u64()),
                (Some("unauthorized"), Some(401))
            );
        }
    }
    let wallets: i64 = sqlx::query_scalar("select count(*) from wallet").fetch_one(&app.db).await.unwrap();
    assert_eq!(wallets, 1, "nothing was created");
    let books = books(&app.db, "guarded").await;
    assert_eq!((books.balance, books.pays), (100, 0), "nothing was paid");
}

#[tokio::test]
async fn health_and_metrics_need_no_token() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    let anonymous = reqwest::Client::new();
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(anonymous.get(app.url(path)).send().await.unwrap().status(), 200, "{path}");
    }
}

#[tokio::test]
async fn idempotency_keys_belong_to_their_caller() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("shared", 100).await;
    let pay = |token: &'static str| {
        app.client
            .post(app.url("/wallets/shared/pay"))
            .header("authorization", format!("Bearer {token}"))
            .header("idempotency-key", "order-1")
            .json(&json!({ "amount": 10 }))
            .send()
    };

    assert_eq!(pay("test-token-0123456789").await.unwrap().status(), 200);
    let other = pay(OPS_TOKEN).await.unwrap();
    assert_eq!(other.status(), 200);
    assert!(other.headers().get("idempotent-replayed").is_none(), "another caller's key is another key");
    let again = pay("test-token-0123456789").await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(books(&app.db, "shared").await.pays, 2);
}

#[tokio::test]
async fn another_callers_wallet_does_not_exist_for_it_and_nothing_it_sends_moves_money() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("mine", 100).await;
    let other = api_client_with(OTHER_TOKEN);
    let send = |method: reqwest::Method, path: &str, body: Option<Value>| {
        let request = other.request(method, app.url(path)).header("idempotency-key", format!("k{path}"));
        match body {
            Some(body) => request.json(&body).send(),
            None => request.send(),
        }
    };
    for (method, path, body) in [
        (reqwest::Method::GET, "/wallets/mine", None),
        (reqwest::Method::GET, "/wallets/mine/transactions", None),
        (reqwest::Method::POST, "/wallets/mine/pay", Some(json!({ "amount": 10 }))),
        (reqwest::Method::POST, "/wallets/mine/deposit", Some(json!({ "amount": 10 }))),
    ] {
        let response = send(method.clone(), path, body).await.unwrap();
        assert_eq!(response.status(), 404, "{method} {path}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["code"], "wallet_not_found", "{method} {path}: as if it did not exist");
    }
    // The same answer as for a wallet nobody opened.
    let none = send(reqwest::Method::GET, "/wallets/nobodys", None).await.unwrap();
    assert_eq!(none.status(), 404);

    let after = books(&app.db, "mine").await;
    assert_eq!((after.balance, after.ledger_sum, after.pays), (100, 100, 0), "nothing moved");
    // The owner sees its wallet; a caller granted every wallet sees and moves it.
    assert_eq!(app.get("/wallets/mine").await.status(), 200);
    let ops = api_client_with(OPS_TOKEN);
    let paid = ops.post(app.url("/wallets/mine/pay")).json(&json!({ "amount": 10 })).send().await.unwrap();
    assert_eq!(paid.status(), 200);
    assert_eq!(books(&app.db, "mine").await.balance, 90);
}

#[tokio::test]
async fn a_transfer_pays_only_from_the_callers_wallets_into_those_it_may_pay_into() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("tester-a", 100).await;
    app.open_wallet("tester-b", 100).await;
    let other = api_client_with(OTHER_TOKEN);
    let opened = other.post(app.url("/wallets")).json(&json!({ "id": "other-a", "balance": 100 })).send();
    assert_eq!(opened.await.unwrap().status(), 201);
    let transfer = |client: &reqwest::Client, from: &str, to: &str| {
        client.post(app.url("/transfers")).json(&json!({ "from": from, "to": to, "amount": 10 })).send()
    };
    let problem = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        (status, body["code"].as_str().unwrap_or_default().to_owned(), body["field"].clone())
    };

    // Another caller's wallet is missing on either side, unless the token list lets this caller pay
    // into that caller's wallets (`grant tester pays-into other`), and the grant goes one way.
    let (status, code, _) = problem(transfer(&other, "tester-a", "other-a").await.unwrap()).await;
    assert_eq!((status, code.as_str()), (404, "wallet_not_found"), "from another caller's wallet");
    let (status, _, _) = problem(transfer(&other, "other-a", "tester-a").await.unwrap()).await;
    assert_eq!(status, 404, "into a caller's wallet without a grant");
    assert_eq!(transfer(&app.client, "tester-a", "tester-b").await.unwrap().status(), 200, "its own");
    let granted = transfer(&app.client, "tester-a", "other-a").await.unwrap();
    assert_eq!(granted.status(), 200, "into a caller it may pay into");
    let paid: Value = granted.json().await.unwrap();

    // The payee sees the transfer and may refund it; a caller with neither wallet does not see it.
    let id = paid["id"].as_str().unwrap();
    assert_eq!(other.get(app.url(&format!("/transfers/{id}"))).send().await.unwrap().status(), 200);
    let unrelated = other.post(app.url("/wallets")).json(&json!({ "id": "other-b" })).send().await.unwrap();
    assert_eq!(unrelated.status(), 201);
    let ops = api_client_with(OPS_TOKEN);
    assert_eq!(
        ops.get(app.url(&format!("/transfers/{id}"))).send().await.unwrap().status(),
        200,
        "every wallet"
    );
    let refund =
        other.post(app.url(&format!("/transfers/{id}/refund"))).json(&json!({})).send().await.unwrap();
    assert_eq!(refund.status(), 200, "the payee refunds");
    assert_eq!(books(&app.db, "tester-a").await.balance, 90);
    assert_eq!(books(&app.db, "tester-b").await.balance, 110);
    assert_eq!(books(&app.db, "other-a").await.balance, 100);
}

#[test]
fn a_replica_without_tokens_refuses_to_start_and_one_can_be_made() {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["serve", "--database-url", "postgres://127.0.0.1:1/x", "--listen", "127.0.0.1:0"])
        .env_remove("API_TOKENS")
        .env_remove("API_TOKENS_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("API_TOKENS"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_walletlock")).arg("token").output().unwrap();
    let token = String::from_utf8(out.stdout).unwrap();
    assert_eq!(token.trim().len(), 64);
    assert!(token.trim().bytes().all(|b| b.is_ascii_hexdigit()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_log_line() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[("RUST_LOG", "debug")]).await;
    open_wallets(&fleet, &["logged"], 5).await;
    fleet.client.post(fleet.url("/wallets/logged/pay")).json(&json!({ "amount": 1 })).send().await.unwrap();
    reqwest::Client::new()
        .get(fleet.url("/wallets/logged"))
        .header("authorization", "Bearer wrong-token-for-the-log")
        .send()
        .await
        .unwrap();

    let log = fleet.replicas[0].log();
    assert!(log.contains("/wallets/{id}/pay"), "the log has the requests");
    for secret in ["test-token-0123456789", "other-token-0123456789", "wrong-token-for-the-log"] {
        assert!(!log.contains(secret), "a token reached the log");
    }
    assert!(
        !log.contains(&env.database_url) || !env.database_url.contains('@'),
        "the database URL reached the log"
    );
}

#[tokio::test]
async fn the_app_role_reads_and_writes_its_tables_and_nothing_more() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let role = format!("app_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("create role {role} login"))).execute(&db).await.unwrap();
    // Migrations run as the owner; `--app-role` grants the replicas' role what they need.
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["migrate", "--app-role", &role])
        .env("DATABASE_URL", &schema.url)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let host = env.database_url.split_once('@').unwrap().1; // 127.0.0.1:port/database
    let app_url = format!("postgres://{role}@{host}?options[search_path]={}", schema.name());
    let app = crate::support::app::spawn_app_on(
        &env,
        schema,
        db.clone(),
        &["--database-url", &app_url, "--webhook-allow-hosts", "127.0.0.1"],
    )
    .await;
    app.open_wallet("least", 100).await;
    // A webhook endpoint, registered and delivered to (its place, its attempts) as the app role.
    let receiver = Receiver::start().await;
    let endpoint: Value = app
        .client
        .post(app.url("/webhook-endpoints"))
        .json(&json!({ "url": receiver.url(), "wallet_ids": ["least"] }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    receiver.set_secret(
        endpoint["secret"].as_str().unwrap_or_else(|| panic!("an endpoint, as the app role: {endpoint}")),
    );
    let paid = app
        .client
        .post(app.url("/wallets/least/pay"))
        .header("idempotency-key", "k")
        .json(&json!({ "amount": 10 }));
    assert_eq!(paid.send().await.unwrap().status(), 200, "the replica works as the app role");
    // (It may also receive the wallet's opening: an endpoint starts at the feed's horizon, which
    // a transaction of another test on the shared database may hold back a moment.)
    eventually("the payment reaches the endpoint", Duration::from_secs(20), || {
        let paid = receiver.taken().iter().any(|r| r.body["type"] == "payment.accepted");
        async move { paid }
    })
    .await;
    // Each delivery's attempt is written once the receiver has answered, so it may trail it.
    let attempts = app.url(&format!("/webhook-endpoints/{}/attempts", endpoint["id"].as_str().unwrap()));
    eventually("every delivery's attempt is recorded", Duration::from_secs(20), || {
        let (read, taken) = (app.client.get(attempts.clone()).send(), receiver.taken().len());
        async move {
            let attempts: Value = read.await.unwrap().json().await.unwrap();
            attempts["attempts"].as_array().map(Vec::len) == Some(taken)
        }
    })
    .await;

    let as_app = sqlx::PgPool::connect(&app_url).await.unwrap();
    for forbidden in [
        "drop table wallet",
        "truncate ledger_entry",
        "delete from wallet",
        "update ledger_entry set amount = 1",
        "create table intruder (id int)",
        "alter table wallet drop constraint wallet_balance_check",
    ] {
        let err = sqlx::query(forbidden).execute(&as_app).await.expect_err(forbidden);
        let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert!(matches!(code.as_deref(), Some("42501")), "{forbidden}: {err}");
    }
    assert_eq!(books(&db, "least").await.balance, 90);
}

/// A Redis of its own with the deploy step's users: the replicas' `walletlock` (leases only) and
/// `admin`. Returns it with its ACL file, and the URLs of the two users.
fn redis_with_users(env: &TestEnv) -> (RedisServer, tempfile::NamedTempFile, String, String) {
    let acl = tempfile::NamedTempFile::new().unwrap();
    crate::support::fleet::lib_sh(&format!(
        "wl_redis_acl {} {} app-password-0123 admin-password-0123",
        acl.path().display(),
        env.prefix
    ));
    let redis = RedisServer::start_with(vec!["--aclfile".into(), acl.path().display().to_string()]);
    let app_redis = format!("redis://walletlock:app-password-0123@127.0.0.1:{}", redis.port);
    let admin_redis = format!("redis://admin:admin-password-0123@127.0.0.1:{}", redis.port);
    (redis, acl, app_redis, admin_redis)
}

#[tokio::test]
async fn a_redis_that_restarts_empty_gets_the_lease_scripts_back_from_the_keeper() {
    let env = TestEnv::new();
    let (mut redis, _acl, app_redis, admin_redis) = redis_with_users(&env);
    let _keeper = OwnedChild(
        Command::new(env!("CARGO_BIN_EXE_walletlock"))
            .args(["redis-functions", "--keep", "200ms", "--redis-url", &admin_redis])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let app = crate::support::app::spawn_app_with(&env, &["--redis-url", &app_redis]).await;
    app.open_wallet("emptied", 1_000).await;
    let pay = || app.client.post(app.url("/wallets/emptied/pay")).json(&json!({ "amount": 1 })).send();
    assert_eq!(pay().await.unwrap().status(), 200);

    // A restart without persistence: every key and the Functions library are gone, and the
    // replicas' user may neither load the library nor run scripts of its own.
    redis.restart();
    let restarted = Instant::now();
    while pay().await.unwrap().status() != 200 {
        assert!(restarted.elapsed() < Duration::from_secs(10), "the payments never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = restarted.elapsed();
    assert!(back < Duration::from_secs(3), "payments came back after {back:?}");
    eprintln!("Redis restarted empty: payments back after {back:?}");
    assert_eq!(books(&app.db, "emptied").await.pays, 2);
}

#[tokio::test]
async fn the_replicas_redis_user_can_only_work_leases() {
    let env = TestEnv::new();
    let (redis, _acl, app_redis, admin_redis) = redis_with_users(&env);
    // The deploy step loads the lease scripts as the administrator; the replicas' user cannot.
    let loaded = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["redis-functions", "--redis-url", &admin_redis])
        .output()
        .unwrap();
    assert!(loaded.status.success(), "{}", String::from_utf8_lossy(&loaded.stderr));
    let app = crate::support::app::spawn_app_with(&env, &["--redis-url", &app_redis]).await;
    app.open_wallet("acl", 1_000).await;

    // A contended burst: acquire, release, the contended mark and the wake-up channel all run.
    let burst: Vec<_> = (0..20)
        .map(|_| app.client.post(app.url("/wallets/acl/pay")).json(&json!({ "amount": 1 })).send())
        .collect();
    for paid in futures::future::join_all(burst).await {
        assert_eq!(paid.unwrap().status(), 200);
    }
    assert_eq!(books(&app.db, "acl").await.pays, 20);
    let admin = deadpool_redis::redis::Client::open(admin_redis.as_str()).unwrap();
    let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
    let stats: String =
        deadpool_redis::redis::cmd("INFO").arg("commandstats").query_async(&mut admin).await.unwrap();
    assert!(stats.contains("cmdstat_fcall:calls="), "the payments ran the functions: {stats}");

    let client = deadpool_redis::redis::Client::open(app_redis.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let endless = "#!lua name=intruder\nredis.register_function('spin', function() while true do end end)";
    for forbidden in [
        vec!["FLUSHALL"],
        vec!["KEYS", "*"],
        vec!["CONFIG", "GET", "*"],
        vec!["SET", "not-a-lease", "1"],
        vec!["DEL", "{other:wallet:x}:lease"],
        // No code of its own: a leaked password cannot run an endless script and stop Redis.
        vec!["EVAL", "while true do end", "0"],
        vec!["EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"],
        vec!["EVAL_RO", "while true do end", "0"],
        vec!["SCRIPT", "LOAD", "while true do end"],
        vec!["SCRIPT", "FLUSH"],
        vec!["SCRIPT", "KILL"],
        vec!["FUNCTION", "LOAD", endless],
        vec!["FUNCTION", "DELETE", "walletlock"],
        vec!["FUNCTION", "FLUSH"],
        vec!["FUNCTION", "KILL"],
        vec!["FUNCTION", "RESTORE", "x"],
    ] {
        let err = deadpool_redis::redis::cmd(forbidden[0])
            .arg(&forbidden[1..])
            .query_async::<()>(&mut conn)
            .await
            .expect_err("refused");
        assert!(err.to_string().to_lowercase().contains("noperm"), "{forbidden:?}: {err}");
    }

    // What the user may still write directly: its fence counters, with the commands the functions
    // run on them (Redis checks each command a function runs against the caller's ACL). A counter
    // set to garbage or to the top does not wedge the wallet: it starts over and is lifted above
    // the row's fence.
    let fence_key = format!("{{{}:wallet:acl}}:fence", env.prefix);
    for sabotage in ["not-a-number", &i64::MAX.to_string()] {
        let _: () = deadpool_redis::redis::cmd("SET")
            .arg(&fence_key)
            .arg(sabotage)
            .query_async(&mut conn)
            .await
            .unwrap();
        let paid = app.client.post(app.url("/wallets/acl/pay")).json(&json!({ "amount": 1 })).send().await;
        assert_eq!(paid.unwrap().status(), 200, "after the fence counter was set to {sabotage}");
    }
    assert_eq!(books(&app.db, "acl").await.pays, 22);

    let anonymous = deadpool_redis::redis::Client::open(format!("redis://127.0.0.1:{}", redis.port)).unwrap();
    let refused = anonymous.get_multiplexed_async_connection().await;
    let denied = match refused {
        Err(_) => true,
        Ok(mut conn) => deadpool_redis::redis::cmd("PING").query_async::<String>(&mut conn).await.is_err(),
    };
    assert!(denied, "Redis without a password refuses");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_limits_a_client_with_429_and_retry_after() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    // Another loopback address than 127.0.0.1, which nginx.conf exempts (local load tests).
    let client = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let mut responses = Vec::new();
    for _wave in 0..10 {
        let wave: Vec<_> = (0..100).map(|_| client.get(fleet.url("/healthz")).send()).collect();
        responses.extend(futures::future::join_all(wave).await);
    }
    let (mut ok, mut limited) = (0, 0);
    for response in responses {
        let response = response.unwrap();
        match response.status().as_u16() {
            200 => ok += 1,
            429 => {
                assert_eq!(response.headers()["retry-after"], "1");
                assert_eq!(response.headers()["content-type"], "application/problem+json");
                let problem: Value = response.json().await.unwrap();
                assert_eq!(problem["code"], "rate_limited");
                limited += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(ok >= 400, "the burst allowance was served: {ok}");
    assert!(limited > 0, "the excess was limited ({ok} served)");
    let from_host = fleet.client.get(fleet.url("/healthz")).send().await.unwrap();
    assert_eq!(from_host.status(), 200, "127.0.0.1 is not limited");
}
