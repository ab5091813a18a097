//! Settings: every option is a flag and an environment variable, listed with its default by
//! `walletlock <command> --help`. An invalid value stops the process with one line naming it.
//! Each setting's help here is its documentation: `walletlock settings` prints the table of
//! `docs/operating/settings.md` from these definitions (`crate::generated_docs`).

use crate::lease::{
    Backoff, ClusterManager, LeaseClient, LeaseSettings, RedisPool, SentinelManager, Ttl, WakeSource,
};
use crate::ledger::storage::Storage;
use crate::wallet::{RedisOutage, Strategy};
use clap::Args;
use secrecy::{ExposeSecret, SecretString};
use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::{net::SocketAddr, path::PathBuf, str::FromStr, time::Duration};

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

/// Bounds on what a replica's Postgres session may hold, sent as session settings when each
/// connection opens. A replica that stalls or is cut off in the middle of a transaction (a transfer,
/// a wallet's creation) must not keep its rows locked past about one lease: the server ends the
/// session once it sits idle in a transaction for [`IDLE_IN_TRANSACTION_LIMIT`], and notices a peer
/// that vanished (no RST: a partition, a frozen VM) by TCP keepalives and the user timeout within
/// about ten seconds even outside one. A statement that runs past [`STATEMENT_LIMIT`] (below
/// `REQUEST_TIMEOUT`) is cancelled, so nothing a request started outlives it by much. Rounds hold no
/// transaction open and never wait for a row (`SKIP LOCKED`), so they meet none of these limits.
const IDLE_IN_TRANSACTION_LIMIT: &str = "2s";
const STATEMENT_LIMIT: &str = "5s";
const SESSION_BOUNDS: [(&str, &str); 6] = [
    ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION_LIMIT),
    ("statement_timeout", STATEMENT_LIMIT),
    ("tcp_keepalives_idle", "5"),
    ("tcp_keepalives_interval", "2"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "10000"),
];

impl DatabaseArgs {
    /// The replica's pool: [`DatabaseArgs::pool`], every session bounded by `SESSION_BOUNDS`.
    pub fn serving_pool(&self) -> anyhow::Result<PgPool> {
        let pool = self.pool()?;
        let options = pool.connect_options().as_ref().clone().options(SESSION_BOUNDS);
        pool.set_connect_options(options);
        Ok(pool)
    }

