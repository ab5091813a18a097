//! The lease's Lua scripts, and how they are sent.
//!
//! Each operation that must compare and then act (take the lease and issue a fence, delete only our
//! own token, extend only our own token) is one script, because Redis runs a script atomically:
//! nothing can happen between the comparison and the action. Every key a script touches is passed
//! in `KEYS` and shares the lease's hash tag, so the script also runs unchanged on Redis Cluster.

use deadpool_redis::redis::{self, FromRedisValue, ServerErrorKind, ToRedisArgs, aio::ConnectionLike};
use std::sync::LazyLock;

/// A Lua script with its SHA1, sent by `EVALSHA` and, when the server's script cache does not know
/// it (a restart, a failover or `SCRIPT FLUSH` empties that cache), by `EVAL` with the full text,
/// which also caches it again.
pub(super) struct LeaseScript {
    code: &'static str,
    sha1: String,
}

impl LeaseScript {
    fn new(code: &'static str) -> Self {
        let sha1 = redis::Script::new(code).get_hash().to_owned();
        Self { code, sha1 }
    }

    /// Runs the script with `keys` and `args` (a value or a tuple of values) on `conn`.
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: impl ToRedisArgs,
    ) -> redis::RedisResult<T> {
        let evalsha = command("EVALSHA", &self.sha1, keys, &args);
        match evalsha.query_async(conn).await {
            Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                command("EVAL", self.code, keys, &args).query_async(conn).await
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

/// Takes the lease if it is free and issues the next fencing token, in one round trip.
///
/// KEYS: lease, fence counter, contended flag. ARGV: token, ttl in ms (at least 1: `Ttl`
/// guarantees it, so the key always expires), fence retention in ms. Returns `{1, fence}` when
/// taken, `{0, pttl}` when another holder has it; then the lease is marked contended for one TTL,
/// so its holder publishes a wake-up when it releases.
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
        r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, fence}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return {0, redis.call('PTTL', KEYS[1])}
"#,
    )
});

/// Deletes the lease only if it still holds our token, and wakes the waiters if there are any.
/// KEYS: lease, contended flag. ARGV: token, release channel. Returns `{1, contended}` if deleted
/// (`contended` is 1 when someone was waiting, and then a wake-up was published), `{0, 0}` if the
/// lease had expired or belongs to someone else (then nothing is deleted).
pub(super) static RELEASE: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
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
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#,
    )
});

/// Issues a new fence above `floor`, only for the current holder. KEYS: lease, fence counter.
/// ARGV: token, floor. Returns the new fence, or -1 if the lease is no longer ours.
///
/// Used when a downstream store has already seen a fence at least as high as ours: Redis lost the
/// counter (restart without persistence, FLUSHALL, failover to a replica that lagged), so it went
/// backwards. Lifting it above what the store saw keeps tokens growing without wedging the name.
pub(super) static ADVANCE_FENCE: LazyLock<LeaseScript> = LazyLock::new(|| {
    LeaseScript::new(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local fence = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[2])
if fence <= floor then
  -- INCRBY rather than SET: SET would drop the counter's expiry.
  fence = redis.call('INCRBY', KEYS[2], floor + 1 - fence)
end
return fence
"#,
    )
});
