//! The pools and clients a process opens, built from its settings (`crate::config`): the Postgres
//! pool, every replica session bounded; the Redis pool of whichever topology `REDIS_URL` names, with
//! its TLS material; the lease client. The files the settings name (certificates, keys) are read
//! and checked here, so a missing or unusable one stops the process at startup, naming its setting.

use crate::config::{DatabaseArgs, LeaseArgs, RedisArgs};
use crate::lease::{
    Backoff, ClusterManager, LeaseClient, LeaseSettings, RedisPool, SentinelManager, WakeSource,
};
use crate::ledger::storage::Storage;
use crate::wallet::{RedisOutage, Strategy};
use secrecy::ExposeSecret;
use sqlx::postgres::{PgConnectOptions, PgPool};
use std::str::FromStr;
use std::time::Duration;

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

/// The replica's pool: [`postgres_pool`], every session bounded by `SESSION_BOUNDS`.
pub fn serving_postgres_pool(database: &DatabaseArgs) -> anyhow::Result<PgPool> {
    let pool = postgres_pool(database)?;
    let options = pool.connect_options().as_ref().clone().options(SESSION_BOUNDS);
    pool.set_connect_options(options);
    Ok(pool)
}

/// A pool that connects on first use, so a replica starts (and reports not ready) while
/// Postgres is still down. Its sessions have no time limits: `migrate` and `audit` use it
/// as they are, for as long as they need. A certificate file named in the URL
/// (`sslrootcert`, or `PGSSLROOTCERT`; `sslcert`) that is missing, unreadable or empty, or an
/// unreadable `sslkey`, stops the process here, rather than failing every connection.
pub fn postgres_pool(database: &DatabaseArgs) -> anyhow::Result<PgPool> {
    let url = database.database_url.expose_secret();
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
    Ok(Storage::pool_options()
        .max_connections(database.pg_pool_size)
        .acquire_timeout(database.pg_acquire_timeout)
        .connect_lazy_with(options))
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

/// The pool's size, and its bounds on waiting for Redis.
fn pool_config(redis: &RedisArgs) -> deadpool_redis::PoolConfig {
    let mut pool = deadpool_redis::PoolConfig::new(redis.redis_pool_size);
    // Without these a checkout would wait forever for a Redis that does not answer.
    pool.timeouts.wait = Some(redis.redis_timeout);
    pool.timeouts.create = Some(redis.redis_timeout);
    pool.timeouts.recycle = Some(redis.redis_timeout);
    pool
}

/// The certificates to verify the servers with (and to present, for mutual TLS), read now;
/// `None` for a plaintext URL. TLS settings with a plaintext URL are refused: they would
/// suggest a protection the connections do not have.
fn tls_certificates(
    redis: &RedisArgs,
    target: &RedisTarget,
) -> anyhow::Result<Option<deadpool_redis::redis::TlsCertificates>> {
    use deadpool_redis::redis::{ClientTlsConfig, TlsCertificates};
    if !target.tls() {
        if redis.redis_tls_ca_file.is_some() || redis.redis_tls_cert_file.is_some() {
            anyhow::bail!(
                "REDIS_TLS_CA_FILE / REDIS_TLS_CERT_FILE are set but REDIS_URL is not a TLS URL (rediss://...)"
            );
        }
        return Ok(None);
    }
    let root_cert = match &redis.redis_tls_ca_file {
        Some(path) => Some(read_certificates("REDIS_TLS_CA_FILE", path)?),
        None => None,
    };
    let client_tls = match (&redis.redis_tls_cert_file, &redis.redis_tls_key_file) {
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
pub fn redis_pool(redis: &RedisArgs) -> anyhow::Result<(RedisPool, WakeSource)> {
    use deadpool_redis::redis::{self, IntoConnectionInfo};
    use deadpool_redis::{Runtime, redis::sentinel::SentinelServerType};
    let unusable = |err: &dyn std::fmt::Display| anyhow::anyhow!("REDIS_URL is not usable: {err}");
    let target = RedisTarget::parse(redis.redis_url.expose_secret()).map_err(|err| unusable(&err))?;
    let tls = tls_certificates(redis, &target)?;
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
                .config(pool_config(redis))
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
                .config(pool_config(redis))
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
                .config(pool_config(redis))
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

/// The lease client for this strategy: with wake-ups on release, or the tutorial's polling.
pub fn lease_client(lease: &LeaseArgs, redis: &RedisArgs) -> anyhow::Result<LeaseClient> {
    let settings = LeaseSettings::new(lease.lease_ttl, lease.lease_wait)
        .with_op_timeout(redis.redis_timeout)
        .with_note_retention(lease.lease_note_ttl);
    // Going on under Postgres alone beats waiting out the whole lease wait for a Redis that
    // is gone.
    let settings = match lease.outage() {
        RedisOutage::Postgres => settings.failing_fast(),
        RedisOutage::Refuse => settings,
    };
    let (pool, wake_source) = redis_pool(redis)?;
    let prefix = redis.redis_key_prefix.clone();
    Ok(match lease.lease_strategy {
        Strategy::Queue => LeaseClient::new(pool, prefix, settings).with_wakeups(wake_source),
        // The tutorial's lock reads the wallet for every payment: no notes.
        Strategy::Tutorial => LeaseClient::new(
            pool,
            prefix,
            settings.with_backoff(Backoff::TUTORIAL).with_note_retention(Duration::ZERO),
        ),
    })
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
