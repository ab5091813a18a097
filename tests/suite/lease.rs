//! The lease: SET NX PX with a random token, token-checked release and refresh, the watchdog.

use crate::support::{TestEnv, eventually};
use std::time::{Duration, Instant};
use walletlock::lease::{Backoff, InvalidTtl, LeaseError, LeaseSettings, Ttl};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test]
async fn a_lease_is_a_fresh_random_token_that_expires() {
    let env = TestEnv::new();
    let leases = env.leases(ms(500), ms(100));
    let first = leases.acquire("w").await.unwrap();
    let token: String = env.redis_cmd(&["GET", &env.lease_key("w")]).await;
    assert_eq!(token.len(), 32, "128 bits as hex");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
    let pttl: i64 = env.redis_cmd(&["PTTL", &env.lease_key("w")]).await;
    assert!((1..=500).contains(&pttl), "the lease expires within its TTL, PTTL={pttl}");
    let first_fence = first.fence();
    first.release().await.unwrap();

    let second = leases.acquire("w").await.unwrap();
    let second_token: String = env.redis_cmd(&["GET", &env.lease_key("w")]).await;
    assert_ne!(second_token, token, "every acquisition draws a new token");
    assert!(second.fence() > first_fence, "fences only grow");
    second.release().await.unwrap();
}

#[tokio::test]
async fn a_held_lease_keeps_others_out_until_their_deadline() {
    let env = TestEnv::new();
    let holder = env.leases(ms(5_000), ms(100)).acquire("w").await.unwrap();

    let started = Instant::now();
    let waiter = env.leases(ms(5_000), ms(150));
    match waiter.acquire("w").await {
        Err(LeaseError::NotObtained { waited, .. }) => {
            // By this test's clock, read before the waiter set its deadline: the waiter's own
            // `waited` starts a moment after that deadline was set, so it may read a hair short.
            let elapsed = started.elapsed();
            assert!(elapsed >= ms(150), "gave up early, after {elapsed:?}");
            assert!(elapsed < ms(1_000), "overran its deadline: {elapsed:?}");
            assert!(waited <= elapsed, "reported {waited:?} of waiting in {elapsed:?}");
        }
        other => panic!("expected NotObtained, got {other:?}"),
    }

    holder.release().await.unwrap();
    let next = waiter.acquire("w").await.expect("free once released");
    next.release().await.unwrap();
}

#[tokio::test]
async fn release_with_a_wrong_token_deletes_nothing() {
    let env = TestEnv::new();
    let lease = env.leases(ms(5_000), ms(100)).acquire("w").await.unwrap();
    // Someone else's lease now sits under the key (ours expired and was taken, say).
    let _: () = env.redis_cmd(&["SET", &env.lease_key("w"), "someone-else", "PX", "5000"]).await;

    assert!(matches!(lease.release().await, Err(LeaseError::NotHeld { .. })));
    let holder: String = env.redis_cmd(&["GET", &env.lease_key("w")]).await;
    assert_eq!(holder, "someone-else", "their lease is untouched");
}

#[tokio::test]
async fn release_after_expiry_reports_not_held_and_leaves_the_next_holder_alone() {
    let env = TestEnv::new();
    let stale = env.leases(ms(50), ms(100)).acquire("w").await.unwrap();
    tokio::time::sleep(ms(100)).await;
    let next = env.leases(ms(5_000), ms(100)).acquire("w").await.expect("free after expiry");

    assert!(matches!(stale.release().await, Err(LeaseError::NotHeld { .. })));
    let pttl: i64 = env.redis_cmd(&["PTTL", &env.lease_key("w")]).await;
    assert!(pttl > 0, "the next holder's lease survives the stale release");
    next.release().await.expect("still held by the next holder");
}

#[test]
fn a_ttl_under_one_millisecond_is_refused() {
    assert_eq!(Ttl::new(Duration::ZERO), Err(InvalidTtl(Duration::ZERO)));
    assert_eq!(Ttl::new(Duration::from_micros(999)), Err(InvalidTtl(Duration::from_micros(999))));
    assert!("0ms".parse::<Ttl>().is_err());
    assert!("0".parse::<Ttl>().is_err());
    assert_eq!(Ttl::new(ms(1)).map(Ttl::as_millis), Ok(1));
}

#[tokio::test]
async fn every_path_that_writes_the_lease_gives_it_an_expiry() {
    let env = TestEnv::new();
    let leases = env.leases(ms(1_000), ms(100));
    let pttl = |key: String| {
        let env = &env;
        async move { env.redis_cmd::<i64>(&["PTTL", &key]).await }
    };

    let mut lease = leases.acquire("w").await.unwrap();
    assert!(pttl(env.lease_key("w")).await > 0, "after acquire");
    lease.refresh().await.unwrap();
    assert!(pttl(env.lease_key("w")).await > 0, "after refresh");
    lease.advance_fence(100).await.unwrap();
    assert!(pttl(env.lease_key("w")).await > 0, "after a fence resynchronization");
    assert!(pttl(env.fence_key("w")).await > 0, "the fence counter expires too, after its retention");
    lease.release_with_note("n").await.unwrap();
    assert_eq!(pttl(env.lease_key("w")).await, -2, "released: gone");
    assert!(pttl(env.note_key("w")).await > 0, "the note expires too, after its retention");
    assert!(leases.leave_note("v", "n").await.unwrap());
    assert!(pttl(env.note_key("v")).await > 0, "a note left without the lease too");
}

