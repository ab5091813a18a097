//! The fence: Postgres refuses a holder whose lease has passed to another, and survives Redis
//! forgetting its fence counter.

use crate::support::{CALLER, TestEnv, books};
use std::time::Duration;
use walletlock::domain::EntryKind;
use walletlock::lease::Lease;
use walletlock::ledger::{self, NewEntry, StoreError};
use walletlock::wallet::{self, WalletError, WalletId};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn pay(amount: i64, balance_after: i64) -> NewEntry {
    NewEntry { id: uuid::Uuid::new_v4(), kind: EntryKind::Pay, amount, balance_after, reference: None }
}

/// Raises the fence of `id` to `lease`'s and reads the wallet.
async fn raise_fence(
    db: &sqlx::PgPool,
    lease: &mut Lease,
    id: &WalletId,
) -> Result<ledger::WalletRead, WalletError> {
    wallet::raise_fence(&mut db.acquire().await.unwrap(), lease, id).await
}

async fn commit(
    db: &sqlx::PgPool,
    lease: &Lease,
    id: &WalletId,
    read: ledger::WalletRead,
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
    let mut tx = db.begin().await.unwrap();
    ledger::create_wallet(&mut tx, id.as_str(), CALLER, balance, true).await.unwrap();
    tx.commit().await.unwrap();
    id
}

#[tokio::test]
async fn a_paused_holder_is_refused_after_the_next_holder_committed() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    let paused_read = raise_fence(&db, &mut paused, &id).await.unwrap();
    tokio::time::sleep(ms(150)).await; // a GC pause, a slow query: the lease expires

    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = raise_fence(&db, &mut next, &id).await.unwrap();
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
async fn a_paused_holder_is_refused_as_soon_as_the_next_holder_raises_the_fence() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    let paused_read = raise_fence(&db, &mut paused, &id).await.unwrap();
    tokio::time::sleep(ms(150)).await;

    // The next holder has raised the wallet's fence but not written anything yet.
    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = raise_fence(&db, &mut next, &id).await.unwrap();

    assert!(matches!(commit(&db, &paused, &id, paused_read, 10).await, Err(StoreError::LeaseLost)));
    commit(&db, &next, &id, next_read, 30).await.expect("the current holder still commits");
    assert_eq!(books(&db, id.as_str()).await.balance, 70);
}

#[tokio::test]
async fn a_holder_paused_before_raising_the_fence_is_refused_when_it_raises_it() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);

    let mut paused = env.leases(ms(100), ms(100)).acquire(&name).await.unwrap();
    tokio::time::sleep(ms(150)).await;
    let mut next = env.leases(ms(5_000), ms(500)).acquire(&name).await.unwrap();
    let next_read = raise_fence(&db, &mut next, &id).await.unwrap();

    // Its fence is below the one the row has seen, and it no longer holds the lease, so it may
    // not lift the counter either.
    assert!(matches!(raise_fence(&db, &mut paused, &id).await, Err(WalletError::LeaseLost)));
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
    let victim_read = raise_fence(&db, &mut victim, &id).await.unwrap();

    // A failover loses the key; another holder takes the lease and raises the wallet's fence.
    let _: () = env.redis_cmd(&["DEL", &env.lease_key(&name)]).await;
    let mut thief = env.leases(ms(5_000), ms(100)).acquire(&name).await.unwrap();
    let thief_read = raise_fence(&db, &mut thief, &id).await.unwrap();

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
        let read = raise_fence(&db, &mut lease, &id).await.unwrap();
        commit(&db, &lease, &id, read, 1).await.unwrap();
        lease.release().await.unwrap();
    }
    let seen = books(&db, id.as_str()).await.fence;
    assert_eq!(seen, 5);

    // Redis forgets the counter (restart without persistence, FLUSHALL, failover).
    let _: () = env.redis_cmd(&["DEL", &env.fence_key(&name)]).await;
    let mut lease = leases.acquire(&name).await.unwrap();
    assert!(lease.fence() <= seen, "the counter went backwards: {}", lease.fence());

    let read = raise_fence(&db, &mut lease, &id)
        .await
        .expect("not wedged: the counter is lifted, then the fence is raised");
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
    let first_read = raise_fence(&db, &mut first, &id).await.unwrap();
    // The lease and the counter are lost together; the next holder is handed the same fence.
    let _: () = env.redis_cmd(&["DEL", &env.lease_key(&name), &env.fence_key(&name)]).await;
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &(first.fence() - 1).to_string()]).await;
    let mut second = env.leases(ms(5_000), ms(100)).acquire(&name).await.unwrap();
    assert_eq!(second.fence(), first.fence(), "the same token, issued twice");

    let second_read =
        raise_fence(&db, &mut second, &id).await.expect("resynchronized above the first holder's fence");
    assert!(second.fence() > first.fence());
    assert!(matches!(commit(&db, &first, &id, first_read, 10).await, Err(StoreError::LeaseLost)));
    commit(&db, &second, &id, second_read, 30).await.unwrap();
    assert_eq!(books(&db, id.as_str()).await.balance, 70);
}

