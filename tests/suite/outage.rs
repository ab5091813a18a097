//! Redis outages, under concurrent payments with keys through nginx to three replicas (or to each
//! replica directly): payments go on under Postgres alone while Redis is gone, hung, or cut off
//! from one replica, and go back on leases by themselves once it answers. Each ends with the bank
//! check: every acknowledged payment in the ledger once, nothing applied that was not.

use crate::support::fleet::Fleet;
use crate::support::hold_row;
use crate::support::load::Bank;
use crate::support::load::{Load, Outcome, check_books, open_wallets, settle, tally, told};
use crate::support::proxy::TcpProxy;
use crate::support::servers::RedisServer;
use crate::support::{CALLER, TestEnv, books, eventually, parse_metrics, tester};
use crate::support::{payment as pay, payment_key as keyed};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use walletlock::idempotency::{Keyed, Prior};
use walletlock::lease::{LeaseSettings, Ttl};
use walletlock::ledger::schema::ScratchSchema;
use walletlock::ledger::storage::Storage;
use walletlock::wallet::{
    Amount, HoldLife, Moved, Movement, MovementOutcome, RedisOutage, Refusal, WalletError, WalletId, Wallets,
};

/// Few wallets for eight clients: the clients contend for each of them all the time. nginx sends
/// each wallet's requests to one replica (`hash ... consistent`), so these spread over replicas.
const WALLETS: [&str; 12] = ["o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8", "o9", "o10", "o11", "o12"];
const OPENING: i64 = 1_000_000;
const SETTINGS: [(&str, &str); 2] = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];

fn opening() -> Vec<(&'static str, i64)> {
    WALLETS.iter().map(|w| (*w, OPENING)).collect()
}

/// One replica's samples named `name`: (labels, value).
async fn samples(fleet: &Fleet, replica: usize, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let scrape = fleet.client.get(fleet.replicas[replica].url("/metrics")).send().await.unwrap();
    parse_metrics(&scrape.text().await.unwrap())
        .into_iter()
        .filter(|(sample, _, _)| sample == name)
        .map(|(_, labels, value)| (labels, value))
        .collect()
}

/// Whether each of `replicas` moves money by `path` (`lease` or `postgres_only`), as its
/// `/readyz` says.
async fn all_on(fleet: &Fleet, replicas: &[usize], path: &str) -> bool {
    let answers = fleet.readiness().await;
    replicas.iter().all(|&n| answers[n].2 == path)
}

/// Each replica's `walletlock_redis_outage` gauge.
async fn outage_gauges(fleet: &Fleet) -> Vec<f64> {
    let mut gauges = Vec::new();
    for replica in 0..fleet.replicas.len() {
        let gauge = samples(fleet, replica, "walletlock_redis_outage").await;
        gauges.push(gauge.iter().map(|(_, value)| value).sum());
    }
    gauges
}

/// The movements one replica applied, by path: (lease, postgres_only).
pub(crate) async fn moved_by_path(fleet: &Fleet, replica: usize) -> (f64, f64) {
    let by_path = samples(fleet, replica, "walletlock_movements_by_path_total").await;
    let count = |path: &str| {
        by_path
            .iter()
            .filter(|(labels, _)| labels.get("path").map(String::as_str) == Some(path))
            .map(|(_, value)| value)
            .sum::<f64>()
    };
    (count("lease"), count("postgres_only"))
}

/// The movements the whole fleet applied, by path.
pub(crate) async fn fleet_by_path(fleet: &Fleet) -> (f64, f64) {
    let mut total = (0.0, 0.0);
    for replica in 0..fleet.replicas.len() {
        let (lease, postgres_only) = moved_by_path(fleet, replica).await;
        total = (total.0 + lease, total.1 + postgres_only);
    }
    total
}

enum Fault {
    /// SIGKILL, then an empty Redis on the same port: every lease, fence counter and note gone.
    Kill,
    /// SIGSTOP, then SIGCONT: Redis hangs, every connection stays open and nothing is answered.
    Stop,
}

impl Fault {
    fn strike(&self, redis: &mut RedisServer) {
        match self {
            Fault::Kill => redis.kill(),
            Fault::Stop => redis.signal(Signal::SIGSTOP),
        }
    }

    fn heal(&self, redis: &mut RedisServer) {
        match self {
            Fault::Kill => redis.start_again(),
            Fault::Stop => redis.signal(Signal::SIGCONT),
        }
    }
}

