//! Overload: a flood of concurrent payments on one wallet through nginx to three replicas. Every
//! client gets an answer (a 200, a 503 `overloaded` or `lock_timeout`, or a 429, each 503 and 429
//! with Retry-After), none a dropped connection; what was shed changed nothing (the bank check);
//! and each replica's memory stays bounded.
//!
//! The replicas' bounds are lowered by their settings (`MAX_IN_FLIGHT`, `WALLET_QUEUE_LIMIT`), so
//! a flood this test client can send at once is shed the way 10,000 clients are at the defaults
//! (`loadtest/run flood` sends those).

use crate::support::TestEnv;
use crate::support::fleet::Fleet;
use crate::support::load::{Attempt, Outcome, check_books, open_wallets};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Concurrent clients in the flood: each its own connection to nginx, all at once.
const FLOOD: usize = 3_000;
/// The bound on each replica's peak resident memory during the flood (the target).
const PEAK_RSS_LIMIT_KIB: u64 = 50 * 1024;
const OPENING: i64 = 1_000_000;

/// What one client of the flood was told.
#[derive(Debug)]
struct Answer {
    status: u16,
    code: String,
    retry_after: bool,
    /// Answered by a replica (`X-Served-By`), not by nginx itself.
    from_replica: bool,
    attempt: Attempt,
}

/// One payment of 1 with its own key, on a connection of its own; `Err` is a connection that gave
/// no answer.
async fn pay_once(url: String, wallet: &'static str) -> Result<Answer, String> {
    // A client per payment: a connection per payment, as from 3,000 separate clients.
    let client = crate::support::api_client();
    let key = uuid::Uuid::new_v4().to_string();
    let sent = Instant::now();
    let response = client
        .post(format!("{url}/wallets/{wallet}/pay"))
        .header("idempotency-key", &key)
        .json(&json!({ "amount": 1 }))
        // Only bounds a hung test: a dropped connection is an error at once, and on a machine
        // busy with other work this client's own tasks may wait long for a core.
        .timeout(Duration::from_secs(90))
        .send()
        .await
        .map_err(|err| format!("no answer: {err:?}"))?;
    let status = response.status().as_u16();
    let retry_after = response.headers().contains_key("retry-after");
    let from_replica = response.headers().contains_key("x-served-by");
    let body: Value = response.json().await.map_err(|err| format!("{status} with no body: {err}"))?;
    let code = body["code"].as_str().unwrap_or("").to_owned();
    let outcome = match status {
        200 => Outcome::Applied(body["id"].as_str().and_then(|id| id.parse().ok()).expect("an entry id")),
        _ => Outcome::NotApplied(code.clone()),
    };
    let attempt = Attempt { wallet: wallet.into(), amount: 1, key, outcome, sent, took: sent.elapsed() };
    Ok(Answer { status, code, retry_after, from_replica, attempt })
}