/// The fence of the wallet's row and of its newest payment.
async fn fences_written(db: &sqlx::PgPool, id: &WalletId) -> (i64, i64) {
    sqlx::query_as(
        "select w.fence, e.fence from wallet w join ledger_entry e on e.wallet_id = w.id
         where w.id = $1 and e.kind = 'pay' order by e.seq desc limit 1",
    )
    .bind(id.as_str())
    .fetch_one(db)
    .await
    .unwrap()
}

/// A wallet whose row has already seen fence `seen` (years of payments, or a counter lifted far).
async fn wallet_that_has_seen(db: &sqlx::PgPool, seen: i64) -> WalletId {
    let id = wallet_with(db, 100).await;
    sqlx::query("update wallet set fence = $2 where id = $1")
        .bind(id.as_str())
        .bind(seen)
        .execute(db)
        .await
        .unwrap();
    id
}

/// Fences near `value` are exact through Redis and Postgres: a counter at `value` issues exactly
/// `value + 1`, the payment commits with exactly that fence in the row and the ledger, and a
/// holder whose row has seen `value` is lifted to exactly `value + 1`. Lua numbers are doubles,
/// exact only up to 2^53: any fence that passes through one comes out rounded.
async fn fences_are_exact_at(value: i64) {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let leases = env.leases(ms(5_000), ms(500));

    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &value.to_string()]).await;
    let mut lease = leases.acquire(&name).await.unwrap();
    assert_eq!(lease.fence(), value + 1, "acquire issues the counter's next value");
    let read = raise_fence(&db, &mut lease, &id).await.unwrap();
    assert_eq!(lease.fence(), value + 1, "fenced with that fence, no resynchronization");
    commit(&db, &lease, &id, read, 1).await.unwrap();
    lease.release().await.unwrap();
    assert_eq!(fences_written(&db, &id).await, (value + 1, value + 1), "row and ledger entry");

    // Redis lost the counter of a wallet whose row has seen `value`.
    let id = wallet_that_has_seen(&db, value).await;
    let name = wallet::lease_name(&id);
    let mut lease = leases.acquire(&name).await.unwrap();
    assert_eq!(lease.fence(), 1, "a fresh counter");
    let read =
        raise_fence(&db, &mut lease, &id).await.expect("lifted above what the row has seen, then fenced");
    assert_eq!(lease.fence(), value + 1, "lifted to exactly one above the row's fence");
    let counter: String = env.redis_cmd(&["GET", &env.fence_key(&name)]).await;
    assert_eq!(counter, (value + 1).to_string(), "the counter in Redis too");
    commit(&db, &lease, &id, read, 1).await.unwrap();
    lease.release().await.unwrap();
    assert_eq!(fences_written(&db, &id).await, (value + 1, value + 1));
}

#[tokio::test]
async fn fences_are_exact_just_above_2_pow_53() {
    fences_are_exact_at((1 << 53) + 1).await;
}

#[tokio::test]
async fn fences_are_exact_at_2_pow_62() {
    fences_are_exact_at(1 << 62).await;
}

#[tokio::test]
async fn fences_are_exact_up_to_the_largest_one() {
    fences_are_exact_at(i64::MAX - 1).await;
}

