//! `spawn_app()`: one replica, in process, on a free port, against a fresh schema.

use super::TestEnv;
use clap::Parser;
use sqlx::PgPool;
use tokio::sync::oneshot;
use walletlock::app::Application;
use walletlock::cli::{Cli, Command};
use walletlock::ledger::schema::ScratchSchema;

pub struct TestApp {
    pub address: String,
    pub client: reqwest::Client,
    pub db: PgPool,
    /// Kept for the life of the replica: it owns the schema the replica writes to.
    pub _schema: ScratchSchema,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// Starts a replica with `extra` flag-value pairs replacing or adding to the defaults.
pub async fn spawn_app_with(env: &TestEnv, extra: &[&str]) -> TestApp {
    let (schema, db) = env.database(4).await;
    spawn_app_on(env, schema, db, extra).await
}

pub async fn spawn_app(env: &TestEnv) -> TestApp {
    spawn_app_with(env, &[]).await
}

/// Starts a replica against an existing schema.
pub async fn spawn_app_on(env: &TestEnv, schema: ScratchSchema, db: PgPool, extra: &[&str]) -> TestApp {
    let mut flags: Vec<(&str, &str)> = vec![
        ("--listen", "127.0.0.1:0"),
        ("--replica-name", "test-replica"),
        ("--database-url", &schema.url),
        ("--redis-url", &env.redis_url),
        ("--redis-key-prefix", &env.prefix),
        ("--lease-wait", "2s"),
        // The test client keeps idle connections open; a drain need not wait long for them.
        ("--shutdown-grace", "1s"),
        ("--api-tokens", super::API_TOKENS),
    ];
    // `extra` is flag-value pairs; each replaces the default of the same flag.
    for pair in extra.chunks(2) {
        let [flag, value] = pair else { panic!("flags come in flag-value pairs: {extra:?}") };
        match flags.iter_mut().find(|(existing, _)| existing == flag) {
            Some(slot) => slot.1 = value,
            None => flags.push((flag, value)),
        }
    }
    let args =
        ["walletlock", "serve"].into_iter().chain(flags.iter().flat_map(|(flag, value)| [*flag, *value]));
    let Command::Serve(serve) = Cli::try_parse_from(args).expect("valid flags").command else {
        unreachable!("a serve command")
    };
    let app = Application::build(&serve).await.expect("replica builds");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    TestApp {
        address,
        client: super::api_client(),
        db,
        _schema: schema,
        stop: Some(stop),
        server: Some(server),
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    pub async fn post_json(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.client.post(self.url(path)).json(&body).send().await.expect("request sent")
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.expect("request sent")
    }

    /// Opens a wallet through the API.
    pub async fn open_wallet(&self, id: &str, balance: i64) {
        let response = self.post_json("/wallets", serde_json::json!({ "id": id, "balance": balance })).await;
        assert_eq!(response.status(), 201, "{:?}", response.text().await);
    }

    /// Stops the replica as SIGTERM would, and waits until it has drained.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("server task").expect("clean shutdown");
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
