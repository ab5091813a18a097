//! The lease's Lua scripts, and how they are sent.
//!
//! Each operation that must compare and then act (take the lease, issue a fence and hand over the
//! last holder's note; delete only our own token and leave ours; extend only our own token) is one
//! script, because Redis runs a script atomically: nothing can happen between the comparison and
//! the action. Every key a script touches is passed in `KEYS` and shares the lease's hash tag, so
//! the script also runs unchanged on Redis Cluster.
//!
//! # Two ways to run them
//! The same scripts are a Redis Functions library, [`LIBRARY`] (`walletlock`), which the deploy
//! step loads as an administrator (`walletlock redis-functions`); the replicas then call them with
//! `FCALL` and need no right to run code of their own (no `EVAL`, `SCRIPT` or `FUNCTION`), so a
//! leaked replica credential cannot run an endless script that stops Redis for everyone. A server
//! without Functions (Redis < 7), or one where the library is not loaded, gets each script by
//! `EVALSHA`/`EVAL` instead. Which way is decided on first use and logged ([`Scripting`]), and
//! changed when the server says otherwise: `FCALL` answered "Function not found" (a restart
//! without persistence lost the library), or `EVAL` refused with `NOPERM` (the user may only
//! `FCALL`).
//!
//! # Fences are exact
//! Lua numbers are doubles, exact only up to 2^53, and Redis turns a Lua number into a command
//! argument in exponent form above 10^14. So no fence ever passes through a Lua number: the
//! counter is moved by Redis's own 64-bit `INCR`, read back with `GET` as a string of digits,
//! compared as such (length, then digits), and returned as that string.

use deadpool_redis::redis::{self, FromRedisValue, ServerErrorKind, ToRedisArgs, aio::ConnectionLike};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The name the library is loaded under.
pub const LIBRARY_NAME: &str = "walletlock";

/// Shared by every script (and defined once in the library).
const HELPERS: &str = r#"
-- Whether the digits `a` stand for a number above the digits `b` (both without sign or leading
-- zeros): the longer is larger, and at equal length the digits compare in order.
local function fence_above(a, b)
  if #a ~= #b then
    return #a > #b
  end
  return a > b
end

-- Moves the fence counter at `key` one up and returns the new fence as a string, and whether the
-- counter started over. A counter that cannot be incremented (at 2^63-1, or not an integer)
-- starts over at 1, as one that Redis lost does: the store that has seen higher fences refuses it,
-- and the holder lifts it above them (walletlock_advance_fence).
local function next_fence(key, retention)
  local restarted = 0
  if type(redis.pcall('INCR', key)) == 'table' then
    redis.call('SET', key, '1')
    restarted = 1
  end
  redis.call('PEXPIRE', key, retention)
  return redis.call('GET', key), restarted
end
"#;

/// A Lua script with its SHA1 and its function's name in [`LIBRARY`].
pub(super) struct LeaseScript {
    function: &'static str,
    /// The script's body: reads `KEYS` and `ARGV`, may call the helpers.
    body: &'static str,
    /// The helpers and the body, as sent by `EVAL`.
    code: String,
    sha1: String,
}

impl LeaseScript {
    fn new(function: &'static str, body: &'static str) -> Self {
        let code = format!("{HELPERS}{body}");
        let sha1 = redis::Script::new(&code).get_hash().to_owned();
        Self { function, body, code, sha1 }
    }

    /// Runs the script with `keys` and `args` (a value or a tuple of values) on `conn`, the way
    /// `scripting` says, switching when the server refuses that way.
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
        scripting: &Scripting,
        keys: &[&str],
        args: impl ToRedisArgs,
    ) -> redis::RedisResult<T> {
        if scripting.get() == Way::Unknown {
            scripting.decide(conn).await?;
        }
        if scripting.get() == Way::Functions {
            match command("FCALL", self.function, keys, &args).query_async(conn).await {
                Err(err) if is_function_missing(&err) => {
                    scripting.switch(Way::Scripts, "the walletlock library is not loaded (FCALL: Function not found); load it with `walletlock redis-functions` as an administrator");
                }
                other => return other,
            }
        }
        match self.evaluate(conn, keys, &args).await {
            Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoPerm) => {
                // This user may not run scripts of its own; perhaps the library is loaded now.
                let called = command("FCALL", self.function, keys, &args).query_async(conn).await;
                if called.is_ok() {
                    scripting.switch(Way::Functions, "EVAL is refused to this user and FCALL works");
                }
                called.map_err(|_| err)
            }
            other => other,
        }
    }

    /// `EVALSHA`, and `EVAL` with the full text when the server's script cache does not know it (a
    /// restart, a failover or `SCRIPT FLUSH` empties that cache), which also caches it again.
    async fn evaluate<T: FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: &impl ToRedisArgs,
    ) -> redis::RedisResult<T> {
        // Not `redis::Script::invoke_async`: on `NOSCRIPT` it sends `SCRIPT LOAD`, then the same
        // `EVALSHA` again (redis 1.2): three round trips in all, where `EVAL` runs the script and
        // caches it in the second.
        match command("EVALSHA", &self.sha1, keys, args).query_async(conn).await {
            Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                command("EVAL", &self.code, keys, args).query_async(conn).await
            }
            other => other,
        }
    }
}

