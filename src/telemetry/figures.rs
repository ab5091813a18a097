//! `walletlock figures`: a replica's live figures from its /metrics, a row of `deploy/local status`.

use super::metrics::{FENCE_REFUSALS, HTTP_REQUEST_DURATION, LEASE_ACQUIRE_WAIT, MOVEMENTS, RESIDENT_MEMORY};

/// The titles of the columns of [`row`].
pub fn header() -> String {
    columns(["PAID", "HTTP P99", "LEASES", "AVG WAIT", "LEASE_LOST", "RSS"].map(str::to_owned))
}

fn columns([paid, p99, leases, wait, lost, rss]: [String; 6]) -> String {
    format!("{paid:>8} {p99:>10} {leases:>8} {wait:>9} {lost:>10} {rss:>9}")
}

/// The figures of a scrape (Prometheus text), all since the replica started: payments accepted;
/// the p99 of the API's answers (its bucket's upper bound; probes and scrapes left out); leases
/// taken and their mean wait; writes the fence refused (lease_lost); resident memory.
pub fn row(scrape: &str) -> String {
    let http_bucket = format!("{}_bucket", HTTP_REQUEST_DURATION.name);
    let (wait_count, wait_sum) =
        (format!("{}_count", LEASE_ACQUIRE_WAIT.name), format!("{}_sum", LEASE_ACQUIRE_WAIT.name));
    let (mut paid, mut leases, mut waited, mut lost, mut rss) = (0.0, 0.0, 0.0, 0.0, 0.0);
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for (name, labels, value) in scrape.lines().filter_map(sample) {
        let label = |key: &str| labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        if name == MOVEMENTS.name && label("kind") == Some("pay") && label("outcome") == Some("accepted") {
            paid += value;
        } else if name == http_bucket && !matches!(label("route"), Some("/healthz" | "/readyz" | "/metrics"))
        {
            let le = label("le").and_then(|le| le.parse().ok()).unwrap_or(f64::INFINITY);
            match buckets.iter_mut().find(|(bound, _)| *bound == le) {
                Some((_, count)) => *count += value,
                None => buckets.push((le, value)),
            }
        } else if name == wait_count {
            leases += value;
        } else if name == wait_sum {
            waited += value;
        } else if name == FENCE_REFUSALS.name {
            lost += value;
        } else if name == RESIDENT_MEMORY.name {
            rss = value;
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map_or(0.0, |(_, count)| *count);
    let p99 = match buckets.iter().find(|(_, count)| total > 0.0 && *count >= 0.99 * total) {
        None => "-".to_owned(),
        Some((le, _)) if le.is_finite() => format!("<={}ms", (le * 1e6).round() / 1e3),
        Some(_) => format!(">{}s", buckets.iter().rev().find(|(le, _)| le.is_finite()).map_or(0.0, |b| b.0)),
    };
    let wait = if leases > 0.0 { format!("{:.1} ms", waited / leases * 1000.0) } else { "-".to_owned() };
    columns([
        format!("{paid}"),
        p99,
        format!("{leases}"),
        wait,
        format!("{lost}"),
        format!("{:.1} MiB", rss / f64::from(1 << 20)),
    ])
}

/// A sample of the text format: its name, labels and value.
type Sample<'a> = (&'a str, Vec<(String, String)>, f64);

/// The sample of a line of the text format (None for a comment).
fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.starts_with('#') {
        return None;
    }
    let (name, mut rest) = line.split_at(line.find(['{', ' '])?);
    let mut labels = Vec::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches([',', ' ']);
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = inner.split_once("=\"")?;
            let (mut value, mut chars) = (String::new(), after.chars());
            loop {
                match chars.next()? {
                    '"' => break,
                    '\\' => value.push(match chars.next()? {
                        'n' => '\n',
                        c => c,
                    }),
                    c => value.push(c),
                }
            }
            labels.push((key.to_owned(), value));
            inner = chars.as_str();
        }
    }
    Some((name, labels, rest.split_whitespace().next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_row_sums_a_scrape() {
        use super::super::metrics::*;
        let http = HTTP_REQUEST_DURATION.name;
        let scrape = format!(
            "# TYPE x counter\n\
             {m}{{kind=\"pay\",outcome=\"accepted\"}} 7\n{m}{{kind=\"pay\",outcome=\"lock_timeout\"}} 2\n\
             {http}_bucket{{method=\"POST\",route=\"/wallets/{{id}}/pay\",le=\"0.025\"}} 98\n\
             {http}_bucket{{method=\"POST\",route=\"/wallets/{{id}}/pay\",le=\"0.05\"}} 99\n\
             {http}_bucket{{method=\"POST\",route=\"/wallets/{{id}}/pay\",le=\"+Inf\"}} 100\n\
             {http}_bucket{{method=\"GET\",route=\"/readyz\",le=\"+Inf\"}} 500\n\
             {w}_sum 0.5\n{w}_count 20\n{f} 1\n{r} 3145728\n",
            m = MOVEMENTS.name,
            w = LEASE_ACQUIRE_WAIT.name,
            f = FENCE_REFUSALS.name,
            r = RESIDENT_MEMORY.name,
        );
        let row: Vec<String> = super::row(&scrape).split_whitespace().map(str::to_owned).collect();
        assert_eq!(row, ["7", "<=50ms", "20", "25.0", "ms", "1", "3.0", "MiB"]);
        assert_eq!(
            super::row("").split_whitespace().collect::<Vec<_>>(),
            ["0", "-", "0", "-", "0", "0.0", "MiB"]
        );
    }
}
