//! The test harness: real Redis and Postgres, a fresh schema and key prefix per test.
//!
//! `deploy/test` starts one Redis and one Postgres for the whole run and passes them in
//! `WALLETLOCK_TEST_REDIS_URL` and `WALLETLOCK_TEST_DATABASE_URL`; each test then isolates itself
//! with its own schema and key prefix. Without those variables (a bare `cargo nextest run`), each
//! test starts private servers, which is slower but needs nothing else. Tests that restart or flush
//! a server always start their own.

pub mod app;
pub mod compose;
pub mod fleet;
pub mod load;
pub mod movements;
pub mod proxy;
pub mod receiver;
pub mod servers;
pub mod tls;
pub mod transfers;

use servers::{CitusCluster, PostgresServer, RedisServer};
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use walletlock::lease::{LeaseClient, LeaseSettings, Ttl};
use walletlock::ledger::schema::ScratchSchema;
use walletlock::ledger::storage::Storage;
use walletlock::wallet::Wallets;

/// The API tokens every test replica accepts: the `tester` caller, a second caller `other`, and
/// `ops`, granted every wallet; `tester`'s transfers may pay into `other`'s wallets.
pub const API_TOKENS: &str = "tester:test-token-0123456789,other:other-token-0123456789,\
                              ops:ops-token-0123456789,grant ops every-wallet,grant tester pays-into other";
/// The `other` caller's token.
pub const OTHER_TOKEN: &str = "other-token-0123456789";
/// The `ops` caller's token (every wallet).
pub const OPS_TOKEN: &str = "ops-token-0123456789";
/// The `tester` caller's token.
pub const TOKEN: &str = "test-token-0123456789";
/// The caller `TOKEN` authenticates, who owns the wallets the tests open.
pub const CALLER: &str = "tester";

/// What `tester` may use: the wallets it opened.
pub fn tester() -> walletlock::wallet::Access {
    walletlock::wallet::Access::own_wallets(CALLER)
}

/// An HTTP client that authenticates as `tester`.
pub fn api_client() -> reqwest::Client {
    api_client_with(TOKEN)
}

/// An HTTP client that sends `token` as its bearer token.
pub fn api_client_with(token: &str) -> reqwest::Client {
    api_client_builder(token).build().expect("client")
}

/// An HTTP client that authenticates as `tester` and trusts only the CA in `ca_pem` for HTTPS.
pub fn api_client_trusting(ca_pem: &[u8]) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(ca_pem).expect("a PEM certificate");
    api_client_builder(TOKEN).tls_built_in_root_certs(false).add_root_certificate(ca).build().expect("client")
}

fn api_client_builder(token: &str) -> reqwest::ClientBuilder {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", format!("Bearer {token}").parse().expect("header"));
    // No built-in roots: the tests' clients speak plain HTTP, or trust the test CA alone
    // (`api_client_trusting`). The product's reqwest loads the system's roots for each client
    // built otherwise, which a test building thousands of clients would pay for each time.
    reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(64)
        .tls_built_in_root_certs(false)
}

/// Whether the tests' Postgres is a Citus cluster: `WALLETLOCK_TEST_POSTGRES=citus` (`single`, or
/// unset: one Postgres). Then a test that starts its own Postgres starts a Citus cluster of its own
/// instead (a coordinator and two workers) and restarts or crashes its coordinator, and
/// `WALLETLOCK_TEST_DATABASE_URL`, when set, is a Citus coordinator too (`deploy/test` runs the
/// storage tests so).
pub fn storage_is_citus() -> bool {
    match std::env::var("WALLETLOCK_TEST_POSTGRES").as_deref() {
        Ok("citus") => true,
        Ok("single") | Err(_) => false,
        Ok(other) => panic!("WALLETLOCK_TEST_POSTGRES is `single` or `citus`, not `{other}`"),
    }
}

