//! The fleet: the real binary as three replica processes behind the real nginx.

use crate::support::fleet::{Fleet, repo};
use crate::support::load::open_wallets;
use crate::support::servers::{OwnedChild, signal, wait_until};
use crate::support::{TestEnv, books};
use nix::sys::signal::Signal;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_pays_on_three_replicas_at_once_accept_exactly_ten() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["burst"], 100).await;

    // Straight to the replicas, spread over all three: nginx would keep one wallet on one replica
    // (see the next test), and this is the race between replicas that the lease and fence settle.
    let pays: Vec<_> = (0..50)
        .map(|n| {
            let url = fleet.replicas[n % 3].url("/wallets/burst/pay");
            let request = fleet.client.post(url).json(&json!({ "amount": 10 }));
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                let served_by = response.headers()["x-served-by"].to_str().unwrap().to_owned();
                (response.status().as_u16(), served_by)
            })
        })
        .collect();
    let mut statuses = BTreeMap::new();
    let mut replicas = BTreeSet::new();
    for pay in pays {
        let (status, served_by) = pay.await.unwrap();
        *statuses.entry(status).or_insert(0) += 1;
        replicas.insert(served_by);
    }

    assert_eq!(statuses, BTreeMap::from([(200, 10), (422, 40)]), "exactly ten accepted");
    assert_eq!(replicas, BTreeSet::from(["replica-1".into(), "replica-2".into(), "replica-3".into()]));
    let wallet = fleet.read("/wallets/burst").await;
    assert_eq!(wallet["balance"], 0);
    let books = books(&fleet.db, "burst").await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (0, 0, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_keeps_each_wallet_and_the_transfers_into_it_on_one_replica_and_spreads_the_wallets() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    // Enough wallets that the hash ring (160 points a replica, placed by its random port) leaves
    // no replica without one: a replica's share of the ring is uneven; with a share of a quarter,
    // 60 wallets all miss it once in 3*10^7. (With 30, one run saw a replica serve none, whether
    // by the ring or by a replica out of rotation was not known then: nginx's errors, printed
    // below, tell which.)
    let wallets: Vec<String> = (0..60).map(|n| format!("route-{n}")).collect();
    let ids: Vec<&str> = wallets.iter().map(String::as_str).collect();
    open_wallets(&fleet, &ids, 1_000).await;

    // Each wallet paid, read and paid again: every request about it names its wallet in the path.
    let mut served: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for id in &ids {
        let pay =
            || fleet.client.post(fleet.url(&format!("/wallets/{id}/pay"))).json(&json!({ "amount": 1 }));
        let read = fleet.client.get(fleet.url(&format!("/wallets/{id}")));
        for request in [pay(), read, pay()] {
            let response = request.send().await.unwrap();
            assert!(response.status().is_success(), "{id}: {}", response.status());
            let replica = response.headers()["x-served-by"].to_str().unwrap().to_owned();
            served.entry(id).or_default().insert(replica);
        }
    }
    // Transfers into each wallet, from two others: a transfer names its payee in its body, and
    // goes where its payee's requests go.
    for (n, payee) in ids.iter().enumerate() {
        for payer in [ids[(n + 1) % ids.len()], ids[(n + 2) % ids.len()]] {
            let body = json!({ "from": payer, "to": payee, "amount": 1 });
            let response = fleet.client.post(fleet.url("/transfers")).json(&body).send().await.unwrap();
            assert!(response.status().is_success(), "{payer} to {payee}: {}", response.status());
            let replica = response.headers()["x-served-by"].to_str().unwrap().to_owned();
            served.entry(payee).or_default().insert(replica);
        }
    }
    for (id, replicas) in &served {
        assert_eq!(
            replicas.len(),
            1,
            "{id}: every request and transfer into it on one replica, not {replicas:?}"
        );
    }
    let used: BTreeSet<&String> = served.values().flatten().collect();
    // A replica nginx took out of rotation (one failed connection does it for 1 s) would also be
    // missing: its errors say so.
    assert_eq!(
        used.len(),
        3,
        "60 wallets spread over the three replicas: {used:?}; nginx: {}",
        fleet.nginx_errors()
    );
}

#[tokio::test]
async fn replicas_that_migrate_at_once_apply_each_migration_once() {
    let env = TestEnv::new();
    let admin = sqlx::PgPool::connect(&env.database_url).await.unwrap();
    let schema = format!("bare_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!(r#"create schema "{schema}""#))).execute(&admin).await.unwrap();
    let url = format!("{}?options[search_path]={schema}", env.database_url);

    let migrators: Vec<_> = (0..3)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_walletlock"))
                .arg("migrate")
                .env("DATABASE_URL", &url)
                .spawn()
                .unwrap()
        })
        .collect();
    for mut migrator in migrators {
        assert!(migrator.wait().unwrap().success());
    }
    let applied: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        r#"select count(*) from "{schema}"._sqlx_migrations"#
    )))
    .fetch_one(&admin)
    .await
    .unwrap();
    let files = std::fs::read_dir(repo().join("migrations")).unwrap().count() as i64;
    assert_eq!(applied, files);
}

#[test]
fn an_invalid_setting_stops_the_replica_with_one_line_naming_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["serve", "--lease-ttl", "0ms", "--database-url", "postgres://localhost/x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--lease-ttl") && stderr.contains("at least 1ms"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["serve"])
        .env("LEASE_WAIT", "soon")
        .env("DATABASE_URL", "x")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--lease-wait"));
}

#[test]
fn help_lists_every_setting_with_its_environment_variable_and_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock")).args(["serve", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for var in [
        "LISTEN_ADDR",
        "DATABASE_URL",
        "REDIS_URL",
        "LEASE_TTL",
        "LEASE_WAIT",
        "REPLICA_NAME",
        "PG_POOL_SIZE",
        "REDIS_POOL_SIZE",
        "LOG_FORMAT",
        "SHUTDOWN_GRACE",
        "REQUEST_TIMEOUT",
        "MAX_IN_FLIGHT",
        "WALLET_QUEUE_LIMIT",
        "LISTEN_BACKLOG",
    ] {
        assert!(help.contains(&format!("env: {var}")), "{var} missing from --help");
    }
    assert!(help.contains("[default: 2s]") && help.contains("[default: 3s]"));
}

/// deploy/lib.sh decides whether a recorded pid still runs: `deploy/local up` restarts what does
/// not, `down` waits for it to exit. A process that was killed but not yet reaped by its parent (a
/// zombie) has stopped, though `kill -0` still finds it.
#[test]
fn the_deploy_scripts_count_a_killed_unreaped_process_as_stopped() {
    let alive = |pid: u32| {
        Command::new("bash")
            .arg("-c")
            .arg(format!("source deploy/lib.sh; wl_alive {pid}"))
            .current_dir(repo())
            .status()
            .unwrap()
            .success()
    };
    let state = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
    };
    let mut sleeper = OwnedChild(Command::new("sleep").arg("60").spawn().unwrap());
    let pid = sleeper.pid();
    assert!(alive(pid), "a running process is alive");

    // This test is its parent and does not reap it yet: it stays a zombie.
    signal(pid, Signal::SIGKILL);
    wait_until("the killed process is a zombie", Duration::from_secs(30), || state(pid) == Some('Z'));
    assert!(!alive(pid), "a zombie is not alive");
    let signal_zero = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None);
    assert!(signal_zero.is_ok(), "though kill -0 finds it");

    sleeper.0.wait().unwrap();
    assert!(!alive(pid), "nor is a reaped one");
}
