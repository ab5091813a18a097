//! The history section of `loadtest report`: a `loadtest/bench` history run's figures beside
//! their targets (docs/api/history.md says what it measures and why those).

use anyhow::{Context, anyhow, bail};
use std::collections::HashMap;
use std::path::Path;

/// The history section of a bench's page, from DIR's reads.tsv (k6's), rollup.tsv and export.tsv
/// (`history_run` in loadtest/bench): its settings, then [`summary`].
pub fn section(dir: &Path) -> anyhow::Result<String> {
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
    Ok(format!(
        "## History: reads and export of one wallet of {} entries\n\n{} users a read while 16 pay other wallets \
         (docs/api/history.md says what it measures); the machine {}% idle before the reads, other \
         processes {}% of the CPU during them.\n\n{}",
        figure("entries")?,
        figure("users")?,
        read("idle")?.trim(),
        other["other_pct"],
        summary(&read("reads.tsv")?, &figures)?
    ))
}

/// The table of the reads (name, p99 ms, requests, share answered as expected: a line each), each
/// p99 as a multiple of the read ceiling's (`read`, GET /wallets/{id}), then the first statements
/// and the export against COPY, with the replicas' RSS growth.
pub fn summary(reads: &str, figures: &HashMap<String, f64>) -> anyhow::Result<String> {
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
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    let mut out = String::from(
        "| read | p99 ms | x GET /wallets/{id} | target | requests | answered |\n|---|---|---|---|---|---|\n",
    );
    for (name, p99, requests, answered) in &rows {
        let ratio = p99 / ceiling;
        let target = if ["read", "pay"].contains(name) {
            String::new()
        } else {
            format!("{} (<= 1.5x)", met(ratio <= 1.5))
        };
        out += &format!(
            "| {name} | {p99:.1} | {ratio:.2} | {target} | {} | {answered:.3} |\n",
            *requests as i64
        );
    }
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
        "\nexport: {entries} entries in {export_s:.1} s = {}/s through nginx; COPY {copy_s:.1} s = {}/s: {:.2}x ({}, >= 0.3x); \
         the replicas' RSS grew {grew:.1} MB while it streamed ({}, <= 10 MB)\n",
        ours as i64,
        theirs as i64,
        ours / theirs,
        met(ours / theirs >= 0.3),
        met(grew <= 10.0)
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    /// The summary of figures whose page the bench's awk program wrote before (this is its output).
    #[test]
    fn a_summary_sets_each_figure_beside_its_target() {
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
        assert_eq!(
            super::summary(reads, &figures).unwrap(),
            "| read | p99 ms | x GET /wallets/{id} | target | requests | answered |\n\
             |---|---|---|---|---|---|\n\
             | pay | 35.2 | 2.82 |  | 12000 | 1.000 |\n\
             | read | 12.5 | 1.00 |  | 40000 | 1.000 |\n\
             | balance_at | 15.7 | 1.26 | met (<= 1.5x) | 30000 | 0.999 |\n\
             | statement | 19.9 | 1.60 | MISSED (<= 1.5x) | 20000 | 1.000 |\n\
             | entries | 13.0 | 1.04 | met (<= 1.5x) | 25000 | 1.000 |\n\
             \n\
             the first statements of the month rolled up its 1000000 entries: 7 requests, one at a time, in 2.1 s\n\
             \n\
             export: 1000000 entries in 5.2 s = 191058/s through nginx; COPY 1.5 s = 666666/s: 0.29x (MISSED, >= 0.3x); \
             the replicas' RSS grew 4.9 MB while it streamed (met, <= 10 MB)\n"
        );
    }
}
