//! How long a lease lives, how long to wait for one, and how waiters retry.

use rand::Rng;
use std::time::Duration;

/// A lease's time to live: at least 1 ms, by construction.
///
/// Redis treats a missing or zero expiry as "never expires", so a zero TTL from an unset setting
/// would create a lock that outlives a crashed holder forever. `Ttl` is the only way to give a
/// lease its expiry, and it refuses anything under a millisecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ttl(Duration);

/// A TTL under 1 ms was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease TTL must be at least 1ms, got {0:?}")]
pub struct InvalidTtl(pub Duration);

impl Ttl {
    pub fn new(ttl: Duration) -> Result<Self, InvalidTtl> {
        if ttl < Duration::from_millis(1) { Err(InvalidTtl(ttl)) } else { Ok(Self(ttl)) }
    }

    pub fn get(self) -> Duration {
        self.0
    }

    /// Whole milliseconds, as `PX` takes them; at least 1.
    pub fn as_millis(self) -> u64 {
        // Cannot truncate to zero: the constructor refused anything under 1 ms.
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }

    /// How often the watchdog refreshes, and how long one refresh may take: a third of the TTL,
    /// so two refreshes can fail before the lease runs out.
    pub fn refresh_period(self) -> Duration {
        (self.0 / 3).max(Duration::from_micros(300))
    }
}

impl std::str::FromStr for Ttl {
    type Err = String;

    /// Parses a human duration such as `2s` or `500ms`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let ttl = humantime::parse_duration(text).map_err(|err| err.to_string())?;
        Self::new(ttl).map_err(|err| err.to_string())
    }
}

/// How a waiter paces its retries while another holder has the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backoff {
    /// Each pause is drawn uniformly from `[min, max]`, so waiters that lost the same round
    /// spread out instead of hitting Redis together again.
    Jittered { min: Duration, max: Duration },
    /// Every pause is the same. Waiters that started together retry together (lockstep); kept to
    /// measure what jitter buys (`walletlock demo lockstep`).
    Fixed(Duration),
}

impl Backoff {
    /// The tutorial's pacing: 5 to 15 ms, randomized.
    pub const TUTORIAL: Backoff =
        Backoff::Jittered { min: Duration::from_millis(5), max: Duration::from_millis(15) };

    /// The pause before the next retry.
    pub fn pause(&self) -> Duration {
        match *self {
            Backoff::Fixed(pause) => pause,
            Backoff::Jittered { min, max } if max > min => rand::rng().random_range(min..=max),
            Backoff::Jittered { min, .. } => min,
        }
    }
}

/// How long a note outlives its lease by default (`LEASE_NOTE_TTL`): an hour, so a name used now and
/// then finds its last holder's note; a name idle for longer costs Redis nothing.
pub const DEFAULT_NOTE_RETENTION: Duration = Duration::from_secs(3600);

/// Everything a [`super::LeaseClient`] needs to know about timing.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// How long a lease lives without a refresh.
    pub ttl: Ttl,
    /// How long `acquire` keeps trying before giving up with `NotObtained`.
    pub wait: Duration,
    /// How waiters pace their retries.
    pub backoff: Backoff,
    /// Bound on any single Redis call, pool checkout included.
    pub op_timeout: Duration,
    /// With wake-ups, the longest a waiter waits for a release notification before asking again
    /// anyway (a lost notification costs at most this).
    pub poll_fallback: Duration,
    /// How long Redis keeps a note a holder left (see [`super::Lease::release_with_note`]) for the
    /// next holder; zero: no note is left.
    pub note_retention: Duration,
    /// Whether an acquisition that finds Redis unreachable (an error, or no answer within
    /// `op_timeout`) gives up at once with `Unavailable`, instead of retrying until its wait is
    /// up: for a caller that has another way to go on without a lease.
    pub fail_fast: bool,
}

impl LeaseSettings {
    pub fn new(ttl: Ttl, wait: Duration) -> Self {
        Self {
            ttl,
            wait,
            backoff: Backoff::Jittered { min: Duration::from_millis(1), max: Duration::from_millis(8) },
            op_timeout: Duration::from_millis(500),
            poll_fallback: Duration::from_millis(20),
            note_retention: DEFAULT_NOTE_RETENTION,
            fail_fast: false,
        }
    }

    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    pub fn with_op_timeout(mut self, op_timeout: Duration) -> Self {
        self.op_timeout = op_timeout;
        self
    }

    pub fn with_note_retention(mut self, retention: Duration) -> Self {
        self.note_retention = retention;
        self
    }

    /// Acquisitions give up at the first Redis failure (see [`LeaseSettings::fail_fast`]).
    pub fn failing_fast(mut self) -> Self {
        self.fail_fast = true;
        self
    }
}
