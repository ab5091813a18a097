//! Settings: every option is a flag and an environment variable, listed with its default by
//! `walletlock <command> --help`. An invalid value stops the process with one line naming it.
//! Each setting's help here is its documentation: `walletlock settings` prints the table of
//! `docs/operating/settings.md` from these definitions (`crate::generated_docs`).

use crate::lease::Ttl;
use crate::wallet::{RedisOutage, Strategy};
use clap::Args;
use secrecy::{ExposeSecret, SecretString};
use std::{net::SocketAddr, path::PathBuf, time::Duration};

pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|err| err.to_string())
}

fn secret(text: &str) -> Result<SecretString, String> {
    Ok(SecretString::from(text.to_owned()))
}

/// Postgres: where, and how many connections.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// Postgres connection URL; secret, never logged. `?sslmode=verify-full&sslrootcert=<CA file>`
    /// for verified TLS (docs/operating/tls.md): a certificate file it names that is missing,
    /// unreadable or empty stops the process at startup.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = secret)]
    pub database_url: SecretString,
    /// Postgres connections per replica, opened when needed and kept. Replicas × pool size must
    /// stay under Postgres's max_connections (docs/operating/scaling-out.md).
    #[arg(long, env = "PG_POOL_SIZE", default_value_t = 10)]
    pub pg_pool_size: u32,
    /// How long to wait for a pooled connection before answering 503.
    #[arg(long, env = "PG_ACQUIRE_TIMEOUT", default_value = "1s", value_parser = duration)]
    pub pg_acquire_timeout: Duration,
}

/// Redis: where, how many connections, and the TLS material.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Redis: `redis://[user:password@]host:port` for one node,
    /// `redis+sentinel://[user:password@]host:port,host:port/master-name` for a primary that Redis
    /// Sentinel fails over (the credentials are the data nodes'), or
    /// `redis+cluster://[user:password@]host:port,host:port` for a Redis Cluster (seed nodes).
    /// `rediss://`, `rediss+sentinel://` (Sentinels and data nodes) and `rediss+cluster://` are the
    /// same over TLS, the server's certificate verified (docs/operating/tls.md). Secret (it may hold
    /// a password), never logged.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379", hide_env_values = true, value_parser = secret)]
    pub redis_url: SecretString,
    /// With a TLS REDIS_URL: PEM file of the certificate authorities that sign the Redis servers'
    /// certificates (default: the system's roots).
    #[arg(long, env = "REDIS_TLS_CA_FILE")]
    pub redis_tls_ca_file: Option<PathBuf>,
    /// With a TLS REDIS_URL: PEM file of this replica's client certificate chain, for servers
    /// that require one (mutual TLS). Needs REDIS_TLS_KEY_FILE.
    #[arg(long, env = "REDIS_TLS_CERT_FILE", requires = "redis_tls_key_file")]
    pub redis_tls_cert_file: Option<PathBuf>,
    /// The private key (PEM) of REDIS_TLS_CERT_FILE.
    #[arg(long, env = "REDIS_TLS_KEY_FILE", requires = "redis_tls_cert_file")]
    pub redis_tls_key_file: Option<PathBuf>,
    /// Redis connections per replica.
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = 16)]
    pub redis_pool_size: usize,
    /// Prefix of every lease key, so several deployments can share one Redis.
    #[arg(long, env = "REDIS_KEY_PREFIX", default_value = "walletlock")]
    pub redis_key_prefix: String,
    /// Bound on any single Redis call, pool checkout included.
    #[arg(long, env = "REDIS_TIMEOUT", default_value = "500ms", value_parser = duration)]
    pub redis_timeout: Duration,
}

/// The wallet lease's timing.
#[derive(Debug, Clone, Args)]
pub struct LeaseArgs {
    /// A lease's life without a refresh (at least 1ms). The watchdog refreshes every third of it;
    /// a crashed holder blocks its wallet for at most this long.
    #[arg(long, env = "LEASE_TTL", default_value = "2s")]
    pub lease_ttl: Ttl,
    /// How long a payment waits for its wallet's lease before 503 lock_timeout.
    #[arg(long, env = "LEASE_WAIT", default_value = "3s", value_parser = duration)]
    pub lease_wait: Duration,
    /// How long Redis keeps a wallet's last known state (balance, version, fence, owner) after its
    /// lease is released, so that the wallet's next payment need not read it from Postgres: the
    /// commit's compare-and-set checks it, and a stale one costs a read. 0s: never kept.
    #[arg(long, env = "LEASE_NOTE_TTL", default_value = "1h", value_parser = duration)]
    pub lease_note_ttl: Duration,
    /// How payments wait for a busy wallet: `queue` (requests for one wallet queue on each
    /// replica behind one worker that applies them in batches under one lease, woken when the
    /// lease is released) or `tutorial` (every request polls the lease every 5 to 15 ms and commits
    /// alone: the tutorial's lock, kept as the benchmark's baseline).
    #[arg(long, env = "LEASE_STRATEGY", value_enum, default_value = "queue")]
    pub lease_strategy: Strategy,
    /// What payments do while Redis cannot be reached: `postgres` (move money under Postgres
    /// alone, each wallet's row locked in its transaction, until Redis answers again) or `refuse`
    /// (503 `lock_timeout` or `dependency_unavailable`). The `tutorial` strategy always refuses
    /// (docs/operating/redis-outages.md).
    #[arg(long, env = "REDIS_OUTAGE", value_enum, default_value = "postgres")]
    pub redis_outage: RedisOutage,
}

