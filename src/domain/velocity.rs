//! Velocity limits (docs/api/limits.md): at most an amount, or a number of debits, per window of
//! time: a calendar day, week (from Monday) or month in the wallet's time zone, or a fixed window
//! of seconds counted from the Unix epoch (`"1m"`: each minute).
//!
//! What each limit's current window has taken ([`Used`]) lives in the wallet's rules, on its row,
//! and is written by the same fenced compare-and-set as its balance: the decision that checks a
//! limit is the one that commits. A debit counts when it is decided: a payment, a transfer's or a
//! movement's debit leg, a hold when it is placed. A hold's settlement gives back what it does
//! not take (a void or an expiry all of it and its count, a capture the part not captured) to the
//! window it was counted in, if that is still the window counted. A capture does not count twice;
//! a refund neither counts nor gives anything back.
//!
//! A limit set in the middle of its window counts from that moment ([`Used::from`]): the audit
//! recomputes every window from the entries and holds stamped in `[from, until)` and finds the
//! same. Windows are decided at the round's time, which entries are stamped with and which never
//! goes down along a wallet's ledger (the audit checks that too).

use super::Refusal;
use chrono::{DateTime, Datelike, Days, Months, NaiveDate, TimeZone, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

/// The span a velocity limit counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Per {
    Day,
    Week,
    Month,
    /// A fixed window of this many seconds, windows starting at multiples of it since the epoch.
    Every(u32),
}

impl Per {
    /// The longest fixed window: a year's worth of seconds.
    pub const LONGEST: u32 = 366 * 86_400;

    /// `day`, `week`, `month`, or a fixed window: a whole number of seconds (`s`), minutes (`m`),
    /// hours (`h`) or days (`d`), e.g. `30s`, `1m`, `24h`, up to [`Self::LONGEST`].
    pub fn parse(text: &str) -> Option<Per> {
        match text {
            "day" => return Some(Per::Day),
            "week" => return Some(Per::Week),
            "month" => return Some(Per::Month),
            _ => {}
        }
        let unit = match text.as_bytes().last()? {
            b's' => 1,
            b'm' => 60,
            b'h' => 3_600,
            b'd' => 86_400,
            _ => return None,
        };
        let digits = &text[..text.len() - 1];
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let seconds = digits.parse::<u32>().ok()?.checked_mul(unit)?;
        (1..=Self::LONGEST).contains(&seconds).then_some(Per::Every(seconds))
    }

    /// Its name as [`Self::parse`] reads it (a fixed window in its largest whole unit).
    pub fn name(self) -> String {
        match self {
            Per::Day => "day".into(),
            Per::Week => "week".into(),
            Per::Month => "month".into(),
            Per::Every(seconds) => {
                let (unit, size) = [('d', 86_400), ('h', 3_600), ('m', 60), ('s', 1)]
                    .into_iter()
                    .find(|(_, size)| seconds % size == 0)
                    .expect("every number of seconds is whole seconds");
                format!("{}{unit}", seconds / size)
            }
        }
    }

    /// The window holding `now`, `[start, end)`, with calendar windows in `tz`.
    pub fn window(self, now: DateTime<Utc>, tz: Tz) -> (DateTime<Utc>, DateTime<Utc>) {
        let today = now.with_timezone(&tz).date_naive();
        let (first, next) = match self {
            Per::Every(seconds) => {
                let seconds = i64::from(seconds);
                let start = now.timestamp().div_euclid(seconds) * seconds;
                let at = |s| DateTime::from_timestamp(s, 0).expect("a window within chrono's range");
                return (at(start), at(start + seconds));
            }
            Per::Day => (today, today + Days::new(1)),
            Per::Week => {
                let monday = today - Days::new(u64::from(today.weekday().num_days_from_monday()));
                (monday, monday + Days::new(7))
            }
            Per::Month => {
                let first = today.with_day(1).expect("every month has a first day");
                (first, first + Months::new(1))
            }
        };
        (start_of(first, tz), start_of(next, tz))
    }
}

/// When `date` begins in `tz`: its midnight, or, where a clock change skips midnight, the first
/// local time that exists that day.
fn start_of(date: NaiveDate, tz: Tz) -> DateTime<Utc> {
    let midnight = date.and_hms_opt(0, 0, 0).expect("midnight exists");
    (0..=24 * 4)
        .find_map(|quarter| {
            let local = midnight + chrono::Duration::minutes(15 * quarter);
            tz.from_local_datetime(&local).earliest()
        })
        .expect("a day has a local time that exists")
        .with_timezone(&Utc)
}

