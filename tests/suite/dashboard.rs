//! The Grafana dashboard (deploy/grafana/walletlock-dashboard.json) against what the replicas
//! export, as `walletlock::telemetry::metrics` declares it: its layout, datasources and variables,
//! and every query: PromQL (promtool), the metrics it names, their kinds and their labels.

use serde_json::{Value, json};
use std::collections::BTreeSet;
use walletlock::telemetry::metrics::{ALL, Kind, PROCESS};

const DASHBOARD: &str = "deploy/grafana/walletlock-dashboard.json";
const DATASOURCES: &str = "deploy/grafana/provisioning/datasources";
/// nginx-prometheus-exporter's metrics for stub_status, and its own `nginx_up`.
const NGINX_EXPORTER: &[&str] = &[
    "nginx_up",
    "nginx_connections_accepted",
    "nginx_connections_active",
    "nginx_connections_handled",
    "nginx_connections_reading",
    "nginx_connections_waiting",
    "nginx_connections_writing",
    "nginx_http_requests_total",
];
/// The labels Prometheus gives every series of a target.
const TARGET_LABELS: &[&str] = &["instance", "job"];

#[test]
fn the_dashboard_queries_only_what_the_replicas_export() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join(DASHBOARD)).unwrap()).unwrap();
    let datasources: String = std::fs::read_dir(root.join(DATASOURCES))
        .unwrap()
        .map(|file| std::fs::read_to_string(file.unwrap().path()).unwrap())
        .collect();
    let provisioned = datasources.lines().filter_map(|line| line.trim().strip_prefix("uid:"));
    let provisioned = provisioned.map(|uid| uid.trim().trim_matches(['"', '\'']).to_owned()).collect();
    let problems = check(&dashboard, &provisioned);
    assert!(problems.is_empty(), "{DASHBOARD}:\n{}", problems.join("\n"));
}

/// Every problem of the dashboard, one a line.
fn check(dashboard: &Value, provisioned: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut need = |ok: bool, problem: String| {
        if !ok {
            problems.push(problem);
        }
    };
    for key in ["title", "uid"] {
        need(dashboard[key].as_str().is_some_and(|s| !s.is_empty()), format!("no {key}"));
    }
    need(dashboard["schemaVersion"].as_u64() >= Some(36), "schemaVersion below 36".into());
    let variables = dashboard["templating"]["list"].as_array().cloned().unwrap_or_default();
    let variable = |name: &str| variables.iter().find(|v| v["name"] == name);
    // A datasource is Prometheus: by a datasource variable of type prometheus, or a provisioned uid.
    let datasource_ok = |ds: &Value| match ds["uid"].as_str() {
        _ if ds.is_null() || ds["type"] == "grafana" => true,
        Some(uid) if ds["type"] == "prometheus" => match uid.strip_prefix('$') {
            Some(name) => variable(name.trim_start_matches('{').trim_end_matches('}'))
                .is_some_and(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
            None => provisioned.contains(uid),
        },
        _ => false,
    };

    let mut panels: Vec<&Value> =
        dashboard["panels"].as_array().map(|p| p.iter().collect()).unwrap_or_default();
    need(!panels.is_empty(), "no panels".into());
    let (mut ids, mut boxes, mut queries) = (BTreeSet::new(), Vec::<(String, [i64; 4])>::new(), Vec::new());
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        need(
            !title.is_empty() && panel["type"].is_string(),
            format!("panel {}: no title or type", panel["id"]),
        );
        need(ids.insert(panel["id"].to_string()), format!("{title}: id {} used twice", panel["id"]));
        let grid = ["x", "y", "w", "h"].map(|k| panel["gridPos"][k].as_i64().unwrap_or(-1));
        let [x, y, w, h] = grid;
        need(
            x >= 0 && y >= 0 && w > 0 && h > 0 && x + w <= 24,
            format!("{title}: gridPos {grid:?} outside the 24 columns"),
        );
        for (other, [ox, oy, ow, oh]) in &boxes {
            need(
                !(x < ox + ow && *ox < x + w && y < oy + oh && *oy < y + h),
                format!("{title} overlaps {other}"),
            );
        }
        boxes.push((title.clone(), grid));
        if panel["type"] == "row" {
            continue;
        }
        need(datasource_ok(&panel["datasource"]), format!("{title}: datasource {}", panel["datasource"]));
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        need(!targets.is_empty(), format!("{title}: no targets"));
        for target in targets {
            let at = format!("{title} {}", target["refId"]);
            need(
                target["refId"].is_string() && datasource_ok(&target["datasource"]),
                format!("{at}: refId or datasource"),
            );
            match target["expr"].as_str() {
                Some(expr) if !expr.trim().is_empty() => queries.push((at, expr.to_owned())),
                _ => need(false, format!("{at}: no expr")),
            }
        }
    }
    for v in variables.iter().filter(|v| v["type"] == "query") {
        let at = format!("variable {}", v["name"]);
        need(datasource_ok(&v["datasource"]), format!("{at}: datasource {}", v["datasource"]));
        let query = v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or_default();
        if let Some((selector, label)) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .and_then(|q| q.rsplit_once(','))
        {
            queries.push((at, format!("{selector}{{{}=~\".*\"}}", label.trim())));
        }
    }

    for (at, expr) in &queries {
        for name in grafana_variables(expr) {
            need(
                name.starts_with("__") || variable(&name).is_some(),
                format!("{at}: ${name} is not a variable"),
            );
        }
        for problem in check_query(&as_promql(expr)) {
            need(false, format!("{at}: {problem}: {expr}"));
        }
    }
    if let Some(problem) = promtool_problems(&queries) {
        need(false, problem);
    }
    problems
}