impl LeaseArgs {
    /// What payments do while Redis is unreachable, for this strategy.
    pub fn outage(&self) -> RedisOutage {
        match self.lease_strategy {
            Strategy::Queue => self.redis_outage,
            Strategy::Tutorial => RedisOutage::Refuse,
        }
    }
}

/// `walletlock serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// This replica's name, sent as X-Served-By and in every log line (default: `<hostname>-<port>`).
    #[arg(long, env = "REPLICA_NAME")]
    pub replica_name: Option<String>,
    /// How long shutdown waits for open connections and payments in flight.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "10s", value_parser = duration)]
    pub shutdown_grace: Duration,
    /// Bound on one request, from arrival to response (503 request_timeout past it). Keep it
    /// above LEASE_WAIT and below nginx's proxy_read_timeout (10 s).
    #[arg(long, env = "REQUEST_TIMEOUT", default_value = "8s", value_parser = duration)]
    pub request_timeout: Duration,
    /// How many `/wallets` requests this replica handles at once. One more is answered 503
    /// `overloaded` (with Retry-After) before its token or body is read or anything else is done,
    /// so a flood costs the replica a bounded amount of memory and work
    /// (docs/operating/overload.md).
    #[arg(long, env = "MAX_IN_FLIGHT", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: u32,
    /// How many deposits and payments one wallet may have queued on this replica. One more is
    /// answered 503 `overloaded` at once: it could not be served within LEASE_WAIT anyway.
    #[arg(long, env = "WALLET_QUEUE_LIMIT", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub wallet_queue_limit: u32,
    /// The listening socket's backlog: connections the kernel completes before the replica accepts
    /// them (capped by net.core.somaxconn). Room for a burst from nginx's connections.
    #[arg(long, env = "LISTEN_BACKLOG", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub listen_backlog: u32,
    /// How long a stored response is replayed for its Idempotency-Key before the key is purged.
    #[arg(long, env = "IDEMPOTENCY_RETENTION", default_value = "24h", value_parser = duration)]
    pub idempotency_retention: Duration,
    /// When a request still in flight with an Idempotency-Key counts as abandoned (its replica
    /// died), so a retry may take the key over. Keep it above REQUEST_TIMEOUT.
    #[arg(long, env = "IDEMPOTENCY_STALE_AFTER", default_value = "10s", value_parser = duration)]
    pub idempotency_stale_after: Duration,
    /// API tokens: `caller:token` entries separated by commas (several per caller, to rotate), and
    /// `grant` entries (docs/api/callers.md); `walletlock token` makes a token. This or
    /// API_TOKENS_FILE is required. Secret, never logged.
    #[arg(long, env = "API_TOKENS", hide_env_values = true, value_parser = secret)]
    pub api_tokens: Option<SecretString>,
    /// A file of API tokens, one `caller:token` or `grant` entry per line (`#` comments). Used
    /// with or instead of API_TOKENS.
    #[arg(long, env = "API_TOKENS_FILE")]
    pub api_tokens_file: Option<std::path::PathBuf>,
    /// Whether each movement writes its events (docs/api/events.md): `on`, or `off` only to
    /// measure what they cost (loadtest/bench): the feed then misses this replica's movements, and
    /// `walletlock audit` reports the entries it wrote without one on wallets that had events.
    #[arg(long, env = "EVENTS", value_enum, default_value = "on")]
    pub events: Switch,
    /// Hosts (names or addresses, comma-separated) a webhook endpoint may be at although they are
    /// not public addresses: an operator's own receivers. Callers may not make the replicas call
    /// loopback, private or link-local addresses otherwise (docs/api/webhooks.md).
    #[arg(long, env = "WEBHOOK_ALLOW_HOSTS", value_delimiter = ',')]
    pub webhook_allow_hosts: Vec<String>,
    /// How long a webhook delivery waits for the endpoint's answer.
    #[arg(long, env = "WEBHOOK_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub webhook_timeout: Duration,
    /// How long an endpoint that does not take a wallet's event is retried (with backoff) before it
    /// is disabled, with the reason.
    #[arg(long, env = "WEBHOOK_RETRY_FOR", default_value = "3days", value_parser = duration)]
    pub webhook_retry_for: Duration,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub lease: LeaseArgs,
}

/// A setting that is on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

impl ServeArgs {
    /// Every configured `caller:token` entry, from `API_TOKENS` and `API_TOKENS_FILE`, for
    /// [`crate::http::auth::Callers::parse`].
    pub fn api_tokens(&self) -> anyhow::Result<SecretString> {
        let mut spec = self.api_tokens.as_ref().map(|t| t.expose_secret().to_owned()).unwrap_or_default();
        if let Some(path) = &self.api_tokens_file {
            let file = std::fs::read_to_string(path)
                .map_err(|err| anyhow::anyhow!("API_TOKENS_FILE {}: {err}", path.display()))?;
            spec.push('\n');
            spec.push_str(&file);
        }
        Ok(SecretString::from(spec))
    }

    /// The configured name, else `<hostname>-<port>` with the port actually bound.
    pub fn replica_name(&self, port: u16) -> String {
        self.replica_name.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|name| name.trim().to_owned())
                .unwrap_or_else(|_| "walletlock".to_owned());
            format!("{host}-{port}")
        })
    }
}
