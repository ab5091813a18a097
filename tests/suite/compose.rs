//! docker-compose.yml for real: `deploy/compose` brings the stack up on a Docker engine (Postgres,
//! Redis, the secrets step, the migration, the replicas, nginx), and it is used as a user uses it,
//! through nginx on a loopback port. One test, one stack: bringing it up is the slow part.

use crate::support::compose::{ComposeStack, docker};
use crate::support::eventually;
use crate::support::load::{Bank, Load, Outcome, check_books, open_wallets, settle, tally};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

/// Enough wallets that nginx's consistent hash (one replica per wallet) sends some to every replica.
const WALLETS: usize = 40;
const OPENING: i64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_stack_serves_through_nginx_scales_loses_nothing_to_a_killed_replica_and_keeps_its_token()
{
    let stack = ComposeStack::up(3).await;
    let started_engine = stack.dockerd_pid_file().exists();
    // Wallets to see which replicas serve, and wallets for the load and its bank check alone.
    let names: Vec<String> = (0..WALLETS).map(|n| format!("compose-{n}")).collect();
    let wallets: Vec<&str> = names.iter().map(String::as_str).collect();
    let load_names: Vec<String> = (0..WALLETS).map(|n| format!("compose-load-{n}")).collect();
    let load_wallets: Vec<&str> = load_names.iter().map(String::as_str).collect();
    open_wallets(&stack, &wallets, OPENING).await;
    open_wallets(&stack, &load_wallets, OPENING).await;

    // Three healthy replicas, each serving payments through nginx.
    let replicas = stack.containers("app");
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    assert_eq!(served_by(&stack, &wallets).await, replica_names(&replicas), "served by all three");

    replicas_connect_as_the_app_role_and_the_redis_acl_user(&stack, &replicas).await;

    // `--scale app=5`: nginx follows without a restart.
    let nginx = stack.containers("nginx").into_iter().next().expect("nginx runs");
    let nginx_started = stack.started_at(&nginx);
    stack.scale(5);
    let replicas = stack.containers("app");
    assert_eq!(replicas.len(), 5, "{replicas:?}");
    let expected = replica_names(&replicas);
    eventually("nginx sends payments to all five replicas", Duration::from_secs(20), || async {
        served_by(&stack, &wallets).await == expected
    })
    .await;
    assert_eq!(stack.containers("nginx"), BTreeSet::from([nginx.clone()]), "the same nginx container");
    assert_eq!(stack.started_at(&nginx), nginx_started, "nginx was not restarted");

    // A replica killed (SIGKILL) under load: after the careful client has retried every unknown
    // outcome with its key, the books balance and no acknowledged payment is lost.
    let load = Load::start(&stack, &load_wallets, 8);
    eventually("payments before the kill", Duration::from_secs(60), || async { load.acknowledged() >= 200 })
        .await;
    let victim = replicas.iter().next().expect("a replica").clone();
    docker(&["kill", &victim]);
    let at_kill = load.acknowledged();
    eventually("payments after the kill", Duration::from_secs(60), || async {
        load.acknowledged() >= at_kill + 300
    })
    .await;
    let mut attempts = load.finish().await;
    println!("attempts around the kill: {:?}", tally(&attempts));
    settle(&stack, &mut attempts).await;
    let opening: Vec<(&str, i64)> = load_wallets.iter().map(|w| (*w, OPENING)).collect();
    check_books(&stack, &opening, &attempts).await;
    assert_eq!(stack.containers("app").len(), 4, "the killed replica stays down (docker kill is a stop)");

    // The secrets step makes the token once: `down` and `up` without -v keep it, and the data.
    let token = stack.token();
    stack.down(false);
    stack.scale(3);
    assert_eq!(stack.token(), token, "the token survives down/up without -v");
    let wallet: serde_json::Value =
        stack.client().get(stack.url("/wallets/compose-load-0")).send().await.unwrap().json().await.unwrap();
    let paid = attempts
        .iter()
        .filter(|a| a.wallet == "compose-load-0" && matches!(a.outcome, Outcome::Applied(_)))
        .count() as i64;
    assert!(paid > 0, "the load paid from compose-load-0");
    assert_eq!(wallet["balance"], json!(OPENING - paid), "the data survives down/up without -v");

    // `down -v` leaves nothing running and no data: no container process, no volume, and no
    // engine if deploy/compose started one.
    let footprint = stack.footprint();
    // Postgres, Redis, the keeper of the lease scripts, three replicas, nginx (the one-shot steps
    // have exited).
    assert_eq!(footprint.pids.len(), 7 + usize::from(started_engine), "{footprint:?}");
    assert!(footprint.volume_dirs.len() >= 3, "pgdata, secrets, promdata at least: {footprint:?}");
    stack.down(true);
    assert_eq!(footprint.left(), Vec::<String>::new());
}

