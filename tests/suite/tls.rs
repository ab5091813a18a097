//! TLS on every hop: clients reach nginx over HTTPS, replicas reach Redis and Postgres over TLS
//! with each server's certificate verified (Redis also asks for the replica's own). Both servers
//! refuse plaintext; a certificate for another host is refused by the replica (a 503, nothing
//! applied), never answered around; and the lease still follows a restarted Redis and a Sentinel
//! failover. Certificates come from a throwaway CA the test makes with `openssl`.

use crate::support::TestEnv;
use crate::support::fleet::{Fleet, repo};
use crate::support::load::{
    Load, Outcome, check_books, open_wallets, pay_one, settle, tally, time_to_recover,
};
use crate::support::servers::{ClusterSet, SentinelSet, redis_cli};
use crate::support::tls::TestCa;
use crate::topologies::{cluster_primary_lost_mid_load, sentinel_failover_mid_load};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

/// The replicas' settings: Redis's CA and client certificate, and quick lease timings.
fn replica_settings(ca: &TestCa) -> Vec<(String, String)> {
    let mut settings = ca.replica_env();
    for (key, value) in [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s"), ("LEASE_WAIT", "3s")] {
        settings.push((key.into(), value.into()));
    }
    settings
}

fn borrowed(settings: &[(String, String)]) -> Vec<(&str, &str)> {
    settings.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// How many of the server's client connections that came over TCP are encrypted, out of all.
async fn encrypted_connections(db: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "select count(*) filter (where s.ssl), count(*)
         from pg_stat_activity a join pg_stat_ssl s using (pid)
         where a.client_addr is not null and a.backend_type = 'client backend'",
    )
    .fetch_one(db)
    .await
    .expect("pg_stat_ssl")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_over_https_reach_redis_and_postgres_over_verified_tls() {
    let ca = TestCa::new();
    let env = TestEnv::with_tls(&ca);
    let settings = replica_settings(&ca);
    let fleet = Fleet::start_https(&env, 3, &borrowed(&settings), &ca).await;
    let wallets = ["tls-a", "tls-b", "tls-c", "tls-d"];
    open_wallets(&fleet, &wallets, 1_000_000).await;

    // HTTPS with the local CA's certificate, HTTP/2 negotiated.
    let read = fleet.client.get(fleet.https_url("/wallets/tls-a")).send().await.expect("an HTTPS answer");
    assert_eq!(read.status(), 200);
    assert_eq!(read.version(), reqwest::Version::HTTP_2, "nginx offers HTTP/2 over TLS");
    // Plain HTTP sent to the HTTPS port is nginx's own 400, in problem+json like its other errors.
    let plain = format!("http://127.0.0.1:{}/wallets/tls-a", fleet.https_port.expect("https"));
    let refused = fleet.client.get(plain).send().await.expect("an answer");
    assert_eq!(refused.status(), 400);
    let problem: Value = refused.json().await.expect("problem+json");
    assert_eq!(problem["code"], "bad_request", "{problem}");

    let load = Load::start_at(&fleet, &[fleet.https_url("")], &wallets, 8);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut attempts = load.finish().await;
    let applied = attempts.iter().filter(|a| matches!(a.outcome, Outcome::Applied(_))).count();
    assert!(applied > 0, "payments went through: {:?}", tally(&attempts));
    settle(&fleet, &mut attempts).await;
    check_books(&fleet, &wallets.map(|w| (w, 1_000_000)), &attempts).await;

    // Every connection Postgres has from the replicas (and the test's own) is encrypted.
    let (encrypted, all) = encrypted_connections(&fleet.db).await;
    assert!(all > 0 && encrypted == all, "{encrypted} of {all} TCP connections are TLS");
    let mut took: Vec<Duration> = attempts.iter().map(|a| a.took).collect();
    took.sort();
    eprintln!(
        "over TLS on every hop: {applied} payments in 3 s by 8 clients over HTTPS/2, median {:?}, p99 {:?}; {encrypted} of {all} Postgres connections TLS; {:?}",
        took[took.len() / 2],
        took[took.len() * 99 / 100],
        tally(&attempts)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_clients_are_refused_by_redis_and_postgres() {
    let ca = TestCa::new();
    let mut env = TestEnv::with_tls(&ca);
    let redis_port = env.own_redis().port;

    // Redis has no plain port: a plaintext PING gets no answer; over TLS with the client
    // certificate it gets PONG, and over TLS without one it is refused too.
    assert!(!redis_cli(redis_port, &["PING"]).contains("PONG"), "plaintext PING answered");
    let tls: Vec<String> = ca.redis_cli_args();
    let mut with_tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    with_tls.push("PING");
    assert_eq!(redis_cli(redis_port, &with_tls).trim(), "PONG");
    assert!(
        !redis_cli(redis_port, &with_tls[..3].iter().copied().chain(["PING"]).collect::<Vec<_>>())
            .contains("PONG")
    );

    // Postgres has only `hostssl` entries: a plaintext connection finds none.
    let plain = env.database_url.split('?').next().expect("a URL").to_owned() + "?sslmode=disable";
    let refused = sqlx::PgPool::connect(&plain).await.expect_err("a plaintext connection is refused");
    assert!(refused.to_string().contains("no encryption"), "{refused}");
    let verified = sqlx::PgPool::connect(&env.database_url).await.expect("a verified TLS connection");
    let (ssl,): (bool,) = sqlx::query_as("select ssl from pg_stat_ssl where pid = pg_backend_pid()")
        .fetch_one(&verified)
        .await
        .unwrap();
    assert!(ssl);
}

/// The balance and the number of ledger entries of `wallet`.
async fn wallet_state(fleet: &Fleet, wallet: &str) -> (i64, i64) {
    sqlx::query_as(
        "select w.balance, (select count(*) from ledger_entry e where e.wallet_id = w.id) from wallet w where w.id = $1",
    )
    .bind(wallet)
    .fetch_one(&fleet.db)
    .await
    .expect("the wallet")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_for_another_host_is_refused_with_a_503_and_nothing_applied() {
    let ca = TestCa::new();
    let mut env = TestEnv::with_tls(&ca);
    let settings = replica_settings(&ca);
    let mut fleet = Fleet::start_https(&env, 1, &borrowed(&settings), &ca).await;
    open_wallets(&fleet, &["elsewhere"], 1_000).await;
    let before = wallet_state(&fleet, "elsewhere").await;
    let good_redis = env.redis_url.clone();
    let good_database = fleet.database_url.clone();
    // The certificates name 127.0.0.1 only; `localhost` reaches the same servers under a name
    // they cannot prove.
    let cases = [
        (
            "REDIS_URL",
            format!("rediss://localhost:{}", env.own_redis().port),
            "certificate not valid for name",
        ),
        (
            "DATABASE_URL",
            good_database.replacen("127.0.0.1", "localhost", 1),
            "certificate not valid for name",
        ),
    ];
    for (setting, wrong_host, reason) in cases {
        let replica = &mut fleet.replicas[0];
        replica.set_env("REDIS_URL", Some(&good_redis));
        replica.set_env("DATABASE_URL", Some(&good_database));
        replica.set_env(setting, Some(&wrong_host));
        // Refuse rather than go on under Postgres alone when Redis cannot be reached, so that
        // both dependencies' refusals show as 503s (tests/suite/outage.rs has the other way).
        replica.set_env("REDIS_OUTAGE", Some("refuse"));
        replica.start_unready();

        // Every payment is refused and changes nothing. The reason reaches the log as soon as one
        // handshake has failed; on a loaded machine a first attempt may instead run out of its
        // connect wait (PG_ACQUIRE_TIMEOUT) before the handshake ends, so a few are allowed.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let paid = fleet
                .client
                .post(fleet.replicas[0].url("/wallets/elsewhere/pay"))
                .json(&json!({ "amount": 100 }))
                .send()
                .await
                .expect("an answer");
            assert_eq!(paid.status(), 503, "{setting} with a wrong-host certificate");
            let problem: Value = paid.json().await.unwrap();
            assert_eq!(problem["code"], "dependency_unavailable", "{problem}");
            assert_eq!(wallet_state(&fleet, "elsewhere").await, before, "{setting}: nothing applied");
            let log = fleet.replicas[0].log();
            if log.contains(reason) {
                break;
            }
            assert!(Instant::now() < deadline, "{setting}: the log says why: {log}");
        }
        let ready = fleet.client.get(fleet.replicas[0].url("/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 503, "{setting}: not ready");
    }

    // Back on the names the certificates carry, the same payment goes through.
    let replica = &mut fleet.replicas[0];
    replica.set_env("REDIS_URL", Some(&good_redis));
    replica.set_env("DATABASE_URL", Some(&good_database));
    replica.start();
    let attempt = pay_one(&fleet.client, &fleet.https_url(""), "elsewhere").await;
    assert!(matches!(attempt.outcome, Outcome::Applied(_)), "{attempt:?}");
    check_books(&fleet, &[("elsewhere", 1_000)], &[attempt]).await;
}

/// `walletlock serve` with `env` on top of working settings: its exit status and what it printed.
fn serve_with(env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .arg("serve")
        .current_dir(repo())
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .env("API_TOKENS", crate::support::API_TOKENS)
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/postgres")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("walletlock serve");
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("walletlock serve kept running with {env:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_replica_refuses_to_start_when_a_tls_file_is_missing_or_unusable() {
    let ca = TestCa::new();
    let ca_file = ca.file("ca.pem");
    let empty_file = tempfile::NamedTempFile::new().expect("an empty file");
    let empty = empty_file.path().display().to_string();
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("REDIS_URL", "rediss://127.0.0.1:1"), ("REDIS_TLS_CA_FILE", "/nonexistent/ca.pem")],
            "REDIS_TLS_CA_FILE",
        ),
        (vec![("REDIS_URL", "rediss://127.0.0.1:1"), ("REDIS_TLS_CA_FILE", &empty)], "REDIS_TLS_CA_FILE"),
        (
            vec![("REDIS_URL", "redis://127.0.0.1:1"), ("REDIS_TLS_CA_FILE", "/nonexistent/ca.pem")],
            "REDIS_TLS_CA_FILE",
        ),
        (
            vec![
                ("REDIS_URL", "rediss://127.0.0.1:1"),
                ("REDIS_TLS_CA_FILE", &ca_file),
                ("REDIS_TLS_CERT_FILE", &ca_file),
                ("REDIS_TLS_KEY_FILE", &empty),
            ],
            "REDIS_TLS_KEY_FILE",
        ),
        (vec![("REDIS_URL", "rediss://127.0.0.1:1/#insecure")], "REDIS_URL"),
        (
            vec![(
                "DATABASE_URL",
                "postgres://p@127.0.0.1:1/p?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            )],
            "sslrootcert",
        ),
        (
            vec![(
                "DATABASE_URL",
                "postgres://p@127.0.0.1:1/p?sslmode=verify-full&sslcert=/nonexistent/c.pem",
            )],
            "sslcert",
        ),
    ];
    for (env, setting) in cases {
        let (status, stderr) = serve_with(&env);
        assert!(!status.success(), "{env:?} started");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {stderr}");
        assert!(lines[0].contains(setting), "{env:?}: the line names {setting}: {stderr}");
        eprintln!("{}", lines[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_over_tls_loses_nothing() {
    let ca = TestCa::new();
    let mut env = TestEnv::with_tls(&ca);
    let settings = replica_settings(&ca);
    let fleet = Fleet::start_https(&env, 3, &borrowed(&settings), &ca).await;
    let wallets = ["r0", "r1", "r2", "r3"];
    open_wallets(&fleet, &wallets, 1_000_000).await;
    let load = Load::start_at(&fleet, &[fleet.https_url("")], &wallets, 8);
    tokio::time::sleep(Duration::from_secs(1)).await;

    env.own_redis().restart();
    let restarted_at = Instant::now();
    let mut attempts = Vec::new();
    let resumed = time_to_recover(&fleet, "r0", Duration::from_secs(20), &mut attempts).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    attempts.extend(load.finish().await);
    let after = attempts
        .iter()
        .filter(|a| a.sent > restarted_at + resumed && matches!(a.outcome, Outcome::Applied(_)))
        .count();
    assert!(after > 0, "payments go on over new TLS connections");
    settle(&fleet, &mut attempts).await;
    check_books(&fleet, &wallets.map(|w| (w, 1_000_000)), &attempts).await;
    eprintln!("redis restart over TLS: payments resumed after {resumed:?}; {:?}", tally(&attempts));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_over_tls_loses_nothing() {
    let ca = TestCa::new();
    let sentinels = SentinelSet::start_tls(&ca);
    let mut env = TestEnv::with_tls(&ca);
    env.redis_url = sentinels.url();
    sentinel_failover_mid_load(sentinels, env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_primary_lost_over_tls_loses_nothing() {
    let ca = TestCa::new();
    let cluster = ClusterSet::start_tls(&ca);
    let mut env = TestEnv::with_tls(&ca);
    env.redis_url = cluster.url();
    cluster_primary_lost_mid_load(cluster, env).await;
}
