//! Crash points for the fault tests.
//!
//! Built with the `failpoints` feature (only `deploy/test` enables it), `WALLETLOCK_FAILPOINT=<name>`
//! makes the process SIGKILL itself at the point of that name: it is how the tests kill a replica
//! exactly between its commit and its response. Without the feature,
//! [`hit`] is an empty inline function.

/// Kills the process if the failpoint `name` is armed.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if ARMED.get_or_init(|| std::env::var("WALLETLOCK_FAILPOINT").ok()).as_deref() == Some(name) {
        eprintln!("failpoint {name}: SIGKILL");
        // SAFETY: kill(2) on our own pid; it does not return.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Failpoints are compiled out of this build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}
