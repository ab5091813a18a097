//! walletlock: stateless wallet replicas behind a load balancer that never lose or double-apply a
//! payment.
//!
//! Two requests for one wallet can land on two replicas in the same millisecond. Each payment
//! therefore runs under the wallet's **lease** in Redis (one holder at a time), and commits with a
//! **fenced** conditional `UPDATE` in Postgres, so a holder whose lease expired mid-work is refused
//! instead of overwriting a newer holder's result.
//!
//! # Layout
//! - [`domain`] is the shared vocabulary at the bottom (wallet ids, amounts, movements, refusals):
//!   every layer may use it, and it uses none. Arrows run one way, down: [`http`] → [`wallet`] →
//!   [`idempotency`] → [`ledger`] → [`domain`], and [`wallet`] → [`lease`]; a layer may also name
//!   one further down (the API takes [`idempotency`]'s keys directly), never one above; [`http`]
//!   does not name [`ledger`], whose rows it gets from [`wallet`]. [`telemetry`] and [`failpoint`]
//!   are called by the others and call none of them (`tests/suite/layers.rs` checks all of this).
//! - [`lease`] is the distributed lock: a small library over Redis that knows nothing of wallets
//!   (acquire with SET NX PX and a fence, token-checked release and refresh, the watchdog).
//! - [`ledger`] is the fenced ledger store: all of the product's SQL lives there (wallets, ledger
//!   entries, raising the fence and the conditional commit, idempotency keys, migrations).
//! - [`wallet`] holds the service that runs each movement under its wallet's lease with a fenced
//!   commit (and re-exports the vocabulary it takes and the rows it answers with); it touches
//!   neither Redis commands nor SQL.
//! - [`idempotency`] is the Idempotency-Key service: claims, replays, takeovers, over the keys
//!   [`ledger`] stores; a stored response is its type, whose parts the store keeps.
//! - [`config`] declares every setting, as a flag and an environment variable, and builds nothing
//!   (the pools and clients are built from them in `app::connect`); [`telemetry`] sets
//!   up logging and the Prometheus recorder; [`failpoint`] holds the fault tests' crash and stall
//!   points (feature `failpoints`).
//! - [`http`] is the API: routes, the problem format for errors, middleware, the accept loop and its
//!   drain; handlers call [`wallet`] and never write SQL. What it answers with is its own (bodies
//!   mapped from the rows [`wallet`] returns), so a stored column is not the API's. [`app`] builds
//!   one replica from its settings.
//! - [`cli`] holds the `walletlock` subcommands, and [`tutorial`] the tutorial's experiments
//!   (`walletlock demo`, with their own unguarded SQL), which the product does not import.
//! - [`loadtest`] holds the load tests' tools (`walletlock loadtest`), which loadtest/ calls.
//! - [`generated_docs`] prints the tables of `docs/` that come from the code (the settings, the
//!   error codes), and checks that the pages hold them.

pub mod app;
pub mod cli;
pub mod config;
pub mod domain;
pub mod failpoint;
pub mod generated_docs;
pub mod http;
pub mod idempotency;
pub mod lease;
pub mod ledger;
pub mod loadtest;
pub mod telemetry;
pub mod tutorial;
pub mod wallet;