async fn payments_go_on_through(fault: Fault) {
    let mut env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    open_wallets(&fleet, &WALLETS, OPENING).await;
    let load = Load::start(&fleet, &WALLETS, 8);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (on_leases, alone) = fleet_by_path(&fleet).await;
    assert!(on_leases > 0.0 && alone == 0.0, "on leases before the outage: {on_leases} and {alone}");
    // The replicas that nginx sends payments to (a replica that serves none never learns of the
    // outage, and its readiness says only that Redis does not answer).
    let mut paying = Vec::new();
    for replica in 0..fleet.replicas.len() {
        if moved_by_path(&fleet, replica).await.0 > 0.0 {
            paying.push(replica);
        }
    }
    assert!(paying.len() >= 2, "payments spread over the replicas: {paying:?}");

    let struck = Instant::now();
    fault.strike(env.own_redis());
    eventually("every replica moves money under Postgres alone", Duration::from_secs(5), || {
        all_on(&fleet, &paying, "postgres_only")
    })
    .await;
    let entered = struck.elapsed();
    let (answers, gauges) = (fleet.readiness().await, outage_gauges(&fleet).await);
    for &n in &paying {
        assert_eq!(
            answers[n],
            (200, "degraded".into(), "postgres_only".into()),
            "ready, degraded, without Redis"
        );
        assert_eq!(gauges[n], 1.0);
    }
    let (acknowledged, before) = (load.acknowledged(), fleet_by_path(&fleet).await);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let (during, after) = (load.acknowledged() - acknowledged, fleet_by_path(&fleet).await);
    assert!(during >= 50, "payments went on while Redis was gone: {during} in 1.5 s");
    assert!(
        after.0 == before.0 && after.1 - before.1 >= 50.0,
        "all under Postgres alone, none on leases: (lease, postgres_only) {before:?} then {after:?}"
    );

    let back = Instant::now();
    fault.heal(env.own_redis());
    eventually("every replica moves money under leases again", Duration::from_secs(5), || {
        all_on(&fleet, &paying, "lease")
    })
    .await;
    let returned = back.elapsed();
    for answer in fleet.readiness().await {
        assert_eq!(answer, (200, "ready".into(), "lease".into()), "ready, on leases again");
    }
    assert_eq!(outage_gauges(&fleet).await, [0.0; 3]);
    let (on_leases, _) = fleet_by_path(&fleet).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (on_leases_after, _) = fleet_by_path(&fleet).await;
    assert!(on_leases_after > on_leases, "payments under leases again: {on_leases} then {on_leases_after}");

    let mut attempts = load.finish().await;
    settle(&fleet, &mut attempts).await;
    eprintln!(
        "entered the outage {entered:?} after the fault, back on leases {returned:?} after Redis answered; {:?}",
        tally(&attempts)
    );
    assert!(returned <= Duration::from_secs(2), "every replica was back on leases after {returned:?}");
    check_books(&fleet, &opening(), &attempts).await;
    for replica in paying.iter().map(|&n| &fleet.replicas[n]) {
        let log = replica.log();
        let (entered, left) =
            (log.matches("Redis is unreachable").count(), log.matches("Redis answers again").count());
        assert_eq!((entered, left), (1, 1), "{}: logged once on entering and once on leaving", replica.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_go_on_under_postgres_alone_while_redis_is_killed_and_back_on_leases_once_it_restarts() {
    payments_go_on_through(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_go_on_under_postgres_alone_while_redis_hangs_and_back_on_leases_once_it_answers() {
    payments_go_on_through(Fault::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_redis_pays_under_postgres_alone_beside_replicas_on_leases_and_loses_nothing()
{
    let mut env = TestEnv::with_own_redis();
    let mut fleet = Fleet::start(&env, 3, &SETTINGS).await;
    // replica-3 reaches Redis through a proxy that will drop every byte: a partition, where
    // replica-3's connections stay open and nothing comes back.
    let redis = format!("127.0.0.1:{}", env.own_redis().port).parse().unwrap();
    let proxy = TcpProxy::start(redis).await;
    let proxied = format!("redis://127.0.0.1:{}", proxy.port);
    fleet.replicas[2].set_env("REDIS_URL", Some(&proxied));
    fleet.replicas[2].start();
    open_wallets(&fleet, &WALLETS, OPENING).await;
    // Nine clients, three on each replica, all paying from the same wallets.
    let urls: Vec<String> = fleet.replicas.iter().map(|replica| replica.url("")).collect();
    let load = Load::start_at(&fleet, &urls, &WALLETS, 9);
    tokio::time::sleep(Duration::from_millis(700)).await;

    proxy.black_hole();
    eventually("replica-3 moves money under Postgres alone", Duration::from_secs(5), || async {
        fleet.readiness().await[2].2 == "postgres_only"
    })
    .await;
    let before: Vec<(f64, f64)> =
        futures::future::join_all((0..3).map(|replica| moved_by_path(&fleet, replica))).await;
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let after: Vec<(f64, f64)> =
        futures::future::join_all((0..3).map(|replica| moved_by_path(&fleet, replica))).await;
    let paths = fleet.readiness().await;
    assert_eq!(paths[0].2, "lease");
    assert_eq!(paths[1].2, "lease");

    let mut attempts = load.finish().await;
    settle(&fleet, &mut attempts).await;
    eprintln!("by path, before and after 2 s of the partition: {before:?} {after:?}; {:?}", tally(&attempts));
    assert!(after[2].1 > before[2].1, "replica-3 paid under Postgres alone during the partition");
    assert!(after[0].0 + after[1].0 > before[0].0 + before[1].0, "the others paid under leases meanwhile");
    check_books(&fleet, &opening(), &attempts).await;
}

/// A replica whose Redis is gone, with `REDIS_OUTAGE=postgres`: its lease client fails fast, as the
/// service's does with that setting. The test's Redis is killed once the wallets are open.
async fn replica_without_redis(env: &mut TestEnv, schema: &ScratchSchema, ids: &[&WalletId]) -> Wallets {
    let settings = LeaseSettings::new(Ttl::new(Duration::from_secs(1)).unwrap(), Duration::from_secs(2));
    let db = Storage::pool_options().max_connections(8).connect(&schema.url).await.unwrap();
    let wallets =
        Wallets::new(db, env.leases_with(settings.failing_fast())).with_redis_outage(RedisOutage::Postgres);
    for id in ids {
        wallets.open(CALLER, id, 100, None).await.unwrap();
    }
    env.own_redis().kill();
    wallets
}

/// Sends every movement at once (each its own request) and waits for all of them.
async fn all_at_once(
    wallets: &Wallets,
    movements: Vec<(&WalletId, Movement, Option<Keyed<MovementOutcome>>)>,
) -> Vec<Result<Moved, WalletError>> {
    let requests: Vec<_> = movements
        .into_iter()
        .map(|(id, movement, key)| {
            let (wallets, id) = (wallets.clone(), id.clone());
            tokio::spawn(async move { wallets.apply(&tester(), &id, movement, key).await })
        })
        .collect();
    let mut results = Vec::new();
    for request in requests {
        results.push(request.await.unwrap());
    }
    results
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_postgres_alone_every_movement_is_decided_as_under_a_lease_and_a_key_sent_twice_charges_once() {
    let mut env = TestEnv::with_own_redis();
    let (schema, db) = env.database(2).await;
    let (a, b, c) = (WalletId::generate(), WalletId::generate(), WalletId::generate());
    let wallets = replica_without_redis(&mut env, &schema, &[&a, &b, &c]).await;

    let results = all_at_once(
        &wallets,
        vec![
            (&a, pay(10), Some(keyed(&a, "twice"))),
            (&a, pay(10), Some(keyed(&a, "twice"))),
            (&b, pay(60), None),
            (&b, pay(50), None),
            (
                &c,
                Movement::Hold {
                    amount: Amount::new(30).unwrap(),
                    life: HoldLife::DEFAULT,
                    reference: None,
                    metadata: Default::default(),
                },
                None,
            ),
        ],
    )
    .await;
    assert_eq!(wallets.redis_outage(), (RedisOutage::Postgres, true), "in an outage");
    let charged: Vec<_> = results[..2].iter().filter(|r| r.is_ok()).collect();
    let replayed =
        results[..2].iter().filter(|r| matches!(r, Err(WalletError::AlreadyRan(Prior::Replay(_))))).count();
    assert_eq!((charged.len(), replayed), (1, 1), "one charge, one replay of it: {:?}", &results[..2]);
    let refused = results[2..4]
        .iter()
        .filter(|r| matches!(r, Err(WalletError::Refused(Refusal::InsufficientFunds { .. }))))
        .count();
    assert_eq!(refused, 1, "60 and 50 from 100: one goes through, {:?}", &results[2..4]);
    let Ok(Moved::Hold { hold, .. }) = &results[4] else { panic!("the hold: {:?}", results[4]) };

    let captured = wallets
        .apply(
            &tester(),
            &c,
            Movement::Capture { hold: hold.id, amount: Some(Amount::new(20).unwrap()) },
            None,
        )
        .await;
    assert!(matches!(captured, Ok(Moved::Hold { entry: Some(_), .. })), "{captured:?}");
    for (id, balance, pays) in [(&a, 90, 1), (&c, 80, 1)] {
        let books = books(&db, id.as_str()).await;
        assert_eq!((books.balance, books.ledger_sum, books.pays), (balance, balance, pays), "{id}");
    }
    let b_books = books(&db, b.as_str()).await;
    assert!([40, 50].contains(&b_books.balance) && b_books.balance == b_books.ledger_sum);
    let held: i64 = sqlx::query_scalar("select held from wallet where id = $1")
        .bind(c.as_str())
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(held, 0, "the capture released the rest of the hold");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_postgres_alone_a_payment_waits_for_a_row_another_transaction_holds_at_most_one_second() {
    let mut env = TestEnv::with_own_redis();
    let (schema, db) = env.database(2).await;
    let id = WalletId::generate();
    let wallets = replica_without_redis(&mut env, &schema, &[&id]).await;

    // Held for 300 ms: the payment waits for the row, then applies.
    let blocker = hold_row(&db, id.as_str()).await;
    let started = Instant::now();
    let paying = tokio::spawn({
        let (wallets, id) = (wallets.clone(), id.clone());
        async move { wallets.apply(&tester(), &id, pay(10), None).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.rollback().await.unwrap();
    assert!(paying.await.unwrap().is_ok());
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited for the row");

    // Held past the lock timeout: 503 lock_timeout, nothing applied.
    let blocker = hold_row(&db, id.as_str()).await;
    let started = Instant::now();
    let result = wallets.apply(&tester(), &id, pay(10), None).await;
    assert!(matches!(result, Err(WalletError::LockTimeout { .. })), "{result:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "bounded by the lock timeout: {:?}",
        started.elapsed()
    );
    blocker.rollback().await.unwrap();
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (90, 90, 1));
}

/// A wallet's entries are timed in the order they were written, whichever path wrote them (an
/// instant's balance and a statement's period read them by time): a round on a lease that stalls
/// before it reads the wallet, while a replica cut off from Redis pays from it under Postgres alone,
/// times its own payment after that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_stalled_before_its_read_times_its_payment_after_one_written_meanwhile_under_postgres_alone()
{
    let mut env = TestEnv::with_own_redis();
    let mut fleet = Fleet::start(&env, 2, &[("LEASE_TTL", "10s")]).await;
    open_wallets(&fleet, &["timed"], OPENING).await;
    // Without the note its opening left, the round reads the wallet's row.
    env.redis_cmd::<()>(&["FLUSHALL"]).await;
    let redis = format!("127.0.0.1:{}", env.own_redis().port).parse().unwrap();
    let proxy = TcpProxy::start(redis).await;
    let proxied = format!("redis://127.0.0.1:{}", proxy.port);
    fleet.replicas[1].set_env("REDIS_URL", Some(&proxied));
    fleet.replicas[1].start();
    proxy.black_hole();

    // replica-1 takes the lease and stops itself in its round, before the round reads the wallet.
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("before_round_read:stop"));
    fleet.replicas[0].start();
    let (client, url) = (fleet.client.clone(), fleet.replicas[0].url(""));
    let mut leased =
        tokio::spawn(async move { crate::support::load::pay(&client, &url, "timed", 1, "leased").await });
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped before its round's read", &mut leased).await;
    let meanwhile =
        crate::support::load::pay(&fleet.client, &fleet.replicas[1].url(""), "timed", 2, "unleased").await;
    assert!(matches!(meanwhile, Outcome::Applied(_)), "replica-2 paid under Postgres alone: {meanwhile:?}");
    fleet.replicas[0].signal(Signal::SIGCONT);
    let resumed = leased.await.unwrap();
    assert!(matches!(resumed, Outcome::Applied(_)), "replica-1 paid once it woke: {resumed:?}");

    let entries: Vec<(i64, i64, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "select seq, amount, created_at from ledger_entry where wallet_id = 'timed' order by seq",
    )
    .fetch_all(&fleet.db)
    .await
    .unwrap();
    assert_eq!(entries.iter().map(|e| e.1).collect::<Vec<_>>(), [OPENING, 2, 1], "the write order");
    assert!(
        entries.windows(2).all(|pair| pair[0].2 <= pair[1].2),
        "entries timed in the write order: {entries:?}"
    );
    let acks: Vec<serde_json::Value> = crate::support::load::opened(&[("timed", OPENING)])
        .into_iter()
        .chain([told("unleased", &meanwhile, &[("timed", -2)]), told("leased", &resumed, &[("timed", -1)])])
        .collect();
    crate::support::fleet::audit_books(fleet.database_url(), &acks);
}