/// Where a test's Redis and Postgres are, and the servers it owns (if any), which stop when the
/// environment is dropped.
pub struct TestEnv {
    pub redis_url: String,
    pub database_url: String,
    pub redis: Option<RedisServer>,
    /// A private Postgres, living exactly as long as the test.
    pub postgres: Option<PostgresServer>,
    /// A private Citus cluster in its place, under `WALLETLOCK_TEST_POSTGRES=citus`.
    pub citus: Option<CitusCluster>,
    /// Namespaces this test's Redis keys.
    pub prefix: String,
}

impl TestEnv {
    /// The shared servers when `deploy/test` provides them, else private ones.
    pub fn new() -> Self {
        init_tracing();
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        match (std::env::var("WALLETLOCK_TEST_REDIS_URL"), std::env::var("WALLETLOCK_TEST_DATABASE_URL")) {
            (Ok(redis_url), Ok(database_url)) => {
                Self { redis_url, database_url, redis: None, postgres: None, citus: None, prefix }
            }
            _ => Self::private_postgres(RedisServer::start(), prefix),
        }
    }

    /// A Redis of this test's own (to restart or flush), with the shared Postgres when there is one.
    pub fn with_own_redis() -> Self {
        init_tracing();
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        let redis = RedisServer::start();
        match std::env::var("WALLETLOCK_TEST_DATABASE_URL") {
            Ok(database_url) => Self {
                redis_url: redis.url(),
                database_url,
                redis: Some(redis),
                postgres: None,
                citus: None,
                prefix,
            },
            Err(_) => Self::private_postgres(redis, prefix),
        }
    }

    /// Both servers of this test's own (to restart Postgres, say).
    pub fn with_own_servers() -> Self {
        init_tracing();
        Self::private_postgres(RedisServer::start(), format!("t{}", uuid::Uuid::new_v4().simple()))
    }

    /// Both servers of this test's own, Postgres with more settings (see
    /// [`PostgresServer::start_with`]).
    pub fn with_own_servers_and_postgres(settings: &[&str]) -> Self {
        init_tracing();
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        if storage_is_citus() {
            return Self::with_own_citus(RedisServer::start(), CitusCluster::start_with(settings), prefix);
        }
        Self::with_servers(RedisServer::start(), PostgresServer::start_with(settings), prefix)
    }

    /// Both servers of this test's own, on TLS only with `ca`'s certificates; the URLs verify
    /// the servers against `ca`. A replica also needs [`tls::TestCa::replica_env`] for Redis.
    pub fn with_tls(ca: &tls::TestCa) -> Self {
        init_tracing();
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        Self::with_servers(RedisServer::start_tls(ca), PostgresServer::start_tls(ca), prefix)
    }

    /// A Redis of this test's own, with `citus`'s coordinator as its Postgres: every scratch
    /// schema's tables are distributed over the workers.
    pub fn with_citus(citus: &CitusCluster) -> Self {
        init_tracing();
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        let redis = RedisServer::start();
        Self {
            redis_url: redis.url(),
            database_url: citus.url(),
            redis: Some(redis),
            postgres: None,
            citus: None,
            prefix,
        }
    }

    /// This test's own Postgres; under `WALLETLOCK_TEST_POSTGRES=citus`, its cluster's
    /// coordinator, which the replicas connect to.
    pub fn own_postgres(&mut self) -> &mut PostgresServer {
        if let Some(citus) = self.citus.as_mut() {
            return &mut citus.coordinator;
        }
        self.postgres.as_mut().expect("this test owns its Postgres")
    }

    fn private_postgres(redis: RedisServer, prefix: String) -> Self {
        if storage_is_citus() {
            return Self::with_own_citus(redis, CitusCluster::start(), prefix);
        }
        Self::with_servers(redis, PostgresServer::start(), prefix)
    }

    fn with_own_citus(redis: RedisServer, citus: CitusCluster, prefix: String) -> Self {
        Self {
            redis_url: redis.url(),
            database_url: citus.url(),
            redis: Some(redis),
            postgres: None,
            citus: Some(citus),
            prefix,
        }
    }