/// A line of /proc/<pid>/status, in KiB (VmHWM: the peak resident memory; VmRSS: now).
fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.trim_start_matches(':').trim().strip_suffix(" kB"))
        .and_then(|kib| kib.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// The replicas' `walletlock_requests_shed_total`, by reason.
async fn shed_counters(fleet: &Fleet) -> BTreeMap<String, usize> {
    let mut shed = BTreeMap::new();
    for replica in &fleet.replicas {
        let scrape = fleet.client.get(replica.url("/metrics")).send().await.unwrap();
        for line in scrape.text().await.unwrap().lines() {
            let Some(sample) = line.strip_prefix("walletlock_requests_shed_total{") else { continue };
            let (labels, value) = sample.rsplit_once(' ').expect("a sample");
            *shed.entry(labels.trim_end_matches('}').to_owned()).or_default() +=
                value.parse::<f64>().expect("a count") as usize;
        }
    }
    shed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_one_wallet_is_answered_whole_shed_early_and_within_memory() {
    let env = TestEnv::new();
    let replica_limits = [("MAX_IN_FLIGHT", "24"), ("WALLET_QUEUE_LIMIT", "12")];
    let fleet = Fleet::start_behind(&env, 3, &replica_limits, &[("WALLETLOCK_NGINX_MAX_CONNS", "32")]).await;
    open_wallets(&fleet, &["flooded"], OPENING).await;
    let idle: Vec<u64> = fleet.replicas.iter().map(|r| proc_status_kib(r.pid(), "VmRSS")).collect();

    // The replicas are frozen while the flood arrives, so the connections nginx opens to them stay
    // busy and every bound is met for sure: nginx's `max_conns` for what comes next, then, once
    // they run again, each replica's requests in flight and the wallet's queue. (Replicas that
    // answer at once would free a connection as fast as nginx fills one, and whether all three
    // were ever full at the same instant would be up to the scheduler.)
    for replica in &fleet.replicas {
        replica.signal(Signal::SIGSTOP);
    }
    let started = Instant::now();
    let flood: Vec<_> = (0..FLOOD).map(|_| tokio::spawn(pay_once(fleet.url(""), "flooded"))).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for replica in &fleet.replicas {
        replica.signal(Signal::SIGCONT);
    }
    let mut answers = Vec::new();
    let mut dropped = Vec::new();
    for client in flood {
        match client.await.unwrap() {
            Ok(answer) => answers.push(answer),
            Err(err) => dropped.push(err),
        }
    }
    let took = started.elapsed();

    let mut by_answer: BTreeMap<String, usize> = BTreeMap::new();
    for answer in &answers {
        *by_answer.entry(format!("{} {}", answer.status, answer.code)).or_default() += 1;
    }
    let shed_by_nginx = answers.iter().filter(|a| a.code == "overloaded" && !a.from_replica).count();
    eprintln!(
        "flood of {FLOOD}: {by_answer:?} ({shed_by_nginx} overloaded from nginx), {} dropped, in {took:?}",
        dropped.len()
    );
    assert!(dropped.is_empty(), "{} clients got no answer, e.g. {:?}", dropped.len(), dropped.first());
    for answer in &answers {
        let allowed = matches!(
            (answer.status, answer.code.as_str()),
            (200, _) | (503, "overloaded" | "lock_timeout") | (429, "rate_limited")
        );
        assert!(allowed, "an answer a flood may not get: {} {}", answer.status, answer.code);
        if answer.status != 200 {
            assert!(answer.retry_after, "{} {} without Retry-After", answer.status, answer.code);
        }
    }
    let applied = answers.iter().filter(|a| a.status == 200).count();
    let shed_by_replicas = answers.iter().filter(|a| a.code == "overloaded" && a.from_replica).count();
    assert!(applied > 0, "payments went through during the flood");

    // Shed at every bound: nginx's connections per replica, each replica's requests in flight, and
    // the wallet's queue on each replica; each shed request counted by the replica that shed it.
    let counted = shed_counters(&fleet).await;
    eprintln!("shed by the replicas: {counted:?}");
    assert!(shed_by_nginx > 0, "nginx answered for replicas at their max_conns");
    for reason in ["reason=\"in_flight\"", "reason=\"wallet_queue\""] {
        assert!(counted.get(reason).is_some_and(|n| *n > 0), "no request shed with {reason}: {counted:?}");
    }
    assert_eq!(counted.values().sum::<usize>(), shed_by_replicas, "walletlock_requests_shed_total");

    // Shed requests changed nothing: the ledger holds exactly the payments answered 200.
    let attempts: Vec<Attempt> = answers.into_iter().map(|a| a.attempt).collect();
    check_books(&fleet, &[("flooded", OPENING)], &attempts).await;

    tokio::time::sleep(Duration::from_secs(2)).await;
    for (replica, idle) in fleet.replicas.iter().zip(idle) {
        let peak = proc_status_kib(replica.pid(), "VmHWM");
        let after = proc_status_kib(replica.pid(), "VmRSS");
        eprintln!("{}: resident memory {idle} KiB before, peak {peak} KiB, {after} KiB after", replica.name);
        assert!(peak < PEAK_RSS_LIMIT_KIB, "{}: peak resident memory {peak} KiB", replica.name);
    }
}
