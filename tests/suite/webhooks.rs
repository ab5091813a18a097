//! Webhooks (docs/api/webhooks.md): a caller's events POSTed to its endpoint by the fleet, signed
//! as Standard Webhooks says, each wallet's in order, at least once, through a receiver that fails,
//! hangs and goes away, and a replica delivering them stopped and killed.

use crate::events::{WALLETS, read_all, start_movers};
use crate::support::fleet::Fleet;
use crate::support::load::open_wallets;
use crate::support::receiver::{Mode, Receiver};
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with, eventually};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The fleet's settings: its receivers are on this machine, and a hung one is given up on soon.
const SETTINGS: [(&str, &str); 2] = [("WEBHOOK_ALLOW_HOSTS", "127.0.0.1"), ("WEBHOOK_TIMEOUT", "1s")];

async fn send(
    fleet: &Fleet,
    client: &reqwest::Client,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client.request(method.parse().unwrap(), fleet.url(path));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The replica that has delivered the most so far.
async fn busiest_dispatcher(fleet: &Fleet) -> usize {
    let mut most = (0, -1.0);
    for replica in 0..fleet.replicas.len() {
        let scrape = fleet.client.get(fleet.replicas[replica].url("/metrics")).send().await;
        let Ok(scrape) = scrape else { continue };
        let text = scrape.text().await.unwrap_or_default();
        let delivered: f64 = text
            .lines()
            .filter(|line| line.starts_with("walletlock_webhook_deliveries_total"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if delivered > most.1 {
            most = (replica, delivered);
        }
    }
    most.0
}

/// Each wallet's events, by their first arrival, are its events 1, 2, 3, ... with no gap, and a
/// duplicate is the same event.
fn in_order_at_least_once(taken: &[crate::support::receiver::Received]) -> HashMap<String, Value> {
    let mut first: HashMap<String, Value> = HashMap::new();
    let mut next: BTreeMap<String, i64> = BTreeMap::new();
    for received in taken {
        assert_eq!(received.body["id"].as_str(), Some(received.id.as_str()), "webhook-id is the event's id");
        if let Some(before) = first.get(&received.id) {
            assert_eq!(before, &received.body, "a duplicate carries the same event");
            continue;
        }
        let wallet = received.body["wallet_id"].as_str().unwrap().to_owned();
        let seq = received.body["sequence"].as_i64().unwrap();
        let expected = next.entry(wallet.clone()).or_insert(1);
        assert_eq!(seq, *expected, "wallet {wallet}: event {seq} arrived first where {expected} was due");
        *expected += 1;
        first.insert(received.id.clone(), received.body.clone());
    }
    first
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_event_reaches_the_endpoint_in_order_through_a_failing_receiver_and_a_stopped_or_killed_dispatcher()
 {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    let mut receiver = Receiver::start().await;
    let (status, endpoint) =
        send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(json!({ "url": receiver.url() })))
            .await;
    assert_eq!(status, 201, "{endpoint}");
    receiver.set_secret(endpoint["secret"].as_str().unwrap());
    open_wallets(&fleet, &WALLETS, 300).await;

    let fleet_ref = Arc::new(fleet);
    let (stop, _, movers) = start_movers(&fleet_ref, 4);
    // The receiver takes, then fails half, goes away for 10 s, hangs past the timeout, answers
    // slowly, and takes again; meanwhile the replica delivering the most is stopped for a while,
    // then killed.
    tokio::time::sleep(Duration::from_secs(1)).await;
    receiver.set_mode(Mode::FailHalf);
    let paused = busiest_dispatcher(&fleet_ref).await;
    fleet_ref.replicas[paused].signal(Signal::SIGSTOP);
    tokio::time::sleep(Duration::from_secs(2)).await;
    fleet_ref.replicas[paused].signal(Signal::SIGCONT);
    receiver.down().await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    receiver.up().await;
    receiver.set_mode(Mode::Hang);
    tokio::time::sleep(Duration::from_secs(2)).await;
    receiver.set_mode(Mode::Slow);
    tokio::time::sleep(Duration::from_secs(2)).await;
    receiver.set_mode(Mode::Take);
    stop.store(true, Ordering::Relaxed);
    for mover in movers {
        mover.await.unwrap();
    }
    let mut fleet = Arc::try_unwrap(fleet_ref).ok().expect("the movers are done");
    let killed = busiest_dispatcher(&fleet).await;
    fleet.replicas[killed].stop(Signal::SIGKILL);
    // A few more movements after the kill, which the other replicas deliver.
    let (status, _) =
        send(&fleet, &fleet.client, "POST", "/wallets/ev0/deposit", Some(json!({ "amount": 1 }))).await;
    assert_eq!(status, 200);

    // Every event of the caller's wallets arrives, at least once, each wallet's in order.
    let everything: Vec<String> =
        read_all(&fleet, "").await.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
    eventually("every event is delivered", Duration::from_secs(60), || {
        let taken: HashSet<String> = receiver.taken().into_iter().map(|r| r.id).collect();
        let missing = everything.iter().filter(|id| !taken.contains(*id)).count();
        async move { missing == 0 }
    })
    .await;
    let first = in_order_at_least_once(&receiver.taken());
    // Nothing that is not an event of the feed (read again: a hold may have expired since).
    let feed: HashSet<String> =
        read_all(&fleet, "").await.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
    let unknown: Vec<&String> = first.keys().filter(|id| !feed.contains(*id)).collect();
    assert!(unknown.is_empty(), "delivered, not in the feed: {unknown:?}");
    assert_eq!(receiver.bad_signatures(), 0, "every delivery is signed with the endpoint's secret");
    // The attempts say what happened: failures and successes.
    let path = format!("/webhook-endpoints/{}/attempts?limit=500", endpoint["id"].as_str().unwrap());
    let (status, attempts) = send(&fleet, &fleet.client, "GET", &path, None).await;
    assert_eq!(status, 200, "{attempts}");
    let attempts = attempts["attempts"].as_array().unwrap();
    assert!(attempts.iter().any(|a| a["error"].is_null() && a["status"] == 204), "{attempts:?}");
    fleet.replicas[killed].start();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_are_the_callers_own_refuse_private_addresses_and_replay_rotate_disable_and_delete() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &SETTINGS[..1]).await;
    let receiver = Receiver::start().await;
    open_wallets(&fleet, &["wh-a"], 100).await;
    let other = api_client_with(OTHER_TOKEN);
    let (status, _) = send(&fleet, &other, "POST", "/wallets", Some(json!({ "id": "wh-theirs" }))).await;
    assert_eq!(status, 201);

    // Bad asks change nothing.
    for (body, status_code, code) in [
        (json!({ "url": "http://10.0.0.7/hook" }), 400, "invalid_webhook_url"),
        (json!({ "url": "http://169.254.169.254/latest" }), 400, "invalid_webhook_url"),
        (json!({ "url": "http://localhost:9/hook" }), 400, "invalid_webhook_url"),
        (json!({ "url": "ftp://example.com/x" }), 400, "invalid_webhook_url"),
        (json!({ "url": "not a url" }), 400, "invalid_webhook_url"),
        (json!({ "url": receiver.url(), "types": ["payment.refused"] }), 400, "invalid_event_type"),
        (json!({ "url": receiver.url(), "wallet_ids": ["not a wallet"] }), 400, "invalid_wallet_id"),
        (json!({ "url": receiver.url(), "wallet_ids": ["wh-theirs"] }), 404, "wallet_not_found"),
        (json!({ "url": receiver.url(), "secret": "mine" }), 400, "invalid_body"),
    ] {
        let (status, problem) =
            send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(body.clone())).await;
        assert_eq!((status, problem["code"].as_str()), (status_code, Some(code)), "{body}: {problem}");
    }
    let huge = json!({ "url": format!("{}?{}", receiver.url(), "x".repeat(20_000)) });
    let (status, _) = send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(huge)).await;
    assert_eq!(status, 413);
    let (_, listed) = send(&fleet, &fleet.client, "GET", "/webhook-endpoints", None).await;
    assert_eq!(listed["endpoints"], json!([]), "nothing was registered");

    // One endpoint, of payments only.
    let ask = json!({ "url": receiver.url(), "types": ["payment.accepted"], "wallet_ids": ["wh-a"] });
    let (status, endpoint) = send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(ask)).await;
    assert_eq!(status, 201, "{endpoint}");
    let id = endpoint["id"].as_str().unwrap().to_owned();
    assert!(endpoint["secret"].as_str().unwrap().starts_with("whsec_"));
    receiver.set_secret(endpoint["secret"].as_str().unwrap());
    let (status, _) = send(&fleet, &other, "GET", &format!("/webhook-endpoints/{id}"), None).await;
    assert_eq!(status, 404, "another caller's endpoint does not exist to it");
    let (status, problem) = send(&fleet, &fleet.client, "GET", "/webhook-endpoints/nope", None).await;
    assert_eq!((status, problem["code"].as_str()), (400, Some("invalid_endpoint_id")));

    let pay = |amount: i64| {
        send(&fleet, &fleet.client, "POST", "/wallets/wh-a/pay", Some(json!({ "amount": amount })))
    };
    assert_eq!(pay(5).await.0, 200);
    assert_eq!(
        send(&fleet, &fleet.client, "POST", "/wallets/wh-a/deposit", Some(json!({ "amount": 1 }))).await.0,
        200
    );
    eventually("the payment is delivered", Duration::from_secs(20), || {
        let taken = receiver.taken();
        async move { taken.len() == 1 }
    })
    .await;
    let first = receiver.taken()[0].clone();
    assert_eq!((first.body["type"].as_str(), first.id.as_str()), (Some("payment.accepted"), "wh-a.2"));

    // A new secret signs what comes next.
    let (status, rotated) =
        send(&fleet, &fleet.client, "POST", &format!("/webhook-endpoints/{id}/rotate-secret"), None).await;
    assert_eq!(status, 200);
    assert_ne!(rotated["secret"], endpoint["secret"]);
    receiver.set_secret(rotated["secret"].as_str().unwrap());
    // Replayed from before the payment: it comes again, with the same id.
    let replay = json!({ "after": first.body["cursor"].as_str().unwrap().replace("-2-wh-a", "-1-wh-a") });
    let (status, replayed) =
        send(&fleet, &fleet.client, "POST", &format!("/webhook-endpoints/{id}/replay"), Some(replay)).await;
    assert_eq!(status, 200, "{replayed}");
    eventually("the payment is delivered again", Duration::from_secs(20), || {
        let taken = receiver.taken();
        async move { taken.len() == 2 }
    })
    .await;
    assert_eq!(receiver.taken()[1].id, "wh-a.2");
    assert_eq!(receiver.bad_signatures(), 0);

    // Disabled, it receives nothing; enabled again, what came meanwhile.
    let set =
        |enabled: bool| json!({ "url": receiver.url(), "types": ["payment.accepted"], "enabled": enabled });
    let (status, disabled) =
        send(&fleet, &fleet.client, "PUT", &format!("/webhook-endpoints/{id}"), Some(set(false))).await;
    assert_eq!((status, &disabled["enabled"]), (200, &json!(false)), "{disabled}");
    assert_eq!(pay(6).await.0, 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(receiver.taken().len(), 2, "a disabled endpoint receives nothing");
    let (status, _) =
        send(&fleet, &fleet.client, "PUT", &format!("/webhook-endpoints/{id}"), Some(set(true))).await;
    assert_eq!(status, 200);
    eventually("the payment made while disabled is delivered", Duration::from_secs(20), || {
        let taken = receiver.taken();
        async move { taken.len() == 3 }
    })
    .await;

    let (status, _) = send(&fleet, &fleet.client, "DELETE", &format!("/webhook-endpoints/{id}"), None).await;
    assert_eq!(status, 204);
    let (status, problem) =
        send(&fleet, &fleet.client, "GET", &format!("/webhook-endpoints/{id}"), None).await;
    assert_eq!((status, problem["code"].as_str()), (404, Some("webhook_endpoint_not_found")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_go_on_while_redis_is_gone() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Arc::new(Fleet::start(&env, 2, &SETTINGS).await);
    let receiver = Receiver::start().await;
    let (status, endpoint) =
        send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(json!({ "url": receiver.url() })))
            .await;
    assert_eq!(status, 201, "{endpoint}");
    receiver.set_secret(endpoint["secret"].as_str().unwrap());
    open_wallets(&*fleet, &WALLETS, 300).await;
    let (stop, _, movers) = start_movers(&fleet, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    env.own_redis().kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    for mover in movers {
        mover.await.unwrap();
    }
    // Everything, the movements made under Postgres alone included, is delivered with Redis gone.
    let everything: Vec<String> =
        read_all(&fleet, "").await.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
    eventually("every event is delivered without Redis", Duration::from_secs(60), || {
        let taken: HashSet<String> = receiver.taken().into_iter().map(|r| r.id).collect();
        let missing = everything.iter().filter(|id| !taken.contains(*id)).count();
        async move { missing == 0 }
    })
    .await;
    in_order_at_least_once(&receiver.taken());
    assert_eq!(receiver.bad_signatures(), 0);
    env.own_redis().start_again();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_does_not_answer_is_probed_then_disabled_past_the_retry_period_and_goes_on_once_enabled()
 {
    let env = TestEnv::new();
    let settings = [SETTINGS[0], SETTINGS[1], ("WEBHOOK_RETRY_FOR", "2s")];
    let fleet = Fleet::start(&env, 1, &settings).await;
    let mut receiver = Receiver::start().await;
    let (_, endpoint) =
        send(&fleet, &fleet.client, "POST", "/webhook-endpoints", Some(json!({ "url": receiver.url() })))
            .await;
    receiver.set_secret(endpoint["secret"].as_str().unwrap());
    let path = format!("/webhook-endpoints/{}", endpoint["id"].as_str().unwrap());
    receiver.down().await;
    let wallets: Vec<String> = (0..60).map(|n| format!("wh-gone-{n:02}")).collect();
    open_wallets(&fleet, &wallets.iter().map(String::as_str).collect::<Vec<_>>(), 100).await;

    // Refused connections: the endpoint, not each event, is failing, and is probed with one
    // wallet at a time, with backoff, not with every wallet's events.
    eventually("the endpoint is seen failing", Duration::from_secs(30), || {
        let (fleet, path) = (&fleet, &path);
        async move { send(fleet, &fleet.client, "GET", path, None).await.1["failing_since"].is_string() }
    })
    .await;
    // Past the retry period: disabled, with the reason.
    eventually("the endpoint is disabled", Duration::from_secs(30), || {
        let (fleet, path) = (&fleet, &path);
        async move {
            let (_, read) = send(fleet, &fleet.client, "GET", path, None).await;
            read["enabled"] == false
        }
    })
    .await;
    let (_, read) = send(&fleet, &fleet.client, "GET", &path, None).await;
    let reason = read["disabled_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("failed for longer than"), "{read}");
    assert!(read["waiting"].as_array().is_some_and(|waiting| !waiting.is_empty()), "{read}");
    let (_, attempts) = send(&fleet, &fleet.client, "GET", &format!("{path}/attempts"), None).await;
    let tried = attempts["attempts"].as_array().map_or(0, Vec::len);
    assert!(tried < wallets.len(), "{tried} attempts for {} wallets: {attempts}", wallets.len());

    // Enabled again with the receiver back, it delivers what waited, in order.
    receiver.up().await;
    let (status, _) = send(&fleet, &fleet.client, "PUT", &path, Some(json!({ "url": receiver.url() }))).await;
    assert_eq!(status, 200);
    eventually("what waited is delivered", Duration::from_secs(30), || {
        let taken = receiver.taken();
        let wallets = &wallets;
        async move { wallets.iter().all(|w| taken.iter().any(|t| t.body["wallet_id"] == w.as_str())) }
    })
    .await;
    in_order_at_least_once(&receiver.taken());
    let (_, read) = send(&fleet, &fleet.client, "GET", &path, None).await;
    assert!(read["failing_since"].is_null(), "{read}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_listen_verifies_and_counts_what_an_endpoint_receives() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &SETTINGS).await;
    let listen = format!("127.0.0.1:{}", crate::support::servers::free_port());
    let (_, endpoint) = send(
        &fleet,
        &fleet.client,
        "POST",
        "/webhook-endpoints",
        Some(json!({ "url": format!("http://{listen}/") })),
    )
    .await;
    let secret = endpoint["secret"].as_str().unwrap();
    let run = |secret: &str, listen: &str| {
        crate::support::servers::OwnedChild(
            std::process::Command::new(env!("CARGO_BIN_EXE_walletlock"))
                .args(["events", "listen", "--quiet", "--listen", listen, "--secret", secret])
                .spawn()
                .unwrap(),
        )
    };
    let _listener = run(secret, &listen);
    open_wallets(&fleet, &["listened"], 100).await;
    let (status, _) =
        send(&fleet, &fleet.client, "POST", "/wallets/listened/pay", Some(json!({ "amount": 1 }))).await;
    assert_eq!(status, 200);
    let stats = || async {
        let stats = reqwest::get(format!("http://{listen}/stats")).await;
        match stats {
            Ok(stats) => stats.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        }
    };
    eventually("the listener has both events", Duration::from_secs(20), || async {
        stats().await["events"] == 2
    })
    .await;
    let stats = stats().await;
    assert_eq!(stats["bad_signatures"], 0, "{stats}");
    assert!(stats["lag_p99_seconds"].as_f64().is_some_and(|lag| lag >= 0.0), "{stats}");

    // A listener with another secret takes nothing: every delivery is refused as unsigned.
    let other = format!("127.0.0.1:{}", crate::support::servers::free_port());
    let _wrong = run("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", &other);
    let (_, moved) = send(
        &fleet,
        &fleet.client,
        "PUT",
        &format!("/webhook-endpoints/{}", endpoint["id"].as_str().unwrap()),
        Some(json!({ "url": format!("http://{other}/") })),
    )
    .await;
    assert_eq!(moved["url"], format!("http://{other}/"));
    send(&fleet, &fleet.client, "POST", "/wallets/listened/pay", Some(json!({ "amount": 1 }))).await;
    eventually("the wrongly keyed listener refuses it", Duration::from_secs(20), || async {
        let stats = reqwest::get(format!("http://{other}/stats")).await;
        let stats = match stats {
            Ok(stats) => stats.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        stats["bad_signatures"].as_u64().is_some_and(|bad| bad > 0) && stats["events"] == 0
    })
    .await;
}
