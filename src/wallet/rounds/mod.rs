//! Queueing and rounds: how the movements of a replica reach Postgres under their leases.
//!
//! - `queue`: each wallet's requests line up behind one worker on the replica, which holds the
//!   wallet's lease and hands what is queued to the rounds in batches;
//! - `payee`: transfers line up by the wallet they pay into, the same way;
//! - `group`: the rounds, which read and write every batch waiting, many wallets per statement.

pub(in crate::wallet) mod group;
pub(in crate::wallet) mod payee;
pub(in crate::wallet) mod queue;
