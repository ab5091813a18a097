//! The load tests' tools, which the scripts in loadtest/ call (`walletlock loadtest ...`): the
//! costs of a run, the CPU others took from it, the bench's table, the history bench's page, the replicas' memory. The product does not import them.

pub mod costs;
pub mod history;
pub mod other_cpu;
pub mod report;
pub mod rss;
