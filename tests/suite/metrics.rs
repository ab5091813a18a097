//! Metrics: after a contention burst through the fleet, every replica's /metrics is valid
//! Prometheus text (promtool, and the reference parser) and its figures match what the clients saw;
//! transfers and refunds are counted by kind and outcome.

use crate::support::fleet::Fleet;
use crate::support::load::open_wallets;
use crate::support::{TestEnv, parse_metrics as parse};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

/// promtool's verdict on a scrape: format and naming lint.
fn promtool_check(scrape: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool on PATH (deploy/test installs Debian's prometheus)");
    child.stdin.take().unwrap().write_all(scrape.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sum(samples: &[(String, BTreeMap<String, String>, f64)], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_burst_match_what_the_clients_saw() {
    let env = TestEnv::new();
    // A short wait, so some payments on the hot wallet time out: those must be counted too.
    let fleet = Fleet::start(&env, 3, &[("LEASE_WAIT", "150ms")]).await;
    open_wallets(&fleet, &["m1", "m2"], 1_000_000).await;
    let requests: Vec<_> = (0..120)
        .map(|n| {
            let wallet = if n % 4 == 0 { "m2" } else { "m1" };
            // Straight to the replicas, spread over all three, so they contend for the leases.
            let url = fleet.replicas[n % 3].url(&format!("/wallets/{wallet}/pay"));
            let request = fleet.client.post(url).json(&json!({ "amount": 1 }));
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                let status = response.status().as_u16();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                (status, body["code"].as_str().unwrap_or("").to_owned())
            })
        })
        .collect();
    let mut seen: BTreeMap<(u16, String), usize> = BTreeMap::new();
    for request in requests {
        *seen.entry(request.await.unwrap()).or_default() += 1;
    }
    let ok = seen.iter().filter(|((status, _), _)| *status == 200).map(|(_, n)| n).sum::<usize>();
    let lock_timeouts = seen.get(&(503, "lock_timeout".into())).copied().unwrap_or(0);
    assert!(ok > 0, "{seen:?}");

    let (mut accepted, mut timeouts, mut leases_taken) = (0.0, 0.0, 0.0);
    for replica in &fleet.replicas {
        let scrape = fleet.client.get(replica.url("/metrics")).send().await.unwrap().text().await.unwrap();
        promtool_check(&scrape);
        let samples = parse(&scrape);
        accepted += sum(&samples, "walletlock_movements_total", &[("kind", "pay"), ("outcome", "accepted")]);
        timeouts +=
            sum(&samples, "walletlock_movements_total", &[("kind", "pay"), ("outcome", "lock_timeout")]);
        let acquisitions = sum(&samples, "walletlock_lease_acquisitions_total", &[]);
        let waits = sum(&samples, "walletlock_lease_acquire_wait_seconds_count", &[]);
        assert_eq!(waits, acquisitions, "{}: one lease-wait observation per acquisition", replica.name);
        leases_taken += acquisitions;
        let info = sum(&samples, "walletlock_replica_info", &[("replica", &replica.name)]);
        assert_eq!(info, 1.0, "{} names itself", replica.name);
        let answered = sum(&samples, "walletlock_http_requests_total", &[("route", "/wallets/{id}/pay")]);
        assert!(answered > 0.0, "{} counted its requests", replica.name);
    }
    // Under a 150 ms wait one replica may lose every race for the two wallets: leases are counted
    // across the fleet, not required of each replica.
    assert!(leases_taken > 0.0, "the replicas took leases");
    assert_eq!(accepted as usize, ok, "accepted payments counted = 200s seen: {seen:?}");
    assert_eq!(timeouts as usize, lock_timeouts, "lock timeouts counted = 503 lock_timeout seen: {seen:?}");
}

/// The samples of `walletlock_transfers_total` in `scrape` (read by the reference parser) that are
/// not zero: by kind, then outcome.
fn transfers_counted(scrape: &str) -> BTreeMap<(String, String), f64> {
    parse(scrape)
        .into_iter()
        .filter(|(name, _, value)| name == "walletlock_transfers_total" && *value != 0.0)
        .map(|(_, labels, value)| ((labels["kind"].clone(), labels["outcome"].clone()), value))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_and_refunds_are_counted_by_kind_and_outcome() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    open_wallets(&fleet, &["payer", "payee"], 100).await;
    let replica = &fleet.replicas[0];
    // POSTs to the replica: what the client was told (`accepted` or the problem's code), and the id
    // of what it made.
    let send = |path: &str, key: Option<&str>, body: Value| {
        let mut request = fleet.client.post(replica.url(path)).json(&body);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap();
            let told = if status == 200 { "accepted" } else { body["code"].as_str().unwrap_or_default() };
            (told.to_owned(), body["id"].as_str().unwrap_or_default().to_owned())
        }
    };
    let transfer = |to: &str, amount: i64| json!({ "from": "payer", "to": to, "amount": amount });
    let told = |sent: (String, String)| sent.0;

    // Transfers: two moved, one short, one into nobody, one moved with a key and then replayed.
    let (_, first) = send("/transfers", None, transfer("payee", 30)).await;
    let (_, second) = send("/transfers", None, transfer("payee", 40)).await;
    assert!(!first.is_empty() && !second.is_empty(), "both moved");
    assert_eq!(told(send("/transfers", None, transfer("payee", 500)).await), "insufficient_funds");
    assert_eq!(told(send("/transfers", None, transfer("ghost", 1)).await), "wallet_not_found");
    let keyed = send("/transfers", Some("once"), transfer("payee", 5)).await;
    assert_eq!(keyed.0, "accepted");
    assert_eq!(send("/transfers", Some("once"), transfer("payee", 5)).await, keyed, "replayed");
    // Refunds of transfers: one moved, one beyond what is left, one from a payee that spent it,
    // one of no transfer.
    let (first, second) = (format!("/transfers/{first}/refund"), format!("/transfers/{second}/refund"));
    let no_transfer = format!("/transfers/{}/refund", uuid::Uuid::new_v4());
    assert_eq!(told(send(&no_transfer, None, json!({})).await), "transfer_not_found");
    assert_eq!(told(send(&first, None, json!({ "amount": 10 })).await), "accepted");
    assert_eq!(told(send(&first, None, json!({ "amount": 25 })).await), "refund_exceeds_payment");
    assert_eq!(told(send("/wallets/payee/pay", None, json!({ "amount": 160 })).await), "accepted");
    assert_eq!(told(send(&second, None, json!({ "amount": 40 })).await), "insufficient_funds");
    // Refunds of payments: two moved (5, then the rest), one beyond the payment, one of no payment.
    let (_, payment) = send("/wallets/payer/pay", None, json!({ "amount": 20 })).await;
    let refunds = "/wallets/payer/refunds";
    assert_eq!(told(send(refunds, None, json!({ "payment": payment, "amount": 5 })).await), "accepted");
    assert_eq!(told(send(refunds, None, json!({ "payment": payment })).await), "accepted");
    let beyond = json!({ "payment": payment, "amount": 1 });
    assert_eq!(told(send(refunds, None, beyond).await), "refund_exceeds_payment");
    let nothing = json!({ "payment": uuid::Uuid::new_v4() });
    assert_eq!(told(send(refunds, None, nothing).await), "payment_not_found");

    // Counted once each, under its kind and outcome; a replay is not a second transfer.
    let scrape = fleet.client.get(replica.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let expected: BTreeMap<(String, String), f64> = [
        ("transfer", "accepted", 3.0),
        ("transfer", "insufficient_funds", 1.0),
        ("transfer", "not_found", 1.0),
        ("transfer", "replayed", 1.0),
        ("transfer_refund", "accepted", 1.0),
        ("transfer_refund", "refund_exceeds_payment", 1.0),
        ("transfer_refund", "insufficient_funds", 1.0),
        ("transfer_refund", "not_found", 1.0),
        ("payment_refund", "accepted", 2.0),
        ("payment_refund", "refund_exceeds_payment", 1.0),
        ("payment_refund", "not_found", 1.0),
    ]
    .into_iter()
    .map(|(kind, outcome, count)| ((kind.to_owned(), outcome.to_owned()), count))
    .collect();
    assert_eq!(transfers_counted(&scrape), expected);
}
