//! The history section of `loadtest report`: a `loadtest/bench` history run's figures, and its
//! targets judged for the page's one targets table (docs/api/history.md says what it measures and
//! why those targets).

use super::report::Met;
use anyhow::{Context, anyhow, bail};
use std::collections::HashMap;
use std::path::Path;

/// A target of the history run, as the targets table shows it: (target, result, met).
pub type Judged = (String, String, Met);

/// The reads judged against the read ceiling, `GET /wallets/{id}` (`read`): each p99 at most
/// [`READ_WITHIN`] times the ceiling's.
const JUDGED_READS: [&str; 3] = ["balance_at", "statement", "entries"];
const READ_WITHIN: f64 = 1.5;
/// The export's rate at least this share of `COPY`'s.
const EXPORT_SHARE: f64 = 0.3;
/// The replicas' RSS grows at most this many MB while an export streams.
const EXPORT_RSS_MB: f64 = 10.0;

fn read_target(name: &str) -> String {
    format!("history: {name} p99 ≤ {READ_WITHIN}x GET /wallets/{{id}}'s")
}
fn export_target() -> String {
    format!("history: export entries/s ÷ COPY rows/s ≥ {EXPORT_SHARE}")
}
fn rss_target() -> String {
    format!("history: the replicas' RSS grows ≤ {EXPORT_RSS_MB} MB while an export streams")
}

/// The history run's targets, each "not run" (its run was left out by BENCH_ONLY).
pub fn not_run() -> Vec<Judged> {
    let reads = JUDGED_READS.iter().map(|name| read_target(name));
    reads.chain([export_target(), rss_target()]).map(|t| (t, "not run".to_owned(), Met::Unknown)).collect()
}

/// The history section of a bench's page, from DIR's reads.tsv (k6's), rollup.tsv and export.tsv
/// (`history_run` in loadtest/bench): its settings, then [`summary`]'s figures; and its targets,
/// for the page's one targets table.
pub fn section(dir: &Path) -> anyhow::Result<(String, Vec<Judged>)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| path.display().to_string())
    };
    let figures: HashMap<String, f64> = [read("rollup.tsv")?, read("export.tsv")?]
        .iter()
        .flat_map(|text| text.lines())
        .map(|line| {
            let (key, value) = line.split_once('\t').ok_or_else(|| anyhow!("not KEY<tab>VALUE: {line}"))?;
            Ok((key.to_owned(), value.parse().with_context(|| format!("{key}: {value}"))?))
        })
        .collect::<anyhow::Result<_>>()?;
    let figure = |key: &str| figures.get(key).copied().ok_or_else(|| anyhow!("no {key}"));
    // As every row of the table: how idle the machine was before, and what others took during.
    let other: serde_json::Value = serde_json::from_str(&read("other_cpu.json")?)?;
    let (figures_text, judged) = summary(&read("reads.tsv")?, &figures)?;
    let text = format!(
        "## History: reads and export of one wallet of {} entries\n\n{} users a read while 16 pay other wallets \
         (docs/api/history.md says what it measures); the machine {}% idle before the reads, other \
         processes {}% of the CPU during them. Its targets are in the targets table above.\n\n{figures_text}",
        figure("entries")?,
        figure("users")?,
        read("idle")?.trim(),
        other["other_pct"],
    );
    Ok((text, judged))
}

