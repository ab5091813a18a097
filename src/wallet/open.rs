//! Opening wallets and reading them: no lease is needed for either (a new row has no other writer,
//! and a read takes no lock).

use super::decision::Held;
use super::{Access, AlreadyExists, OpenOutcome, WalletError, WalletId, Wallets, error::commit, lease_name};
use crate::idempotency::{self, Receipt};
use crate::ledger::{self, StoreError, Wallet};
use crate::telemetry::metrics::{EVENTS_WRITTEN, PG_POOL_ACQUIRE_WAIT};
use sqlx::pool::PoolConnection;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Wallets {
    /// Claims `key` for a request that stores its outcome after it ran (wallet creation), or
    /// finds what an earlier request with it left (see [`idempotency::Keys::begin`]).
    pub async fn begin_keyed(
        &self,
        scope: idempotency::Scope,
        key: idempotency::IdempotencyKey,
        fingerprint: [u8; 32],
    ) -> Result<idempotency::Begin, WalletError> {
        Ok(self.keys.begin(scope, key, fingerprint).await?)
    }

    /// Opens a wallet owned by `owner` (a caller) with an opening balance (recorded as its `open`
    /// entry). With a receipt, the outcome is stored for its idempotency key in the same
    /// transaction.
    pub async fn open(
        &self,
        owner: &str,
        id: &WalletId,
        balance: i64,
        receipt: Option<Receipt<OpenOutcome>>,
    ) -> Result<Wallet, WalletError> {
        let (this, id, owner) = (self.clone(), id.clone(), owner.to_owned());
        self.run_to_end(receipt.as_ref().map(|r| r.claim.clone()), async move {
            let mut tx = this.db.begin().await?;
            match ledger::create_wallet(&mut tx, id.as_str(), &owner, balance, this.round_settings.events)
                .await
            {
                Ok((wallet, open)) => {
                    if let Some(receipt) = &receipt
                        && !idempotency::complete(&mut tx, receipt, &Ok(wallet.clone()), Some(open.id))
                            .await?
                    {
                        return Err(WalletError::KeyTakenOver);
                    }
                    commit(tx).await?;
                    if this.round_settings.events {
                        let opened = crate::domain::EventType::WalletOpened.as_str();
                        metrics::counter!(EVENTS_WRITTEN.name, "type" => opened).increment(1);
                    }
                    this.leave_note(&id, &wallet);
                    Ok(wallet)
                }
                Err(StoreError::WalletExists) => {
                    drop(tx);
                    if let Some(receipt) = &receipt {
                        let mut tx = this.db.begin().await?;
                        if !idempotency::complete(&mut tx, receipt, &Err(AlreadyExists), None).await? {
                            return Err(WalletError::KeyTakenOver);
                        }
                        tx.commit().await?;
                    }
                    Err(WalletError::Exists)
                }
                Err(err) => Err(err.into()),
            }
        })
        .await
    }

    /// Leaves the wallet just opened, as it is, in its lease's note, so that its first payment need
    /// not read it (see [`queue`]), in the background: opening a wallet does not wait for Redis or
    /// fail without it. The note is only advice, checked by the first write that uses it.
    fn leave_note(&self, id: &WalletId, wallet: &Wallet) {
        let opened = Held {
            balance: wallet.balance,
            held: wallet.held,
            version: wallet.version,
            fence: wallet.fence,
            owner: wallet.owner.as_deref().map(Arc::from),
            rules: Default::default(),
            from_note: false,
        };
        let (leases, name, note) = (self.leases.clone(), lease_name(id), opened.to_note());
        self.in_flight.spawn(async move {
            if let Err(err) = leases.leave_note(&name, &note).await {
                tracing::debug!(lease = %name, error = %err, "no note left for the new wallet; its first payment reads it");
            }
        });
    }

    /// The wallet, if `access` may use it: to a caller that may not, it does not exist.
    pub async fn get(&self, access: &Access, id: &WalletId) -> Result<Wallet, WalletError> {
        let mut conn = self.connection().await?;
        ledger::find_wallet(&mut conn, id.as_str())
            .await?
            .filter(|wallet| access.may_use(wallet.owner.as_deref()))
            .ok_or(WalletError::NotFound)
    }

    /// A pooled Postgres connection, its wait measured (and boxed: every read and every rare
    /// write of wallets, holds, history, events and webhooks comes through here).
    pub(super) async fn connection(&self) -> Result<PoolConnection<sqlx::Postgres>, WalletError> {
        let waiting = Instant::now();
        let conn = ledger::acquire(&self.db).await?;
        metrics::histogram!(PG_POOL_ACQUIRE_WAIT.name).record(waiting.elapsed());
        Ok(conn)
    }

    /// Deletes the stored responses of idempotency keys past their retention; how many.
    pub async fn purge_expired_keys(&self) -> Result<u64, StoreError> {
        self.keys.purge_expired().await
    }

    /// Whether Redis and Postgres each answer within `limit`: (redis, postgres). In a Redis
    /// outage Redis is not asked: the outage's own probe ends it once Redis serves leases again.
    pub async fn dependencies_answer(&self, limit: Duration) -> (bool, bool) {
        let in_outage = self.outage.is_active();
        let (redis, postgres) = tokio::join!(
            async {
                !in_outage && matches!(tokio::time::timeout(limit, self.leases.ping()).await, Ok(Ok(())))
            },
            tokio::time::timeout(limit, ledger::ping(&self.db)),
        );
        (redis, matches!(postgres, Ok(Ok(()))))
    }
}