/// The names of the Grafana variables an expr uses (`$name`, `${name}`, `${name:format}`).
fn grafana_variables(expr: &str) -> Vec<String> {
    expr.split('$')
        .skip(1)
        .map(|rest| {
            rest.trim_start_matches('{').chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        })
        .map(String::from_iter)
        .filter(|name| name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        .collect()
}

/// expr as PromQL: a Grafana variable outside a string stands for a duration (`[$__rate_interval]`).
fn as_promql(expr: &str) -> String {
    let (mut out, mut quote, mut chars) = (String::new(), None, expr.chars().peekable());
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '"' | '\'' | '`') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (None, '$') => {
                let braced = chars.next_if_eq(&'{').is_some();
                while chars
                    .next_if(|c| c.is_ascii_alphanumeric() || *c == '_' || (braced && *c != '}'))
                    .is_some()
                {}
                if braced {
                    chars.next();
                }
                out.push_str("5m");
                continue;
            }
            _ => {}
        }
        out.push(c);
    }
    out
}

/// promtool's verdict on the queries' syntax, as the expressions of recording rules (None: all parse).
fn promtool_problems(queries: &[(String, String)]) -> Option<String> {
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(n, (_, expr))| json!({"record": format!("dashboard:query{n}"), "expr": as_promql(expr)}))
        .collect();
    let file = tempfile::Builder::new().suffix(".yml").tempfile().unwrap();
    std::fs::write(file.path(), json!({"groups": [{"name": "dashboard", "rules": rules}]}).to_string())
        .unwrap();
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(file.path())
        .output()
        .expect("promtool on PATH (deploy/test installs Debian's prometheus)");
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let names = queries.iter().enumerate().map(|(n, (at, _))| format!("query{n}: {at}\n"));
    (!out.status.success()).then(|| format!("promtool check rules:\n{report}{}", names.collect::<String>()))
}

/// A function call or aggregation open in the scan: its name (None for plain parentheses), its
/// `by` labels, and what the selectors inside it gave: their labels, whether one was a _bucket.
#[derive(Default)]
struct Call {
    name: Option<String>,
    by: Vec<String>,
    labels: BTreeSet<String>,
    bucket: bool,
}

/// The words of PromQL that name no metric.
const KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

