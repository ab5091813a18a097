//! Crash and stall points for the fault tests.
//!
//! Built with the `failpoints` feature (only `deploy/test` enables it), `WALLETLOCK_FAILPOINT=<name>`
//! makes the process SIGKILL itself at the point of that name: it is how the tests kill a replica
//! exactly between its commit and its response. `WALLETLOCK_FAILPOINT=<name>:stop` makes it SIGSTOP
//! itself there instead (a stalled process, a frozen VM), until the test sends SIGCONT; only the
//! first time, so the woken process serves on (under load) as one that was frozen once. Without
//! the feature, [`hit`] is an empty inline function.

/// Kills or stops the process if the failpoint `name` is armed.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let Some(armed) = ARMED.get_or_init(|| std::env::var("WALLETLOCK_FAILPOINT").ok()).as_deref() else {
        return;
    };
    let stop = match armed.strip_prefix(name) {
        Some("") => false,
        Some(":stop") => true,
        _ => return,
    };
    static STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if stop && STOPPED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    eprintln!("failpoint {armed}");
    // SAFETY: signals to ourselves. SIGSTOP is raised on this thread, so this thread stops before
    // it goes on (a signal sent to the process may be taken by another thread first, and this one
    // would run on past the failpoint for a moment).
    unsafe {
        if stop {
            libc::raise(libc::SIGSTOP);
        } else {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Failpoints are compiled out of this build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}
