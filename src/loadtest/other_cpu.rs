//! `walletlock loadtest other-cpu`: the CPU that processes outside the benchmark used during a run
//! (loadtest/bench runs each run again when they took too much of it). Every second it reads
//! /proc; a process outside the trees of the root pids counts with the CPU it used since the first
//! sample, or since it started if that was later. A process that starts and ends between two
//! samples is missed: a lower bound.

use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Samples every second until SIGTERM, or until process `while_pid` ends, then writes into `out`
/// what the processes outside the trees of `roots` used ([`Sampler::json`]).
pub async fn run(out: &Path, while_pid: u32, roots: Vec<u32>) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // SAFETY: sysconf only reads the system's configuration.
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } as f64;
    let ticks = super::clock_ticks();
    let mut sigterm = signal(SignalKind::terminate())?;
    let (mut sampler, mut stop) = (Sampler::new(roots), false);
    loop {
        sampler.sample(uptime(), &processes(ticks));
        if stop || !Path::new(&format!("/proc/{while_pid}")).exists() {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = sigterm.recv() => stop = true,
        }
    }
    std::fs::write(out, sampler.json(cores) + "\n")?;
    Ok(())
}

/// A process as one sample saw it.
pub struct Process {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
    /// User and system CPU, in seconds.
    pub cpu: f64,
}

#[derive(Default)]
pub struct Sampler {
    roots: HashSet<u32>,
    first: Option<f64>,
    last: f64,
    /// Each process's CPU when first seen (0 for those that started after the first sample).
    base: HashMap<u32, f64>,
    /// What each process outside the roots' trees used, by pid: its command and its seconds.
    used: HashMap<u32, (String, f64)>,
}

impl Sampler {
    pub fn new(roots: impl IntoIterator<Item = u32>) -> Self {
        Sampler { roots: roots.into_iter().collect(), ..Sampler::default() }
    }

    /// One sample at TIME (seconds since boot) of every process.
    pub fn sample(&mut self, time: f64, processes: &[Process]) {
        let first = self.first.is_none();
        self.first.get_or_insert(time);
        self.last = time;
        let parent: HashMap<u32, u32> = processes.iter().map(|p| (p.pid, p.ppid)).collect();
        let mut ours: HashMap<u32, bool> = HashMap::new();
        for p in processes {
            let base = *self.base.entry(p.pid).or_insert(if first { p.cpu } else { 0.0 });
            // Up the parents until a root, a process already placed, or none.
            let (mut chain, mut at) = (Vec::new(), p.pid);
            let verdict = loop {
                if let Some(&known) = ours.get(&at) {
                    break known;
                }
                if self.roots.contains(&at) {
                    break true;
                }
                if at <= 1 {
                    break false;
                }
                chain.push(at);
                at = parent.get(&at).copied().unwrap_or(0);
            };
            ours.extend(chain.into_iter().map(|pid| (pid, verdict)));
            ours.insert(at, verdict);
            if !verdict {
                self.used.insert(p.pid, (p.comm.clone(), p.cpu - base));
            }
        }
    }

    /// The JSON loadtest/bench reads: wall_s, other_cpu_s, other_pct (of all CORES) and the top 5
    /// commands by CPU.
    pub fn json(&self, cores: f64) -> String {
        let wall = self.last - self.first.unwrap_or(self.last);
        let mut by_command: HashMap<&str, f64> = HashMap::new();
        for (comm, seconds) in self.used.values().filter(|(_, s)| *s > 0.0) {
            *by_command.entry(comm).or_default() += seconds;
        }
        let other = by_command.values().fold(0.0, |sum, s| sum + s);
        let mut top: Vec<(&str, f64)> = by_command.into_iter().filter(|(_, s)| *s >= 0.1).collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        let top: Vec<String> = top
            .iter()
            .take(5)
            .map(|(comm, s)| format!("[{}, {s:.1}]", serde_json::Value::from(*comm)))
            .collect();
        let pct = if wall > 0.0 { 100.0 * other / (wall * cores) } else { 0.0 };
        format!(
            "{{\"wall_s\": {wall:.1}, \"other_cpu_s\": {other:.1}, \"other_pct\": {pct:.1}, \"top\": [{}]}}",
            top.join(", ")
        )
    }
}

/// Every process in /proc now, from its stat line (the command is between the first "(" and the
/// last ")"; after it: state, ppid, ..., utime and stime, the 12th and 13th).
pub fn processes(ticks: f64) -> Vec<Process> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let parse = |pid: u32, stat: &str| {
        let (open, close) = (stat.find('(')?, stat.rfind(')')?);
        let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
        let ticks_at = |i: usize| fields.get(i)?.parse::<f64>().ok();
        Some(Process {
            pid,
            ppid: fields.get(1)?.parse().ok()?,
            comm: stat[open + 1..close].to_owned(),
            cpu: (ticks_at(11)? + ticks_at(12)?) / ticks,
        })
    };
    dir.filter_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        parse(pid, &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?) // (gone since the listing)
    })
    .collect()
}

/// Seconds since boot.
pub fn uptime() -> f64 {
    let text = std::fs::read_to_string("/proc/uptime").unwrap_or_default();
    text.split_whitespace().next().and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_runs_outside_the_roots_trees_counts() {
        let p = |pid, ppid, comm: &str, cpu| Process { pid, ppid, comm: comm.into(), cpu };
        let mut sampler = Sampler::new([10]);
        sampler.sample(
            100.0,
            &[p(1, 0, "init", 50.0), p(10, 1, "bench", 1.0), p(11, 10, "k6", 2.0), p(20, 1, "cron", 7.0)],
        );
        sampler.sample(
            104.0,
            &[
                p(1, 0, "init", 50.0),
                p(10, 1, "bench", 3.0),
                p(11, 10, "k6", 6.0),
                p(12, 11, "psql", 1.0),
                p(20, 1, "cron", 9.0),
                p(30, 1, "rustc", 1.5),
                p(31, 1, "rustc", 0.5),
            ],
        );
        // cron's 2 s since the first sample, and both rustc's whole 2 s; the bench's tree is left out.
        assert_eq!(
            sampler.json(2.0),
            r#"{"wall_s": 4.0, "other_cpu_s": 4.0, "other_pct": 50.0, "top": [["cron", 2.0], ["rustc", 2.0]]}"#
        );
        assert_eq!(
            Sampler::new([1]).json(2.0),
            r#"{"wall_s": 0.0, "other_cpu_s": 0.0, "other_pct": 0.0, "top": []}"#
        );
    }
}
