//! `walletlock events listen`: a webhook endpoint for a developer's machine or a bench. It
//! verifies each delivery's Standard Webhooks signature with the endpoint's secret, prints each
//! event it takes (one JSON line, unless quiet), and answers `GET /stats` with what arrived: the
//! events, the duplicates, the bad signatures and the lag (arrival less the event's `created_at`).

use crate::wallet::webhooks::sign;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// What arrived so far.
#[derive(Default)]
struct Inbox {
    /// Each event's id, first arrival only.
    seen: HashSet<String>,
    /// Each first arrival's lag, in seconds.
    lags: Vec<f64>,
    duplicates: u64,
    bad_signatures: u64,
    first_at: Option<DateTime<Utc>>,
    last_at: Option<DateTime<Utc>>,
}

/// `GET /stats`.
#[derive(Debug, Serialize)]
struct Stats {
    events: usize,
    duplicates: u64,
    bad_signatures: u64,
    /// The first and the last first arrival.
    first_at: Option<DateTime<Utc>>,
    last_at: Option<DateTime<Utc>>,
    lag_p50_seconds: Option<f64>,
    lag_p99_seconds: Option<f64>,
    lag_max_seconds: Option<f64>,
}

struct Listener {
    secret: String,
    quiet: bool,
    inbox: Mutex<Inbox>,
}

/// Serves on `listen` until the process is stopped.
pub async fn listen(listen: SocketAddr, secret: String, quiet: bool) -> anyhow::Result<()> {
    let listener = Arc::new(Listener { secret, quiet, inbox: Mutex::default() });
    let app = Router::new()
        .route("/", post(take))
        .route("/{*path}", post(take))
        .route("/stats", get(stats))
        .with_state(listener);
    let socket = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, "listening for webhooks; GET /stats says what arrived");
    axum::serve(socket, app).with_graceful_shutdown(super::server::shutdown_signal()).await?;
    Ok(())
}

async fn take(State(listener): State<Arc<Listener>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let arrived = Utc::now();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let (id, timestamp) = (header("webhook-id"), header("webhook-timestamp"));
    let valid = timestamp.parse::<i64>().is_ok_and(|timestamp| {
        let expected = sign(&listener.secret, id, timestamp, &body);
        header("webhook-signature").split(' ').any(|signature| signature == expected)
    });
    let mut inbox = listener.inbox.lock().expect("not poisoned");
    if !valid {
        inbox.bad_signatures += 1;
        return StatusCode::UNAUTHORIZED;
    }
    if !inbox.seen.insert(id.to_owned()) {
        inbox.duplicates += 1;
        return StatusCode::NO_CONTENT;
    }
    let created_at = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|event| event["created_at"].as_str().and_then(|at| DateTime::parse_from_rfc3339(at).ok()));
    if let Some(created_at) = created_at {
        inbox.lags.push((arrived - created_at.with_timezone(&Utc)).as_seconds_f64().max(0.0));
    }
    inbox.first_at.get_or_insert(arrived);
    inbox.last_at = Some(arrived);
    drop(inbox);
    if !listener.quiet {
        println!("{}", String::from_utf8_lossy(&body));
    }
    StatusCode::NO_CONTENT
}

async fn stats(State(listener): State<Arc<Listener>>) -> axum::Json<Stats> {
    let inbox = listener.inbox.lock().expect("not poisoned");
    let mut lags = inbox.lags.clone();
    lags.sort_by(f64::total_cmp);
    let at = |quantile: f64| {
        let last = lags.len().checked_sub(1)?;
        lags.get(((last as f64) * quantile).round() as usize).copied()
    };
    axum::Json(Stats {
        events: inbox.seen.len(),
        duplicates: inbox.duplicates,
        bad_signatures: inbox.bad_signatures,
        first_at: inbox.first_at,
        last_at: inbox.last_at,
        lag_p50_seconds: at(0.5),
        lag_p99_seconds: at(0.99),
        lag_max_seconds: at(1.0),
    })
}
