//! The load tests' tools, which the scripts in loadtest/ call (`walletlock loadtest ...`): the
//! costs of a run, the bench's table. The product does not import them.

pub mod costs;
pub mod report;
