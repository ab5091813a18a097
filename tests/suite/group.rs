//! Rounds across wallets: one statement writes every wallet a replica holds, each conditional on its
//! own fence and version; a wallet whose lease was lost is left out alone, a key sent twice runs
//! once, and rounds that share wallets wait for each other instead of deadlocking.

use crate::support::{TestEnv, books, eventually, render};
use std::time::{Duration, Instant};
use walletlock::idempotency::{self, IdempotencyKey, Keyed, Prior, Scope};
use walletlock::ledger::group::{self, ClaimOutcome, GroupWrite, ToClaim, WalletWrite};
use walletlock::ledger::{self, Entry, EntryKind};
use walletlock::wallet::{Amount, Movement, WalletError, WalletId, lease_name};

async fn wallet_with(db: &sqlx::PgPool, balance: i64) -> WalletId {
    let id = WalletId::generate();
    ledger::create_wallet(&mut db.acquire().await.unwrap(), id.as_str(), balance).await.unwrap();
    id
}

fn payment(id: &WalletId, fence: i64, version: i64, amount: i64, balance: i64) -> Entry {
    Entry {
        id: uuid::Uuid::new_v4(),
        wallet_id: id.as_str().to_owned(),
        kind: EntryKind::Pay,
        amount,
        balance,
        version,
        fence,
        reference: None,
        transfer_id: None,
        refund_of: None,
        created_at: chrono::Utc::now(),
    }
}

#[tokio::test]
async fn a_round_writes_every_wallet_but_the_one_another_holder_claimed() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let ids = [wallet_with(&db, 100).await, wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    let mut conn = db.acquire().await.unwrap();
    let claims: Vec<ToClaim> = ids.iter().map(|id| ToClaim { id: id.as_str(), fence: 5 }).collect();
    let found = group::read(&mut conn, &claims, &[]).await.unwrap();
    for id in &ids {
        assert!(matches!(found.claims[id.as_str()], ClaimOutcome::Claimed(_)), "{:?}", found.claims);
    }

    // The second wallet's lease passes to a newer holder, which claims it.
    let newer = [ToClaim { id: ids[1].as_str(), fence: 6 }];
    assert!(matches!(
        group::read(&mut conn, &newer, &[]).await.unwrap().claims[ids[1].as_str()],
        ClaimOutcome::Claimed(_)
    ));

    let entries: Vec<Entry> = ids.iter().map(|id| payment(id, 5, 2, 10, 90)).collect();
    let write = GroupWrite {
        wallets: ids
            .iter()
            .map(|id| WalletWrite { id: id.as_str(), fence: 5, read_version: 1, balance: 90, version: 2 })
            .collect(),
        entries: entries.iter().collect(),
        keys: Vec::new(),
    };
    let moved = group::commit(&mut conn, &write, chrono::Utc::now(), Duration::from_secs(60)).await.unwrap();

    assert!(moved.contains(ids[0].as_str()) && moved.contains(ids[2].as_str()), "{moved:?}");
    assert!(!moved.contains(ids[1].as_str()), "the stale holder's write is refused");
    for (id, expected) in [(&ids[0], 90), (&ids[1], 100), (&ids[2], 90)] {
        let books = books(&db, id.as_str()).await;
        assert_eq!((books.balance, books.ledger_sum), (expected, expected), "{id}");
    }
}

fn pay(amount: i64) -> Movement {
    Movement::Pay { amount: Amount::new(amount).unwrap(), reference: None }
}

