//! The tutorial's strategy ([`super::Strategy::Tutorial`]): every request takes its wallet's lease
//! itself and has its movement written alone under it, the benchmark's baseline; and the
//! tutorial's two-step fence raise, which its demos and the fence tests call.

use super::decision::Op;
use super::rounds::group::{self, BUSY_PAUSE};
use super::{Moved, WalletError, WalletId, Wallets, lease_name};
use crate::lease::Lease;
use crate::ledger::{self, StoreError};
use std::time::Instant;

impl Wallets {
    /// The tutorial's way: this request takes the lease itself, has its movement written alone
    /// under it, and releases.
    pub(super) async fn apply_alone(&self, id: &WalletId, op: Op) -> Result<Moved, WalletError> {
        let mut lease = self.leases.acquire(&lease_name(id)).await?;
        tracing::Span::current().record("lease_wait_ms", lease.waited().as_secs_f64() * 1e3);
        lease.keep_alive();
        let started = Instant::now();
        let outcome = self.write_alone(&mut lease, id, op).await;
        tracing::Span::current().record("db_ms", started.elapsed().as_secs_f64() * 1e3);
        // Release on every outcome, so the next holder does not wait out our TTL. A lease found
        // already gone changes nothing: the fence has decided by now.
        if let Err(err) = lease.release().await {
            tracing::debug!(wallet = %id, error = %err, "release found the lease gone");
        }
        outcome
    }

    async fn write_alone(&self, lease: &mut Lease, id: &WalletId, mut op: Op) -> Result<Moved, WalletError> {
        // After one resynchronization our fence is above every fence the row has seen, unless
        // another holder raised the fence meanwhile, which only a lost lease lets happen.
        let mut resynced = false;
        loop {
            if lease.is_lost() {
                return Err(WalletError::LeaseLost);
            }
            let job = group::Job { id: id.clone(), fence: lease.fence(), held: None, ops: vec![op] };
            match self.rounds.run(job).await {
                group::JobOutcome::Done { mut results, .. } => return results.remove(0),
                group::JobOutcome::FenceBehind { .. } if resynced => return Err(WalletError::LeaseLost),
                group::JobOutcome::FenceBehind { seen, mut ops } => {
                    lease.advance_fence(seen).await?;
                    resynced = true;
                    op = ops.remove(0);
                }
                group::JobOutcome::Busy { mut ops } => {
                    tokio::time::sleep(BUSY_PAUSE).await;
                    op = ops.remove(0);
                }
                // Not from a job that reads its wallet, as this one does; run it again all the same.
                group::JobOutcome::Stale { mut ops } => op = ops.remove(0),
            }
        }
    }
}

/// Raises the wallet's fence to the lease's. If the row has seen our fence or a higher one, either
/// we are a stale holder (then the token-checked resynchronization refuses us too) or Redis lost
/// the fence counter, which is lifted above what the row has seen before raising the row's fence again.
pub async fn raise_fence(
    conn: &mut sqlx::PgConnection,
    lease: &mut Lease,
    id: &WalletId,
) -> Result<ledger::WalletRead, WalletError> {
    // Two rounds: after one resynchronization our fence is above every fence the row has seen,
    // unless another holder raised the fence meanwhile, which only a holder that lost its lease lets happen.
    for _ in 0..2 {
        match ledger::raise_fence(conn, id.as_str(), lease.fence()).await {
            Err(StoreError::FenceBehind { seen, .. }) => {
                lease.advance_fence(seen).await?;
            }
            other => return Ok(other?),
        }
    }
    Err(WalletError::LeaseLost)
}