    /// A pool that connects on first use, so a replica starts (and reports not ready) while
    /// Postgres is still down. Its sessions have no time limits: `migrate` and `audit` use it
    /// as they are, for as long as they need. A certificate file named in the URL
    /// (`sslrootcert`, or `PGSSLROOTCERT`; `sslcert`) that is missing, unreadable or empty, or an
    /// unreadable `sslkey`, stops the process here, rather than failing every connection.
    pub fn pool(&self) -> anyhow::Result<PgPool> {
        let url = self.database_url.expose_secret();
        let options = PgConnectOptions::from_str(url)
            .map_err(|err| anyhow::anyhow!("DATABASE_URL is not a Postgres URL: {err}"))?
            // Every statement a replica prepares is one fixed shape over keys (a wallet's id, an
            // idempotency key, arrays of them in a round), which one generic plan serves as well as
            // a plan made for each execution's values. Left to choose, Postgres kept planning the
            // rounds' statements anew on every execution: a tenth of its CPU on the spread benchmark.
            .options([("plan_cache_mode", "force_generic_plan")]);
        // A value that is itself a PEM (sqlx accepts one inline) names no file.
        let file = |value: String| (!value.trim_start().starts_with("-----BEGIN")).then_some(value);
        let root_cert = url_parameter(url, &["sslrootcert", "ssl-root-cert", "ssl-ca"])
            .or_else(|| std::env::var("PGSSLROOTCERT").ok());
        if let Some(path) = root_cert.and_then(file) {
            read_certificates("DATABASE_URL sslrootcert", std::path::Path::new(&path))?;
        }
        if let Some(path) = url_parameter(url, &["sslcert", "ssl-cert"]).and_then(file) {
            read_certificates("DATABASE_URL sslcert", std::path::Path::new(&path))?;
        }
        if let Some(path) = url_parameter(url, &["sslkey", "ssl-key"]).and_then(file) {
            std::fs::read(&path).map_err(|err| anyhow::anyhow!("DATABASE_URL sslkey {path}: {err}"))?;
        }
        Ok(PgPoolOptions::new()
            .max_connections(self.pg_pool_size)
            .acquire_timeout(self.pg_acquire_timeout)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // Citus routes a statement to the node of its wallet by the values of its
                    // parameters, which a generic plan does not have: it refuses to plan most of
                    // them ("could not create distributed plan"). There, plan each execution.
                    // And a `SET LOCAL` (a lock timeout) reaches the workers the transaction
                    // runs on.
                    if Storage::of(conn).await? == Storage::Citus {
                        conn.execute(
                            "set plan_cache_mode = force_custom_plan; set citus.propagate_set_commands = 'local'",
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_lazy_with(options))
    }
}

/// The value of the first of `names` in `url`'s query string, percent-decoded.
fn url_parameter(url: &str, names: &[&str]) -> Option<String> {
    let (_, query) = url.split_once('?')?;
    let value = query.split('&').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        names.contains(&name).then_some(value)
    })?;
    let bytes = value.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                decoded.push(byte);
                i += 3;
            }
            (b'+', _) => {
                decoded.push(b' ');
                i += 1;
            }
            (byte, _) => {
                decoded.push(byte);
                i += 1;
            }
        }
    }
    Some(String::from_utf8_lossy(&decoded).into_owned())
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

/// The three forms of `REDIS_URL`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RedisTarget {
    /// `redis[s]://[user:password@]host:port[/db]`
    Node(String),
    /// `redis[s]+sentinel://[user:password@]host:port,host:port,.../master-name`: the Sentinels
    /// to ask (as URLs), the name of the primary they watch, and the credentials for the data
    /// nodes. With TLS, to the Sentinels and to the data nodes alike.
    Sentinel { sentinels: Vec<String>, master: String, username: Option<String>, password: Option<String> },
    /// `redis[s]+cluster://[user:password@]host:port,host:port,...`: seed nodes, as URLs.
    Cluster { nodes: Vec<String> },
}

impl RedisTarget {
    fn parse(url: &str) -> Result<Self, String> {
        let several = |rest: &str| -> (Option<String>, Vec<String>) {
            let (userinfo, hosts) = match rest.rsplit_once('@') {
                Some((userinfo, hosts)) => (Some(userinfo.to_owned()), hosts),
                None => (None, rest),
            };
            (userinfo, hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(str::to_owned).collect())
        };
        if url.contains("#insecure") {
            return Err(
                "it asks for no certificate verification (#insecure); walletlock always verifies".into()
            );
        }
        let topology = |scheme: &str| {
            url.strip_prefix(&format!("redis+{scheme}://"))
                .map(|rest| ("redis", rest))
                .or_else(|| url.strip_prefix(&format!("rediss+{scheme}://")).map(|rest| ("rediss", rest)))
        };
        if let Some((scheme, rest)) = topology("sentinel") {
            let (authority, master) =
                rest.split_once('/').ok_or("a Sentinel REDIS_URL ends with /<master name>")?;
            let (userinfo, sentinels) = several(authority);
            let (username, password) = match userinfo.as_deref().map(|u| u.split_once(':')) {
                Some(Some((user, password))) => {
                    ((!user.is_empty()).then(|| user.to_owned()), Some(password.to_owned()))
                }
                Some(None) => (userinfo, None),
                None => (None, None),
            };
            if sentinels.is_empty() || master.is_empty() {
                return Err("a Sentinel REDIS_URL names at least one Sentinel and the master".into());
            }
            let sentinels = sentinels.iter().map(|host| format!("{scheme}://{host}")).collect();
            Ok(RedisTarget::Sentinel { sentinels, master: master.to_owned(), username, password })
        } else if let Some((scheme, rest)) = topology("cluster") {
            let (userinfo, hosts) = several(rest.trim_end_matches('/'));
            if hosts.is_empty() {
                return Err("a Cluster REDIS_URL names at least one node".into());
            }
            let credentials = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
            Ok(RedisTarget::Cluster {
                nodes: hosts.iter().map(|h| format!("{scheme}://{credentials}{h}")).collect(),
            })
        } else if url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("redis+unix://")
        {
            Ok(RedisTarget::Node(url.to_owned()))
        } else {
            Err("REDIS_URL starts with redis[s]://, redis[s]+sentinel:// or redis[s]+cluster://".into())
        }
    }

