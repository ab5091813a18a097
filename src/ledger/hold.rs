//! Holds as stored: read by id for the API, released when expired inside a transfer's
//! transaction, and found for the sweeper. Placing and settling holds is part of a round's one
//! statement ([`super::group::commit`]), like every movement of a wallet's queue.

use super::StoreError;
use crate::domain::{HoldStatus, Metadata};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

/// A hold as stored, once read as of a time ([`Hold::as_of`]): one still `held` past `expires_at`
/// reads as `expired`, its amount available again whether or not a movement has released it yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub id: Uuid,
    pub wallet_id: String,
    /// Minor units reserved.
    pub amount: i64,
    /// What its capture charged; 0 unless captured.
    pub captured: i64,
    pub status: HoldStatus,
    pub expires_at: DateTime<Utc>,
    pub reference: Option<String>,
    /// Its movement's metadata, which its capture's entry keeps.
    pub metadata: Metadata,
    pub created_at: DateTime<Utc>,
    /// When it was captured, voided or released; `None` while held.
    pub settled_at: Option<DateTime<Utc>>,
    /// The `pay` entry of its capture, once captured.
    pub capture_entry: Option<Uuid>,
    /// The held movement whose debit leg it reserves; `None` for a hold of its own. Such a hold
    /// is captured or voided with its movement, never alone.
    pub movement_id: Option<Uuid>,
    /// The fence of the lease it was placed under.
    pub fence: i64,
}

/// A hold to place: `amount` of `wallet_id`, until `expires_at`, under the lease holding `fence`,
/// for a held movement's debit leg if `movement_id` says so.
#[derive(Debug, Clone)]
pub struct NewHold {
    pub wallet_id: String,
    pub amount: i64,
    pub expires_at: DateTime<Utc>,
    pub reference: Option<String>,
    pub metadata: Metadata,
    pub fence: i64,
    pub movement_id: Option<Uuid>,
}

impl Hold {
    /// A hold placed at `now`: held, nothing captured.
    pub fn placed(new: NewHold, now: DateTime<Utc>) -> Hold {
        let NewHold { wallet_id, amount, expires_at, reference, metadata, fence, movement_id } = new;
        Hold {
            id: super::new_entry_id(),
            wallet_id,
            amount,
            captured: 0,
            status: HoldStatus::Held,
            expires_at,
            reference,
            metadata,
            created_at: now,
            settled_at: None,
            capture_entry: None,
            movement_id,
            fence,
        }
    }

    /// As it stands at `now`: a hold still held past its expiry is expired.
    pub fn as_of(mut self, now: DateTime<Utc>) -> Self {
        if self.status == HoldStatus::Held && self.expires_at <= now {
            self.status = HoldStatus::Expired;
        }
        self
    }
}

impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for Hold {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(Hold {
            id: row.try_get("id")?,
            wallet_id: row.try_get("wallet_id")?,
            amount: row.try_get("amount")?,
            captured: row.try_get("captured")?,
            status: row.try_get("status")?,
            expires_at: row.try_get("expires_at")?,
            reference: row.try_get("reference")?,
            metadata: super::stored_metadata(row, "metadata")?,
            created_at: row.try_get("created_at")?,
            settled_at: row.try_get("settled_at")?,
            capture_entry: row.try_get("capture_entry")?,
            movement_id: row.try_get("movement_id")?,
            fence: row.try_get("fence")?,
        })
    }
}

/// The hold, with the owner of its wallet (who may see and settle it).
pub async fn find_hold(
    conn: &mut PgConnection,
    id: Uuid,
) -> Result<Option<(Hold, Option<String>)>, StoreError> {
    let row = sqlx::query(
        // language=PostgreSQL
        "select h.*, w.owner from hold h join wallet w on w.id = h.wallet_id where h.id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let owner: Option<String> = row.try_get("owner")?;
    Ok(Some((sqlx::FromRow::from_row(&row)?, owner)))
}

/// Wallets with holds still held that expired before `before`: what the sweeper releases. At most
/// `limit`.
pub async fn wallets_with_expired_holds(
    conn: &mut PgConnection,
    before: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        // language=PostgreSQL
        r#"select distinct wallet_id from hold
           where status = 'held' and expires_at < $1
           limit $2"#,
    )
    .bind(before)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// The holds `ids` of `wallets`, and every hold still held of `expired_of` that expired by `now`,
/// in the caller's transaction (with those wallets' rows locked): what a movement between wallets
/// decides on outside a round (see `crate::wallet::transfer`), as a round's read brings them.
pub async fn read_holds(
    conn: &mut PgConnection,
    wallets: &[&str],
    ids: &[Uuid],
    expired_of: &[&str],
    now: DateTime<Utc>,
) -> Result<std::collections::HashMap<Uuid, Hold>, StoreError> {
    if ids.is_empty() && expired_of.is_empty() {
        return Ok(Default::default());
    }
    let holds: Vec<Hold> = sqlx::query_as(
        // language=PostgreSQL
        r#"select * from hold
           where wallet_id = any($1)
             and (id = any($2) or (wallet_id = any($3) and status = 'held' and expires_at <= $4))"#,
    )
    .bind(wallets)
    .bind(ids)
    .bind(expired_of)
    .bind(now)
    .fetch_all(conn)
    .await?;
    Ok(holds.into_iter().map(|hold| (hold.id, hold)).collect())
}