impl TryFrom<String> for Per {
    type Error = String;
    fn try_from(text: String) -> Result<Self, Self::Error> {
        Per::parse(&text).ok_or_else(|| format!("not a window: {text:?}"))
    }
}

impl From<Per> for String {
    fn from(per: Per) -> String {
        per.name()
    }
}

/// One velocity limit as its owner set it: at most `amount` in all, and at most `count` debits,
/// in each window of `per` (at least one of the two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VelocityLimit {
    pub per: Per,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<i64>,
}

/// What the debits of one window took: those stamped from `from` (the window's start, or when
/// the limit was set if that is later) until `until`, the window's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Used {
    pub from: DateTime<Utc>,
    pub until: DateTime<Utc>,
    pub amount: i64,
    pub count: i64,
}

/// A velocity limit and what its window has taken so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Velocity {
    #[serde(flatten)]
    pub limit: VelocityLimit,
    pub used: Used,
}

/// How many velocity limits a wallet may have.
pub const MOST_VELOCITY: usize = 8;

/// The velocity limits of a wallet, in the time zone its calendar windows are counted in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Velocities {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub velocity: Vec<Velocity>,
    /// The time zone of calendar windows; UTC when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<Tz>,
}

/// The tightest of a wallet's velocity limits at one moment, for each measure: what a debit may
/// still take, and the limit that says so. `Copy`, so each [`super::Funds`] carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Room {
    pub amount: Option<Tight>,
    pub count: Option<Tight>,
}

/// What one limit leaves, which limit it is, and when its window ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tight {
    pub left: i64,
    pub per: Per,
    pub resets_at: DateTime<Utc>,
}

impl Room {
    /// No velocity limit: anything may be debited (as far as velocity goes).
    pub const NONE: Room = Room { amount: None, count: None };

    /// Why a debit of `amount` does not fit, if it does not.
    pub fn refuses(self, amount: i64) -> Option<Refusal> {
        if let Some(tight) = self.count.filter(|tight| tight.left < 1) {
            return Some(tight.refusal(super::LimitKind::Count(tight.per)));
        }
        let tight = self.amount.filter(|tight| amount > tight.left)?;
        Some(tight.refusal(super::LimitKind::Amount(tight.per)))
    }
}

impl Tight {
    fn refusal(self, limit: super::LimitKind) -> Refusal {
        Refusal::LimitExceeded { limit, left: self.left.max(0), resets_at: Some(self.resets_at) }
    }
}

impl Velocities {
    pub const NONE: Velocities = Velocities { velocity: Vec::new(), timezone: None };

    fn tz(&self) -> Tz {
        self.timezone.unwrap_or(Tz::UTC)
    }

    /// What `velocity`'s window at `now` has taken: what it counted, or nothing yet once `now` is
    /// past its end.
    pub fn used_at(&self, velocity: &Velocity, now: DateTime<Utc>) -> Used {
        if now < velocity.used.until {
            return velocity.used;
        }
        let (from, until) = velocity.limit.per.window(now, self.tz());
        Used { from, until, amount: 0, count: 0 }
    }

    /// The tightest room the limits leave at `now`.
    pub fn room(&self, now: DateTime<Utc>) -> Room {
        let mut room = Room::NONE;
        for velocity in &self.velocity {
            let used = self.used_at(velocity, now);
            let tighter = |tight: Option<Tight>, limit: Option<i64>, taken: i64| match limit {
                Some(limit) if tight.is_none_or(|t| limit - taken < t.left) => {
                    Some(Tight { left: limit - taken, per: velocity.limit.per, resets_at: used.until })
                }
                _ => tight,
            };
            room.amount = tighter(room.amount, velocity.limit.amount, used.amount);
            room.count = tighter(room.count, velocity.limit.count, used.count);
        }
        room
    }

    /// Counts a debit of `amount` decided at `now` in every window.
    pub fn count(&mut self, amount: i64, now: DateTime<Utc>) {
        self.take(now, |used| (used.amount, used.count) = (used.amount + amount, used.count + 1));
    }

    /// Gives back `amount` and `count` debits counted at `counted_at` (a hold's placement) to
    /// each window at `now` that counted it.
    pub fn give_back(&mut self, counted_at: DateTime<Utc>, amount: i64, count: i64, now: DateTime<Utc>) {
        self.take(now, |used| {
            if (used.from..used.until).contains(&counted_at) {
                (used.amount, used.count) = (used.amount - amount, used.count - count);
            }
        });
    }