fn command(verb: &str, script: &str, keys: &[&str], args: &impl ToRedisArgs) -> redis::Cmd {
    let mut cmd = redis::cmd(verb);
    cmd.arg(script).arg(keys.len()).arg(keys).arg(args);
    cmd
}

fn is_function_missing(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|detail| detail.starts_with("Function not found"))
}

/// How a [`super::LeaseClient`] sends its scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Way {
    /// Not decided yet: Redis has not been reached.
    Unknown = 0,
    /// `FCALL` into the loaded [`LIBRARY`].
    Functions = 1,
    /// `EVALSHA`, falling back to `EVAL`.
    Scripts = 2,
}

/// The way scripts are sent, shared by a client's clones.
#[derive(Debug, Default)]
pub(super) struct Scripting(AtomicU8);

impl Scripting {
    pub(super) fn get(&self) -> Way {
        match self.0.load(Ordering::Relaxed) {
            1 => Way::Functions,
            2 => Way::Scripts,
            _ => Way::Unknown,
        }
    }

    fn switch(&self, way: Way, why: &str) {
        if self.0.swap(way as u8, Ordering::Relaxed) != way as u8 {
            tracing::warn!(way = ?way, why, "lease scripts: switched the way they are sent");
        }
    }

    /// Asks the server whether the library is loaded (`FUNCTION LIST`), and logs the way chosen.
    /// Only a Redis that could not be reached leaves it undecided.
    pub(super) async fn decide(&self, conn: &mut impl ConnectionLike) -> redis::RedisResult<Way> {
        let (way, why) = match loaded_library(conn).await {
            Ok(Some(code)) if code == LIBRARY.as_str() => {
                (Way::Functions, "the walletlock library is loaded")
            }
            Ok(Some(_)) => (
                Way::Functions,
                "the walletlock library is loaded, but not this build's: load this build's with `walletlock redis-functions`",
            ),
            Ok(None) => (Way::Scripts, "the walletlock library is not loaded"),
            Err(err) if err.is_io_error() || err.is_timeout() || err.is_connection_dropped() => {
                return Err(err);
            }
            Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoPerm) => {
                (Way::Functions, "this user may not list functions; calling them")
            }
            Err(_) => (Way::Scripts, "this server has no Functions (Redis < 7)"),
        };
        if self
            .0
            .compare_exchange(Way::Unknown as u8, way as u8, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            match way {
                Way::Functions => tracing::info!(
                    library = LIBRARY_NAME,
                    why,
                    "lease scripts run as Redis Functions (FCALL)"
                ),
                _ => tracing::info!(why, "lease scripts run as EVALSHA scripts"),
            }
        }
        Ok(self.get())
    }
}

/// The code of the library named [`LIBRARY_NAME`] that the server holds, if it holds one.
pub(super) async fn loaded_library(conn: &mut impl ConnectionLike) -> redis::RedisResult<Option<String>> {
    let mut list = redis::cmd("FUNCTION");
    list.arg("LIST").arg("LIBRARYNAME").arg(LIBRARY_NAME).arg("WITHCODE");
    let libraries = list.query_async::<Vec<HashMap<String, redis::Value>>>(conn).await?;
    let ours = libraries.iter().find(|library| {
        library.get("library_name").and_then(|v| String::from_redis_value_ref(v).ok()).as_deref()
            == Some(LIBRARY_NAME)
    });
    Ok(ours
        .and_then(|library| library.get("library_code"))
        .and_then(|code| String::from_redis_value_ref(code).ok()))
}

/// Takes the lease if it is free and issues the next fencing token, and hands over the note its
/// last holder left, in one round trip.
///
/// KEYS: lease, fence counter, contended flag, note. ARGV: token, ttl in ms (at least 1: `Ttl`
/// guarantees it, so the key always expires), fence retention in ms. Returns `{1, fence, note}`
/// when taken (`{2, fence, note}` when the counter could not grow and started over: see
/// `next_fence`), `{0, pttl, nil}` when another holder has it; then the lease is marked contended
/// for one TTL, so its holder publishes a wake-up when it releases.
///
/// The note is deleted as it is handed over: a holder that takes the lease and never releases it
/// (it crashed, or lost the lease) leaves no note, so the next holder reads the store instead. A
/// caller without a note key (a replica of the build before notes) passes three keys and gets none.
///
/// The counter expires after the retention without an acquisition, so names that went idle do not
/// hold Redis memory forever; a counter that restarts from zero is the same case as a counter lost
/// to a flush, and is caught and lifted the same way (`ADVANCE_FENCE`).
///
/// The second branch covers an earlier attempt of ours whose reply was lost (a timeout or a dropped
/// connection after Redis applied the SET): the lease is already ours, so it is renewed and its
/// fence returned rather than waiting for our own lease to expire. Nobody else can have moved the
/// counter since, because only the lease holder increments it.
pub(super) static ACQUIRE: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        "walletlock_acquire",
        r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence, restarted = next_fence(KEYS[2], ARGV[3])
  local note = false
  if KEYS[4] then
    note = redis.call('GET', KEYS[4])
    if note then
      redis.call('DEL', KEYS[4])
    end
  end
  return {1 + restarted, fence, note}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, redis.call('GET', KEYS[2]) or '0', false}