    fn with_servers(redis: RedisServer, postgres: PostgresServer, prefix: String) -> Self {
        Self {
            redis_url: redis.url(),
            database_url: postgres.url("postgres"),
            redis: Some(redis),
            postgres: Some(postgres),
            citus: None,
            prefix,
        }
    }

    pub fn own_redis(&mut self) -> &mut RedisServer {
        self.redis.as_mut().expect("this test owns its Redis")
    }

    /// A fresh, migrated schema and a pool of `pool_size` connections into it.
    pub async fn database(&self, pool_size: u32) -> (ScratchSchema, PgPool) {
        ScratchSchema::create(&self.database_url, "test", pool_size).await.expect("scratch schema")
    }

    /// A separate Redis connection pool, as one replica would have.
    pub fn redis_pool(&self) -> deadpool_redis::Pool {
        let mut config = deadpool_redis::Config::from_url(&self.redis_url);
        let mut pool = deadpool_redis::PoolConfig::new(16);
        pool.timeouts.wait = Some(Duration::from_millis(500));
        pool.timeouts.create = Some(Duration::from_millis(500));
        pool.timeouts.recycle = Some(Duration::from_millis(500));
        config.pool = Some(pool);
        config.create_pool(Some(deadpool_redis::Runtime::Tokio1)).expect("redis pool")
    }

    /// A lease client of its own (its own Redis pool), under this test's key prefix.
    pub fn leases(&self, ttl: Duration, wait: Duration) -> LeaseClient {
        self.leases_with(LeaseSettings::new(Ttl::new(ttl).expect("ttl"), wait))
    }

    /// Like [`TestEnv::leases`], with every timing setting given.
    pub fn leases_with(&self, settings: LeaseSettings) -> LeaseClient {
        let client = deadpool_redis::redis::Client::open(self.redis_url.as_str()).expect("redis url");
        LeaseClient::new(self.redis_pool(), self.prefix.clone(), settings).with_wakeups(client)
    }

    /// The wallet service as one replica runs it: its own Postgres pool into `schema`, its own
    /// Redis pool.
    pub async fn replica(&self, schema: &ScratchSchema, ttl: Duration, wait: Duration) -> Wallets {
        let db = Storage::pool_options()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(2))
            .connect(&schema.url)
            .await
            .expect("replica pool");
        Wallets::new(db, self.leases(ttl, wait))
    }

    /// Runs a redis command on this test's Redis, for checks and sabotage.
    pub async fn redis_cmd<T: deadpool_redis::redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let client = deadpool_redis::redis::Client::open(self.redis_url.as_str()).expect("redis url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("redis connection");
        deadpool_redis::redis::cmd(args[0])
            .arg(&args[1..])
            .query_async(&mut conn)
            .await
            .expect("redis command")
    }

    /// The Redis key that holds the lease on `name` (see the lease module's key layout).
    pub fn lease_key(&self, name: &str) -> String {
        format!("{{{}:{name}}}:lease", self.prefix)
    }

    /// The Redis key a waiter sets when it finds the lease on `name` taken.
    pub fn contended_key(&self, name: &str) -> String {
        format!("{{{}:{name}}}:contended", self.prefix)
    }

    pub fn fence_key(&self, name: &str) -> String {
        format!("{{{}:{name}}}:fence", self.prefix)
    }

    /// The Redis key that keeps the note the last holder of `name` left.
    pub fn note_key(&self, name: &str) -> String {
        format!("{{{}:{name}}}:note", self.prefix)
    }
}

/// Polls `check` every few milliseconds until it holds, or panics with `what` after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + limit;
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn init_tracing() {
    if std::env::var_os("TEST_LOG").is_some() {
        walletlock::telemetry::init(walletlock::telemetry::LogFormat::Pretty);
    }
}

/// The balance and the ledger of a wallet, read straight from the tables.
pub struct Books {
    pub balance: i64,
    pub ledger_sum: i64,
    pub pays: i64,
    pub fence: i64,
}

