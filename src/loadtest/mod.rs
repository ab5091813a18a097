//! The load tests' tools, which the scripts in loadtest/ call (`walletlock loadtest ...`): the
//! bench's table. The product does not import them.

pub mod report;