    /// Whether every connection is TLS.
    fn tls(&self) -> bool {
        match self {
            RedisTarget::Node(url) => url.starts_with("rediss://"),
            RedisTarget::Sentinel { sentinels: urls, .. } | RedisTarget::Cluster { nodes: urls } => {
                urls.iter().all(|url| url.starts_with("rediss://"))
            }
        }
    }
}

/// Reads a PEM file named by `setting` that must hold at least one certificate: a missing,
/// unreadable or empty file stops the process at startup, naming the setting, rather than failing
/// every connection later.
fn read_certificates(setting: &str, path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let pem = std::fs::read(path).map_err(|err| anyhow::anyhow!("{setting} {}: {err}", path.display()))?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| anyhow::anyhow!("{setting} {}: not PEM certificates: {err}", path.display()))?;
    if certificates.is_empty() {
        anyhow::bail!("{setting} {}: holds no PEM certificate", path.display());
    }
    Ok(pem)
}

/// Reads a PEM private key file named by `setting`, refusing a missing, unreadable or keyless one.
fn read_private_key(setting: &str, path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use rustls::pki_types::{PrivateKeyDer, pem::PemObject};
    let pem = std::fs::read(path).map_err(|err| anyhow::anyhow!("{setting} {}: {err}", path.display()))?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|err| anyhow::anyhow!("{setting} {}: not a PEM private key: {err}", path.display()))?;
    Ok(pem)
}

impl RedisArgs {
    fn pool_config(&self) -> deadpool_redis::PoolConfig {
        let mut pool = deadpool_redis::PoolConfig::new(self.redis_pool_size);
        // Without these a checkout would wait forever for a Redis that does not answer.
        pool.timeouts.wait = Some(self.redis_timeout);
        pool.timeouts.create = Some(self.redis_timeout);
        pool.timeouts.recycle = Some(self.redis_timeout);
        pool
    }

    /// The certificates to verify the servers with (and to present, for mutual TLS), read now;
    /// `None` for a plaintext URL. TLS settings with a plaintext URL are refused: they would
    /// suggest a protection the connections do not have.
    fn tls_certificates(
        &self,
        target: &RedisTarget,
    ) -> anyhow::Result<Option<deadpool_redis::redis::TlsCertificates>> {
        use deadpool_redis::redis::{ClientTlsConfig, TlsCertificates};
        if !target.tls() {
            if self.redis_tls_ca_file.is_some() || self.redis_tls_cert_file.is_some() {
                anyhow::bail!(
                    "REDIS_TLS_CA_FILE / REDIS_TLS_CERT_FILE are set but REDIS_URL is not a TLS URL (rediss://...)"
                );
            }
            return Ok(None);
        }
        let root_cert = match &self.redis_tls_ca_file {
            Some(path) => Some(read_certificates("REDIS_TLS_CA_FILE", path)?),
            None => None,
        };
        let client_tls = match (&self.redis_tls_cert_file, &self.redis_tls_key_file) {
            (Some(cert), Some(key)) => Some(ClientTlsConfig {
                client_cert: read_certificates("REDIS_TLS_CERT_FILE", cert)?,
                client_key: read_private_key("REDIS_TLS_KEY_FILE", key)?,
            }),
            _ => None,
        };
        Ok(Some(TlsCertificates { client_tls, root_cert }))
    }

