//! `walletlock loadtest rss`: the replicas' memory after a run, as loadtest/run writes it into
//! rss.txt and [`super::report`] reads it back.

use std::path::Path;

/// A line per replica deploy/local runs under STATE (its replica-N/walletlock.pid), in N's order:
/// NAME PID VmHWM_kB VmRSS_kB UPTIME_S, the peak and the present resident memory and the seconds
/// since it started. A replica whose process is gone has no line.
pub fn rss(state: &Path, ticks: f64) -> String {
    let mut replicas: Vec<(u32, String)> = std::fs::read_dir(state)
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            Some((name.strip_prefix("replica-")?.parse().ok()?, name))
        })
        .collect();
    replicas.sort();
    let mut out = String::new();
    for (_, name) in replicas {
        let pid = std::fs::read_to_string(state.join(&name).join("walletlock.pid")).unwrap_or_default();
        let pid = pid.lines().next().unwrap_or_default();
        let (Ok(status), Ok(stat)) = (
            std::fs::read_to_string(format!("/proc/{pid}/status")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
        ) else {
            continue;
        };
        // The 22nd field of stat, the 20th after the command's closing parenthesis: when it started.
        let started =
            stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(19)?.parse::<f64>().ok());
        let up = (super::other_cpu::uptime() - started.unwrap_or(0.0) / ticks).floor();
        out += &format!("{name} {pid} {} {} {up}\n", kb(&status, "VmHWM:"), kb(&status, "VmRSS:"));
    }
    out
}

/// The kB of FIELD in /proc/PID/status.
fn kb<'a>(status: &'a str, field: &str) -> &'a str {
    status.lines().find_map(|line| line.strip_prefix(field)?.split_whitespace().next()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    /// This process, as a replica of a made-up state directory.
    #[test]
    fn a_replica_has_its_peak_and_present_memory_and_uptime() {
        let state = tempfile::tempdir().unwrap();
        for (n, pid) in [(10, std::process::id()), (2, std::process::id()), (3, u32::MAX)] {
            std::fs::create_dir(state.path().join(format!("replica-{n}"))).unwrap();
            std::fs::write(state.path().join(format!("replica-{n}/walletlock.pid")), format!("{pid}\n"))
                .unwrap();
        }
        let lines = super::rss(state.path(), 100.0);
        let lines: Vec<Vec<&str>> = lines.lines().map(|line| line.split(' ').collect()).collect();
        assert_eq!(lines.iter().map(|line| line[0]).collect::<Vec<_>>(), ["replica-2", "replica-10"]);
        for line in lines {
            assert_eq!(line[1], std::process::id().to_string());
            let [hwm, rss, up] = [2, 3, 4].map(|i| line[i].parse::<u64>().unwrap());
            assert!(hwm >= rss && rss > 0 && up < 3600, "{line:?}");
        }
    }
}