#[tokio::test]
async fn a_note_left_at_release_is_handed_to_the_next_holder_once() {
    let env = TestEnv::new();
    let leases = env.leases(ms(5_000), ms(100));
    let mut first = leases.acquire("w").await.unwrap();
    assert_eq!(first.take_note(), None, "nobody held it before");
    first.release_with_note("balance 70").await.unwrap();

    let mut second = env.leases(ms(5_000), ms(100)).acquire("w").await.unwrap();
    assert_eq!(second.take_note().as_deref(), Some("balance 70"), "from another client too");
    assert_eq!(second.take_note(), None, "taken once");
    let left: Option<String> = env.redis_cmd(&["GET", &env.note_key("w")]).await;
    assert_eq!(left, None, "handing it over deletes it: a holder that never releases leaves none");
    second.release().await.unwrap();

    let mut third = leases.acquire("w").await.unwrap();
    assert_eq!(third.take_note(), None, "a plain release leaves no note");
    third.release().await.unwrap();
}

#[tokio::test]
async fn a_holder_whose_lease_expired_leaves_no_note() {
    let env = TestEnv::new();
    let stale = env.leases(ms(50), ms(100)).acquire("w").await.unwrap();
    tokio::time::sleep(ms(100)).await;

    assert!(matches!(stale.release_with_note("stale").await, Err(LeaseError::NotHeld { .. })));
    let mut next = env.leases(ms(5_000), ms(100)).acquire("w").await.unwrap();
    assert_eq!(next.take_note(), None, "only the holder may leave a note");
    next.release().await.unwrap();
}

#[tokio::test]
async fn a_note_left_without_the_lease_never_replaces_a_holders() {
    let env = TestEnv::new();
    let leases = env.leases(ms(5_000), ms(100));
    leases.acquire("w").await.unwrap().release_with_note("the holder's").await.unwrap();
    assert!(!leases.leave_note("w", "an older one").await.unwrap(), "a note is there");
    assert_eq!(leases.acquire("w").await.unwrap().take_note().as_deref(), Some("the holder's"));

    let off = env.leases_with(
        LeaseSettings::new(Ttl::new(ms(5_000)).unwrap(), ms(100)).with_note_retention(Duration::ZERO),
    );
    assert!(!off.leave_note("v", "n").await.unwrap(), "no note retention: no notes");
    off.acquire("v").await.unwrap().release_with_note("n").await.unwrap();
    let left: Option<String> = env.redis_cmd(&["GET", &env.note_key("v")]).await;
    assert_eq!(left, None);
}

#[tokio::test]
async fn release_still_works_after_the_script_cache_is_flushed() {
    let env = TestEnv::new();
    let leases = env.leases(ms(5_000), ms(100));
    let lease = leases.acquire("w").await.unwrap();
    // A Redis restart or failover empties the script cache: EVALSHA answers NOSCRIPT, and the
    // lease falls back to EVAL.
    let _: () = env.redis_cmd(&["SCRIPT", "FLUSH"]).await;
    lease.release().await.expect("released through the EVAL fallback");
    let _: () = env.redis_cmd(&["SCRIPT", "FLUSH"]).await;
    leases.acquire("w").await.expect("acquired through the EVAL fallback").release().await.unwrap();
}

#[tokio::test]
async fn the_watchdog_keeps_a_lease_through_work_three_times_its_ttl() {
    let env = TestEnv::new();
    let ttl = ms(300);
    let mut lease = env.leases(ttl, ms(100)).acquire("w").await.unwrap();
    lease.keep_alive();

    let rival = env.leases(ttl, ms(50));
    let deadline = Instant::now() + ttl * 3 + ms(100);
    while Instant::now() < deadline {
        assert!(
            matches!(rival.acquire("w").await, Err(LeaseError::NotObtained { .. })),
            "the lease lapsed mid-work"
        );
        tokio::time::sleep(ms(50)).await;
    }
    assert!(!lease.is_lost());
    lease.release().await.expect("still ours after 3 TTLs of work");
}

#[tokio::test]
async fn the_watchdog_signals_a_lease_taken_from_under_us() {
    let env = TestEnv::new();
    let ttl = ms(300);
    let mut lease = env.leases(ttl, ms(100)).acquire("w").await.unwrap();
    lease.keep_alive();
    let _: () = env.redis_cmd(&["SET", &env.lease_key("w"), "thief", "PX", "5000"]).await;

    let work = tokio::time::sleep(ms(5_000));
    let started = Instant::now();
    tokio::select! {
        () = work => panic!("the work ran to its end on a lost lease"),
        () = lease.lost() => {}
    }
    assert!(started.elapsed() <= ttl, "cancelled within one refresh period, took {:?}", started.elapsed());
}

