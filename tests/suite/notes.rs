//! The lease's note: a wallet's next holder starts from what the last one wrote, without reading
//! the row, and a note that is stale or forged moves no money.

use crate::support::payment as pay;
use crate::support::{CALLER, EntryOf, TestEnv, books, eventually, tester};
use std::time::Duration;
use walletlock::wallet::{Access, Refusal, WalletError, WalletId, Wallets, lease_name};

/// A replica and a wallet of `balance` it opened for `tester`, with the note opening it left.
async fn opened(env: &TestEnv, balance: i64) -> (Wallets, WalletId, sqlx::PgPool, impl Sized) {
    let (schema, db) = env.database(2).await;
    let wallets = env.replica(&schema, Duration::from_secs(2), Duration::from_secs(5)).await;
    let id = WalletId::generate();
    wallets.open(CALLER, &id, balance, None).await.unwrap();
    let note_key = env.note_key(&lease_name(&id));
    eventually("opening the wallet left its note", Duration::from_secs(2), || async {
        env.redis_cmd::<i64>(&["EXISTS", &note_key]).await == 1
    })
    .await;
    (wallets, id, db, schema)
}

async fn note(env: &TestEnv, id: &WalletId) -> Option<String> {
    env.redis_cmd(&["GET", &env.note_key(&lease_name(id))]).await
}

async fn forge_note(env: &TestEnv, id: &WalletId, note: &str) {
    let _: () = env.redis_cmd(&["SET", &env.note_key(&lease_name(id)), note]).await;
}

#[tokio::test]
async fn each_holder_leaves_the_wallet_as_it_wrote_it_for_the_next() {
    let env = TestEnv::new();
    let (wallets, id, db, _schema) = opened(&env, 100).await;
    assert_eq!(
        note(&env, &id).await.as_deref(),
        Some("w3:100:0:1:0::tester"),
        "balance:held:version:fence:owner"
    );

    let first = wallets.apply(&tester(), &id, pay(30), None).await.entry().unwrap();
    let second = wallets.apply(&tester(), &id, pay(20), None).await.entry().unwrap();

    assert_eq!((first.balance, second.balance), (70, 50));
    assert!(second.fence > first.fence, "two leases, one after the other");
    let expected = format!("w3:50:0:3:{}::tester", second.fence);
    assert_eq!(note(&env, &id).await, Some(expected), "the last holder's write");
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (50, 50, 2));
}

#[tokio::test]
async fn a_stale_note_costs_a_read_and_moves_nothing_by_itself() {
    let env = TestEnv::new();
    let (wallets, id, db, _schema) = opened(&env, 100).await;
    // A note left behind by a write it does not know of: the row has version 1, balance 100.
    forge_note(&env, &id, "w3:40:0:1:0::tester").await;

    let entry =
        wallets.apply(&tester(), &id, pay(70), None).await.entry().expect("decided on the row, not the note");

    assert_eq!((entry.balance, entry.version), (30, 2));
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (30, 30, 1));
}

#[tokio::test]
async fn a_note_forged_to_show_more_money_spends_none_of_it() {
    let env = TestEnv::new();
    let (wallets, id, db, _schema) = opened(&env, 100).await;
    // Anyone who may write to Redis can write a note: the row's own version and fence, a richer
    // balance.
    forge_note(&env, &id, "w3:1000000:0:1:0::tester").await;

    let refused = wallets.apply(&tester(), &id, pay(500), None).await.entry();

    assert!(
        matches!(refused, Err(WalletError::Refused(Refusal::InsufficientFunds { balance: 100, .. }))),
        "{refused:?}"
    );
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.ledger_sum, books.pays), (100, 100, 0));
}

#[tokio::test]
async fn a_note_naming_another_owner_neither_hides_the_wallet_nor_hands_it_over() {
    let env = TestEnv::new();
    let (wallets, id, db, _schema) = opened(&env, 100).await;
    let other = Access::own_wallets("other");

    forge_note(&env, &id, "w3:100:0:1:0::other").await;
    let taken = wallets.apply(&other, &id, pay(10), None).await.entry();
    assert!(matches!(taken, Err(WalletError::NotFound)), "{taken:?}");

    forge_note(&env, &id, "w3:100:0:1:0::other").await;
    let owners =
        wallets.apply(&tester(), &id, pay(10), None).await.entry().expect("the owner's payment runs");
    assert_eq!(owners.balance, 90);
    let books = books(&db, id.as_str()).await;
    assert_eq!((books.balance, books.pays), (90, 1), "only the owner's payment");
}

#[tokio::test]
async fn a_note_that_is_not_one_is_ignored() {
    let env = TestEnv::new();
    let (wallets, id, _db, _schema) = opened(&env, 100).await;
    for garbage in [
        "",
        "w3:",
        "w2:100:0:1:0:tester",
        "w3:100:0:1:0:x5:tester",
        "w3:100:0:1:0:b1.b2.b3.b4.b5.b6.b7.b8.b9:tester",
        "w3:100:0:x:0::tester",
        "w3:-5:0:1:0::tester",
        "w3:100:0:1:99::tester",
        "w3:100:101:1:0::tester",
    ] {
        forge_note(&env, &id, garbage).await;
        let entry = wallets.apply(&tester(), &id, pay(1), None).await.entry();
        assert!(entry.is_ok(), "with the note {garbage:?}: {entry:?}");
    }
}