/// The `X-Served-By` of one payment on each wallet through nginx.
async fn served_by(stack: &ComposeStack, wallets: &[&str]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for wallet in wallets {
        let response = stack
            .client()
            .post(stack.url(&format!("/wallets/{wallet}/pay")))
            .header("idempotency-key", uuid::Uuid::new_v4().to_string())
            .json(&json!({ "amount": 1 }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "pay from {wallet}");
        names.insert(response.headers()["x-served-by"].to_str().unwrap().to_owned());
    }
    names
}

/// A replica names itself <hostname>-<port>, and a container's hostname is its short id.
fn replica_names(containers: &BTreeSet<String>) -> BTreeSet<String> {
    containers.iter().map(|id| format!("{id}-8080")).collect()
}

/// Each replica's own credentials (from its container's environment) log in as `walletlock_app`
/// and as the Redis user `walletlock`, every connection the replicas hold is theirs, and neither
/// can change the schema or run what the ACL does not allow.
async fn replicas_connect_as_the_app_role_and_the_redis_acl_user(
    stack: &ComposeStack,
    replicas: &BTreeSet<String>,
) {
    let replica = replicas.iter().next().expect("a replica");
    let database_url = reqwest::Url::parse(&stack.container_env(replica, "DATABASE_URL")).unwrap();
    assert_eq!(database_url.username(), "walletlock_app");
    let redis_url = reqwest::Url::parse(&stack.container_env(replica, "REDIS_URL")).unwrap();
    assert_eq!(redis_url.username(), "walletlock");

    let app = sqlx::PgPool::connect(&format!(
        "postgres://walletlock_app:{}@127.0.0.1:{}/walletlock",
        database_url.password().unwrap(),
        stack.pg_port
    ))
    .await
    .expect("the replica's credentials log in");
    let wallets: i64 = sqlx::query_scalar("select count(*) from wallet").fetch_one(&app).await.unwrap();
    assert!(wallets > 0, "the app role reads the wallets");
    for ddl in
        ["alter table wallet add column sneaky int", "drop table ledger_entry", "create table sneaky (x int)"]
    {
        let refused = sqlx::query(ddl).execute(&app).await.expect_err(ddl);
        let code = refused.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{ddl}: {refused}");
    }

    let ips: Vec<String> = replicas.iter().map(|id| stack.container_ip(id)).collect();
    let users: Vec<(String, String)> = sqlx::query_as(
        "select usename::text, host(client_addr) from pg_stat_activity
         where backend_type = 'client backend' and host(client_addr) = any($1)",
    )
    .bind(&ips)
    .fetch_all(stack.db())
    .await
    .unwrap();
    assert!(!users.is_empty(), "the replicas hold Postgres connections");
    assert!(users.iter().all(|(user, _)| user == "walletlock_app"), "{users:?}");

    let clients =
        stack.exec("redis", &["redis-cli", "--no-auth-warning", "--user", "admin", "client", "list"]);
    let replica_clients: Vec<&str> =
        clients.lines().filter(|line| ips.iter().any(|ip| line.contains(&format!(" addr={ip}:")))).collect();
    assert!(!replica_clients.is_empty(), "the replicas hold Redis connections: {clients}");
    assert!(replica_clients.iter().all(|line| line.contains(" user=walletlock ")), "{replica_clients:?}");
    let password = redis_url.password().unwrap();
    for command in [&["flushall"][..], &["eval", "return 1", "0"], &["config", "get", "*"]] {
        let mut args = vec!["redis-cli", "--no-auth-warning", "--user", "walletlock", "--pass", password];
        args.extend_from_slice(command);
        let answer = stack.exec("redis", &args);
        assert!(answer.contains("NOPERM"), "{command:?} as the replicas' Redis user: {answer}");
    }
}