#[test]
fn jittered_waiters_spread_out_and_fixed_ones_move_in_lockstep() {
    let jittered = Backoff::Jittered { min: ms(5), max: ms(15) };
    let pauses: std::collections::HashSet<Duration> = (0..100).map(|_| jittered.pause()).collect();
    assert!(pauses.len() > 50, "only {} distinct pauses in 100", pauses.len());
    assert!(pauses.iter().all(|p| (ms(5)..=ms(15)).contains(p)));
    assert_eq!(Backoff::Fixed(ms(10)).pause(), ms(10));
}

#[tokio::test]
async fn a_dropped_holder_releases_its_lease() {
    let env = TestEnv::new();
    let leases = env.leases(ms(10_000), ms(100));
    let holder = async {
        let mut lease = leases.acquire("w").await.unwrap();
        lease.keep_alive();
        std::future::pending::<()>().await;
        drop(lease);
    };
    // The caller gives up mid-critical-section: the future, and the lease in it, are dropped.
    assert!(tokio::time::timeout(ms(100), holder).await.is_err());
    eventually("lease released after drop", Duration::from_secs(2), || async {
        env.redis_cmd::<i64>(&["EXISTS", &env.lease_key("w")]).await == 0
    })
    .await;
}

#[tokio::test]
async fn a_panicking_holder_releases_its_lease() {
    let env = TestEnv::new();
    let leases = env.leases(ms(10_000), ms(100));
    let task = tokio::spawn({
        let leases = leases.clone();
        async move {
            let _lease = leases.acquire("w").await.unwrap();
            panic!("the protected work panicked");
        }
    });
    assert!(task.await.is_err());
    let next = leases.acquire("w").await.expect("released by the panicking holder, long before its TTL");
    next.release().await.unwrap();
}

/// Lease settings whose poll fallback is far longer than a wake-up takes, so a test can tell which
/// of the two got a waiter in.
fn slow_polling(ttl: Duration, poll_fallback: Duration) -> LeaseSettings {
    let mut settings = LeaseSettings::new(Ttl::new(ttl).unwrap(), ms(5_000));
    settings.poll_fallback = poll_fallback;
    settings
}

#[tokio::test]
async fn a_waiter_is_woken_by_the_release_not_by_its_next_poll() {
    let env = TestEnv::new();
    let leases = env.leases_with(slow_polling(ms(10_000), ms(3_000)));
    let holder = leases.acquire("w").await.unwrap();
    let waiter = {
        let leases = leases.clone();
        tokio::spawn(async move { leases.acquire("w").await.map(|lease| (lease, Instant::now())) })
    };
    // The waiter found the lease taken (it marked it contended); from then on a release wakes it.
    eventually("the waiter marks the lease contended", ms(2_000), || async {
        env.redis_cmd::<i64>(&["EXISTS", &env.contended_key("w")]).await == 1
    })
    .await;

    let released_at = Instant::now();
    holder.release().await.unwrap();
    let (lease, acquired_at) = waiter.await.unwrap().expect("the waiter gets the lease");
    let after = acquired_at - released_at;
    assert!(after < ms(1_000), "woken {after:?} after the release; its next poll was 3 s away");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn a_lease_that_expires_unreleased_is_taken_at_the_next_poll() {
    let env = TestEnv::new();
    // No release, so no wake-up: the holder crashed. The waiter's poll finds the lease expired.
    let holder = env.leases_with(slow_polling(ms(300), ms(200))).acquire("w").await.unwrap();
    std::mem::forget(holder);
    let started = Instant::now();
    let lease = env.leases_with(slow_polling(ms(5_000), ms(200))).acquire("w").await.unwrap();
    let waited = started.elapsed();
    assert!(waited < ms(2_000), "took the expired lease after {waited:?}: TTL 300 ms + one 200 ms poll");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn the_scripts_run_as_functions_once_loaded_and_as_evalsha_when_the_library_is_gone() {
    // A Redis of its own: the library is loaded server-wide.
    let env = TestEnv::with_own_redis();
    let library = walletlock::lease::load_library(&env.redis_pool().into()).await.unwrap();
    assert_eq!(library, "walletlock");
    let leases = env.leases(ms(5_000), ms(100));
    leases.decide_scripting().await.unwrap();
    assert_eq!(leases.uses_functions(), Some(true), "the loaded library is called with FCALL");
    let lease = leases.acquire("w").await.unwrap();

    // A restart without persistence, or an operator, removes the library: EVALSHA takes over.
    let _: () = env.redis_cmd(&["FUNCTION", "DELETE", "walletlock"]).await;
    lease.release().await.expect("released through EVALSHA");
    assert_eq!(leases.uses_functions(), Some(false));
    leases.acquire("w").await.unwrap().release().await.unwrap();
    let stats: String = env.redis_cmd(&["INFO", "commandstats"]).await;
    assert!(stats.contains("cmdstat_fcall:"), "the acquisition was an FCALL: {stats}");
    assert!(stats.contains("cmdstat_evalsha:"), "the release and what followed, EVALSHA: {stats}");
}