fn word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// What is wrong with the metrics a query names: each must be exported with the labels its
/// matchers use; rate(), irate() and increase() take counters (or a histogram's series),
/// histogram_quantile() a histogram's _bucket series; `by (label)` groups by a label of the series
/// it aggregates.
fn check_query(expr: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut calls = vec![Call::default()];
    // The name of the call whose `(` comes next, its `by` labels, and the labels of the call a `)`
    // just closed (for `sum(...) by (label)`).
    let (mut pending, mut by, mut closed) = (None::<String>, Vec::new(), None::<BTreeSet<String>>);
    let mut rest = expr;
    while let Some(c) = rest.chars().next() {
        let word: String = rest.chars().take_while(|c| word_char(*c)).collect();
        if word.is_empty() || c.is_ascii_digit() {
            rest = &rest[c.len_utf8().max(word.len())..];
            match c {
                '"' | '\'' | '`' => rest = rest.split_once(c).map_or("", |(_, after)| after),
                '[' => rest = rest.split_once(']').map_or("", |(_, after)| after),
                '{' => problems.push("a selector without a metric name".to_owned()),
                '(' => {
                    calls.push(Call { name: pending.take(), by: std::mem::take(&mut by), ..Call::default() })
                }
                ')' => {
                    let call = calls.pop().unwrap();
                    if call.name.as_deref() == Some("histogram_quantile") && !call.bucket {
                        problems.push("histogram_quantile() over no _bucket series".into());
                    }
                    grouped_by(&call.by, &call.labels, &mut problems);
                    let outer = calls.last_mut().unwrap();
                    outer.labels.extend(call.labels.iter().cloned());
                    outer.bucket |= call.bucket;
                    closed = Some(call.labels);
                    continue;
                }
                _ => {}
            }
            closed = closed.filter(|_| c.is_whitespace());
            continue;
        }
        rest = rest[word.len()..].trim_start();
        let next: String = rest.chars().take_while(|c| word_char(*c)).collect();
        if KEYWORDS.contains(&word.as_str()) {
            if let Some(list) = rest.strip_prefix('(') {
                let (list, after) = list.split_once(')').unwrap_or_default();
                rest = after;
                let labels: Vec<String> = list.split(',').map(|l| l.trim().to_owned()).collect();
                match (word.as_str(), &closed) {
                    ("by", Some(of)) => grouped_by(&labels, of, &mut problems),
                    ("by", None) => by = labels,
                    _ => {}
                }
            }
        } else if rest.starts_with('(') || next == "by" || next == "without" {
            pending = Some(word);
        } else {
            let mut matchers = Vec::new();
            if let Some(mut inner) = rest.strip_prefix('{') {
                loop {
                    inner = inner.trim_start_matches([',', ' ']);
                    if let Some(after) = inner.strip_prefix('}') {
                        rest = after;
                        break;
                    }
                    let Some((label, value)) = inner.split_once(['=', '!']) else { break };
                    matchers.push(label.trim().to_owned());
                    let value = value.trim_start_matches(['=', '~', ' ']);
                    let quote = value.chars().next().unwrap_or('"');
                    inner = value.get(1..).and_then(|v| v.split_once(quote)).map_or("", |(_, after)| after);
                }
            }
            let function = calls.iter().rev().find_map(|call| call.name.clone());
            let call = calls.last_mut().unwrap();
            match series(&word) {
                Ok((kind, labels)) => {
                    let of_histogram = kind == Some(Kind::Histogram);
                    if let Some(f @ ("rate" | "irate" | "increase")) = function.as_deref()
                        && kind == Some(Kind::Gauge)
                    {
                        problems.push(format!("{f}() over {word}, not a counter"));
                    }
                    if function.as_deref() == Some("histogram_quantile") && !word.ends_with("_bucket") {
                        problems.push(format!("histogram_quantile() over {word}, not a _bucket series"));
                    }
                    for label in matchers.iter().filter(|m| kind.is_some() && !labels.contains(*m)) {
                        problems.push(format!("{word} has no label {label} (it has {labels:?})"));
                    }
                    call.bucket |= of_histogram && word.ends_with("_bucket");
                    call.labels.extend(labels);
                }
                Err(problem) => problems.push(problem),
            }
        }
        closed = None;
    }
    problems
}

/// `by (labels)` over series that have `of`.
fn grouped_by(labels: &[String], of: &BTreeSet<String>, problems: &mut Vec<String>) {
    for label in labels.iter().filter(|label| !of.contains(*label)) {
        problems.push(format!("grouped by {label}, which no series it aggregates has"));
    }
}

/// A series a query may name: its metric's kind (None for what Prometheus and nginx's exporter
/// make, whose kind and labels are not declared here) and labels.
fn series(name: &str) -> Result<(Option<Kind>, BTreeSet<String>), String> {
    let targets = TARGET_LABELS.iter().map(|l| l.to_string());
    if name == "up" || name.starts_with("scrape_") || NGINX_EXPORTER.contains(&name) {
        return Ok((None, targets.collect()));
    }
    if name.starts_with("nginx_") {
        return Err(format!("{name} is not a metric nginx-prometheus-exporter exports for stub_status"));
    }
    let metric = ALL.iter().chain(PROCESS).find(|m| {
        (m.kind != Kind::Histogram && m.name == name)
            || (m.kind == Kind::Histogram
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(m.name)))
    });
    let Some(metric) = metric else {
        return Err(format!(
            "{name} is not exported (a histogram's series are its _bucket, _sum and _count)"
        ));
    };
    let le = (metric.kind == Kind::Histogram && name.ends_with("_bucket")).then(|| "le".to_owned());
    Ok((Some(metric.kind), metric.labels.iter().map(|l| l.to_string()).chain(targets).chain(le).collect()))
}

#[test]
fn the_check_finds_what_is_wrong_with_a_query() {
    let problems = |expr: &str| check_query(expr).join("; ");
    assert_eq!(problems("sum by (le) (rate(walletlock_lease_acquire_wait_seconds_bucket[5m]))"), "");
    assert!(problems("rate(walletlock_redis_outage[5m])").contains("not a counter"));
    assert!(
        problems("histogram_quantile(0.9, rate(walletlock_lease_acquisitions_total[5m]))")
            .contains("_bucket")
    );
    assert!(problems("walletlock_lease_acquire_wait_seconds").contains("not exported"));
    assert!(problems("walletlock_movements_total{kind=\"pay\",route=\"x\"}").contains("no label route"));
    assert!(problems("sum by (route) (walletlock_movements_total)").contains("grouped by route"));
    assert!(problems("sum(walletlock_movements_total) by (kind, route)").contains("grouped by route"));
    assert!(problems("nginx_http_requests").contains("nginx-prometheus-exporter"));
    assert_eq!(as_promql("rate(x{a=~\"$replica\"}[$__rate_interval])"), "rate(x{a=~\"$replica\"}[5m])");
}
