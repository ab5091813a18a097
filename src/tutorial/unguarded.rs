//! The tutorial's naive read-modify-write: read the balance, decide, write it back, with neither
//! fence nor version in the `WHERE`. Two writers that read the same balance both write, and one
//! update is lost. Only `walletlock demo` uses it, to show what the fenced commit prevents; the
//! product's SQL is all in `crate::ledger`.

use sqlx::PgConnection;

pub async fn read_balance(conn: &mut PgConnection, id: &str) -> sqlx::Result<Option<i64>> {
    // language=PostgreSQL
    sqlx::query_scalar!("select balance from wallet where id = $1", id).fetch_optional(conn).await
}

/// Overwrites the balance whatever happened since it was read: the lost update, on purpose.
pub async fn overwrite_balance(conn: &mut PgConnection, id: &str, balance: i64) -> sqlx::Result<()> {
    // language=PostgreSQL
    sqlx::query!("update wallet set balance = $2, updated_at = now() where id = $1", id, balance)
        .execute(conn)
        .await?;
    Ok(())
}
