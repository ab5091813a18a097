//! Group commit: movements queued for one wallet are applied in batches under one lease, each still
//! decided on its own, none applied if the batch's fenced commit is refused.

use crate::support::hold_row;
use crate::support::{CALLER, EntryOf, TestEnv, books, eventually, render, tester};
use crate::support::{payment as pay, payment_key as keyed};
use std::time::{Duration, Instant};
use walletlock::idempotency::{Keyed, Prior};
use walletlock::wallet::{Movement, MovementOutcome, Refusal, WalletError, WalletId, Wallets, lease_name};

/// Queues `movements` (in this order) while another holder keeps the wallet's lease, then lets
/// the wallet's worker have it: they all go in one batch.
async fn one_batch(
    env: &TestEnv,
    wallets: &Wallets,
    id: &WalletId,
    movements: Vec<(Movement, Option<Keyed<MovementOutcome>>)>,
) -> Vec<Result<walletlock::ledger::Entry, WalletError>> {
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire(&lease_name(id)).await.unwrap();
    let mut queued = Vec::new();
    for (movement, key) in movements {
        let (wallets, id) = (wallets.clone(), id.clone());
        queued.push(tokio::spawn(async move { wallets.apply(&tester(), &id, movement, key).await.entry() }));
        // Let each one reach the queue before the next, so the order is the order given.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.release().await.unwrap();
    let mut results = Vec::new();
    for request in queued {
        results.push(request.await.unwrap());
    }
    results
}

#[tokio::test]
async fn a_payment_that_does_not_fit_is_refused_alone_in_its_batch() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_secs(2), Duration::from_secs(5)).await;
    let id = WalletId::generate();
    wallets.open(CALLER, &id, 100, None).await.unwrap();

    let results =
        one_batch(&env, &wallets, &id, vec![(pay(60), None), (pay(50), None), (pay(30), None)]).await;

    assert_eq!(results[0].as_ref().unwrap().balance, 40);
    assert!(matches!(results[1], Err(WalletError::Refused(Refusal::InsufficientFunds { balance: 40, .. }))));
    assert_eq!(results[2].as_ref().unwrap().balance, 10);
    let (first, third) = (results[0].as_ref().unwrap(), results[2].as_ref().unwrap());
    assert_eq!((first.version, third.version), (2, 3), "one entry each, in order");
    assert_eq!(first.created_at, third.created_at, "one transaction for the batch");
    assert_eq!(first.fence, third.fence, "under one lease");
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (10, 10, 2));
}

#[tokio::test]
async fn two_requests_with_one_key_in_one_batch_charge_once() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_secs(2), Duration::from_secs(5)).await;
    let id = WalletId::generate();
    wallets.open(CALLER, &id, 100, None).await.unwrap();

    // A double tap: the same request twice, queued behind one lease, lands in one batch.
    let results = one_batch(
        &env,
        &wallets,
        &id,
        vec![(pay(10), Some(keyed(&id, "twice"))), (pay(10), Some(keyed(&id, "twice")))],
    )
    .await;

    let first = results[0].as_ref().expect("the first one runs");
    assert_eq!(first.balance, 90);
    match &results[1] {
        Err(WalletError::AlreadyRan(Prior::Replay(stored))) => {
            assert_eq!(stored, &render(&Ok(walletlock::wallet::Moved::Entry(first.clone()))))
        }
        other => panic!("the second one gets the first one's response: {other:?}"),
    }
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.pays), (90, 1), "charged once");
}

