//! The fence: Postgres refuses a holder whose lease has passed to another, and survives Redis
//! forgetting its fence counter.

use crate::support::{TestEnv, books};
use std::time::Duration;
use walletlock::lease::Lease;
use walletlock::ledger::{self, EntryKind, NewEntry, StoreError};
use walletlock::wallet::{self, WalletError, WalletId};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn pay(amount: i64, balance_after: i64) -> NewEntry {
    NewEntry { id: uuid::Uuid::new_v4(), kind: EntryKind::Pay, amount, balance_after, reference: None }
}

/// Claims `id` for `lease` and commits one payment of `amount` from what the claim read.
async fn claim(db: &sqlx::PgPool, lease: &mut Lease, id: &WalletId) -> Result<ledger::Claimed, WalletError> {
    wallet::claim(&mut db.acquire().await.unwrap(), lease, id).await
}

async fn commit(
    db: &sqlx::PgPool,
    lease: &Lease,
    id: &WalletId,
    read: ledger::Claimed,
    amount: i64,
) -> Result<(), StoreError> {
    let mut tx = db.begin().await.unwrap();
    ledger::commit(&mut tx, id.as_str(), lease.fence(), read.version, &[pay(amount, read.balance - amount)])
        .await?;
    tx.commit().await.unwrap();
    Ok(())
}

async fn wallet_with(db: &sqlx::PgPool, balance: i64) -> WalletId {
    let id = WalletId::generate();
    ledger::create_wallet(&mut db.acquire().await.unwrap(), id.as_str(), balance).await.unwrap();
    id
}

#[tokio::test]
async fn a_paused_holder_is_refused_after_the_next_holder_committed() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    let paused_read = claim(&db, &mut paused, &id).await.unwrap();
    tokio::time::sleep(ms(150)).await; // a GC pause, a slow query: the lease expires

    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = claim(&db, &mut next, &id).await.unwrap();
    commit(&db, &next, &id, next_read, 30).await.unwrap();

    assert!(matches!(commit(&db, &paused, &id, paused_read, 10).await, Err(StoreError::LeaseLost)));
    let books = books(&db, id.as_str()).await;
    assert_eq!(
        (books.balance, books.ledger_sum, books.pays),
        (70, 70, 1),
        "only the current holder's payment"
    );
}

#[tokio::test]
async fn a_paused_holder_is_refused_as_soon_as_the_next_holder_claims() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    let paused_read = claim(&db, &mut paused, &id).await.unwrap();
    tokio::time::sleep(ms(150)).await;

    // The next holder has claimed the wallet but not written anything yet.
    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = claim(&db, &mut next, &id).await.unwrap();

    assert!(matches!(commit(&db, &paused, &id, paused_read, 10).await, Err(StoreError::LeaseLost)));
    commit(&db, &next, &id, next_read, 30).await.expect("the current holder still commits");
    assert_eq!(books(&db, id.as_str()).await.balance, 70);
}

#[tokio::test]
async fn a_holder_paused_before_its_claim_is_refused_at_the_claim() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    tokio::time::sleep(ms(150)).await;
    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = claim(&db, &mut next, &id).await.unwrap();

    // Its fence is below the one the row has seen, and it no longer holds the lease, so it may
    // not lift the counter either.
    assert!(matches!(claim(&db, &mut paused, &id).await, Err(WalletError::LeaseLost)));
    commit(&db, &next, &id, next_read, 30).await.unwrap();
}

#[tokio::test]
async fn a_stolen_lease_cancels_the_work_and_its_write_is_refused() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut victim = env.leases(ms(300), ms(100)).acquire(&name).await.unwrap();
    victim.keep_alive();
    let victim_read = claim(&db, &mut victim, &id).await.unwrap();

    // A failover loses the key; another holder takes the lease and claims the wallet.
    let _: () = env.redis_cmd(&["DEL", &env.lease_key(&name)]).await;
    let mut thief = env.leases(ms(5_000), ms(100)).acquire(&name).await.unwrap();
    let thief_read = claim(&db, &mut thief, &id).await.unwrap();

    let work = tokio::time::sleep(ms(5_000));
    tokio::select! {
        () = work => panic!("the work outlived the lease"),
        () = victim.lost() => {}
    }
    assert!(matches!(commit(&db, &victim, &id, victim_read, 10).await, Err(StoreError::LeaseLost)));
    commit(&db, &thief, &id, thief_read, 30).await.unwrap();
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (70, 70, 1));
}

#[tokio::test]
async fn a_fence_counter_lost_by_redis_is_lifted_above_what_postgres_has_seen() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);
    let leases = env.leases(ms(5_000), ms(500));

    for _ in 0..5 {
        let mut lease = leases.acquire(&name).await.unwrap();
        let read = claim(&db, &mut lease, &id).await.unwrap();
        commit(&db, &lease, &id, read, 1).await.unwrap();
        lease.release().await.unwrap();
    }
    let seen = books(&db, id.as_str()).await.fence;
    assert_eq!(seen, 5);

    // Redis forgets the counter (restart without persistence, FLUSHALL, failover).
    let _: () = env.redis_cmd(&["DEL", &env.fence_key(&name)]).await;
    let mut lease = leases.acquire(&name).await.unwrap();
    assert!(lease.fence() <= seen, "the counter went backwards: {}", lease.fence());

    let read = claim(&db, &mut lease, &id)
        .await
        .expect("not wedged: the counter is lifted, then the claim succeeds");
    assert!(lease.fence() > seen, "fence {} not above {seen}", lease.fence());
    commit(&db, &lease, &id, read, 1).await.unwrap();
    lease.release().await.unwrap();
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (94, 94, 6));
}

#[tokio::test]
async fn a_fence_issued_twice_lets_only_one_holder_in() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut first = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    let first_read = claim(&db, &mut first, &id).await.unwrap();
    // The lease and the counter are lost together; the next holder is handed the same fence.
    let _: () = env.redis_cmd(&["DEL", &env.lease_key(&name), &env.fence_key(&name)]).await;
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &(first.fence() - 1).to_string()]).await;
    let mut second = env.leases(ms(5_000), ms(100)).acquire(&name).await.unwrap();
    assert_eq!(second.fence(), first.fence(), "the same token, issued twice");

    let second_read =
        claim(&db, &mut second, &id).await.expect("resynchronized above the first holder's fence");
    assert!(second.fence() > first.fence());
    assert!(matches!(commit(&db, &first, &id, first_read, 10).await, Err(StoreError::LeaseLost)));
    commit(&db, &second, &id, second_read, 30).await.unwrap();
    assert_eq!(books(&db, id.as_str()).await.balance, 70);
}