/// The table of the reads (name, p99 ms, requests, share answered as expected: a line each), each
/// p99 as a multiple of the read ceiling's (`read`, GET /wallets/{id}), then the first statements
/// and the export against COPY, with the replicas' RSS growth; and the targets judged on them.
pub fn summary(reads: &str, figures: &HashMap<String, f64>) -> anyhow::Result<(String, Vec<Judged>)> {
    let figure = |key: &str| figures.get(key).copied().ok_or_else(|| anyhow!("no {key}"));
    let rows = reads.lines().map(|line| {
        let number = |n: &str| n.parse::<f64>().with_context(|| format!("reads.tsv: {line}"));
        let [name, p99, requests, answered] = line.split('\t').collect::<Vec<_>>()[..] else {
            bail!("reads.tsv: {line}")
        };
        Ok((name, number(p99)?, number(requests)?, number(answered)?))
    });
    let rows = rows.collect::<anyhow::Result<Vec<_>>>()?;
    let ceiling = rows.iter().find(|row| row.0 == "read").ok_or_else(|| anyhow!("reads.tsv: no read"))?.1;
    let mut out = String::from(
        "| read | p99 ms | x GET /wallets/{id} | requests | answered |\n|---|---|---|---|---|\n",
    );
    for (name, p99, requests, answered) in &rows {
        out +=
            &format!("| {name} | {p99:.1} | {:.2} | {} | {answered:.3} |\n", p99 / ceiling, *requests as i64);
    }
    let mut judged: Vec<Judged> = JUDGED_READS
        .iter()
        .map(|&name| match rows.iter().find(|row| row.0 == name) {
            Some(&(_, p99, ..)) => (
                read_target(name),
                format!("{:.2} ({p99:.1} ms ÷ {ceiling:.1} ms)", p99 / ceiling),
                Met::from(p99 / ceiling <= READ_WITHIN),
            ),
            None => (read_target(name), "not measured".to_owned(), Met::Unknown),
        })
        .collect();
    let (entries, export_s, copy_s) =
        (figure("entries")?, figure("export_ms")? / 1000.0, figure("copy_ms")? / 1000.0);
    let (ours, theirs) = (entries / export_s, entries / copy_s);
    let grew = (figure("rss_peak_kb")? - figure("rss_before_kb")?) / 1024.0;
    out += &format!(
        "\nthe first statements of the month rolled up its {entries} entries: {} requests, one at a time, in {:.1} s\n",
        figure("rollup_statements")?,
        figure("rollup_ms")? / 1000.0
    );
    out += &format!(
        "\nexport: {entries} entries in {export_s:.1} s = {}/s through nginx; COPY {copy_s:.1} s = {}/s; \
         the replicas' RSS grew {grew:.1} MB while it streamed\n",
        ours as i64, theirs as i64,
    );
    judged.push((
        export_target(),
        format!("{:.2} ({}/s ÷ {}/s)", ours / theirs, ours as i64, theirs as i64),
        Met::from(ours / theirs >= EXPORT_SHARE),
    ));
    judged.push((rss_target(), format!("{grew:.1} MB"), Met::from(grew <= EXPORT_RSS_MB)));
    Ok((out, judged))
}

#[cfg(test)]
mod tests {
    use super::Met;
    use std::collections::HashMap;

    /// The summary of figures whose page the bench's awk program wrote before, and its targets.
    #[test]
    fn a_summary_judges_each_target_on_its_figures() {
        let reads = "pay\t35.21234\t12000\t1\nread\t12.5\t40000\t1\nbalance_at\t15.71\t30000\t0.9993\n\
                     statement\t19.95\t20000\t1\nentries\t13.04\t25000\t1\n";
        let figures: HashMap<String, f64> = [
            ("rollup_statements", 7.0),
            ("rollup_ms", 2140.0),
            ("entries", 1_000_000.0),
            ("export_ms", 5234.0),
            ("copy_ms", 1500.0),
            ("rss_before_kb", 90000.0),
            ("rss_peak_kb", 95000.0),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let (text, judged) = super::summary(reads, &figures).unwrap();
        assert_eq!(
            text,
            "| read | p99 ms | x GET /wallets/{id} | requests | answered |\n\
             |---|---|---|---|---|\n\
             | pay | 35.2 | 2.82 | 12000 | 1.000 |\n\
             | read | 12.5 | 1.00 | 40000 | 1.000 |\n\
             | balance_at | 15.7 | 1.26 | 30000 | 0.999 |\n\
             | statement | 19.9 | 1.60 | 20000 | 1.000 |\n\
             | entries | 13.0 | 1.04 | 25000 | 1.000 |\n\
             \n\
             the first statements of the month rolled up its 1000000 entries: 7 requests, one at a time, in 2.1 s\n\
             \n\
             export: 1000000 entries in 5.2 s = 191058/s through nginx; COPY 1.5 s = 666666/s; \
             the replicas' RSS grew 4.9 MB while it streamed\n"
        );
        let judged: Vec<(&str, &str, Met)> =
            judged.iter().map(|(t, r, m)| (t.as_str(), r.as_str(), *m)).collect();
        assert_eq!(
            judged,
            [
                ("history: balance_at p99 ≤ 1.5x GET /wallets/{id}'s", "1.26 (15.7 ms ÷ 12.5 ms)", Met::Yes),
                ("history: statement p99 ≤ 1.5x GET /wallets/{id}'s", "1.60 (19.9 ms ÷ 12.5 ms)", Met::No),
                ("history: entries p99 ≤ 1.5x GET /wallets/{id}'s", "1.04 (13.0 ms ÷ 12.5 ms)", Met::Yes),
                ("history: export entries/s ÷ COPY rows/s ≥ 0.3", "0.29 (191058/s ÷ 666666/s)", Met::No),
                ("history: the replicas' RSS grows ≤ 10 MB while an export streams", "4.9 MB", Met::Yes),
            ]
        );
        let not_run: Vec<String> = super::not_run().into_iter().map(|(t, ..)| t).collect();
        let named: Vec<&str> = judged.iter().map(|(t, ..)| *t).collect();
        assert_eq!(not_run, named, "a run left out names the same targets");
    }
}