#[tokio::test]
async fn a_fence_at_the_top_is_a_clear_error_and_the_documented_reset_frees_the_wallet() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(4).await;
    let leases = env.leases(ms(5_000), ms(500));

    // A counter at the top (a leaked credential's INCRBY) cannot grow: it starts over, and the
    // row's fence lifts it. No wallet is wedged by Redis alone.
    let id = wallet_that_has_seen(&db, 41).await;
    let name = wallet::lease_name(&id);
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &i64::MAX.to_string()]).await;
    let mut lease = leases.acquire(&name).await.expect("a full counter starts over");
    assert_eq!(lease.fence(), 1);
    let read = raise_fence(&db, &mut lease, &id).await.expect("lifted above the row's fence");
    assert_eq!(lease.fence(), 42);
    commit(&db, &lease, &id, read, 1).await.unwrap();
    lease.release().await.unwrap();

    // A row that has seen the largest fence cannot be fenced again: a clear error, nothing changed.
    let id = wallet_that_has_seen(&db, i64::MAX).await;
    let name = wallet::lease_name(&id);
    let mut lease = leases.acquire(&name).await.unwrap();
    match raise_fence(&db, &mut lease, &id).await {
        Err(WalletError::FenceExhausted(cause)) => {
            assert!(cause.to_string().contains("fence space is exhausted"), "{cause}")
        }
        other => panic!("expected FenceExhausted, got {other:?}"),
    }
    assert!(matches!(
        lease.advance_fence(i64::MAX).await,
        Err(walletlock::lease::LeaseError::FenceExhausted { seen: i64::MAX, .. })
    ));
    lease.release().await.expect("the lease is still held and released");
    assert_eq!(books(&db, id.as_str()).await.fence, i64::MAX, "nothing changed");

    // The documented reset (docs/operating/fence-resets.md), as the tables' owner.
    let mut tx = db.begin().await.unwrap();
    for setting in [
        "set local citus.enable_unsafe_triggers = on",
        "set local citus.multi_shard_modify_mode = sequential",
    ] {
        sqlx::query(setting).execute(&mut *tx).await.unwrap();
    }
    sqlx::query("alter table wallet disable trigger wallet_counters_only_grow")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("update wallet set fence = 0 where id = $1")
        .bind(id.as_str())
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("alter table wallet enable trigger wallet_counters_only_grow")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let _: () = env.redis_cmd(&["DEL", &env.fence_key(&name)]).await;
    let mut lease = leases.acquire(&name).await.unwrap();
    let read = raise_fence(&db, &mut lease, &id).await.expect("free again");
    commit(&db, &lease, &id, read, 1).await.unwrap();
    lease.release().await.unwrap();
    assert_eq!(books(&db, id.as_str()).await.fence, 1);
}

#[tokio::test]
async fn the_row_refuses_a_fence_or_version_moving_back_whoever_sends_it() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let id = wallet_with(&db, 100).await;
    sqlx::query("update wallet set fence = 7, version = 3 where id = $1")
        .bind(id.as_str())
        .execute(&db)
        .await
        .unwrap();

    for backwards in
        ["update wallet set fence = 6 where id = $1", "update wallet set version = 2 where id = $1"]
    {
        let err = sqlx::query(backwards).bind(id.as_str()).execute(&db).await.unwrap_err();
        let code = err.as_database_error().and_then(|db| db.code()).map(|code| code.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{backwards}: a check violation, not {err}");
    }
    let (fence, version): (i64, i64) = sqlx::query_as("select fence, version from wallet where id = $1")
        .bind(id.as_str())
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!((fence, version), (7, 3), "nothing moved back");
    sqlx::query("update wallet set fence = 8, version = 4 where id = $1")
        .bind(id.as_str())
        .execute(&db)
        .await
        .unwrap();
}

