//! Where the leases live: one Redis node, a primary that Redis Sentinel fails over, or a Redis
//! Cluster. The client crates do the topology work (deadpool's pools, redis-rs's Sentinel and
//! Cluster clients: finding the primary, following `MOVED`); this module only puts the three
//! behind one connection type for the lease scripts.
//!
//! Each pool is built from a redis-rs client the caller configured, TLS included (a Sentinel or
//! Cluster client carries its certificates to every node it finds), so a connection found by
//! failover or redirection is verified like the first one.
//!
//! Every lease script touches keys of one hash tag (see the module doc of [`super`]), so on a
//! Cluster each runs on the one node that owns its slot.

use deadpool::managed::{self, Metrics, RecycleResult};
use deadpool_redis::redis::{self, Cmd, Pipeline, RedisError, RedisFuture, Value, aio::ConnectionLike};
use deadpool_redis::{PoolError, Status};
use std::sync::Arc;

/// A connection pool to one of the three topologies.
#[derive(Clone)]
pub enum RedisPool {
    Single(deadpool_redis::Pool),
    Sentinel(managed::Pool<SentinelManager>),
    Cluster(managed::Pool<ClusterManager>),
}

/// Makes connections to whichever node the Sentinels name primary at the time.
pub struct SentinelManager {
    client: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
}

impl SentinelManager {
    pub fn new(client: redis::sentinel::SentinelClient) -> Self {
        Self { client: tokio::sync::Mutex::new(client) }
    }
}

impl managed::Manager for SentinelManager {
    type Type = redis::aio::MultiplexedConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<Self::Type, RedisError> {
        self.client.lock().await.get_async_connection().await
    }

    async fn recycle(&self, conn: &mut Self::Type, _: &Metrics) -> RecycleResult<RedisError> {
        ping(conn).await
    }
}

/// Makes Cluster connections (each follows the slot map and `MOVED` on its own).
pub struct ClusterManager {
    client: redis::cluster::ClusterClient,
}

impl ClusterManager {
    pub fn new(client: redis::cluster::ClusterClient) -> Self {
        Self { client }
    }
}

impl managed::Manager for ClusterManager {
    type Type = redis::cluster_async::ClusterConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<Self::Type, RedisError> {
        self.client.get_async_connection().await
    }

    async fn recycle(&self, conn: &mut Self::Type, _: &Metrics) -> RecycleResult<RedisError> {
        ping(conn).await
    }
}

/// A pooled connection is given out again only after it answered.
async fn ping(conn: &mut impl ConnectionLike) -> RecycleResult<RedisError> {
    redis::cmd("PING").query_async::<String>(conn).await?;
    Ok(())
}

impl From<deadpool_redis::Pool> for RedisPool {
    fn from(pool: deadpool_redis::Pool) -> Self {
        RedisPool::Single(pool)
    }
}

impl RedisPool {
    pub async fn get(&self) -> Result<RedisConnection, PoolError> {
        Ok(match self {
            RedisPool::Single(pool) => RedisConnection::Single(pool.get().await?),
            RedisPool::Sentinel(pool) => RedisConnection::Sentinel(pool.get().await?),
            RedisPool::Cluster(pool) => RedisConnection::Cluster(pool.get().await?),
        })
    }

    pub fn status(&self) -> Status {
        match self {
            RedisPool::Single(pool) => pool.status(),
            RedisPool::Sentinel(pool) => pool.status(),
            RedisPool::Cluster(pool) => pool.status(),
        }
    }

    pub fn topology(&self) -> &'static str {
        match self {
            RedisPool::Single(_) => "single",
            RedisPool::Sentinel(_) => "sentinel",
            RedisPool::Cluster(_) => "cluster",
        }
    }
}

/// A pooled connection of any topology.
pub enum RedisConnection {
    Single(deadpool_redis::Connection),
    Sentinel(managed::Object<SentinelManager>),
    Cluster(managed::Object<ClusterManager>),
}

impl RedisConnection {
    /// Closes this connection instead of returning it to the pool: after a failover, a pooled
    /// connection may still point at the old primary, which answers `PING` (so the pool keeps it)
    /// but refuses writes with `READONLY`.
    pub fn discard(self) {
        match self {
            RedisConnection::Single(conn) => drop(deadpool_redis::Connection::take(conn)),
            RedisConnection::Sentinel(conn) => drop(managed::Object::take(conn)),
            RedisConnection::Cluster(conn) => drop(managed::Object::take(conn)),
        }
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Single(conn) => conn.req_packed_command(cmd),
            RedisConnection::Sentinel(conn) => conn.req_packed_command(cmd),
            RedisConnection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Single(conn) => conn.req_packed_commands(cmd, offset, count),
            RedisConnection::Sentinel(conn) => conn.req_packed_commands(cmd, offset, count),
            RedisConnection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Single(conn) => conn.get_db(),
            RedisConnection::Sentinel(conn) => conn.get_db(),
            RedisConnection::Cluster(conn) => conn.get_db(),
        }
    }
}

/// Where the release notifications' Pub/Sub connection goes.
/// A pooled connection's multiplexed channel, cloned: many tasks send on it at once, and redis-rs
/// writes what they send together, so the replica's concurrent lease commands share round trips
/// instead of each checking a connection out (which deadpool pays for with a `PING`).
#[derive(Clone)]
pub enum SharedConnection {
    Node(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl RedisConnection {
    /// The channel of this connection, to share.
    pub fn share(&self) -> SharedConnection {
        match self {
            RedisConnection::Single(conn) => SharedConnection::Node((**conn).clone()),
            RedisConnection::Sentinel(conn) => SharedConnection::Node((**conn).clone()),
            RedisConnection::Cluster(conn) => SharedConnection::Cluster((**conn).clone()),
        }
    }
}

impl ConnectionLike for SharedConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            SharedConnection::Node(conn) => conn.req_packed_command(cmd),
            SharedConnection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            SharedConnection::Node(conn) => conn.req_packed_commands(cmd, offset, count),
            SharedConnection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            SharedConnection::Node(conn) => conn.get_db(),
            SharedConnection::Cluster(conn) => conn.get_db(),
        }
    }
}

#[derive(Clone)]
pub enum WakeSource {
    /// The one node (boxed: a client with TLS settings is large).
    Node(Box<redis::Client>),
    /// Whichever node Sentinel names primary now (asked again on every reconnect).
    Sentinel(Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>),
    /// Any node of a Cluster: a PUBLISH reaches every node, so one subscription anywhere hears
    /// all releases. The first node that answers.
    AnyOf(Vec<redis::Client>),
}

impl From<redis::Client> for WakeSource {
    fn from(client: redis::Client) -> Self {
        WakeSource::Node(Box::new(client))
    }
}

impl WakeSource {
    pub async fn connect(&self) -> redis::RedisResult<redis::aio::PubSub> {
        match self {
            WakeSource::Node(client) => client.get_async_pubsub().await,
            WakeSource::Sentinel(sentinel) => {
                sentinel.lock().await.async_get_client().await?.get_async_pubsub().await
            }
            WakeSource::AnyOf(clients) => {
                let mut last = None;
                for client in clients {
                    match client.get_async_pubsub().await {
                        Ok(pubsub) => return Ok(pubsub),
                        Err(err) => last = Some(err),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    redis::RedisError::from((redis::ErrorKind::Client, "no cluster node"))
                }))
            }
        }
    }
}
