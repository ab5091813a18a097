//! Holds: reserve part of a wallet's available balance now, capture or void it later, or let it
//! expire. Placing, capturing and voiding a hold are movements like a payment: queued for the
//! wallet's worker, decided under its lease ([`super::batch`]), written fenced by the rounds. This
//! module finds holds for the API and has the sweeper release expired ones, which only tidies up:
//! the first movement that needs an expired hold's amount releases it itself.

use super::{Access, Moved, Movement, WalletError, WalletId, Wallets};
use crate::ledger::hold::{self as store, Hold};
use std::time::Duration;
use uuid::Uuid;

/// The sweeper leaves a hold this long past its expiry before it releases it: movements that need
/// the amount release it sooner themselves, and the sweeper does not race them for the lease.
const SWEEP_AFTER: Duration = Duration::from_secs(1);
/// The most wallets one sweep releases holds of.
const SWEEP_WALLETS: i64 = 100;

impl Wallets {
    /// The hold `id` as it stands now, if `access` may use its wallet: to a caller that may not,
    /// it does not exist.
    pub async fn find_hold(&self, access: &Access, id: Uuid) -> Result<Hold, WalletError> {
        let mut conn = self.connection().await?;
        match store::find_hold(&mut conn, id).await? {
            Some((hold, owner)) if access.may_use(owner.as_deref()) => Ok(hold.as_of(chrono::Utc::now())),
            _ => Err(WalletError::HoldNotFound),
        }
    }

    /// The wallet of hold `id`, for a capture or void to be queued on (see [`Wallets::find_hold`]).
    /// A hold of a held movement is settled with its movement alone
    /// ([`WalletError::HoldOfMovement`]); which movement a hold belongs to never changes, so this
    /// check needs no lease.
    pub async fn wallet_of_hold(&self, access: &Access, id: Uuid) -> Result<WalletId, WalletError> {
        let hold = self.find_hold(access, id).await?;
        if let Some(movement) = hold.movement_id {
            return Err(WalletError::HoldOfMovement { movement });
        }
        WalletId::parse(&hold.wallet_id).map_err(|_| WalletError::internal("a stored wallet id"))
    }

    /// Releases the holds that expired a while ago, wallet by wallet, each under its lease like
    /// any movement; how many wallets it tidied.
    pub async fn release_expired_holds(&self) -> Result<usize, WalletError> {
        let before = chrono::Utc::now() - chrono::Duration::from_std(SWEEP_AFTER).unwrap_or_default();
        let wallets = {
            let mut conn = self.connection().await?;
            store::wallets_with_expired_holds(&mut conn, before, SWEEP_WALLETS).await?
        };
        let sweeper = Access { every_wallet: true, ..Access::own_wallets("walletlock-sweeper") };
        let mut released = 0;
        for id in wallets {
            let Ok(id) = WalletId::parse(&id) else { continue };
            match self.apply(&sweeper, &id, Movement::ReleaseExpired, None).await {
                Ok(Moved::Released) => released += 1,
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(wallet = %id, error = %err, "expired holds not released; the next sweep tries again")
                }
            }
        }
        Ok(released)
    }
}
