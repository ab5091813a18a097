//! Where the tables live: one Postgres, or spread over a Citus cluster by wallet
//! (docs/operating/citus.md). The statements are the same SQL either way except where a statement would touch several
//! wallets at once: on one Postgres a round writes many wallets in one statement, one WAL flush;
//! under Citus that would be a transaction on several nodes, so there a round is the wallets of one
//! node, written one statement a shard ([`super::shards`], [`super::group`]).

use super::StoreError;
use super::shards::{NodeAddress, ShardMap};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;
use tokio::sync::{OnceCell, watch};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Every table on one Postgres.
    OnePostgres,
    /// The tables distributed by wallet over a Citus cluster (`walletlock migrate` distributed
    /// them): every statement of a wallet's movement runs on the node holding that wallet.
    Citus,
}

impl Storage {
    /// What the database behind `conn` is: Citus when it has the extension.
    pub async fn of(conn: &mut PgConnection) -> Result<Self, sqlx::Error> {
        let citus: bool =
            sqlx::query_scalar("select exists (select from pg_extension where extname = 'citus')")
                .fetch_one(conn)
                .await?;
        Ok(if citus { Storage::Citus } else { Storage::OnePostgres })
    }

    /// The options of every pool of connections that move money (a replica's, and the suite's
    /// replicas in process): each new connection's session set up by [`Storage::prepare_session`].
    pub fn pool_options() -> PgPoolOptions {
        PgPoolOptions::new().after_connect(|conn, _| Box::pin(Storage::prepare_session(conn)))
    }

    /// Sets up the session of a new connection for where the tables live. Citus routes a statement
    /// to the node of its wallet by the values of its parameters, which a generic plan does not
    /// have: it refuses to plan most of them ("could not create distributed plan"). There, each
    /// execution is planned (whatever plan mode the pool asked for), and a `SET LOCAL` (a lock
    /// timeout) reaches the workers the transaction runs on.
    pub async fn prepare_session(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if Storage::of(conn).await? == Storage::Citus {
            conn.execute(
                "set plan_cache_mode = force_custom_plan; set citus.propagate_set_commands = 'local'",
            )
            .await?;
        }
        Ok(())
    }
}

/// A database's [`Storage`], learnt from the first connection that answers and kept: a replica
/// starts whether or not Postgres is up, so it cannot ask at startup. Under Citus, with where each
/// wallet is ([`KnownStorage::shards`]). Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct KnownStorage(Arc<Learnt>);

#[derive(Debug, Default)]
struct Learnt {
    storage: OnceCell<Storage>,
    shards: OnceLock<watch::Receiver<Option<Arc<ShardMap>>>>,
    workers: OnceLock<Workers>,
}

impl KnownStorage {
    /// The storage, once learnt.
    pub fn get(&self) -> Option<Storage> {
        self.0.storage.get().copied()
    }

    /// Under Citus, the map of the wallets' shards, which a task of its own reads again every few
    /// seconds ([`super::shards::keep`]), started by the first call; `None` on one Postgres, until
    /// the storage is learnt, and until the map is read.
    pub fn shards(&self, db: &PgPool) -> Option<Arc<ShardMap>> {
        if self.get() != Some(Storage::Citus) {
            return None;
        }
        self.0.shards.get_or_init(|| super::shards::keep(db.clone())).borrow().clone()
    }

    /// Under Citus, the connections straight to its workers (see [`Workers`]), made as `db`'s are.
    pub fn workers(&self, db: &PgPool) -> &Workers {
        self.0.workers.get_or_init(|| Workers::like(db))
    }

    /// The storage of `db`, asking it the first time.
    pub async fn of(&self, db: &PgPool) -> Result<Storage, StoreError> {
        if let Some(storage) = self.get() {
            return Ok(storage);
        }
        // Boxed, here and in `on`: asked once, and unboxed its 14 KB made the future of every
        // caller (a transfer's, a history read's) that large.
        let ask = self.0.storage.get_or_try_init(|| async {
            let mut conn = db.acquire().await?;
            Ok::<_, StoreError>(Storage::of(&mut conn).await?)
        });
        Box::pin(ask).await.copied()
    }

    /// The storage of the database behind `conn`, asking on `conn` itself the first time: for a
    /// caller holding a transaction, which must never wait for a second connection from the pool
    /// (with the pool full of such callers, each would wait for the others' until it timed out).
    pub async fn on(&self, conn: &mut PgConnection) -> Result<Storage, StoreError> {
        if let Some(storage) = self.get() {
            return Ok(storage);
        }
        let ask = self.0.storage.get_or_try_init(|| async { Ok::<_, StoreError>(Storage::of(conn).await?) });
        Box::pin(ask).await.copied()
    }
}

/// Connections straight to the workers of a Citus cluster, a pool for each worker's address, each
/// connecting as the coordinator's pool does, to that address: a round whose wallets are all on
/// one worker is written there, on its shards' own tables ([`super::group::commit`]), without the
/// coordinator's hop, Citus's planning of each statement and its distributed transaction. A worker
/// this replica cannot reach leaves its rounds to the coordinator's route.
#[derive(Debug)]
pub struct Workers {
    options: PgConnectOptions,
    acquire_timeout: Duration,
    pools: Mutex<HashMap<NodeAddress, PgPool>>,
}

/// Connections a replica keeps to each worker: it writes one round at a time
/// (`crate::wallet::rounds`), and a round that failed closes its connection as the next starts.
const WORKER_CONNECTIONS: u32 = 2;

/// How long a round waits for a connection to its worker before it goes through the coordinator:
/// a worker connection is never busy (one round at a time), so only connecting takes time, and
/// sqlx retries a refused connection until this passes.
const WORKER_CONNECT_WITHIN: Duration = Duration::from_secs(1);

impl Workers {
    fn like(db: &PgPool) -> Self {
        Workers {
            options: (*db.connect_options()).clone(),
            acquire_timeout: db.options().get_acquire_timeout(),
            pools: Mutex::default(),
        }
    }

    /// The pool of the worker at `address`, made on first use (it connects when first asked).
    pub fn pool(&self, address: &NodeAddress) -> PgPool {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        let pool = pools.entry(address.clone()).or_insert_with(|| {
            Storage::pool_options()
                .max_connections(WORKER_CONNECTIONS)
                .acquire_timeout(self.acquire_timeout.min(WORKER_CONNECT_WITHIN))
                .connect_lazy_with(self.options.clone().host(&address.0).port(address.1))
        });
        pool.clone()
    }
}
