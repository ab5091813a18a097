//! The database schema: the embedded migrations, and throwaway schemas for demos and tests.
//!
//! Migrations are plain SQL in `migrations/`, applied in order and never edited once applied
//! (sqlx checksums them). sqlx's Postgres migrator holds an advisory lock while it runs, so
//! several replicas starting at once apply each migration exactly once.

use sqlx::{
    Executor, PgPool,
    migrate::{MigrateError, Migrator},
    postgres::{PgConnectOptions, PgPoolOptions},
};
use std::str::FromStr;

use super::storage::Storage;

pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Applies every migration not yet applied; on a database with the Citus extension, then
/// distributes the tables ([`distribute`]).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    MIGRATOR.run(pool).await?;
    let storage = Storage::of(&mut *pool.acquire().await.map_err(MigrateError::Execute)?).await;
    if storage.map_err(MigrateError::Execute)? == Storage::Citus {
        distribute(pool).await.map_err(MigrateError::Execute)?;
    }
    Ok(())
}

/// The tables of the current schema, as Citus distributes them: every one by the wallet it
/// belongs to, hashed into the same shards (co-located with `wallet`), so a wallet's row, its
/// entries, holds and idempotency keys always sit on one node, and a movement of one wallet is a
/// transaction on that node alone. A transfer lives with its paying wallet; the keys of requests
/// not scoped to one wallet share one placement (migration 0010 says why). Tables already
/// distributed are left as they are, so every `migrate` may run it; a table created by a later
/// migration needs its line here.
const DISTRIBUTION: [(&str, &str); 9] = [
    ("wallet", "id"),
    ("hold", "wallet_id"),
    ("ledger_entry", "wallet_id"),
    ("transfer", "from_wallet"),
    ("movement", "wallet_id"),
    ("idempotency_key", "wallet_id"),
    ("entry_rollup", "wallet_id"),
    ("entry_rollup_until", "wallet_id"),
    ("event", "wallet_id"),
];

/// Distributes the tables of the current schema that are not yet distributed (see
/// [`DISTRIBUTION`]), in the order their foreign keys need.
async fn distribute(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    // The wallet and ledger triggers only read the row they fire for (or refuse the statement),
    // which is what Citus asks of a trigger on a shard; it wants that said.
    conn.execute("set citus.enable_unsafe_triggers = on").await?;
    for (table, column) in DISTRIBUTION {
        sqlx::query(
            // language=PostgreSQL
            r#"select create_distributed_table($1::regclass, $2,
                                               colocate_with => case when $1 = 'wallet' then 'default'
                                                                     else 'wallet' end)
               where not exists (select from pg_dist_partition where logicalrelid = $1::regclass)"#,
        )
        .bind(table)
        .bind(column)
        .execute(&mut *conn)
        .await?;
    }
    conn.execute("reset citus.enable_unsafe_triggers").await?;
    // A round written on its worker's shard tables takes Citus's share lock on their metadata,
    // which only a shard's owner may take, and checks they are still there (see
    // `group::Routed::on_worker`); this runs as the owner, for the app role.
    conn.execute(
        r#"create or replace function walletlock_shards_here(shards bigint[], node int) returns boolean
           language sql security definer set search_path = pg_catalog as $$
               select lock_shard_metadata(5, shards);
               select count(*) = cardinality(shards) from pg_dist_placement
               where shardid = any(shards) and groupid = node;
           $$"#,
    )
    .await?;
    conn.execute("revoke all on function walletlock_shards_here(bigint[], int) from public").await?;
    Ok(())
}