    /// The connection pool for `REDIS_URL`'s topology, and where release notifications come from.
    /// Every client is built with the TLS certificates, so connections the topology finds later
    /// (a promoted primary, a redirected slot, the Pub/Sub connection) are verified the same way.
    pub fn connect(&self) -> anyhow::Result<(RedisPool, WakeSource)> {
        use deadpool_redis::redis::{self, IntoConnectionInfo};
        use deadpool_redis::{Runtime, redis::sentinel::SentinelServerType};
        let unusable = |err: &dyn std::fmt::Display| anyhow::anyhow!("REDIS_URL is not usable: {err}");
        let target = RedisTarget::parse(self.redis_url.expose_secret()).map_err(|err| unusable(&err))?;
        let tls = self.tls_certificates(&target)?;
        let client = |url: &str| match &tls {
            Some(certificates) => redis::Client::build_with_tls(url, certificates.clone()),
            None => redis::Client::open(url),
        };
        Ok(match target {
            RedisTarget::Node(url) => {
                let client = client(&url).map_err(|err| unusable(&err))?;
                let manager = deadpool_redis::Manager::new(client.get_connection_info().clone())
                    .map_err(|err| unusable(&err))?;
                let pool = deadpool_redis::Pool::builder(manager)
                    .config(self.pool_config())
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|err| unusable(&err))?;
                (RedisPool::Single(pool), client.into())
            }
            RedisTarget::Sentinel { sentinels, master, username, password } => {
                let sentinel_client = || -> redis::RedisResult<redis::sentinel::SentinelClient> {
                    let addresses = sentinels
                        .iter()
                        .map(|url| url.as_str().into_connection_info().map(|info| info.addr().clone()))
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut builder = redis::sentinel::SentinelClientBuilder::new(
                        addresses,
                        &master,
                        SentinelServerType::Master,
                    )?;
                    if let Some(username) = &username {
                        builder = builder.set_client_to_redis_username(username);
                    }
                    if let Some(password) = &password {
                        builder = builder.set_client_to_redis_password(password);
                    }
                    if let Some(certificates) = &tls {
                        builder = builder
                            .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                            .set_client_to_redis_certificates(certificates.clone())
                            .set_client_to_sentinel_certificates(certificates.clone());
                    }
                    builder.build()
                };
                let manager = SentinelManager::new(sentinel_client().map_err(|err| unusable(&err))?);
                let pool = deadpool::managed::Pool::builder(manager)
                    .config(self.pool_config())
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|err| unusable(&err))?;
                let wake = sentinel_client().map_err(|err| unusable(&err))?;
                (
                    RedisPool::Sentinel(pool),
                    WakeSource::Sentinel(std::sync::Arc::new(tokio::sync::Mutex::new(wake))),
                )
            }
            RedisTarget::Cluster { nodes } => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                if let Some(certificates) = &tls {
                    builder = builder.certs(certificates.clone());
                }
                let manager = ClusterManager::new(builder.build().map_err(|err| unusable(&err))?);
                let pool = deadpool::managed::Pool::builder(manager)
                    .config(self.pool_config())
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|err| unusable(&err))?;
                let clients = nodes
                    .iter()
                    .map(|url| client(url))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|err| unusable(&err))?;
                (RedisPool::Cluster(pool), WakeSource::AnyOf(clients))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::RedisTarget;

    #[test]
    fn redis_urls_name_a_node_a_sentinel_set_or_a_cluster() {
        assert_eq!(
            RedisTarget::parse("redis://:pw@127.0.0.1:6379"),
            Ok(RedisTarget::Node("redis://:pw@127.0.0.1:6379".into()))
        );
        assert_eq!(
            RedisTarget::parse("redis+sentinel://app:pw@10.0.0.1:26379,10.0.0.2:26379/walletlock"),
            Ok(RedisTarget::Sentinel {
                sentinels: vec!["redis://10.0.0.1:26379".into(), "redis://10.0.0.2:26379".into()],
                master: "walletlock".into(),
                username: Some("app".into()),
                password: Some("pw".into()),
            })
        );
        assert_eq!(
            RedisTarget::parse("redis+cluster://app:pw@n1:7000,n2:7001"),
            Ok(RedisTarget::Cluster {
                nodes: vec!["redis://app:pw@n1:7000".into(), "redis://app:pw@n2:7001".into()]
            })
        );
        assert!(!RedisTarget::parse("redis+cluster://n1:7000").unwrap().tls());
    }

    #[test]
    fn tls_urls_are_the_same_forms_with_rediss_and_never_skip_verification() {
        let node = RedisTarget::parse("rediss://:pw@redis.internal:6380").unwrap();
        assert!(node.tls());
        let sentinel = RedisTarget::parse("rediss+sentinel://app:pw@s1:26380,s2:26380/walletlock").unwrap();
        assert_eq!(
            sentinel,
            RedisTarget::Sentinel {
                sentinels: vec!["rediss://s1:26380".into(), "rediss://s2:26380".into()],
                master: "walletlock".into(),
                username: Some("app".into()),
                password: Some("pw".into()),
            }
        );
        assert!(sentinel.tls());
        let cluster = RedisTarget::parse("rediss+cluster://app:pw@n1:7000,n2:7001").unwrap();
        assert_eq!(
            cluster,
            RedisTarget::Cluster {
                nodes: vec!["rediss://app:pw@n1:7000".into(), "rediss://app:pw@n2:7001".into()]
            }
        );
        assert!(cluster.tls());
        assert!(RedisTarget::parse("rediss://h:6380/#insecure").is_err());
    }

    #[test]
    fn url_parameters_are_found_and_percent_decoded() {
        let url = "postgres://u@h/db?sslmode=verify-full&sslrootcert=/etc/ssl/my%20ca.pem";
        assert_eq!(super::url_parameter(url, &["sslrootcert"]).as_deref(), Some("/etc/ssl/my ca.pem"));
        assert_eq!(super::url_parameter(url, &["sslcert"]), None);
        assert_eq!(super::url_parameter("postgres://u@h/db", &["sslrootcert"]), None);
    }

    #[test]
    fn redis_urls_that_are_none_of_the_forms_are_refused() {
        for bad in ["http://x", "redis+sentinel://h:1", "redis+sentinel://h:1/", "redis+cluster://"] {
            assert!(RedisTarget::parse(bad).is_err(), "{bad}");
        }
    }
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

    /// The lease client for this strategy: with wake-ups on release, or the tutorial's polling.
    pub fn client(&self, redis: &RedisArgs) -> anyhow::Result<LeaseClient> {
        let settings = LeaseSettings::new(self.lease_ttl, self.lease_wait)
            .with_op_timeout(redis.redis_timeout)
            .with_note_retention(self.lease_note_ttl);
        // Going on under Postgres alone beats waiting out the whole lease wait for a Redis that
        // is gone.
        let settings = match self.outage() {
            RedisOutage::Postgres => settings.failing_fast(),
            RedisOutage::Refuse => settings,
        };
        let (pool, wake_source) = redis.connect()?;
        let prefix = redis.redis_key_prefix.clone();
        Ok(match self.lease_strategy {
            Strategy::Queue => LeaseClient::new(pool, prefix, settings).with_wakeups(wake_source),
            // The tutorial's lock reads the wallet for every payment: no notes.
            Strategy::Tutorial => LeaseClient::new(
                pool,
                prefix,
                settings.with_backoff(Backoff::TUTORIAL).with_note_retention(Duration::ZERO),
            ),
        })
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
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub lease: LeaseArgs,
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

    pub fn key_settings(&self) -> crate::idempotency::KeySettings {
        crate::idempotency::KeySettings {
            retention: self.idempotency_retention,
            stale_after: self.idempotency_stale_after,
        }
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
