//! A wallet's history (see [`ledger::history`]): reads that take no lease and never wait for a
//! movement, each of one wallet the caller may use.

use super::{Access, WalletError, WalletId, Wallets};
use crate::ledger::history::{BalanceAt, EntryFilter, Statement};
use crate::ledger::{self, Entry};
use chrono::{DateTime, Utc};
use sqlx::PgConnection;

impl Wallets {
    /// A page of the wallet's entries that `filter` selects.
    pub async fn entries(
        &self,
        access: &Access,
        id: &WalletId,
        filter: &EntryFilter,
    ) -> Result<Vec<Entry>, WalletError> {
        let mut conn = self.connection().await?;
        visible(&mut conn, access, id).await?;
        Ok(ledger::history::entries(&mut conn, id.as_str(), filter).await?)
    }

    /// Every entry `filter` selects, `filter.limit` at a time (see [`ledger::history::chunks`]),
    /// if `access` may read the wallet: checked once, before the first chunk.
    pub async fn entry_chunks(
        &self,
        access: &Access,
        id: &WalletId,
        filter: EntryFilter,
    ) -> Result<impl futures::Stream<Item = Result<Vec<Entry>, WalletError>> + Send + 'static, WalletError>
    {
        visible(&mut *self.connection().await?, access, id).await?;
        Ok(futures::TryStreamExt::map_err(
            ledger::history::chunks(self.db.clone(), id.as_str().to_owned(), filter),
            WalletError::from,
        ))
    }

    /// The wallet as of `at`: [`WalletError::NotOpenYet`] if it opened after `at`.
    pub async fn balance_at(
        &self,
        access: &Access,
        id: &WalletId,
        at: DateTime<Utc>,
    ) -> Result<BalanceAt, WalletError> {
        let mut conn = self.connection().await?;
        visible(&mut conn, access, id).await?;
        ledger::history::balance_at(&mut conn, id.as_str(), at).await?.ok_or(WalletError::NotOpenYet)
    }

    /// The wallet's statement over `[from, to)`.
    pub async fn statement(
        &self,
        access: &Access,
        id: &WalletId,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Statement, WalletError> {
        let mut conn = self.connection().await?;
        visible(&mut conn, access, id).await?;
        Ok(ledger::history::statement(&mut conn, id.as_str(), from, to, chrono::Utc::now()).await?)
    }
}

/// Whether `access` may read the wallet: [`WalletError::NotFound`] if it does not exist or is
/// another caller's.
pub(super) async fn visible(
    conn: &mut PgConnection,
    access: &Access,
    id: &WalletId,
) -> Result<(), WalletError> {
    let wallet = ledger::find_wallet(conn, id.as_str()).await?;
    if wallet.is_some_and(|wallet| access.may_use(wallet.owner.as_deref())) {
        Ok(())
    } else {
        Err(WalletError::NotFound)
    }
}
