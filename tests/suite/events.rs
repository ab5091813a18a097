//! Events (docs/api/events.md): every committed movement's events written by its own commit, and
//! the change feed, `GET /events`, read through nginx while the fleet moves money: each wallet's
//! events numbered with no gap in the order they happened, every event shown exactly once to a
//! reader that follows the feed, none of a refused movement, and the audit agreeing.

use crate::outage::fleet_by_path;
use crate::support::app::spawn_app;
use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with, eventually};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

pub(crate) const WALLETS: [&str; 4] = ["ev0", "ev1", "ev2", "ev3"];

async fn post(fleet: &Fleet, path: &str, body: Value) -> (u16, Value) {
    let response = fleet
        .client
        .post(fleet.url(path))
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// One page of the feed: its events and `next`.
async fn page(client: &reqwest::Client, fleet: &Fleet, query: &str) -> (Vec<Value>, Value) {
    let response = client.get(fleet.url(&format!("/events?{query}"))).send().await.unwrap();
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "/events?{query}: {body}");
    (body["events"].as_array().unwrap().clone(), body["next"].clone())
}

/// Every event committed before the call, read page by page from the first. The feed shows
/// events below its horizon, the oldest transaction still running (src/ledger/event.rs), which
/// any transaction of the database holds back, another test's too: so it is read once every
/// transaction running at the call has ended.
pub(crate) async fn read_all(fleet: &Fleet, extra: &str) -> Vec<Value> {
    let now: i64 =
        sqlx::query_scalar("select pg_current_xact_id()::text::int8").fetch_one(&fleet.db).await.unwrap();
    eventually("the transactions running now end", Duration::from_secs(60), || async {
        let mut conn = fleet.db.acquire().await.unwrap();
        walletlock::ledger::event::horizon(&mut conn).await.unwrap() > now
    })
    .await;
    let (mut events, mut after) = (Vec::new(), String::new());
    loop {
        let (got, next) = page(&fleet.client, fleet, &format!("limit=37&after={after}{extra}")).await;
        if got.is_empty() {
            return events;
        }
        events.extend(got);
        after = next.as_str().unwrap().to_owned();
    }
}

/// Each wallet's events are numbered 1, 2, 3, ... in the order the feed shows them, and no
/// event shows twice.
fn numbered_in_order(events: &[Value]) -> BTreeMap<String, i64> {
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut ids = HashSet::new();
    for event in events {
        assert!(ids.insert(event["id"].as_str().unwrap().to_owned()), "shown twice: {event}");
        let wallet = event["wallet_id"].as_str().unwrap().to_owned();
        let seq = event["sequence"].as_i64().unwrap();
        let before = last.insert(wallet.clone(), seq).unwrap_or(0);
        assert_eq!(seq, before + 1, "wallet {wallet}'s events out of order or with a gap at {event}");
        assert_eq!(event["id"], format!("{wallet}.{seq}"));
    }
    last
}

/// A failure a fault test may see, with nothing applied: a lease lost to a stopped replica, a
/// dependency gone for a moment.
fn transient((status, code): (u16, Option<&str>)) -> bool {
    matches!(
        (status, code),
        (409, Some("lease_lost")) | (503, Some("lock_timeout" | "dependency_unavailable"))
    )
}

/// `count` clients running [`move_money`] on the fleet until `stop` is set: `stop`, how many
/// payments they saw refused, and the clients, each answering with what it caused.
pub(crate) fn start_movers(fleet: &Arc<Fleet>, count: usize) -> (Arc<AtomicBool>, Arc<AtomicUsize>, Movers) {
    let (stop, refused) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let movers = (0..count)
        .map(|n| {
            let (fleet, stop, refused) = (fleet.clone(), stop.clone(), refused.clone());
            tokio::spawn(async move { move_money(&fleet, n, stop, refused).await })
        })
        .collect();
    (stop, refused, movers)
}

pub(crate) type Movers = Vec<tokio::task::JoinHandle<BTreeMap<&'static str, i64>>>;