pub async fn books(db: &PgPool, wallet: &str) -> Books {
    // One statement, so balance and ledger are read from the same snapshot.
    let (balance, fence, ledger_sum, pays): (i64, i64, i64, i64) = sqlx::query_as(
        "select w.balance, w.fence,
                coalesce(sum(case when e.kind in ('pay', 'transfer_out') then -e.amount else e.amount end), 0)::int8,
                count(e.id) filter (where e.kind = 'pay')
         from wallet w left join ledger_entry e on e.wallet_id = w.id
         where w.id = $1
         group by w.id",
    )
    .bind(wallet)
    .fetch_one(db)
    .await
    .expect("wallet row");
    Books { balance, ledger_sum, pays, fence }
}

/// The ledger entry of a deposit or payment, from what [`walletlock::wallet::Wallets::apply`] did.
pub trait EntryOf {
    fn entry(self) -> Result<walletlock::ledger::Entry, walletlock::wallet::WalletError>;
}

impl EntryOf for Result<walletlock::wallet::Moved, walletlock::wallet::WalletError> {
    fn entry(self) -> Result<walletlock::ledger::Entry, walletlock::wallet::WalletError> {
        self.map(|moved| moved.entry().cloned().expect("a deposit or payment writes an entry"))
    }
}

/// A stand-in for the HTTP layer's rendering of a movement's outcome, for tests that store
/// idempotent responses without a server: the entry's id, or the refusal.
pub fn render(outcome: &walletlock::wallet::MovementOutcome) -> walletlock::idempotency::StoredResponse {
    let body = match outcome {
        Ok(moved) => moved.entry().map(|entry| entry.id.to_string()).unwrap_or_default(),
        Err(refusal) => refusal.to_string(),
    };
    walletlock::idempotency::StoredResponse {
        status: if outcome.is_ok() { 200 } else { 422 },
        content_type: "text/plain".into(),
        body: body.into(),
    }
}

/// The reference parser's reading of a scrape: (name, labels, value) samples.
pub fn parse_metrics(scrape: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    let python = std::env::var("WALLETLOCK_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = fleet::repo().join("tests/tools/parse_metrics.py");
    let mut child =
        Command::new(python).arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(scrape.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "prometheus_client could not parse the scrape (deploy/test installs it)");
    let samples: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    samples
        .into_iter()
        .map(|s| {
            let labels = s["labels"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            (s["name"].as_str().unwrap().to_owned(), labels, s["value"].as_f64().unwrap())
        })
        .collect()
}

/// A payment of `amount` (no reference), as a request makes it.
pub fn payment(amount: i64) -> walletlock::wallet::Movement {
    walletlock::wallet::Movement::Pay {
        amount: walletlock::wallet::Amount::new(amount).unwrap(),
        reference: None,
        metadata: Default::default(),
    }
}

/// The tester's idempotency key `key` for a payment from wallet `id`, for the same request each
/// time (one fingerprint).
pub fn payment_key(
    id: &walletlock::wallet::WalletId,
    key: &str,
) -> walletlock::idempotency::Keyed<walletlock::wallet::MovementOutcome> {
    use walletlock::idempotency::{self, IdempotencyKey, Keyed, Scope};
    Keyed {
        scope: Scope::wallet("tester", id),
        key: IdempotencyKey::parse(key.as_bytes()).unwrap(),
        fingerprint: idempotency::fingerprint("POST", "/pay", b"10"),
        render,
    }
}

/// Holds wallet `wallet`'s row locked in a transaction of the test's own (another holder's
/// statement, an operator's session) until it is rolled back or dropped.
pub async fn hold_row(db: &PgPool, wallet: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut row = db.begin().await.unwrap();
    sqlx::query("select 1 from wallet where id = $1 for update")
        .bind(wallet)
        .execute(&mut *row)
        .await
        .unwrap();
    row
}
