//! `walletlock demo`: the tutorial's experiments, run as the real binary prints them.

use crate::support::TestEnv;
use std::process::Command;

fn demo(env: &TestEnv, name: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["demo", name])
        .env("DATABASE_URL", &env.database_url)
        .env("REDIS_URL", &env.redis_url)
        .output()
        .expect("walletlock runs");
    assert!(out.status.success(), "demo {name} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect()
}

fn field(line: &str, name: &str) -> i64 {
    let prefix = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

#[test]
fn race_without_a_lease_is_broken() {
    let line = &demo(&TestEnv::new(), "race")[0];
    assert!(line.ends_with(" BROKEN"), "{line}");
}

#[test]
fn the_lease_accepts_exactly_ten() {
    let line = &demo(&TestEnv::new(), "lock")[0];
    assert_eq!(line, "accepted=10 balance=0 expected=0 OK");
}

#[test]
fn a_lease_shorter_than_the_work_is_broken() {
    let line = &demo(&TestEnv::new(), "short-ttl")[0];
    assert!(line.ends_with(" BROKEN"), "{line}");
}

#[test]
fn the_same_short_lease_with_the_fence_is_ok_and_counts_the_refused_writes() {
    let line = &demo(&TestEnv::new(), "fenced")[0];
    assert!(line.contains(" OK"), "{line}");
    assert_eq!(field(line, "balance"), field(line, "expected"));
    assert!(
        field(line, "refused_stale_writes") > 0,
        "the short lease should have let stale writes reach the fence: {line}"
    );
}

#[test]
fn lockstep_times_fixed_against_jittered_retries() {
    let lines = demo(&TestEnv::new(), "lockstep");
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].contains("fixed 10ms retries") && lines[1].contains("jittered 5-15ms retries"),
        "{lines:?}"
    );
    for line in &lines {
        assert!(line.starts_with("accepted=10 balance=0 expected=0 OK"), "{line}");
        assert!(line.ends_with(" ms"), "{line}");
    }
}
