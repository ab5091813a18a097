//! Redis forgets everything mid-run (a restart without persistence, FLUSHALL): spends continue,
//! no wallet is wedged, no update is lost.

use crate::support::{CALLER, TestEnv, books, tester};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use walletlock::wallet::{Amount, Movement, Refusal, WalletError, WalletId, Wallets};

enum Loss {
    Restart,
    FlushAll,
}

/// Eight spenders on three replicas pay 1 at a time from one wallet for `run`; `loss` strikes at
/// a third of the run. Returns the replicas, the wallet and the number of acknowledged spends.
async fn spend_through(loss: Loss) {
    let mut env = TestEnv::with_own_redis();
    let (schema, db) = env.database(2).await;
    let (ttl, wait) = (Duration::from_millis(500), Duration::from_secs(2));
    let replicas: Vec<Wallets> = vec![
        env.replica(&schema, ttl, wait).await,
        env.replica(&schema, ttl, wait).await,
        env.replica(&schema, ttl, wait).await,
    ];
    let id = WalletId::generate();
    replicas[0].open(CALLER, &id, 1_000_000, None).await.unwrap();

    let accepted = Arc::new(AtomicUsize::new(0));
    let run = Duration::from_millis(1_500);
    let stop_at = Instant::now() + run;
    let spenders: Vec<_> = (0..8)
        .map(|n| {
            let (replica, id, accepted) = (replicas[n % 3].clone(), id.clone(), accepted.clone());
            tokio::spawn(async move {
                while Instant::now() < stop_at {
                    match replica
                        .apply(
                            &tester(),
                            &id,
                            Movement::Pay {
                                amount: Amount::new(1).unwrap(),
                                reference: None,
                                metadata: Default::default(),
                            },
                            None,
                        )
                        .await
                    {
                        Ok(_) => {
                            accepted.fetch_add(1, Ordering::Relaxed);
                        }
                        // While Redis is gone, a spend may fail cleanly: then nothing was applied.
                        Err(
                            WalletError::Unavailable { .. }
                            | WalletError::LockTimeout { .. }
                            | WalletError::LeaseLost,
                        ) => tokio::time::sleep(Duration::from_millis(5)).await,
                        Err(WalletError::Refused(Refusal::InsufficientFunds { .. })) => {
                            unreachable!("a million is plenty")
                        }
                        Err(other) => panic!("unexpected failure: {other:?}"),
                    }
                }
            })
        })
        .collect();

    tokio::time::sleep(run / 3).await;
    let fence_before = books(&db, id.as_str()).await.fence;
    let before = accepted.load(Ordering::Relaxed);
    assert!(before > 0, "spends were flowing before the loss");
    match loss {
        Loss::Restart => env.own_redis().restart(),
        Loss::FlushAll => {
            let _: () = env.redis_cmd(&["FLUSHALL"]).await;
        }
    }
    for spender in spenders {
        spender.await.unwrap();
    }

    let accepted = accepted.load(Ordering::Relaxed);
    assert!(accepted > before, "spends continued after the loss: {before} before, {accepted} in all");
    let books = books(&db, id.as_str()).await;
    assert_eq!(books.pays as usize, accepted, "every acknowledged spend is in the ledger, once");
    assert_eq!(books.balance, 1_000_000 - accepted as i64, "no update lost");
    assert_eq!(books.balance, books.ledger_sum);
    assert!(
        books.fence > fence_before,
        "the fence kept growing across the loss: {fence_before} then {}",
        books.fence
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spends_continue_through_a_redis_restart_that_loses_every_key() {
    spend_through(Loss::Restart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spends_continue_through_a_flushall() {
    spend_through(Loss::FlushAll).await;
}
