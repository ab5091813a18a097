//! The load tests' tools, which the scripts in loadtest/ call (`walletlock loadtest ...`): the
//! costs of a run, the CPU others took from it, the bench's page (its table and its history
//! section), the replicas' memory. The product does not import them.

pub mod costs;
pub mod history;
pub mod other_cpu;
pub mod report;
pub mod rss;

/// The kernel's clock ticks a second, the unit of /proc/PID/stat's times.
pub fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads the system's configuration.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}
