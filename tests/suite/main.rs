//! walletlock's behaviour, against real Redis and Postgres processes.
//!
//! One test binary (so it links once); each module reads as the specification of one part.

mod support;

mod access;
mod api;
mod batch;
mod batches;
mod burst;
mod citus;
mod compose;
mod dashboard;
mod demos;
mod durability;
mod events;
mod faults;
mod fence;
mod fleet;
mod group;
mod history;
mod holds;
mod idempotency;
mod layers;
mod lease;
mod limits;
mod metadata;
mod metrics;
mod movements;
mod notes;
mod openapi;
mod outage;
mod overload;
mod redis_loss;
mod tls;
mod topologies;
mod transfers;
mod webhooks;