#[tokio::test]
async fn the_row_refuses_an_id_or_owner_outside_the_rule_whoever_sends_it() {
    let env = TestEnv::new();
    let (_schema, db) = env.database(2).await;
    let longest = "a".repeat(64);
    for (id, owner) in [(longest.as_str(), "o"), ("A-z_0", longest.as_str())] {
        sqlx::query("insert into wallet (id, balance, version, owner) values ($1, 0, 1, $2)")
            .bind(id)
            .bind(owner)
            .execute(&db)
            .await
            .unwrap_or_else(|err| panic!("{id:?} owned by {owner:?} is within the rule: {err}"));
    }
    let too_long = "a".repeat(65);
    for (id, owner) in [("", "o"), (too_long.as_str(), "o"), ("a b", "o"), ("é", "o"), ("a\n", "o")]
        .into_iter()
        .chain([("ok-1", ""), ("ok-2", too_long.as_str()), ("ok-3", "a/b")])
    {
        let err = sqlx::query("insert into wallet (id, balance, version, owner) values ($1, 0, 1, $2)")
            .bind(id)
            .bind(owner)
            .execute(&db)
            .await
            .unwrap_err();
        let code = err.as_database_error().and_then(|db| db.code()).map(|code| code.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{id:?} owned by {owner:?}: a check violation, not {err}");
    }
    let count: i64 = sqlx::query_scalar("select count(*) from wallet").fetch_one(&db).await.unwrap();
    assert_eq!(count, 2, "only the two within the rule were written");
}

#[tokio::test]
async fn a_fence_counter_moved_far_past_the_row_is_refused_and_spends_none_of_its_fences() {
    use crate::support::{payment, tester};
    use walletlock::domain::MAX_FENCE_STEP;
    let env = TestEnv::new();
    let (schema, db) = env.database(4).await;
    let wallets = env.replica(&schema, ms(5_000), ms(2_000)).await;
    let id = wallet_with(&db, 100).await;
    let name = wallet::lease_name(&id);
    wallets.apply(&tester(), &id, payment(1), None).await.expect("paid under fence 1");
    assert_eq!(books(&db, id.as_str()).await.fence, 1);
    let refused = |result: Result<wallet::Moved, WalletError>, fence: i64, row: i64| match result {
        Err(WalletError::FenceImplausible { fence: sent, seen }) => {
            assert_eq!((sent, seen), (fence, row), "the lease's fence and the row's")
        }
        other => panic!("expected FenceImplausible for fence {fence}, got {other:?}"),
    };

    // A counter set just below the top (a leaked Redis password's SET): the next lease's fence is
    // 2^63-1, which written would leave the row no fence above it. It is refused, nothing written.
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &(i64::MAX - 1).to_string()]).await;
    refused(wallets.apply(&tester(), &id, payment(1), None).await, i64::MAX, 1);
    let after = books(&db, id.as_str()).await;
    assert_eq!((after.fence, after.pays, after.balance), (1, 1, 99), "nothing written");
    // The counter cannot grow past the top: it starts over, and the row's fence lifts it.
    wallets.apply(&tester(), &id, payment(1), None).await.expect("paid after the counter started over");
    assert_eq!(books(&db, id.as_str()).await.fence, 2, "the row's fences are not spent");

    // Far past the row, short of the top: refused each time, until an operator deletes the counter
    // (docs/operating/fence-resets.md).
    let moved = 2 + MAX_FENCE_STEP;
    let _: () = env.redis_cmd(&["SET", &env.fence_key(&name), &moved.to_string()]).await;
    for attempt in 1..=2 {
        refused(wallets.apply(&tester(), &id, payment(1), None).await, moved + attempt, 2);
    }
    // A transfer's write carries the paying lease's fence the same way.
    let payee = wallet_with(&db, 0).await;
    let between = wallet::Between {
        parties: wallet::Parties::new(id.clone(), payee.clone()).unwrap(),
        amount: wallet::Amount::new(1).unwrap(),
        reference: None,
        metadata: wallet::Metadata::default(),
    };
    match wallets.transfer(&tester(), between, None).await {
        Err(WalletError::FenceImplausible { fence, seen: 2 }) => assert_eq!(fence, moved + 3),
        other => panic!("expected FenceImplausible for the transfer, got {other:?}"),
    }
    assert_eq!(books(&db, payee.as_str()).await.balance, 0, "nothing moved");
    assert_eq!(books(&db, id.as_str()).await.fence, 2);
    let _: () = env.redis_cmd(&["DEL", &env.fence_key(&name)]).await;
    wallets.apply(&tester(), &id, payment(1), None).await.expect("paid once the counter is deleted");
    let after = books(&db, id.as_str()).await;
    assert_eq!((after.fence, after.pays, after.balance, after.ledger_sum), (3, 3, 97, 97));
}
