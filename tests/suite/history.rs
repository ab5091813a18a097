//! A wallet's history (docs/api/history.md): its balance as of any instant, statements that chain,
//! entries filtered and paged either way while new ones arrive, exports that stream and resume,
//! and the audit that proves the chain they all read.

use crate::support::fleet::{Fleet, audit};
use crate::support::load::open_wallets;
use crate::support::{OTHER_TOKEN, TestEnv, api_client_with};
use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use futures::StreamExt;
use rand::Rng;
use serde_json::{Value, json};
use std::collections::BTreeMap;

fn instant(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn time_of(entry: &Value) -> DateTime<Utc> {
    entry["created_at"].as_str().unwrap().parse().unwrap()
}

/// `count` movements on `wallet`, sent `concurrency` at a time round the fleet's replicas
/// directly (so its entries are written by every replica): payments of 1 to 9, each with a
/// reference `ref-<n % 4>`, and a deposit every fifth.
async fn move_money(fleet: &Fleet, wallet: &str, count: usize, concurrency: usize) {
    futures::stream::iter(0..count)
        .for_each_concurrent(concurrency, |n| async move {
            let replica = &fleet.replicas[n % fleet.replicas.len()];
            let (route, amount) = if n % 5 == 0 { ("deposit", 7) } else { ("pay", 1 + (n % 9) as i64) };
            let body = if route == "pay" {
                json!({ "amount": amount, "reference": format!("ref-{}", n % 4) })
            } else {
                json!({ "amount": amount })
            };
            let response = fleet
                .client
                .post(replica.url(&format!("/wallets/{wallet}/{route}")))
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .json(&body)
                .send()
                .await
                .unwrap();
            assert!(response.status().is_success(), "{route} {n}: {}", response.status());
        })
        .await;
}

/// Every entry of `wallet`, oldest first, by pages of `limit` through `/entries` with `query`.
async fn all_entries(fleet: &Fleet, wallet: &str, query: &str, limit: usize) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/wallets/{wallet}/entries?limit={limit}{query}");
        if let Some(cursor) = &cursor {
            path.push_str(&format!("&cursor={cursor}"));
        }
        let page = fleet.read(&path).await;
        entries
            .extend(page["entries"].as_array().unwrap_or_else(|| panic!("{path}: {page}")).iter().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return entries,
        }
    }
}

