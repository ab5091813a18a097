//! Outgrowing one Redis: the lease on Redis Sentinel and on Redis Cluster, under load through the
//! fleet, with a primary killed mid-load; and transfers whose two leases live on two primaries. A failover can hand one lease to two holders (Redis
//! replicates asynchronously): the fence in Postgres refuses the stale one, and the bank check
//! proves nothing was lost or applied twice.

use crate::support::fleet::Fleet;
use crate::support::load::{Load, Outcome, check_books, open_wallets, settle, tally, time_to_recover};
use crate::support::servers::{ClusterSet, SentinelSet};
use crate::support::transfers::{
    TransferLoad, check_books as check_transfer_books, settle as transfer_settle, tally as transfer_tally,
};
use crate::support::{TestEnv, eventually};
use std::time::{Duration, Instant};

/// Wallets whose lease keys land on different slots, so a cluster spreads them over its primaries.
fn wallets(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("t{i}")).collect()
}

/// Fetches the fence resynchronizations and lease_lost refusals the replicas counted.
async fn fence_figures(fleet: &Fleet) -> (f64, f64) {
    let (mut resyncs, mut refusals) = (0.0, 0.0);
    for replica in &fleet.replicas {
        let Ok(response) = fleet.client.get(replica.url("/metrics")).send().await else { continue };
        let text = response.text().await.unwrap_or_default();
        for line in text.lines() {
            let value = || line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            if line.starts_with("walletlock_fence_resyncs_total ") {
                resyncs += value();
            } else if line.starts_with("walletlock_fence_refusals_total ") {
                refusals += value();
            }
        }
    }
    (resyncs, refusals)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_mid_load_loses_nothing() {
    let sentinels = SentinelSet::start();
    let mut env = TestEnv::new();
    env.redis_url = sentinels.url();
    sentinel_failover_mid_load(sentinels, env).await;
}

/// Payments through a fleet on `sentinels` while the primary is killed: they resume on the
/// promoted replica without a replica restart, and the bank check passes. The fleet reaches
/// Redis as `env` and `sentinels.replica_env` say (over TLS when the set speaks it).
pub async fn sentinel_failover_mid_load(mut sentinels: SentinelSet, env: TestEnv) {
    let mut settings = vec![("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s"), ("LEASE_WAIT", "3s")];
    settings.extend(sentinels.replica_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let fleet = Fleet::start(&env, 3, &settings).await;
    let names = wallets(8);
    let ids: Vec<&str> = names.iter().map(String::as_str).collect();
    open_wallets(&fleet, &ids, 1_000_000).await;
    let load = Load::start(&fleet, &ids, 8);
    tokio::time::sleep(Duration::from_millis(1_000)).await;

    let old = sentinels.kill_primary();
    let killed_at = Instant::now();
    let mut attempts = Vec::new();
    // Payments go on under Postgres alone until the Sentinels promote a replica (docs/operating/
    // redis-outages.md), then on leases from the new primary.
    let resumed = time_to_recover(&fleet, "t0", Duration::from_secs(20), &mut attempts).await;
    eventually("the Sentinels promote a replica", Duration::from_secs(20), || async {
        sentinels.current_primary() != old
    })
    .await;
    let promoted_after = killed_at.elapsed();
    eventually("every replica is on leases from the new primary", Duration::from_secs(10), || async {
        fleet.readiness().await.iter().all(|(_, _, payments)| payments == "lease")
    })
    .await;
    let on_leases_after = killed_at.elapsed();
    let probe = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    attempts.extend(load.finish().await);

    assert!(resumed <= Duration::from_secs(10), "payments resumed {resumed:?} after the primary died");
    let after: usize =
        attempts.iter().filter(|a| a.sent > probe && matches!(a.outcome, Outcome::Applied(_))).count();
    assert!(after > 0, "the replicas follow the new primary without a restart");
    eprintln!(
        "promoted {promoted_after:?} after the kill; every replica on leases {on_leases_after:?} after it"
    );
    settle(&fleet, &mut attempts).await;
    check_books(&fleet, &ids.iter().map(|w| (*w, 1_000_000)).collect::<Vec<_>>(), &attempts).await;
    let (resyncs, refusals) = fence_figures(&fleet).await;
    eprintln!(
        "sentinel failover: payments resumed after {resumed:?}; lease_lost refusals {refusals}, fence resyncs {resyncs}; {:?}",
        tally(&attempts)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_primary_lost_mid_load_loses_nothing() {
    let cluster = ClusterSet::start();
    let mut env = TestEnv::new();
    env.redis_url = cluster.url();
    cluster_primary_lost_mid_load(cluster, env).await;
}

/// Payments through a fleet on `cluster` while the primary of one wallet's slot is killed: they
/// resume once its replica takes the slots over, and the bank check passes. The fleet reaches
/// Redis as `env` and `cluster.replica_env` say (over TLS when the cluster speaks it).
pub async fn cluster_primary_lost_mid_load(mut cluster: ClusterSet, env: TestEnv) {
    let mut settings = vec![
        ("LEASE_TTL", "1s"),
        ("IDEMPOTENCY_STALE_AFTER", "2s"),
        ("LEASE_WAIT", "3s"),
        ("REDIS_TIMEOUT", "3s"),
    ];
    settings.extend(cluster.replica_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let fleet = Fleet::start(&env, 3, &settings).await;
    let names = wallets(24);
    let ids: Vec<&str> = names.iter().map(String::as_str).collect();
    open_wallets(&fleet, &ids, 1_000_000).await;

    // The wallets' leases are spread over all three primaries.
    let owners: std::collections::BTreeSet<u16> =
        ids.iter().map(|id| cluster.owner_of(&env.lease_key(&format!("wallet:{id}")))).collect();
    assert_eq!(owners.len(), 3, "the test wallets cover every primary");

    let load = Load::start(&fleet, &ids, 8);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // Kill the primary of t0's lease, and time how long until t0 can be paid again.
    let doomed = cluster.owner_of(&env.lease_key("wallet:t0"));
    cluster.kill(doomed);
    let mut attempts = Vec::new();
    let resumed = time_to_recover(&fleet, "t0", Duration::from_secs(20), &mut attempts).await;
    // The node asked may learn of the failover a moment after the client that paid did.
    eventually("its replica took the slots over", Duration::from_secs(5), || async {
        cluster.owner_of(&env.lease_key("wallet:t0")) != doomed
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    attempts.extend(load.finish().await);

    assert!(resumed <= Duration::from_secs(10), "payments resumed {resumed:?} after the primary died");
    settle(&fleet, &mut attempts).await;
    check_books(&fleet, &ids.iter().map(|w| (*w, 1_000_000)).collect::<Vec<_>>(), &attempts).await;
    let (resyncs, refusals) = fence_figures(&fleet).await;
    eprintln!(
        "cluster failover: payments on the lost primary's slots resumed after {resumed:?}; lease_lost refusals {refusals}, fence resyncs {resyncs}; {:?}",
        tally(&attempts)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_between_wallets_whose_leases_live_on_different_cluster_primaries_balance() {
    let cluster = ClusterSet::start();
    let mut env = TestEnv::new();
    env.redis_url = cluster.url();
    let settings: Vec<(&str, &str)> =
        cluster.replica_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let fleet = Fleet::start(&env, 3, &settings).await;
    // Slots follow the test's random key prefix: put first two wallets on two primaries, since
    // those are the ones transferred both ways.
    let owner = |id: &str| cluster.owner_of(&env.lease_key(&format!("wallet:{id}")));
    let mut names = wallets(6);
    let first = owner(&names[0]);
    let other = (1..100).map(|n| format!("t{n}")).find(|id| owner(id) != first).expect("two primaries");
    names.retain(|id| *id != other);
    names.insert(1, other);
    names.truncate(6);
    let ids: Vec<&str> = names.iter().map(String::as_str).collect();
    let owners: Vec<u16> = ids.iter().map(|id| owner(id)).collect();
    assert_ne!(owners[0], owners[1], "the two wallets of the both-ways clients are on two primaries");
    let opening = 2_000;
    open_wallets(&fleet, &ids, opening).await;

    // Both ways between t0 and t1, and random pairs among the six: two leases on two nodes each.
    let load = TransferLoad::each(&fleet, &ids, 8, 12);
    let mut attempts = tokio::time::timeout(Duration::from_secs(90), load.done())
        .await
        .expect("8 clients sent 12 transfers each within 90 s");
    transfer_settle(&fleet, &mut attempts).await;
    let counts = transfer_tally(&attempts);
    eprintln!("transfers on a cluster: {counts:?}");
    let applied = counts.get("applied").copied().unwrap_or(0);
    assert!(applied * 2 >= attempts.len(), "most transfers applied: {counts:?}");
    check_transfer_books(&fleet, &ids.iter().map(|w| (*w, opening)).collect::<Vec<_>>(), &attempts).await;
}