#[tokio::test]
async fn one_key_twice_in_a_round_of_several_wallets_charges_once() {
    let env = TestEnv::new();
    let (schema, db) = env.database(4).await;
    let wallets = env.replica(&schema, Duration::from_secs(2), Duration::from_secs(5)).await;
    let ids = [wallet_with(&db, 100).await, wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    // Both of the replica's rounds wait on the key table held here, so the next round gathers
    // every wallet's batch at once.
    let stuck = [wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    let mut blocker = db.begin().await.unwrap();
    sqlx::query("lock table idempotency_key in access exclusive mode").execute(&mut *blocker).await.unwrap();
    let mut blocked = Vec::new();
    for id in &stuck {
        let (wallets, id) = (wallets.clone(), id.clone());
        blocked.push(tokio::spawn(async move { wallets.apply(&id, pay(1), None).await }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keyed = || Keyed {
        scope: Scope::wallet("tester", &ids[0]),
        key: IdempotencyKey::parse(b"double-tap").unwrap(),
        fingerprint: idempotency::fingerprint("POST", "/pay", br#"{"amount":10}"#),
        render,
    };
    let mut queued = Vec::new();
    for (id, key) in [(&ids[0], Some(keyed())), (&ids[0], Some(keyed())), (&ids[1], None), (&ids[2], None)] {
        let (wallets, id) = (wallets.clone(), id.clone());
        queued.push(tokio::spawn(async move { wallets.apply(&id, pay(10), key).await }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eventually("every wallet's worker holds its lease", Duration::from_secs(2), || async {
        let mut held = 0;
        for id in &ids {
            held += env.redis_cmd::<i64>(&["EXISTS", &env.lease_key(&lease_name(id))]).await;
        }
        held == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    blocker.commit().await.unwrap();

    let mut results = Vec::new();
    for request in queued {
        results.push(request.await.unwrap());
    }
    for request in blocked {
        request.await.unwrap().unwrap();
    }
    let first = results[0].as_ref().expect("the first request with the key runs");
    match &results[1] {
        Err(WalletError::AlreadyRan(Prior::Replay(stored))) => {
            assert_eq!(stored, &render(&Ok(first.clone())))
        }
        other => panic!("the second request with the key replays the first: {other:?}"),
    }
    let (second, third) = (results[2].as_ref().unwrap(), results[3].as_ref().unwrap());
    assert!(
        first.created_at == second.created_at && second.created_at == third.created_at,
        "one round wrote the three wallets"
    );
    assert_eq!(books(&db, ids[0].as_str()).await.pays, 1, "charged once");
    for id in &ids {
        assert_eq!(books(&db, id.as_str()).await.balance, 90);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rounds_that_share_wallets_wait_for_each_other_and_never_deadlock() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(8).await;
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(wallet_with(&db, 1_000_000).await);
    }
    let deadlocks = || async {
        sqlx::query_scalar::<_, i64>(
            "select deadlocks from pg_stat_database where datname = current_database()",
        )
        .fetch_one(&db)
        .await
        .unwrap()
    };
    let before = deadlocks().await;

    // Four writers, as stale and current holders of the same wallets would be, each taking the
    // wallets in its own order: claim all, then write all.
    let stop_at = Instant::now() + Duration::from_secs(2);
    let writers: Vec<_> = (0..4i64)
        .map(|writer| {
            let (db, mut ids) = (db.clone(), ids.clone());
            if writer % 2 == 1 {
                ids.reverse();
            }
            tokio::spawn(async move {
                let mut conn = db.acquire().await.unwrap();
                let (mut rounds, mut fence) = (0, writer);
                while Instant::now() < stop_at {
                    fence += 4;
                    let claims: Vec<ToClaim> =
                        ids.iter().map(|id| ToClaim { id: id.as_str(), fence }).collect();
                    let found = group::read(&mut conn, &claims, &[]).await.expect("no deadlock at the claim");
                    let mut entries = Vec::new();
                    let mut wallets = Vec::new();
                    for id in &ids {
                        if let ClaimOutcome::Claimed(read) = found.claims[id.as_str()] {
                            entries.push(payment(id, fence, read.version + 1, 1, read.balance - 1));
                            wallets.push(WalletWrite {
                                id: id.as_str(),
                                fence,
                                read_version: read.version,
                                balance: read.balance - 1,
                                version: read.version + 1,
                            });
                        }
                    }
                    let write = GroupWrite { wallets, entries: entries.iter().collect(), keys: Vec::new() };
                    group::commit(&mut conn, &write, chrono::Utc::now(), Duration::from_secs(60))
                        .await
                        .expect("no deadlock at the write");
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let mut rounds = 0;
    for writer in writers {
        rounds += writer.await.unwrap();
    }

    assert!(rounds > 20, "the writers ran: {rounds} rounds");
    assert_eq!(deadlocks().await, before, "Postgres detected no deadlock");
    for id in &ids {
        let books = books(&db, id.as_str()).await;
        assert_eq!(books.balance, books.ledger_sum, "{id}");
    }
}