/// Grants `role` exactly what the service needs on the tables of the current schema, and nothing
/// else: it reads wallets and writes their balance, version, fence and held amount, appends to the
/// ledger and the transfers (never updates or deletes them), places holds and settles them (the
/// status columns only), and manages idempotency keys. Replicas connect as that role; migrations run as the owner. Granting
/// again is harmless, so every `walletlock migrate --app-role` re-applies it.
pub async fn grant_app_role(pool: &PgPool, role: &str) -> anyhow::Result<()> {
    let valid = !role.is_empty()
        && role.len() <= 63
        && role.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !role.as_bytes()[0].is_ascii_digit();
    anyhow::ensure!(valid, "--app-role must be a lowercase Postgres identifier, not {role:?}");
    let schema: String = sqlx::query_scalar("select current_schema()").fetch_one(pool).await?;
    let mut tx = pool.begin().await?;
    for statement in [
        format!(r#"grant usage on schema "{schema}" to {role}"#),
        // The columns a movement writes, and no other: a wallet's id and owner never change.
        format!(r#"revoke update on "{schema}".wallet from {role}"#),
        format!(
            r#"grant select, insert, update (balance, version, fence, held, updated_at, event_seq, event_position, rules) on "{schema}".wallet to {role}"#
        ),
        format!(r#"grant select, insert on "{schema}".ledger_entry to {role}"#),
        format!(r#"grant select, insert on "{schema}".transfer to {role}"#),
        format!(r#"grant select, insert on "{schema}".movement to {role}"#),
        format!(r#"grant select, insert on "{schema}".event to {role}"#),
        format!(r#"revoke update on "{schema}".hold from {role}"#),
        format!(
            r#"grant select, insert, update (status, captured, capture_entry, settled_at) on "{schema}".hold to {role}"#
        ),
        format!(r#"grant select, insert, update, delete on "{schema}".idempotency_key to {role}"#),
        // The statements' rollups, which they fill as they go (src/ledger/history.rs).
        format!(r#"grant select, insert on "{schema}".entry_rollup to {role}"#),
        format!(r#"grant select, insert, update on "{schema}".entry_rollup_until to {role}"#),
        // Webhooks: endpoints are the callers' to manage, and the dispatchers move their place,
        // keep the waiting wallets and the attempts (and purge old attempts).
        format!(r#"grant select, insert, update, delete on "{schema}".webhook_endpoint to {role}"#),
        format!(r#"grant select, insert, update, delete on "{schema}".webhook_pending to {role}"#),
        format!(r#"grant select, insert, delete on "{schema}".webhook_attempt to {role}"#),
    ] {
        tx.execute(sqlx::AssertSqlSafe(statement)).await?;
    }
    // Under Citus, where `migrate` made it: a round's check that its shards are on its worker.
    let shards_here: Option<String> =
        sqlx::query_scalar("select to_regprocedure('walletlock_shards_here(bigint[], int)')::text")
            .fetch_one(&mut *tx)
            .await?;
    if let Some(function) = shards_here {
        tx.execute(sqlx::AssertSqlSafe(format!("grant execute on function {function} to {role}"))).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A schema of its own, migrated and empty, dropped by [`ScratchSchema::drop`]: isolates a demo
/// run or a test from every other user of the same database.
#[derive(Debug)]
pub struct ScratchSchema {
    admin: PgPool,
    name: String,
    /// The database URL with this schema first on the search path, for processes that connect
    /// by URL (replicas in the fleet tests).
    pub url: String,
}

impl ScratchSchema {
    /// Creates `<label>_<random>` in the database at `database_url`, migrates it, and returns it
    /// with a pool of `pool_size` connections whose search path is that schema.
    pub async fn create(database_url: &str, label: &str, pool_size: u32) -> anyhow::Result<(Self, PgPool)> {
        let name = format!("{label}_{}", uuid::Uuid::new_v4().simple());
        let admin = PgPoolOptions::new().max_connections(1).connect(database_url).await?;
        admin.execute(sqlx::AssertSqlSafe(format!(r#"create schema "{name}""#))).await?;
        let options = PgConnectOptions::from_str(database_url)?.options([("search_path", name.as_str())]);
        let pool = PgPoolOptions::new().max_connections(pool_size).connect_with(options).await?;
        migrate(&pool).await?;
        let separator = if database_url.contains('?') { '&' } else { '?' };
        let url = format!("{database_url}{separator}options[search_path]={name}");
        Ok((Self { admin, name, url }, pool))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub async fn drop(self) -> anyhow::Result<()> {
        let statement = format!(r#"drop schema "{}" cascade"#, self.name);
        self.admin.execute(sqlx::AssertSqlSafe(statement)).await?;
        Ok(())
    }
}