#[tokio::test]
async fn a_lease_lost_while_the_wallet_is_busy_applies_none_of_the_batch_and_every_request_hears_lease_lost()
{
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_millis(300), Duration::from_secs(5)).await;
    let id = WalletId::generate();
    wallets.open(CALLER, &id, 100, None).await.unwrap();

    // Another statement holds the wallet's row, so the batch's round finds it busy and tries
    // again; meanwhile Redis loses the lease (as in a failover).
    let blocker = hold_row(&db, id.as_str()).await;
    let holder =
        env.leases(Duration::from_secs(10), Duration::from_secs(1)).acquire(&lease_name(&id)).await.unwrap();
    let mut queued = Vec::new();
    for (amount, key) in [(10, Some(keyed(&id, "held"))), (20, None), (30, None)] {
        let (wallets, id) = (wallets.clone(), id.clone());
        queued
            .push(tokio::spawn(async move { wallets.apply(&tester(), &id, pay(amount), key).await.entry() }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.release().await.unwrap();
    let lease = env.lease_key(&lease_name(&id));
    eventually("the worker holds the lease", Duration::from_secs(2), || async {
        env.redis_cmd::<i64>(&["EXISTS", &lease]).await == 1
    })
    .await;
    let _: () = env.redis_cmd(&["DEL", &lease]).await;

    for request in queued {
        let result = request.await.unwrap();
        assert!(matches!(result, Err(WalletError::LeaseLost)), "{result:?}");
    }
    blocker.rollback().await.unwrap();
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (100, 100, 0), "none of the batch applied");
    let keys_left: i64 =
        sqlx::query_scalar("select count(*) from idempotency_key").fetch_one(&db).await.unwrap();
    assert_eq!(keys_left, 0, "no response stored, so a retry runs");
}

#[tokio::test]
async fn a_batch_that_outlives_the_ttl_keeps_its_lease_through_the_watchdog() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let ttl = Duration::from_millis(300);
    let wallets = env.replica(&schema, ttl, Duration::from_secs(5)).await;
    let id = WalletId::generate();
    wallets.open(CALLER, &id, 100, None).await.unwrap();

    // The batch is stuck behind a row lock for three TTLs.
    let row = hold_row(&db, id.as_str()).await;
    let payment = tokio::spawn({
        let (wallets, id) = (wallets.clone(), id.clone());
        async move { wallets.apply(&tester(), &id, pay(10), None).await.entry() }
    });
    let key = env.lease_key(&lease_name(&id));
    eventually("the worker holds the lease", Duration::from_secs(2), || async {
        env.redis_cmd::<i64>(&["EXISTS", &key]).await == 1
    })
    .await;
    let until = Instant::now() + ttl * 3;
    while Instant::now() < until {
        assert!(env.redis_cmd::<i64>(&["PTTL", &key]).await > 0, "the lease lapsed while its batch ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    row.rollback().await.unwrap();

    assert_eq!(payment.await.unwrap().unwrap().balance, 90, "the batch committed under its kept lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_hammering_one_wallet_are_both_served() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let (ttl, wait) = (Duration::from_secs(2), Duration::from_secs(5));
    let replicas = [env.replica(&schema, ttl, wait).await, env.replica(&schema, ttl, wait).await];
    let id = WalletId::generate();
    replicas[0].open(CALLER, &id, 10_000_000, None).await.unwrap();

    let stop_at = Instant::now() + Duration::from_millis(1_500);
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (replica, id) = (replicas[n % 2].clone(), id.clone());
            tokio::spawn(async move {
                let mut accepted = 0;
                while Instant::now() < stop_at {
                    replica.apply(&tester(), &id, pay(1), None).await.entry().expect("served, not timed out");
                    accepted += 1;
                }
                (n % 2, accepted)
            })
        })
        .collect();
    let mut per_replica = [0usize; 2];
    for client in clients {
        let (replica, accepted) = client.await.unwrap();
        per_replica[replica] += accepted;
    }
    let total = per_replica[0] + per_replica[1];
    assert!(total > 0);
    for (n, served) in per_replica.iter().enumerate() {
        assert!(*served * 5 >= total, "replica {n} starved: {per_replica:?}");
    }
    assert_eq!(books(&db, id.as_str()).await.pays as usize, total);
}
