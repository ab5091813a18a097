//! Durability: a payment a client was told was applied stays applied, whatever happens to Postgres
//! after the answer. Under concurrent payments through nginx to three replicas, ending with the
//! bank check (`support::load::check_books`) and a bound on how fast service resumes.

use crate::support::load::{
    Attempt, Load, Outcome, check_books, open_wallets, pay, settle, tally, time_to_recover,
};
use crate::support::{TestEnv, eventually, fleet::Fleet};
use futures::StreamExt;
use std::time::{Duration, Instant};

const WALLETS: [&str; 6] = ["d1", "d2", "d3", "d4", "d5", "d6"];
const OPENING: i64 = 1_000_000;

/// A one-second lease, and keys of requests cut off by the crash taken over after two seconds.
const SETTINGS: [(&str, &str); 2] = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];

/// Payments acknowledged before Postgres is crashed.
const ACKNOWLEDGED_BEFORE_THE_CRASH: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_payment_survives_a_postgres_crash() {
    // A Postgres of the test's own, with synchronous_commit=on: a commit is acknowledged only once
    // its WAL has been written out of Postgres's memory. (The suite's Postgres runs with
    // synchronous_commit=off, for speed: there a commit is acknowledged while its WAL may still be
    // only in Postgres's shared memory, and a crash may lose it.) fsync=off and full_page_writes=off stay,
    // as in the rest of the suite: this crash kills processes, not the machine, and the kernel's
    // page cache keeps every write Postgres made before it died. They would not do for a power loss.
    let mut env = TestEnv::with_own_servers_and_postgres(&["synchronous_commit=on"]);
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    let setting: String = sqlx::query_scalar("show synchronous_commit").fetch_one(&fleet.db).await.unwrap();
    assert_eq!(setting, "on", "this Postgres acknowledges a commit only once its WAL is written");
    open_wallets(&fleet, &WALLETS, OPENING).await;
    let load = Load::start(&fleet, &WALLETS, 8);

    // Crash Postgres (SIGKILL of the postmaster: no shutdown, no checkpoint) the moment a payment
    // has just been acknowledged, with the load's other payments in flight.
    eventually("payments acknowledged", Duration::from_secs(30), || async {
        load.acknowledged() >= ACKNOWLEDGED_BEFORE_THE_CRASH
    })
    .await;
    let seen = load.acknowledged();
    let deadline = Instant::now() + Duration::from_secs(5);
    while load.acknowledged() == seen {
        assert!(Instant::now() < deadline, "no payment acknowledged for 5 s before the crash");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let crashed_at = Instant::now();
    let postmaster = tokio::task::block_in_place(|| env.own_postgres().crash());

    // The same server again, on the same data directory and port: it recovers from its WAL.
    tokio::task::block_in_place(|| env.own_postgres().start_again());
    let up_at = Instant::now();
    let restart = up_at - crashed_at;
    let mut attempts = Vec::new();
    let resumed = time_to_recover(&fleet, "d1", Duration::from_secs(15), &mut attempts).await;
    assert!(resumed <= Duration::from_secs(10), "payments resumed {resumed:?} after Postgres came back");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    attempts.extend(load.finish().await);

    // What the clients had been told was applied when Postgres died.
    let acknowledged_before: Vec<Attempt> = attempts
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::Applied(_)) && a.sent + a.took <= crashed_at)
        .cloned()
        .collect();
    assert!(acknowledged_before.len() >= ACKNOWLEDGED_BEFORE_THE_CRASH);
    let last_before = acknowledged_before.iter().map(|a| a.sent + a.took).max().expect("acknowledged");
    assert!(crashed_at - last_before < Duration::from_millis(500), "crashed right after an acknowledgement");
    let after = attempts.iter().filter(|a| matches!(a.outcome, Outcome::Applied(_)) && a.sent > up_at);
    assert!(after.count() > 1, "the load's payments went through again after the restart");

    let told = tally(&attempts);
    settle(&fleet, &mut attempts).await;
    // Each of them, retried with its key after the crash, is the same one payment: its record
    // and its ledger entry both survived (a lost one would come back as a new payment under a new
    // id, or as a claim still in flight).
    let replays: Vec<(Attempt, Outcome)> = futures::stream::iter(acknowledged_before.iter().cloned())
        .map(|a| {
            let (client, url) = (fleet.client.clone(), fleet.url(""));
            async move {
                let replay = pay(&client, &url, &a.wallet, a.amount, &a.key).await;
                (a, replay)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for (attempt, replay) in &replays {
        assert_eq!(
            *replay, attempt.outcome,
            "the payment acknowledged before the crash, retried: {attempt:?}"
        );
    }
    // Every acknowledged payment, before the crash or after, is in the ledger exactly once.
    let opening: Vec<(&str, i64)> = WALLETS.iter().map(|w| (*w, OPENING)).collect();
    check_books(&fleet, &opening, &attempts).await;
    eprintln!(
        "postgres crash (postmaster {postmaster} SIGKILLed): {} payments acknowledged before it, \
         the last {:?} before; down and recovered in {restart:?}; payments resumed {resumed:?} \
         after it was up; the clients were told {told:?}, settled {:?}",
        acknowledged_before.len(),
        crashed_at - last_before,
        tally(&attempts)
    );
}