end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return {0, redis.call('PTTL', KEYS[1]), false}
"#,
    )
});

/// What [`ACQUIRE`] answered: `taken` 1 or 2 with the fence and the note handed over, or 0 with
/// the lease's remaining time in `fence`. A library loaded by the build before notes answers two
/// items, and hands over no note.
pub(super) struct Acquired {
    pub(super) taken: i64,
    pub(super) fence: i64,
    pub(super) note: Option<String>,
}

impl FromRedisValue for Acquired {
    fn from_redis_value_ref(value: &redis::Value) -> Result<Self, redis::ParsingError> {
        let items: Vec<redis::Value> = Vec::from_redis_value_ref(value)?;
        let (taken, fence, note) = match items.as_slice() {
            [taken, fence] => (taken, fence, None),
            [taken, fence, note] => (taken, fence, Some(note)),
            _ => return Err(format!("the acquire script answered {} items", items.len()).into()),
        };
        Ok(Self {
            taken: i64::from_redis_value_ref(taken)?,
            fence: i64::from_redis_value_ref(fence)?,
            note: note.map(Option::<String>::from_redis_value_ref).transpose()?.flatten(),
        })
    }

    fn from_redis_value(value: redis::Value) -> Result<Self, redis::ParsingError> {
        Self::from_redis_value_ref(&value)
    }
}

/// Deletes the lease only if it still holds our token, leaves the holder's note for the next one,
/// and wakes the waiters if there are any. KEYS: lease, contended flag, note. ARGV: token, release
/// channel, note (empty: none), note retention in ms. Returns `{1, contended}` if deleted
/// (`contended` is 1 when someone was waiting, and then a wake-up was published), `{0, 0}` if the
/// lease had expired or belongs to someone else (then nothing is deleted and no note is left: only
/// the holder may leave one).
pub(super) static RELEASE: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        "walletlock_release",
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[3] and ARGV[3] and ARGV[3] ~= '' then
    redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
  end
  local contended = redis.call('DEL', KEYS[2])
  if contended == 1 then
    redis.call('PUBLISH', ARGV[2], '1')
  end
  return {1, contended}
end
return {0, 0}
"#,
    )
});

/// Resets the lease's expiry only if it still holds our token. KEYS: lease. ARGV: token, ttl in ms.
/// Returns 1 if extended, 0 if the lease is no longer ours.
pub(super) static REFRESH: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        "walletlock_refresh",
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#,
    )
});

/// Issues a new fence above `floor`, only for the current holder. KEYS: lease, fence counter.
/// ARGV: token, floor (digits, at least 0), fence retention in ms. Returns `{1, fence}`, `{0, 0}`
/// if the lease is no longer ours, or `{-1, 0}` if `floor` is 2^63-1, above which no fence exists.
///
/// Used when a downstream store has already seen a fence at least as high as ours: Redis lost the
/// counter (restart without persistence, FLUSHALL, failover to a replica that lagged), so it went
/// backwards. Lifting it above what the store saw keeps tokens growing without wedging the name.
/// A counter already above `floor` just moves one up; one at or below it (or unreadable) is set to
/// `floor`, and `INCR` makes that `floor + 1` exactly.
pub(super) static ADVANCE_FENCE: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        "walletlock_advance_fence",
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0, 0}
end
local counter = redis.call('GET', KEYS[2])
local ahead = counter and string.match(counter, '^[1-9]%d*$') and fence_above(counter, ARGV[2])
if not ahead or type(redis.pcall('INCR', KEYS[2])) == 'table' then
  redis.call('SET', KEYS[2], ARGV[2])
  if type(redis.pcall('INCR', KEYS[2])) == 'table' then
    return {-1, 0}
  end
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {1, redis.call('GET', KEYS[2])}
"#,
    )
});

/// The scripts as a Redis Functions library named [`LIBRARY_NAME`], for `FUNCTION LOAD`: each
/// script's body is a function whose parameters are named `KEYS` and `ARGV`, so it reads exactly as
/// it does under `EVAL`.
pub static LIBRARY: LazyLock<String> = LazyLock::new(|| {
    let mut library = format!("#!lua name={LIBRARY_NAME}\n{HELPERS}");
    for script in [&*ACQUIRE, &*RELEASE, &*REFRESH, &*ADVANCE_FENCE] {
        library.push_str(&format!(
            "\nredis.register_function('{}', function(KEYS, ARGV)\n{}\nend)\n",
            script.function, script.body
        ));
    }
    library
});
