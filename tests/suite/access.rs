//! Access: every /wallets route needs a bearer token, checked before anything is read or stored;
//! idempotency keys belong to their caller; health stays open; secrets stay out of logs.

use crate::support::app::spawn_app;
use crate::support::fleet::Fleet;
use crate::support::{TestEnv, books};
use serde_json::{Value, json};
use std::process::Command;

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
    let other = pay("other-token-0123456789").await.unwrap();
    assert_eq!(other.status(), 200);
    assert!(other.headers().get("idempotent-replayed").is_none(), "another caller's key is another key");
    let again = pay("test-token-0123456789").await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(books(&app.db, "shared").await.pays, 2);
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
    let created = fleet
        .client
        .post(fleet.url("/wallets"))
        .json(&json!({ "id": "logged", "balance": 5 }))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
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