    fn take(&mut self, now: DateTime<Utc>, mut change: impl FnMut(&mut Used)) {
        for n in 0..self.velocity.len() {
            let mut used = self.used_at(&self.velocity[n], now);
            change(&mut used);
            self.velocity[n].used = used;
        }
    }

    /// These limits replaced by `limits` in `timezone`, at `now`: a limit of the same window in
    /// the same zone keeps what its window has taken; any other counts from `now`, starting with
    /// `already`, what debits stamped `now` took before it (those decided before it in its batch).
    pub fn replaced(
        &self,
        limits: &[VelocityLimit],
        timezone: Option<Tz>,
        now: DateTime<Utc>,
        (amount, count): (i64, i64),
    ) -> Velocities {
        let mut new = Velocities { velocity: Vec::with_capacity(limits.len()), timezone };
        for limit in limits {
            let kept = self
                .velocity
                .iter()
                .find(|v| v.limit.per == limit.per && self.tz() == new.tz())
                .map(|v| self.used_at(v, now));
            let used = kept.unwrap_or_else(|| {
                let (_, until) = limit.per.window(now, new.tz());
                Used { from: now, until, amount, count }
            });
            new.velocity.push(Velocity { limit: *limit, used });
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LimitKind;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    fn limit(per: &str, amount: Option<i64>, count: Option<i64>) -> VelocityLimit {
        VelocityLimit { per: Per::parse(per).unwrap(), amount, count }
    }

    #[test]
    fn windows_are_named_as_read_and_anything_else_is_refused() {
        for (text, per) in [
            ("day", Per::Day),
            ("week", Per::Week),
            ("month", Per::Month),
            ("30s", Per::Every(30)),
            ("1m", Per::Every(60)),
            ("90m", Per::Every(5_400)),
            ("24h", Per::Every(86_400)),
            ("366d", Per::Every(Per::LONGEST)),
        ] {
            assert_eq!(Per::parse(text), Some(per), "{text}");
        }
        assert_eq!(Per::Every(86_400).name(), "1d", "the largest whole unit");
        assert_eq!(Per::Every(5_400).name(), "90m");
        for bad in ["", "s", "0s", "-1m", "1.5h", "367d", "1w", "Day", "1 m", "99999999999s"] {
            assert_eq!(Per::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn calendar_windows_begin_at_local_midnight_on_mondays_and_firsts() {
        let paris: Tz = "Europe/Paris".parse().unwrap();
        // 23:30 UTC on Sunday 6 December is 00:30 on Monday 7 December in Paris.
        let now = at("2026-12-06T23:30:00Z");
        assert_eq!(Per::Day.window(now, Tz::UTC), (at("2026-12-06T00:00:00Z"), at("2026-12-07T00:00:00Z")));
        assert_eq!(Per::Day.window(now, paris), (at("2026-12-06T23:00:00Z"), at("2026-12-07T23:00:00Z")));
        assert_eq!(Per::Week.window(now, Tz::UTC), (at("2026-11-30T00:00:00Z"), at("2026-12-07T00:00:00Z")));
        assert_eq!(Per::Week.window(now, paris), (at("2026-12-06T23:00:00Z"), at("2026-12-13T23:00:00Z")));
        assert_eq!(Per::Month.window(now, paris), (at("2026-11-30T23:00:00Z"), at("2026-12-31T23:00:00Z")));
        // A day that loses an hour is 23 hours long.
        let spring = Per::Day.window(at("2026-03-29T12:00:00Z"), paris);
        assert_eq!(spring, (at("2026-03-28T23:00:00Z"), at("2026-03-29T22:00:00Z")));
        // Where the clocks skip midnight (Santiago, 6 September 2026), the day starts at 01:00.
        let santiago: Tz = "America/Santiago".parse().unwrap();
        let skipped = Per::Day.window(at("2026-09-06T12:00:00Z"), santiago);
        assert_eq!(skipped.0, at("2026-09-06T04:00:00Z"));
    }

    #[test]
    fn fixed_windows_are_multiples_of_their_length_since_the_epoch() {
        let per = Per::Every(60);
        assert_eq!(
            per.window(at("2026-12-06T10:00:59.999Z"), Tz::UTC),
            (at("2026-12-06T10:00:00Z"), at("2026-12-06T10:01:00Z"))
        );
        let zone: Tz = "Asia/Kolkata".parse().unwrap();
        assert_eq!(per.window(at("2026-12-06T10:01:00Z"), zone).0, at("2026-12-06T10:01:00Z"), "no zone");
    }

    #[test]
    fn the_tightest_limit_says_what_is_left_and_a_new_window_starts_from_nothing() {
        let now = at("2026-12-06T10:00:00Z");
        let mut limits = Velocities::NONE.replaced(
            &[
                limit("day", Some(1_000), Some(3)),
                limit("month", Some(1_500), None),
                limit("1m", None, Some(2)),
            ],
            None,
            now,
            (0, 0),
        );
        assert_eq!(limits.velocity[0].used.from, now, "a limit set today counts from when it was set");
        limits.count(600, now);
        let room = limits.room(now);
        assert_eq!(room.amount.map(|t| (t.left, t.per)), Some((400, Per::Day)));
        assert_eq!(room.count.map(|t| (t.left, t.per)), Some((1, Per::Every(60))));
        let over = room.refuses(401).unwrap();
        let resets = at("2026-12-07T00:00:00Z");
        assert_eq!(
            over,
            Refusal::LimitExceeded { limit: LimitKind::Amount(Per::Day), left: 400, resets_at: Some(resets) }
        );
        assert_eq!(room.refuses(400), None);
        limits.count(1, now);
        let minute_end = at("2026-12-06T10:01:00Z");
        assert_eq!(
            limits.room(now).refuses(1),
            Some(Refusal::LimitExceeded {
                limit: LimitKind::Count(Per::Every(60)),
                left: 0,
                resets_at: Some(minute_end)
            })
        );
        // The next minute: the count per minute starts again; the day's amount does not.
        let later = minute_end;
        assert_eq!(limits.room(later).refuses(1), None);
        limits.count(399, later);
        let day = limits.room(later).amount.unwrap();
        assert_eq!((day.left, day.per), (0, Per::Day));
        // The next day, the day's window is new, the month's is not.
        let tomorrow = at("2026-12-07T09:00:00Z");
        let room = limits.room(tomorrow);
        assert_eq!(room.amount.map(|t| (t.left, t.per)), Some((500, Per::Month)));
    }

    #[test]
    fn a_hold_gives_back_only_to_the_window_that_counted_it() {
        let placed = at("2026-12-06T23:59:00Z");
        let mut limits = Velocities::NONE.replaced(
            &[limit("day", Some(100), Some(5))],
            None,
            at("2026-12-01T00:00:00Z"),
            (0, 0),
        );
        limits.count(70, placed);
        limits.give_back(placed, 30, 0, placed);
        assert_eq!(
            (limits.velocity[0].used.amount, limits.velocity[0].used.count),
            (40, 1),
            "captured 40 of 70"
        );
        limits.give_back(placed, 40, 1, at("2026-12-07T00:00:01Z"));
        let used = limits.velocity[0].used;
        assert_eq!(
            (used.from, used.amount, used.count),
            (at("2026-12-07T00:00:00Z"), 0, 0),
            "yesterday's stays spent"
        );
        let before_set = at("2026-11-30T12:00:00Z");
        limits.count(10, at("2026-12-07T01:00:00Z"));
        limits.give_back(before_set, 10, 1, at("2026-12-07T01:00:00Z"));
        assert_eq!(
            limits.velocity[0].used.amount, 10,
            "a hold placed before the window gives nothing back to it"
        );
    }

    #[test]
    fn replaced_limits_keep_what_their_window_took_in_the_same_zone_only() {
        let now = at("2026-12-06T10:00:00Z");
        let mut limits = Velocities::NONE.replaced(&[limit("day", Some(100), None)], None, now, (0, 0));
        limits.count(60, now);
        let later = at("2026-12-06T11:00:00Z");
        let kept = limits.replaced(
            &[limit("day", Some(80), Some(9)), limit("week", Some(500), None)],
            None,
            later,
            (7, 1),
        );
        assert_eq!(kept.velocity[0].used.amount, 60, "the day's limit changed, not what the day took");
        let week = kept.velocity[1].used;
        assert_eq!(
            (week.from, week.amount, week.count),
            (later, 7, 1),
            "a new one counts what its moment took"
        );
        let elsewhere = kept.replaced(
            &[limit("day", Some(80), None)],
            Some("Asia/Tokyo".parse().unwrap()),
            later,
            (0, 0),
        );
        assert_eq!(
            (elsewhere.velocity[0].used.from, elsewhere.velocity[0].used.amount),
            (later, 0),
            "another zone's day"
        );
    }
}