/// Pays, deposits, holds (captured, voided, left to expire), transfers, splits and refunds
/// from `n`'s own corner of the wallets until `stop`; how many of each kind of event it caused.
pub(crate) async fn move_money(
    fleet: &Fleet,
    n: usize,
    stop: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
) -> BTreeMap<&'static str, i64> {
    let mut caused: BTreeMap<&'static str, i64> = BTreeMap::new();
    let mut count = |kind: &'static str, times: i64| *caused.entry(kind).or_default() += times;
    let (mine, next) = (WALLETS[n % 4], WALLETS[(n + 1) % 4]);
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) && round < 400 {
        round += 1;
        let ok = |status: u16| status == 200 || status == 201;
        // A payment that may be refused (the wallets run low): a refusal has no event.
        let (status, paid) = post(fleet, &format!("/wallets/{mine}/pay"), json!({ "amount": 25 })).await;
        if ok(status) {
            count("payment.accepted", 1);
            if round % 5 == 0 {
                let refund = json!({ "payment": paid["id"], "amount": 3 });
                if ok(post(fleet, &format!("/wallets/{mine}/refunds"), refund).await.0) {
                    count("refund.accepted", 1);
                }
            }
        } else {
            match (status, paid["code"].as_str()) {
                (422, Some("insufficient_funds")) => _ = refused.fetch_add(1, Ordering::Relaxed),
                other => assert!(transient(other), "{paid}"),
            }
        }
        // One no wallet can pay: refused whatever the others did.
        let (status, refusal) =
            post(fleet, &format!("/wallets/{mine}/pay"), json!({ "amount": 1_000_000 })).await;
        match (status, refusal["code"].as_str()) {
            (422, Some("insufficient_funds")) => _ = refused.fetch_add(1, Ordering::Relaxed),
            other => assert!(transient(other), "{refusal}"),
        }
        if ok(post(fleet, &format!("/wallets/{mine}/deposit"), json!({ "amount": 5 })).await.0) {
            count("deposit.accepted", 1);
        }
        let life = if round % 7 == 0 { 1 } else { 60 };
        let (status, hold) =
            post(fleet, &format!("/wallets/{mine}/holds"), json!({ "amount": 2, "expires_in": life })).await;
        if ok(status) {
            count("hold.placed", 1);
            let id = hold["id"].as_str().unwrap();
            if round % 3 == 0 {
                if ok(post(fleet, &format!("/holds/{id}/capture"), json!({ "amount": 1 })).await.0) {
                    count("hold.captured", 1);
                }
            } else if life > 1 && ok(post(fleet, &format!("/holds/{id}/void"), json!({})).await.0) {
                count("hold.voided", 1);
            }
        }
        let transfer = json!({ "from": mine, "to": next, "amount": 3 });
        if ok(post(fleet, "/transfers", transfer).await.0) {
            count("transfer.accepted", 2);
        }
        if round % 4 == 0 {
            let legs = json!([{ "wallet_id": mine, "amount": -4 }, { "wallet_id": next, "amount": 3 },
                              { "wallet_id": WALLETS[(n + 2) % 4], "amount": 1 }]);
            if ok(post(fleet, "/movements", json!({ "legs": legs })).await.0) {
                count("movement.accepted", 3);
            }
        }
    }
    caused
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_committed_movement_has_its_events_in_order_and_a_reader_following_the_feed_sees_each_once() {
    let env = TestEnv::new();
    let fleet = Arc::new(Fleet::start(&env, 3, &[]).await);
    open_wallets(&*fleet, &WALLETS, 300).await;

    // A reader following the feed as the money moves, long polling from the first event, until
    // it has read as many as the feed holds once the money stopped (`wanted`, 0 until then).
    let wanted = Arc::new(AtomicUsize::new(0));
    let follower = {
        let (fleet, wanted) = (fleet.clone(), wanted.clone());
        tokio::spawn(async move {
            let (mut seen, mut after) = (Vec::new(), String::new());
            while wanted.load(Ordering::Relaxed) == 0 || seen.len() < wanted.load(Ordering::Relaxed) {
                let (got, next) =
                    page(&fleet.client, &fleet, &format!("wait=1&limit=50&after={after}")).await;
                if let Some(next) = next.as_str() {
                    after = next.to_owned();
                }
                seen.extend(got);
            }
            seen
        })
    };
    let (stop, refused, movers) = start_movers(&fleet, 8);
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let mut caused: BTreeMap<&str, i64> = BTreeMap::new();
    for mover in movers {
        for (kind, times) in mover.await.unwrap() {
            *caused.entry(kind).or_default() += times;
        }
    }

    // The holds left to expire are released by the sweeper, or by the next movement.
    let everything = read_all(&fleet, "").await;
    let numbered = numbered_in_order(&everything);
    let mut by_type: BTreeMap<String, i64> = BTreeMap::new();
    for event in &everything {
        *by_type.entry(event["type"].as_str().unwrap().to_owned()).or_default() += 1;
    }
    assert_eq!(by_type.remove("wallet.opened"), Some(4), "{by_type:?}");
    by_type.remove("hold.expired");
    let caused: BTreeMap<String, i64> = caused.into_iter().map(|(kind, n)| (kind.to_owned(), n)).collect();
    assert_eq!(by_type, caused, "an event for each movement the clients were told was made, and no other");
    assert!(refused.load(Ordering::Relaxed) > 0, "some payments were refused: {caused:?}");
    for event in &everything {
        let entry = &event["entry"];
        match event["type"].as_str().unwrap() {
            "hold.placed" | "hold.voided" | "hold.expired" => {
                assert!(entry.is_null() && event["hold"]["id"].is_string(), "{event}")
            }
            "hold.captured" => assert_eq!(entry["hold_id"], event["hold"]["id"], "{event}"),
            _ => assert_eq!(entry["wallet_id"], event["wallet_id"], "{event}"),
        }
        if event["type"] == "hold.placed" {
            assert_eq!(event["hold"]["status"], "held", "a hold as its placing left it: {event}");
        }
    }
    // The wallet's own count agrees.
    for wallet in WALLETS {
        let last: i64 = sqlx::query_scalar("select event_seq from wallet where id = $1")
            .bind(wallet)
            .fetch_one(&fleet.db)
            .await
            .unwrap();
        assert_eq!(numbered.get(wallet), Some(&last), "{wallet}");
    }

    // The reader that followed the feed saw exactly the same events, in the same order.
    let total = everything.len();
    wanted.store(total, Ordering::Relaxed);
    let seen = tokio::time::timeout(Duration::from_secs(60), follower)
        .await
        .expect("the follower reads every event within a minute")
        .unwrap();
    let ids =
        |events: &[Value]| events.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect::<Vec<_>>();
    let seen_ids = ids(&seen);
    assert!(seen_ids.len() >= total, "the follower stopped early: {} of {total}", seen_ids.len());
    assert_eq!(seen_ids[..total], ids(&everything)[..], "the follower's events are the feed's");
    numbered_in_order(&seen);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

/// The audit reads books that are moving as of one moment (on one Postgres a snapshot, under
/// Citus, whose workers have no snapshot in common, with the writes paused while it copies): run
/// while four clients pay, place holds (some left to expire and be swept), capture, void,
/// transfer and split, every audit finds nothing, each though money moved while it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_audit_run_while_money_moves_reads_one_moment_and_finds_nothing() {
    let env = TestEnv::new();
    let fleet = Arc::new(Fleet::start(&env, 2, &[]).await);
    open_wallets(&*fleet, &WALLETS, 300).await;
    let (stop, _, movers) = start_movers(&fleet, 4);
    let events_so_far = || async {
        let sum: i64 =
            sqlx::query_scalar("select sum(event_seq)::int8 from wallet").fetch_one(&fleet.db).await.unwrap();
        sum
    };
    for audit_run in 0..6 {
        let before = events_so_far().await;
        let url = fleet.database_url.clone();
        let (ok, report) = tokio::task::spawn_blocking(move || audit(&url)).await.unwrap();
        assert!(ok, "audit {audit_run}, run while money moved: {report}");
        eventually("money moving while the audits run", Duration::from_secs(30), || async {
            events_so_far().await > before
        })
        .await;
    }
    assert!(movers.iter().any(|mover| !mover.is_finished()), "money still moving after the last audit");
    stop.store(true, Ordering::Relaxed);
    for mover in movers {
        mover.await.unwrap();
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_written_under_postgres_alone_through_a_redis_outage_with_no_gap() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Arc::new(Fleet::start(&env, 2, &[]).await);
    open_wallets(&*fleet, &WALLETS, 300).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (refused, caused) = (Arc::new(AtomicUsize::new(0)), Arc::new(std::sync::Mutex::new(BTreeMap::new())));
    let movers: Vec<_> = (0..4)
        .map(|n| {
            let (fleet, stop, refused, caused) =
                (fleet.clone(), stop.clone(), refused.clone(), caused.clone());
            tokio::spawn(async move {
                for (kind, times) in move_money(&fleet, n, stop, refused).await {
                    *caused.lock().unwrap().entry(kind).or_default() += times;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    env.own_redis().kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.own_redis().start_again();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for mover in movers {
        mover.await.unwrap();
    }
    let (on_leases, alone) = fleet_by_path(&fleet).await;
    assert!(
        on_leases > 0.0 && alone > 0.0,
        "money moved on leases ({on_leases}) and under Postgres alone ({alone})"
    );
    let everything = read_all(&fleet, "").await;
    numbered_in_order(&everything);
    let mut by_type: BTreeMap<&str, i64> = BTreeMap::new();
    for event in &everything {
        *by_type.entry(event["type"].as_str().unwrap()).or_default() += 1;
    }
    by_type.remove("wallet.opened");
    by_type.remove("hold.expired");
    assert_eq!(by_type, *caused.lock().unwrap(), "an event for each movement made, under Postgres alone too");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_shows_a_caller_its_own_wallets_answers_a_waiting_reader_at_once_and_refuses_bad_asks() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["mine"], 100).await;
    let other = api_client_with(OTHER_TOKEN);
    let response =
        other.post(fleet.url("/wallets")).json(&json!({ "id": "theirs", "balance": 5 })).send().await;
    assert_eq!(response.unwrap().status(), 201);

    // Each caller sees the events of its own wallets, and another's wallet does not exist to it.
    // (A moment's wait: on a database shared with others, a transaction of theirs may hold the
    // feed back for a while.)
    let (mine, next) = page(&fleet.client, &fleet, "wait=20").await;
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(
        (mine[0]["type"].as_str(), mine[0]["wallet_id"].as_str()),
        (Some("wallet.opened"), Some("mine"))
    );
    assert_eq!(mine[0]["entry"]["amount"], 100);
    let (theirs, _) = page(&other, &fleet, "wait=20").await;
    assert_eq!(theirs.iter().map(|e| e["wallet_id"].as_str().unwrap()).collect::<Vec<_>>(), ["theirs"]);
    let hidden = fleet.client.get(fleet.url("/events?wallet_id=theirs")).send().await.unwrap();
    assert_eq!(hidden.status(), 404);

    // A reader waiting past the last event is answered with the next one as soon as it is written.
    let after = next.as_str().unwrap().to_owned();
    let waiting = {
        let (client, url) = (fleet.client.clone(), fleet.url(&format!("/events?wait=25&after={after}")));
        tokio::spawn(async move { client.get(url).send().await.unwrap().json::<Value>().await.unwrap() })
    };
    let (status, paid) = post(&fleet, "/wallets/mine/pay", json!({ "amount": 30, "reference": "r-1" })).await;
    assert_eq!(status, 200, "{paid}");
    let answered = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("a waiting reader is answered once an event is written, well before its wait is over")
        .unwrap();
    let events = answered["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{answered}");
    assert_eq!(events[0]["type"], "payment.accepted");
    assert_eq!(events[0]["entry"]["id"], paid["id"]);
    assert_eq!(events[0]["sequence"], 2);
    assert_eq!(answered["next"], events[0]["cursor"]);
    // With nothing new, the page is empty and `next` stays where it was.
    let cursor = answered["next"].as_str().unwrap();
    let (none, same) = page(&fleet.client, &fleet, &format!("after={cursor}")).await;
    assert!(none.is_empty());
    assert_eq!(same, answered["next"]);
    // Filters: by type, and by wallet.
    let (payments, _) =
        page(&fleet.client, &fleet, "type=payment.accepted,refund.accepted&wallet_id=mine").await;
    assert_eq!(payments.len(), 1, "{payments:?}");

    for (query, code) in [
        ("after=12-x-mine", "invalid_cursor"),
        ("after=1-0-mine", "invalid_cursor"),
        ("limit=0", "invalid_limit"),
        ("limit=501", "invalid_limit"),
        ("type=payment.refused", "invalid_event_type"),
        ("type=payment.accepted,", "invalid_event_type"),
        ("wallet_id=not%20a%20wallet", "invalid_wallet_id"),
        ("wait=31", "invalid_wait"),
        ("wait=-1", "invalid_query"),
        ("since=1", "invalid_query"),
    ] {
        let response = fleet.client.get(fleet.url(&format!("/events?{query}"))).send().await.unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!((status.as_u16(), body["code"].as_str()), (400, Some(code)), "{query}: {body}");
    }
    let anonymous = reqwest::Client::new().get(fleet.url("/events")).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_an_entry_without_its_event_and_a_gap_in_a_wallets_events() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;
    app.open_wallet("gap", 100).await;
    app.open_wallet("quiet", 100).await;
    app.open_wallet("crossed", 100).await;
    for wallet in ["gap", "crossed"] {
        assert_eq!(
            app.post_json(&format!("/wallets/{wallet}/pay"), json!({ "amount": 10 })).await.status(),
            200
        );
    }
    let (ok, report) = audit(&app._schema.url);
    assert!(ok, "{report}");

    // Behind the service's back (as the schema's owner): a number taken with no event, and a
    // deposit written with no event, its wallet's own books otherwise straight.
    sqlx::query("update wallet set event_seq = event_seq + 1 where id = 'gap'")
        .execute(&app.db)
        .await
        .unwrap();
    sqlx::query(
        "with moved as (
             update wallet set balance = balance + 5, version = version + 1 where id = 'quiet'
             returning id, balance, version, fence)
         insert into ledger_entry (id, wallet_id, seq, kind, amount, balance_after, fence, created_at)
         select gen_random_uuid(), id, version, 'deposit', 5, balance, fence, clock_timestamp() from moved",
    )
    .execute(&app.db)
    .await
    .unwrap();
    // And a balance event its entry did not cross: the payment took `crossed` from 100 to 90.
    let (position,): (String,) = sqlx::query_as(
        "select position::text from event where wallet_id = 'crossed' order by seq desc limit 1",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    sqlx::query("update wallet set event_seq = 3 where id = 'crossed'").execute(&app.db).await.unwrap();
    sqlx::query(
        "insert into event (wallet_id, seq, position, type, entry_id, monitor, created_at)
         select 'crossed', 3, $1::xid8, 'wallet.balance_below', id, 50, clock_timestamp()
         from ledger_entry where wallet_id = 'crossed' and seq = 2",
    )
    .bind(position)
    .execute(&app.db)
    .await
    .unwrap();
    let (ok, report) = audit(&app._schema.url);
    assert!(!ok, "{report}");
    for problem in [
        "wallet gap: event_seq 3 but 2 events numbered up to 2",
        "wallet quiet entry 2: 0 events name it",
        "wallet crossed event 3: wallet.balance_below of 50, which its entry did not cross",
    ] {
        assert!(report.contains(problem), "the audit reports `{problem}`:\n{report}");
    }
    assert!(report.contains("audit FAILED: 3 problems"), "and nothing else:\n{report}");
}

/// The events of `wallet` in the feed once `done` says they are all there (a transaction of
/// another test on a shared database may hold the feed back for a moment).
async fn events_of(fleet: &Fleet, wallet: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let events = read_all(fleet, &format!("&wallet_id={wallet}")).await;
        if done(&events) {
            return events;
        }
        assert!(std::time::Instant::now() < deadline, "the feed of {wallet} stays at {events:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `events` after the first `skip`, as (type, monitor) — the monitor as `below 50` or
/// `above 150` — with each balance event's entry the same as the event's before it.
fn balance_story(events: &[Value], skip: usize) -> Vec<(String, String)> {
    let mut story = Vec::new();
    for (n, event) in events.iter().enumerate().skip(skip) {
        let monitor = match event["monitor"].as_object().and_then(|m| m.iter().next()) {
            Some((side, amount)) => {
                assert_eq!(event["entry"]["id"], events[n - 1]["entry"]["id"], "its movement's: {event}");
                format!("{side} {amount}")
            }
            None => String::new(),
        };
        story.push((event["type"].as_str().unwrap().to_owned(), monitor));
    }
    story
}

fn story(events: &[(&str, &str)]) -> Vec<(String, String)> {
    events.iter().map(|(kind, monitor)| (kind.to_string(), monitor.to_string())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_monitor_fires_once_per_crossing_in_the_commit_of_the_movement_that_crossed_it() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["watched", "payee"], 100).await;
    for (monitor, set) in [
        (json!({ "below": 50 }), json!([{ "below": 50 }])),
        (json!({ "above": 150 }), json!([{ "below": 50 }, { "above": 150 }])),
    ] {
        let (status, body) = post(&fleet, "/wallets/watched/monitors", monitor).await;
        assert_eq!((status, &body["monitors"]), (201, &set), "{body}");
    }
    let watched: Value =
        fleet.client.get(fleet.url("/wallets/watched")).send().await.unwrap().json().await.unwrap();
    assert_eq!(watched["monitors"], json!([{ "below": 50 }, { "above": 150 }]));

    // Across every kind of movement: a payment, a deposit, a transfer and a split.
    for (path, body) in [
        ("/wallets/watched/pay", json!({ "amount": 60 })), // 100 → 40: below 50
        ("/wallets/watched/pay", json!({ "amount": 10 })), // 40 → 30: still below
        ("/wallets/watched/deposit", json!({ "amount": 200 })), // 30 → 230: above 150
        ("/transfers", json!({ "from": "watched", "to": "payee", "amount": 190 })), // 40: below 50
        (
            "/movements",
            json!({ "legs": [{ "wallet_id": "payee", "amount": -10 },
                                        { "wallet_id": "watched", "amount": 10 }] }),
        ), // 50: neither
    ] {
        let (status, moved) = post(&fleet, path, body).await;
        assert!(status == 200 || status == 201, "{path}: {moved}");
    }
    let events = events_of(&fleet, "watched", |events| events.len() >= 9).await;
    assert_eq!(
        balance_story(&events, 1),
        story(&[
            ("payment.accepted", ""),
            ("wallet.balance_below", "below 50"),
            ("payment.accepted", ""),
            ("deposit.accepted", ""),
            ("wallet.balance_above", "above 150"),
            ("transfer.accepted", ""),
            ("wallet.balance_below", "below 50"),
            ("movement.accepted", ""),
        ])
    );

    // Removed, it fires no more; the other still does.
    let delete = fleet.client.delete(fleet.url("/wallets/watched/monitors/below/50")).send().await.unwrap();
    assert_eq!(delete.status(), 200);
    assert_eq!(delete.json::<Value>().await.unwrap()["monitors"], json!([{ "above": 150 }]));
    assert_eq!(post(&fleet, "/wallets/watched/pay", json!({ "amount": 20 })).await.0, 200); // 30
    assert_eq!(post(&fleet, "/wallets/watched/deposit", json!({ "amount": 121 })).await.0, 200); // 151
    let events = events_of(&fleet, "watched", |events| events.len() >= 12).await;
    assert_eq!(
        balance_story(&events, 9),
        story(&[("payment.accepted", ""), ("deposit.accepted", ""), ("wallet.balance_above", "above 150")])
    );

    // Set with a key, it is set once, and the retry is answered as the first was.
    let set = || {
        fleet
            .client
            .post(fleet.url("/wallets/watched/monitors"))
            .header("idempotency-key", "monitor-1")
            .json(&json!({ "below": 10 }))
            .send()
    };
    let (first, again) = (set().await.unwrap(), set().await.unwrap());
    assert_eq!((first.status().as_u16(), again.status().as_u16()), (201, 201));
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(first.json::<Value>().await.unwrap(), again.json::<Value>().await.unwrap());

    // Every bad ask is a 4xx that changes nothing.
    let before = read_all(&fleet, "&wallet_id=watched").await.len();
    for n in 0..6 {
        assert_eq!(post(&fleet, "/wallets/watched/monitors", json!({ "above": 1000 + n })).await.0, 201);
    }
    let full: Value =
        fleet.client.get(fleet.url("/wallets/watched")).send().await.unwrap().json().await.unwrap();
    assert_eq!(full["monitors"].as_array().unwrap().len(), 8);
    let other = api_client_with(OTHER_TOKEN);
    for (client, method, path, body, status, code) in [
        (&fleet.client, "POST", "/wallets/watched/monitors", json!({ "below": 5 }), 422, "too_many_monitors"),
        (
            &fleet.client,
            "POST",
            "/wallets/watched/monitors",
            json!({ "below": 1, "above": 2 }),
            400,
            "invalid_monitor",
        ),
        (&fleet.client, "POST", "/wallets/watched/monitors", json!({}), 400, "invalid_monitor"),
        (
            &fleet.client,
            "POST",
            "/wallets/watched/monitors",
            json!({ "below": 1_000_000_000_001_i64 }),
            400,
            "invalid_monitor",
        ),
        (&fleet.client, "POST", "/wallets/watched/monitors", json!({ "below": "5" }), 400, "invalid_body"),
        (&fleet.client, "POST", "/wallets/watched/monitors", json!({ "under": 5 }), 400, "invalid_body"),
        (&fleet.client, "POST", "/wallets/nobody/monitors", json!({ "below": 5 }), 404, "wallet_not_found"),
        (&other, "POST", "/wallets/watched/monitors", json!({ "below": 5 }), 404, "wallet_not_found"),
        (
            &fleet.client,
            "DELETE",
            "/wallets/watched/monitors/below/999",
            Value::Null,
            404,
            "monitor_not_found",
        ),
        (
            &fleet.client,
            "DELETE",
            "/wallets/watched/monitors/sideways/5",
            Value::Null,
            400,
            "invalid_monitor",
        ),
        (
            &fleet.client,
            "DELETE",
            "/wallets/watched/monitors/below/five",
            Value::Null,
            400,
            "invalid_monitor",
        ),
        (&other, "DELETE", "/wallets/watched/monitors/above/150", Value::Null, 404, "wallet_not_found"),
    ] {
        let request = match method {
            "POST" => client.post(fleet.url(path)).json(&body),
            _ => client.delete(fleet.url(path)),
        };
        let response = request.send().await.unwrap();
        let answered = response.status().as_u16();
        let problem: Value = response.json().await.unwrap();
        assert_eq!(
            (answered, problem["code"].as_str()),
            (status, Some(code)),
            "{method} {path} {body}: {problem}"
        );
    }
    let after: Value =
        fleet.client.get(fleet.url("/wallets/watched")).send().await.unwrap().json().await.unwrap();
    assert_eq!(after["monitors"], full["monitors"], "nothing changed");
    assert_eq!(read_all(&fleet, "&wallet_id=watched").await.len(), before);
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monitor_set_on_leases_fires_under_postgres_alone_through_a_redis_outage_and_after_it() {
    let mut env = TestEnv::with_own_redis();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["kept"], 100).await;
    assert_eq!(post(&fleet, "/wallets/kept/monitors", json!({ "below": 50 })).await.0, 201);
    // On leases, decided from the lease's note: the monitor is in it.
    assert_eq!(post(&fleet, "/wallets/kept/pay", json!({ "amount": 1 })).await.0, 200); // 99
    assert_eq!(post(&fleet, "/wallets/kept/pay", json!({ "amount": 60 })).await.0, 200); // 39
    assert_eq!(post(&fleet, "/wallets/kept/deposit", json!({ "amount": 61 })).await.0, 200); // 100
    // Under Postgres alone, decided from the row.
    env.own_redis().kill();
    let (on_leases, _) = fleet_by_path(&fleet).await;
    assert_eq!(post(&fleet, "/wallets/kept/pay", json!({ "amount": 60 })).await.0, 200); // 40
    assert_eq!(post(&fleet, "/wallets/kept/monitors", json!({ "above": 90 })).await.0, 201);
    assert_eq!(post(&fleet, "/wallets/kept/deposit", json!({ "amount": 60 })).await.0, 200); // 100
    let (_, alone) = fleet_by_path(&fleet).await;
    assert!(
        alone > 0.0 && on_leases > 0.0,
        "moved on leases ({on_leases}) and under Postgres alone ({alone})"
    );
    // Back on leases (an empty Redis: no note), decided from the row again.
    env.own_redis().start_again();
    eventually("payments are back on leases", Duration::from_secs(30), || async {
        let before = fleet_by_path(&fleet).await.0;
        assert_eq!(post(&fleet, "/wallets/kept/deposit", json!({ "amount": 1 })).await.0, 200);
        fleet_by_path(&fleet).await.0 > before
    })
    .await;
    let kept: Value =
        fleet.client.get(fleet.url("/wallets/kept")).send().await.unwrap().json().await.unwrap();
    let to_forty = kept["balance"].as_i64().unwrap() - 40;
    let paid = post(&fleet, "/wallets/kept/pay", json!({ "amount": to_forty })).await;
    assert_eq!(paid.0, 200, "{}", paid.1);
    let last = paid.1["id"].clone();
    let events = events_of(&fleet, "kept", |events| events.iter().any(|e| e["entry"]["id"] == last)).await;
    let story = balance_story(&events, 1);
    let balance_events: Vec<&str> = story
        .iter()
        .filter(|(kind, _)| kind.starts_with("wallet.balance"))
        .map(|(_, m)| m.as_str())
        .collect();
    assert_eq!(balance_events, ["below 50", "below 50", "above 90", "below 50"], "{story:?}");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}