fn versions(entries: &[Value]) -> Vec<i64> {
    entries.iter().map(|entry| entry["version"].as_i64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_balance_as_of_any_instant_is_that_of_the_last_entry_written_by_then() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["asof"], 1_000).await;
    move_money(&fleet, "asof", 60, 6).await;
    let entries = all_entries(&fleet, "asof", "", 500).await;
    assert_eq!(versions(&entries), (1..=61).collect::<Vec<_>>());

    // Entries written in one round share its instant: as of it, the wallet is as the last of them
    // left it, and stays so until the next instant.
    let mut by_time: BTreeMap<DateTime<Utc>, &Value> = BTreeMap::new();
    for entry in &entries {
        by_time.insert(time_of(entry), entry);
    }
    let times: Vec<DateTime<Utc>> = by_time.keys().copied().collect();
    for (n, at) in times.iter().enumerate() {
        let last = by_time[at];
        let next = times.get(n + 1).copied().unwrap_or_else(|| *at + TimeDelta::milliseconds(1));
        let between = *at + (next - *at) / 2;
        for probe in [*at, between, next - TimeDelta::microseconds(1)] {
            let then = fleet.read(&format!("/wallets/asof/balance?at={}", instant(probe))).await;
            assert_eq!(
                (then["balance"].as_i64(), then["version"].as_i64(), then["entry"]["id"].as_str()),
                (last["balance"].as_i64(), last["version"].as_i64(), last["id"].as_str()),
                "as of {probe}: {then}"
            );
            assert_eq!(
                (then["held"].as_i64(), then["available"].as_i64()),
                (Some(0), last["balance"].as_i64())
            );
        }
    }

    let before_open = instant(times[0] - TimeDelta::microseconds(1));
    let response =
        fleet.client.get(fleet.url(&format!("/wallets/asof/balance?at={before_open}"))).send().await.unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(response.json::<Value>().await.unwrap()["code"], "wallet_not_yet_open");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_balance_as_of_an_instant_counts_the_holds_held_then() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    open_wallets(&fleet, &["held"], 1_000).await;
    let place = |amount: i64| {
        let client = fleet.client.clone();
        let url = fleet.url("/wallets/held/holds");
        async move {
            let response =
                client.post(url).json(&json!({ "amount": amount, "expires_in": 600 })).send().await.unwrap();
            assert_eq!(response.status(), 201);
            response.json::<Value>().await.unwrap()
        }
    };
    let first = place(100).await;
    let second = place(30).await;
    let both_held = Utc::now();
    let voided = fleet
        .client
        .post(fleet.url(&format!("/holds/{}/void", second["id"].as_str().unwrap())))
        .send()
        .await
        .unwrap();
    assert_eq!(voided.status(), 200);
    let one_held = Utc::now();
    let captured = fleet
        .client
        .post(fleet.url(&format!("/holds/{}/capture", first["id"].as_str().unwrap())))
        .json(&json!({ "amount": 60 }))
        .send()
        .await
        .unwrap();
    assert_eq!(captured.status(), 200);
    let none_held = Utc::now();
    let fleet = &fleet;
    let as_of = |at: DateTime<Utc>| {
        let path = format!("/wallets/held/balance?at={}", instant(at));
        async move { fleet.read(&path).await }
    };
    let [a, b, c] = [as_of(both_held).await, as_of(one_held).await, as_of(none_held).await];
    let seen = |then: &Value| (then["balance"].as_i64(), then["held"].as_i64(), then["available"].as_i64());
    assert_eq!(seen(&a), (Some(1_000), Some(130), Some(870)), "{a}");
    assert_eq!(seen(&b), (Some(1_000), Some(100), Some(900)), "{b}");
    assert_eq!(seen(&c), (Some(940), Some(0), Some(940)), "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statements_over_any_split_of_a_period_chain_exactly_and_add_up_to_their_entries() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["stmt"], 1_000).await;
    let start = Utc::now() - TimeDelta::seconds(1);
    move_money(&fleet, "stmt", 40, 4).await;
    let end = Utc::now();
    let entries = all_entries(&fleet, "stmt", "", 500).await;

    // The period cut at random instants, some of them exactly an entry's.
    let mut rng = rand::rng();
    for _ in 0..5 {
        let mut cuts: Vec<DateTime<Utc>> = (0..6)
            .map(|_| {
                if rng.random_bool(0.5) {
                    time_of(&entries[rng.random_range(0..entries.len())])
                } else {
                    start + (end - start) * rng.random_range(1..1000) / 1000
                }
            })
            .collect();
        cuts.extend([start, end]);
        cuts.sort();
        cuts.dedup();
        let mut previous: Option<Value> = None;
        let mut counted = 0;
        for window in cuts.windows(2) {
            let path =
                format!("/wallets/stmt/statement?from={}&to={}", instant(window[0]), instant(window[1]));
            let statement = fleet.read(&path).await;
            if let Some(previous) = &previous {
                assert_eq!(
                    (&previous["closing_balance"], &previous["closing_version"]),
                    (&statement["opening_balance"], &statement["opening_version"]),
                    "{path}"
                );
            }
            let net: i64 = statement["totals"]
                .as_array()
                .unwrap()
                .iter()
                .map(|total| {
                    let amount = total["amount"].as_i64().unwrap();
                    if total["kind"] == "pay" || total["kind"] == "transfer_out" { -amount } else { amount }
                })
                .sum();
            let count: i64 =
                statement["totals"].as_array().unwrap().iter().map(|t| t["count"].as_i64().unwrap()).sum();
            assert_eq!(
                statement["closing_balance"].as_i64().unwrap(),
                statement["opening_balance"].as_i64().unwrap() + net,
                "{path}: {statement}"
            );
            assert_eq!(count, statement["entries"].as_i64().unwrap(), "{statement}");
            counted += count;
            previous = Some(statement);
        }
        assert_eq!(counted, entries.len() as i64, "the pieces hold every entry once");
        let last = previous.unwrap();
        assert_eq!(last["closing_balance"], entries.last().unwrap()["balance"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_of_past_hours_sum_the_same_from_their_rollups_as_entry_by_entry() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    // Three days of a wallet's history, ending an hour ago (so its hours are final and a
    // statement rolls them up), written straight into the ledger as a long-lived wallet's would
    // be: deposits of 3 and payments of 1, at uneven instants.
    // More entries than a statement rolls up in one transaction, so they roll up over several.
    let entries = 25_000_i64;
    let end = Utc::now() - TimeDelta::hours(1);
    let start = end - TimeDelta::days(3);
    let mut rng = rand::rng();
    let mut offsets: Vec<i64> =
        (0..entries).map(|_| rng.random_range(0..TimeDelta::days(3).num_microseconds().unwrap())).collect();
    offsets.sort_unstable();
    let seeded: Vec<(DateTime<Utc>, &str, i64)> = offsets
        .iter()
        .enumerate()
        .map(|(n, offset)| {
            let (kind, amount) = match n {
                0 => ("open", 100),
                n if n % 3 == 0 => ("pay", 1),
                _ => ("deposit", 3),
            };
            (start + TimeDelta::microseconds(*offset), kind, amount)
        })
        .collect();
    let signed = |kind: &str, amount: i64| if kind == "pay" { -amount } else { amount };
    let balance: i64 = seeded.iter().map(|(_, kind, amount)| signed(kind, *amount)).sum();
    let mut tx = fleet.db.begin().await.unwrap();
    sqlx::query(
        "insert into wallet (id, balance, held, version, fence, owner, created_at, updated_at)
         values ('long', $1, 0, $2, 1, 'tester', $3, $4)",
    )
    .bind(balance)
    .bind(entries)
    .bind(start)
    .bind(end)
    .execute(&mut *tx)
    .await
    .unwrap();
    let after: Vec<i64> = seeded
        .iter()
        .scan(0, |balance, (_, kind, amount)| {
            *balance += signed(kind, *amount);
            Some(*balance)
        })
        .collect();
    sqlx::query(
        "insert into ledger_entry (id, wallet_id, seq, kind, amount, balance_after, fence, created_at)
         select gen_random_uuid(), 'long', n, kind, amount, balance_after, least(n - 1, 1), at
         from unnest($1::text[], $2::int8[], $3::int8[], $4::timestamptz[]) with ordinality
              as e(kind, amount, balance_after, at, n)",
    )
    .bind(seeded.iter().map(|(_, kind, _)| *kind).collect::<Vec<_>>())
    .bind(seeded.iter().map(|(_, _, amount)| *amount).collect::<Vec<_>>())
    .bind(&after)
    .bind(seeded.iter().map(|(at, _, _)| *at).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "the seeded wallet is a sound one: {report}");

    // Periods with ragged ends and whole hours between, each asked twice: first it rolls up the
    // hours it needs, then it reads them.
    let span = (end - start).num_microseconds().unwrap() + TimeDelta::hours(2).num_microseconds().unwrap();
    for _ in 0..12 {
        let mut cut =
            [0, 0].map(|_| start - TimeDelta::hours(1) + TimeDelta::microseconds(rng.random_range(0..span)));
        cut.sort();
        let (from, to) = (cut[0], cut[1].max(cut[0] + TimeDelta::microseconds(1)));
        let mut expected: BTreeMap<&str, (i64, i64)> = BTreeMap::new();
        for (at, kind, amount) in &seeded {
            if *at >= from && *at < to {
                let total = expected.entry(kind).or_default();
                *total = (total.0 + 1, total.1 + amount);
            }
        }
        for asked in ["first", "again"] {
            let path = format!("/wallets/long/statement?from={}&to={}", instant(from), instant(to));
            let statement = fleet.read(&path).await;
            let totals: BTreeMap<&str, (i64, i64)> = statement["totals"]
                .as_array()
                .unwrap_or_else(|| panic!("{path}: {statement}"))
                .iter()
                .map(|t| {
                    (
                        t["kind"].as_str().unwrap(),
                        (t["count"].as_i64().unwrap(), t["amount"].as_i64().unwrap()),
                    )
                })
                .collect();
            assert_eq!(totals, expected, "{asked}: {path}");
            let count: i64 = expected.values().map(|(count, _)| count).sum();
            assert_eq!(statement["entries"].as_i64(), Some(count), "{asked}: {path}");
        }
    }
    let rolled: i64 = sqlx::query_scalar("select count(*) from entry_rollup where wallet_id = 'long'")
        .fetch_one(&fleet.db)
        .await
        .unwrap();
    assert!(rolled > 0, "the statements rolled hours up");
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "the rollups are what the entries make: {report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pages_either_way_skip_and_repeat_nothing_while_entries_arrive_and_filters_select_exactly() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 3, &[]).await;
    open_wallets(&fleet, &["pages"], 1_000_000).await;
    move_money(&fleet, "pages", 30, 3).await;

    // Paged newest first while 90 more are written: from the entry newest when the paging began,
    // down to the first.
    let writes = move_money(&fleet, "pages", 90, 3);
    let pages = async {
        let mut desc = Vec::new();
        let mut page = fleet.read("/wallets/pages/entries?order=desc&limit=1").await;
        // Newest first from the entry newest when the paging began.
        let top = page["entries"][0]["version"].as_i64().unwrap();
        loop {
            desc.extend(page["entries"].as_array().unwrap().iter().cloned());
            let Some(cursor) = page["next_cursor"].as_str() else { break };
            page = fleet.read(&format!("/wallets/pages/entries?order=desc&limit=7&cursor={cursor}")).await;
        }
        (top, desc)
    };
    let ((), (top, desc)) = tokio::join!(writes, pages);
    assert_eq!(versions(&desc), (1..=top).rev().collect::<Vec<_>>());
    let asc = all_entries(&fleet, "pages", "", 7).await;
    assert_eq!(versions(&asc), (1..=121).collect::<Vec<_>>());

    // Each filter, against the same filter applied to every entry.
    let times: Vec<DateTime<Utc>> = asc.iter().map(time_of).collect();
    let (from, to) = (times[20], times[100]);
    let cases: [(String, Selects); 4] = [
        ("&kind=pay".into(), Box::new(|e: &Value| e["kind"] == "pay")),
        ("&kind=deposit,open".into(), Box::new(|e: &Value| e["kind"] == "deposit" || e["kind"] == "open")),
        ("&reference=ref-3".into(), Box::new(|e: &Value| e["reference"] == "ref-3")),
        (
            format!("&from={}&to={}&kind=pay&reference=ref-1", instant(from), instant(to)),
            Box::new(move |e: &Value| {
                let at = time_of(e);
                at >= from && at < to && e["kind"] == "pay" && e["reference"] == "ref-1"
            }),
        ),
    ];
    for (query, selects) in &cases {
        let expected: Vec<i64> = versions(&asc.iter().filter(|e| selects(e)).cloned().collect::<Vec<_>>());
        assert!(!expected.is_empty(), "{query} selects something");
        assert_eq!(versions(&all_entries(&fleet, "pages", query, 4).await), expected, "{query}");
        let newest_first = all_entries(&fleet, "pages", &format!("{query}&order=desc"), 5).await;
        assert_eq!(
            versions(&newest_first),
            expected.iter().rev().copied().collect::<Vec<_>>(),
            "{query} desc"
        );
    }

    // `/transactions` is the newest-first page it always was.
    let legacy = fleet.read("/wallets/pages/transactions?limit=3").await;
    assert_eq!(versions(legacy["transactions"].as_array().unwrap()), [121, 120, 119]);
    assert_eq!(legacy["next_cursor"], "119");
}

/// Which entries a filter should select, as the test applies it to every entry.
type Selects = Box<dyn Fn(&Value) -> bool>;

/// Lines of an export of `wallet`'s entries as `accept`, from `cursor`; after `stop_after` lines
/// the connection is dropped (the client gave up part way), else read to the end.
async fn export(
    fleet: &Fleet,
    wallet: &str,
    accept: &str,
    cursor: Option<&str>,
    stop_after: Option<usize>,
) -> Vec<String> {
    let mut url = fleet.url(&format!("/wallets/{wallet}/entries"));
    if let Some(cursor) = cursor {
        url.push_str(&format!("?cursor={cursor}"));
    }
    let response = fleet.client.get(url).header("accept", accept).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with(accept));
    let mut response = response;
    let mut text = String::new();
    let mut lines = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = text.find('\n') {
            lines.push(text[..end].to_owned());
            text.drain(..=end);
            if stop_after.is_some_and(|stop| lines.len() >= stop) {
                return lines;
            }
        }
    }
    assert!(text.is_empty(), "the export ends with a whole line");
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_export_cut_short_and_resumed_from_its_last_cursor_yields_every_entry_once() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 2, &[]).await;
    open_wallets(&fleet, &["export"], 1_000_000).await;
    // More entries than an export reads at a time, so it streams several reads.
    move_money(&fleet, "export", 2_400, 16).await;
    let entries = all_entries(&fleet, "export", "", 500).await;
    assert_eq!(entries.len(), 2_401);

    let cut = export(&fleet, "export", "application/x-ndjson", None, Some(1_500)).await;
    let last: Value = serde_json::from_str(cut.last().unwrap()).unwrap();
    let rest = export(&fleet, "export", "application/x-ndjson", last["cursor"].as_str(), None).await;
    let exported: Vec<Value> =
        cut.iter().chain(&rest).map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(versions(&exported), versions(&entries), "every entry once, in order");
    for (exported, read) in exported.iter().zip(&entries) {
        let mut exported = exported.clone();
        exported.as_object_mut().unwrap().remove("cursor");
        assert_eq!(&exported, read);
    }

    // `walletlock export`, an operator's, writes the same lines, and resumes from a cursor too.
    let command = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_walletlock"))
            .args(["export", "--wallet", "export"])
            .args(args)
            .env("DATABASE_URL", &fleet.database_url)
            .output()
            .expect("walletlock export");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect::<Vec<_>>()
    };
    let whole: Vec<String> = cut.iter().chain(&rest).cloned().collect();
    assert_eq!(command(&["--format", "ndjson"]), whole);
    let resumed = command(&["--format", "ndjson", "--cursor", last["cursor"].as_str().unwrap()]);
    assert_eq!(resumed, rest);

    let csv = export(&fleet, "export", "text/csv", None, None).await;
    assert_eq!(command(&[]), csv, "CSV by default");
    assert_eq!(
        csv[0],
        "id,wallet_id,version,kind,amount,balance,fence,reference,metadata,transfer_id,refund_of,hold_id,created_at,\
         cursor"
    );
    assert_eq!(csv.len(), 1 + entries.len());
    for (line, entry) in csv[1..].iter().zip(&entries) {
        let fields: Vec<&str> = line.split(',').collect();
        assert_eq!(fields[0], entry["id"].as_str().unwrap());
        assert_eq!(fields[2].parse::<i64>().unwrap(), entry["version"].as_i64().unwrap());
        assert_eq!(fields[5].parse::<i64>().unwrap(), entry["balance"].as_i64().unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_history_requests_are_clear_problems_and_another_callers_wallet_does_not_exist() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    open_wallets(&fleet, &["mine"], 100).await;
    let tomorrow = instant(Utc::now() + TimeDelta::days(1));
    let (early, late) =
        (instant(Utc::now() - TimeDelta::hours(2)), instant(Utc::now() - TimeDelta::hours(1)));
    let cases = [
        ("/wallets/mine/balance?at=yesterday", 400, "invalid_time"),
        ("/wallets/mine/balance?at=2026-12-01", 400, "invalid_time"),
        (&format!("/wallets/mine/balance?at={tomorrow}") as &str, 400, "invalid_time"),
        ("/wallets/mine/balance", 400, "invalid_query"),
        ("/wallets/mine/balance?at=2000-01-01T00:00:00Z", 404, "wallet_not_yet_open"),
        (&format!("/wallets/mine/statement?from={late}&to={early}"), 400, "invalid_time"),
        (&format!("/wallets/mine/statement?from={early}&to={early}"), 400, "invalid_time"),
        (&format!("/wallets/mine/statement?from={early}&to={tomorrow}"), 400, "invalid_time"),
        (&format!("/wallets/mine/statement?from={early}"), 400, "invalid_query"),
        (&format!("/wallets/mine/entries?from={late}&to={early}"), 400, "invalid_time"),
        ("/wallets/mine/entries?kind=payment", 400, "invalid_kind"),
        ("/wallets/mine/entries?kind=pay,", 400, "invalid_kind"),
        ("/wallets/mine/entries?order=newest", 400, "invalid_order"),
        ("/wallets/mine/entries?limit=0", 400, "invalid_limit"),
        ("/wallets/mine/entries?limit=501", 400, "invalid_limit"),
        ("/wallets/mine/entries?cursor=zzz", 400, "invalid_cursor"),
        ("/wallets/mine/entries?cursor=d5", 400, "invalid_cursor"),
        ("/wallets/mine/entries?metadata=1", 400, "invalid_query"),
        ("/wallets/mine/entries?metadata[]=1", 400, "invalid_metadata"),
        ("/wallets/bad%20id/entries", 400, "invalid_wallet_id"),
        ("/wallets/nobody/entries", 404, "wallet_not_found"),
        ("/wallets/nobody/balance?at=2026-01-01T00:00:00Z", 404, "wallet_not_found"),
    ];
    for (path, status, code) in cases {
        let response = fleet.client.get(fleet.url(path)).send().await.unwrap();
        assert_eq!(response.status(), status, "{path}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["code"], code, "{path}: {problem}");
    }
    let stranger = api_client_with(OTHER_TOKEN);
    for read in [
        "entries",
        "balance?at=2026-01-01T00:00:00Z",
        "statement?from=2026-01-01T00:00:00Z&to=2026-01-02T00:00:00Z",
    ] {
        let response = stranger.get(fleet.url(&format!("/wallets/mine/{read}"))).send().await.unwrap();
        assert_eq!(response.status(), 404, "another caller's {read}");
        assert_eq!(response.json::<Value>().await.unwrap()["code"], "wallet_not_found");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_reports_a_tampered_balance_a_gap_a_fence_or_a_time_that_goes_down_and_a_false_rollup() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    let wallets = ["t-balance", "t-gap", "t-fence", "t-time", "t-rollup"];
    open_wallets(&fleet, &wallets, 1_000).await;
    for wallet in wallets {
        move_money(&fleet, wallet, 4, 1).await;
    }
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
    // As an intruder with the owner's role would: past the trigger that keeps the ledger
    // append-only.
    let mut tx = fleet.db.begin().await.unwrap();
    sqlx::query("set local session_replication_role = replica").execute(&mut *tx).await.unwrap();
    for tampering in [
        "update ledger_entry set balance_after = balance_after + 1 where wallet_id = 't-balance' and seq = 3",
        "delete from ledger_entry where wallet_id = 't-gap' and seq = 3",
        "update ledger_entry set fence = 0 where wallet_id = 't-fence' and seq = 4",
        "update ledger_entry set created_at = created_at - interval '1 hour' where wallet_id = 't-time' and seq = 4",
        // A statement's rollup of an hour with no such entries.
        "insert into entry_rollup values ('t-rollup', date_trunc('hour', now()) - interval '2 hours', 'pay', 1, 5)",
        "insert into entry_rollup_until values ('t-rollup', date_trunc('hour', now()) - interval '1 hour')",
    ] {
        sqlx::query(tampering).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    let (ok, report) = audit(&fleet.database_url);
    assert!(!ok, "{report}");
    for (wallet, says) in [
        ("t-balance", "wallet t-balance entry 3: pay of"),
        ("t-gap", "wallet t-gap: version 5 but 4 ledger entries"),
        ("t-fence", "wallet t-fence entry 4: fence 0 below the previous entry's"),
        ("t-time", "wallet t-time entry 4: written at"),
        ("t-rollup", "wallet t-rollup hour "),
    ] {
        assert!(report.contains(says), "{wallet}: {report}");
    }
}
