//! Rounds across wallets: one statement writes every wallet a replica holds, each conditional on its
//! own fence and version; a wallet whose lease was lost is left out alone, a key sent twice runs
//! once, and rounds that share wallets wait for each other instead of deadlocking.

use crate::support::hold_row;
use crate::support::payment as pay;
use crate::support::{CALLER, EntryOf, TestEnv, books, eventually, render, tester};
use std::time::{Duration, Instant};
use walletlock::domain::EntryKind;
use walletlock::idempotency::{self, IdempotencyKey, Keyed, Prior, Scope};
use walletlock::ledger::group::{self, GroupWrite, HoldsToRead, ReadOutcome, ToRead, WalletWrite};
use walletlock::ledger::storage::Storage;
use walletlock::ledger::{self, Entry};
use walletlock::wallet::{Moved, WalletError, WalletId, lease_name};

pub(crate) async fn wallet_with(db: &sqlx::PgPool, balance: i64) -> WalletId {
    let id = WalletId::generate();
    let mut tx = db.begin().await.unwrap();
    ledger::create_wallet(&mut tx, id.as_str(), CALLER, balance, true).await.unwrap();
    tx.commit().await.unwrap();
    id
}

pub(crate) fn payment(id: &WalletId, fence: i64, version: i64, amount: i64, balance: i64) -> Entry {
    Entry {
        id: uuid::Uuid::new_v4(),
        wallet_id: id.as_str().to_owned(),
        kind: EntryKind::Pay,
        amount,
        balance,
        version,
        fence,
        reference: None,
        metadata: Default::default(),
        transfer_id: None,
        refund_of: None,
        hold_id: None,
        created_at: chrono::Utc::now(),
    }
}

/// The first write of each of `ids` (opened with 100, never written) under the lease holding
/// `fence`: a payment of 10.
pub(crate) fn first_writes(ids: &[WalletId], fence: i64) -> Vec<WalletWrite<'_>> {
    ids.iter()
        .enumerate()
        .map(|(n, id)| WalletWrite {
            id: id.as_str(),
            group: n as i32,
            fence,
            read_fence: 0,
            read_version: 1,
            read_balance: 100,
            read_held: 0,
            owner: Some(CALLER),
            balance: 90,
            held: 0,
            version: 2,
        })
        .collect()
}

/// Writes `write` on one Postgres, timed `at`, its keys kept a minute.
async fn commit_at(
    conn: &mut sqlx::PgConnection,
    write: &GroupWrite<'_>,
    at: chrono::DateTime<chrono::Utc>,
) -> Result<group::Committed, ledger::StoreError> {
    group::commit(conn, Storage::OnePostgres, None, None, write, at, Duration::from_secs(60)).await
}

/// [`commit_at`] now.
async fn commit_now(
    conn: &mut sqlx::PgConnection,
    write: &GroupWrite<'_>,
) -> Result<group::Committed, ledger::StoreError> {
    commit_at(conn, write, chrono::Utc::now()).await
}

/// The wallets a round of `reads` is about (the round's reads look keys and holds up among them).
fn round_of<'a>(reads: &[ToRead<'a>]) -> Vec<&'a str> {
    reads.iter().map(|read| read.id).collect()
}

#[tokio::test]
async fn a_round_writes_every_wallet_but_the_one_a_newer_holder_wrote_since_its_read() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let ids = [wallet_with(&db, 100).await, wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    let mut conn = db.acquire().await.unwrap();
    let reads: Vec<ToRead> =
        ids.iter().map(|id| ToRead { id: id.as_str(), fence: 5, written: false }).collect();
    let found =
        group::read(&mut conn, None, &reads, &round_of(&reads), &[], HoldsToRead::none()).await.unwrap();
    for id in &ids {
        assert!(
            matches!(found.wallets[id.as_str()], ReadOutcome::Ready { fence: 0, .. }),
            "{:?}",
            found.wallets
        );
    }
    // The second wallet's lease passes to a newer holder, which reads and writes it first.
    let newer = [ToRead { id: ids[1].as_str(), fence: 6, written: false }];
    assert!(matches!(
        group::read(&mut conn, None, &newer, &round_of(&newer), &[], HoldsToRead::none())
            .await
            .unwrap()
            .wallets[ids[1].as_str()],
        ReadOutcome::Ready { .. }
    ));
    let newer_entry = payment(&ids[1], 6, 2, 10, 90);
    let write = GroupWrite {
        entries: vec![&newer_entry],
        keys: Vec::new(),
        ..GroupWrite::of(first_writes(&ids[1..2], 6))
    };
    let committed = commit_now(&mut conn, &write).await.unwrap();
    assert!(committed.moved.contains(ids[1].as_str()), "{committed:?}");

    let entries: Vec<Entry> = ids.iter().map(|id| payment(id, 5, 2, 10, 90)).collect();
    let write = GroupWrite {
        entries: entries.iter().collect(),
        keys: Vec::new(),
        ..GroupWrite::of(first_writes(&ids, 5))
    };
    let committed = commit_now(&mut conn, &write).await.unwrap();

    let moved = &committed.moved;
    assert!(moved.contains(ids[0].as_str()) && moved.contains(ids[2].as_str()), "{committed:?}");
    assert!(!moved.contains(ids[1].as_str()), "the stale holder's write is refused");
    assert!(committed.busy.is_empty(), "{committed:?}");
    for id in &ids {
        let books = books(&db, id.as_str()).await;
        assert_eq!((books.balance, books.ledger_sum, books.pays), (90, 90, 1), "{id}: one payment each");
    }
    // The stale holder can read no more: the row has seen a higher fence than its lease's.
    let stale = [ToRead { id: ids[1].as_str(), fence: 5, written: false }];
    let found =
        group::read(&mut conn, None, &stale, &round_of(&stale), &[], HoldsToRead::none()).await.unwrap();
    assert_eq!(found.wallets[ids[1].as_str()], ReadOutcome::FenceBehind { seen: 6 });
    // The newer holder reads the row at its own fence: ready if it says it wrote with that fence
    // (a holder keeping its lease across rounds), behind if not (the same fence issued twice).
    for (written, ready) in [(true, true), (false, false)] {
        let own = [ToRead { id: ids[1].as_str(), fence: 6, written }];
        let found =
            group::read(&mut conn, None, &own, &round_of(&own), &[], HoldsToRead::none()).await.unwrap();
        let outcome = &found.wallets[ids[1].as_str()];
        assert_eq!(
            matches!(outcome, ReadOutcome::Ready { fence: 6, .. }),
            ready,
            "written {written}: {outcome:?}"
        );
    }
}

