//! The race: many replicas spend from one wallet at the same instant.

use crate::support::payment as pay;
use crate::support::{CALLER, EntryOf, TestEnv, books, eventually, tester};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;
use walletlock::ledger;
use walletlock::tutorial::{hammer, unguarded_spend};
use walletlock::wallet::{Refusal, WalletError, WalletId, Wallets};

async fn open(wallets: &Wallets, balance: i64) -> WalletId {
    let id = WalletId::generate();
    wallets.open(CALLER, &id, balance, None).await.unwrap();
    id
}

#[tokio::test]
async fn fifty_concurrent_spends_through_three_replicas_accept_exactly_ten() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let (ttl, wait) = (Duration::from_secs(2), Duration::from_secs(10));
    let replicas = [
        env.replica(&schema, ttl, wait).await,
        env.replica(&schema, ttl, wait).await,
        env.replica(&schema, ttl, wait).await,
    ];
    let id = open(&replicas[0], 100).await;

    let start = Arc::new(Barrier::new(50));
    let spends: Vec<_> = (0..50)
        .map(|n| {
            let (replica, id, start) = (replicas[n % 3].clone(), id.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                replica.apply(&tester(), &id, pay(10), None).await.entry()
            })
        })
        .collect();
    let (mut accepted, mut declined) = (0, 0);
    for spend in spends {
        match spend.await.unwrap() {
            Ok(_) => accepted += 1,
            Err(WalletError::Refused(Refusal::InsufficientFunds { .. })) => declined += 1,
            Err(other) => panic!("unexpected outcome: {other:?}"),
        }
    }

    assert_eq!((accepted, declined), (10, 40));
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (0, 0, 10));
}

#[tokio::test]
async fn without_the_lease_concurrent_spends_lose_updates() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(50).await;
    let id = WalletId::generate();
    let mut tx = db.begin().await.unwrap();
    ledger::create_wallet(&mut tx, id.as_str(), CALLER, 100, true).await.unwrap();
    tx.commit().await.unwrap();

    // Everyone reads before anyone writes back: the interleaving a busy fleet produces by chance.
    let all_read = Arc::new(Barrier::new(50));
    let (accepted, _) = hammer(50, || {
        let (db, id, all_read) = (db.clone(), id.clone(), all_read.clone());
        async move {
            unguarded_spend(&db, &id, 10, async move {
                all_read.wait().await;
            })
            .await
        }
    })
    .await
    .unwrap();

    let balance = books(&db, id.as_str()).await.balance;
    assert_eq!(accepted, 50, "every spend saw 100 and went ahead");
    assert_eq!(balance, 90, "49 of 50 updates were lost");
}

#[tokio::test]
async fn a_dropped_caller_leaves_no_lease_behind_and_no_half_applied_spend() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_secs(10), Duration::from_secs(5)).await;
    let id = open(&wallets, 100).await;

    // The client hangs up at every moment of the spend: while it waits for the lease, holds it,
    // commits. Whatever moment, the spend is either fully applied or not at all, and the lease
    // does not linger until its TTL.
    let tester = tester();
    for cutoff_us in [0, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000] {
        let spend = wallets.apply(&tester, &id, pay(1), None);
        let _ = tokio::time::timeout(Duration::from_micros(cutoff_us), spend).await;
    }
    assert!(wallets.drain(Duration::from_secs(5)).await, "every abandoned spend finished");
    eventually("no lease left behind", Duration::from_secs(3), || async {
        env.redis_cmd::<i64>(&["EXISTS", &env.lease_key(&walletlock::wallet::lease_name(&id))]).await == 0
    })
    .await;
    let books = books(&db, id.as_str()).await;
    assert_eq!(books.balance, books.ledger_sum, "no half-applied spend");
    assert_eq!(books.balance, 100 - books.pays, "every pay row moved the balance once");
}

#[tokio::test]
async fn a_spend_whose_caller_left_still_runs_to_its_end() {
    let env = TestEnv::new();
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_secs(10), Duration::from_secs(5)).await;
    let id = open(&wallets, 100).await;

    // Another holder keeps the wallet busy, so our spend is waiting for the lease when its
    // caller gives up.
    let leases = env.leases(Duration::from_secs(10), Duration::from_secs(5));
    let blocker = leases.acquire(&walletlock::wallet::lease_name(&id)).await.unwrap();
    let tester = tester();
    let spend = wallets.apply(&tester, &id, pay(10), None);
    assert!(tokio::time::timeout(Duration::from_millis(50), spend).await.is_err());
    blocker.release().await.unwrap();

    eventually("the abandoned spend committed", Duration::from_secs(3), || async {
        books(&db, id.as_str()).await.pays == 1
    })
    .await;
    assert!(wallets.drain(Duration::from_secs(1)).await, "nothing left in flight");
    assert_eq!(books(&db, id.as_str()).await.balance, 90);
}