#[tokio::test]
async fn the_wallets_of_one_group_are_written_all_or_none() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let ids = [wallet_with(&db, 100).await, wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    let mut conn = db.acquire().await.unwrap();
    // A newer holder writes the second wallet first.
    let newer_entry = payment(&ids[1], 6, 2, 10, 90);
    let newer = GroupWrite { entries: vec![&newer_entry], ..GroupWrite::of(first_writes(&ids[1..2], 6)) };
    let now = chrono::Utc::now();
    commit_at(&mut conn, &newer, now).await.unwrap();

    // The first two wallets are the legs of one movement, the third a group of its own: the stale
    // second leg leaves the first unwritten too, and the third is written.
    let entries: Vec<Entry> = ids.iter().map(|id| payment(id, 5, 2, 10, 90)).collect();
    let mut wallets = first_writes(&ids, 5);
    wallets[1].group = wallets[0].group;
    let write = GroupWrite { entries: entries.iter().collect(), ..GroupWrite::of(wallets) };
    let committed = commit_at(&mut conn, &write, now).await.unwrap();
    assert_eq!(committed.moved, [ids[2].as_str().to_owned()].into(), "{committed:?}");
    assert!(committed.busy.is_empty(), "{committed:?}");
    let pays: Vec<i64> = futures::future::join_all(ids.iter().map(|id| books(&db, id.as_str())))
        .await
        .into_iter()
        .map(|books| books.pays)
        .collect();
    assert_eq!(pays, [0, 1, 1], "the first leg is not written without the second");
    assert_eq!(books(&db, ids[0].as_str()).await.balance, 100);
}

#[tokio::test]
async fn a_round_leaves_out_a_wallet_whose_row_another_statement_holds_and_writes_the_others() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let ids = [wallet_with(&db, 100).await, wallet_with(&db, 100).await];
    let blocker = hold_row(&db, ids[0].as_str()).await;

    let mut conn = db.acquire().await.unwrap();
    let entries: Vec<Entry> = ids.iter().map(|id| payment(id, 5, 2, 10, 90)).collect();
    let wallets = ids
        .iter()
        .enumerate()
        .map(|(n, id)| WalletWrite {
            id: id.as_str(),
            group: n as i32,
            fence: 5,
            read_fence: 0,
            read_version: 1,
            read_balance: 100,
            read_held: 0,
            owner: Some(CALLER),
            balance: 90,
            held: 0,
            version: 2,
        })
        .collect();
    let write = GroupWrite { entries: entries.iter().collect(), keys: Vec::new(), ..GroupWrite::of(wallets) };
    let started = Instant::now();
    let committed = commit_now(&mut conn, &write).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(1), "the round did not wait for the row");
    assert!(
        committed.busy.contains(ids[0].as_str()) && !committed.moved.contains(ids[0].as_str()),
        "{committed:?}"
    );
    assert!(committed.moved.contains(ids[1].as_str()), "{committed:?}");
    blocker.rollback().await.unwrap();
    assert_eq!(books(&db, ids[0].as_str()).await.balance, 100);
    assert_eq!(books(&db, ids[1].as_str()).await.balance, 90);
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
        blocked.push(tokio::spawn(async move { wallets.apply(&tester(), &id, pay(1), None).await.entry() }));
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
        queued.push(tokio::spawn(async move { wallets.apply(&tester(), &id, pay(10), key).await.entry() }));
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
            assert_eq!(stored, &render(&Ok(Moved::Entry(first.clone()))))
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
    // wallets in its own order: read all, then write all.
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
                    let reads: Vec<ToRead> =
                        ids.iter().map(|id| ToRead { id: id.as_str(), fence, written: false }).collect();
                    let found =
                        group::read(&mut conn, None, &reads, &round_of(&reads), &[], HoldsToRead::none())
                            .await
                            .expect("no deadlock at the read");
                    let mut entries = Vec::new();
                    let mut wallets = Vec::new();
                    for id in &ids {
                        if let ReadOutcome::Ready { wallet: read, fence: read_fence, .. } =
                            found.wallets[id.as_str()]
                        {
                            entries.push(payment(id, fence, read.version + 1, 1, read.balance - 1));
                            wallets.push(WalletWrite {
                                id: id.as_str(),
                                group: wallets.len() as i32,
                                fence,
                                read_fence,
                                read_version: read.version,
                                read_balance: read.balance,
                                read_held: 0,
                                owner: Some(CALLER),
                                balance: read.balance - 1,
                                held: 0,
                                version: read.version + 1,
                            });
                        }
                    }
                    let write = GroupWrite {
                        entries: entries.iter().collect(),
                        keys: Vec::new(),
                        ..GroupWrite::of(wallets)
                    };
                    commit_now(&mut conn, &write).await.expect("no deadlock at the write");
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
