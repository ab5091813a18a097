//! A real HTTP receiver of webhooks, as a consumer would run one: it verifies every delivery's
//! Standard Webhooks signature with its own HMAC (not walletlock's code), and records what it
//! took. It can be told to fail half of what it gets, to hang past the sender's timeout, or to go
//! away (its port closed) and come back.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// What the receiver does with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Takes it (204).
    Take = 0,
    /// Answers 500 to every other one, and takes the rest.
    FailHalf = 1,
    /// Answers only after `HANG`, past the sender's timeout (and takes it then).
    Hang = 2,
    /// Takes it after `SLOW`, well within the sender's timeout.
    Slow = 3,
}

pub const HANG: Duration = Duration::from_secs(3);
pub const SLOW: Duration = Duration::from_millis(250);

/// A delivery the receiver took (or saw), with a valid signature.
#[derive(Debug, Clone)]
pub struct Received {
    pub id: String,
    pub body: Value,
}

#[derive(Default)]
struct Inbox {
    secret: Mutex<String>,
    taken: Mutex<Vec<Received>>,
    bad_signatures: AtomicUsize,
    mode: AtomicU8,
    seen: AtomicUsize,
}

pub struct Receiver {
    pub port: u16,
    inbox: Arc<Inbox>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// Whether `header` (`v1,<base64>` signatures, space-separated) holds the HMAC-SHA256 of
/// `<id>.<timestamp>.<body>` keyed with the secret's base64 part.
pub fn signed(secret: &str, id: &str, timestamp: &str, body: &[u8], header: &str) -> bool {
    let Ok(key) = BASE64.decode(secret.trim_start_matches("whsec_")) else { return false };
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()));
    header.split(' ').any(|signature| signature == expected)
}

async fn take(State(inbox): State<Arc<Inbox>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let (id, timestamp, signature) =
        (header("webhook-id"), header("webhook-timestamp"), header("webhook-signature"));
    let secret = inbox.secret.lock().unwrap().clone();
    let fresh = timestamp.parse::<i64>().is_ok_and(|at| (chrono::Utc::now().timestamp() - at).abs() < 300);
    if !fresh || !signed(&secret, &id, &timestamp, &body, &signature) {
        inbox.bad_signatures.fetch_add(1, Ordering::Relaxed);
        return StatusCode::UNAUTHORIZED;
    }
    let n = inbox.seen.fetch_add(1, Ordering::Relaxed);
    match inbox.mode.load(Ordering::Relaxed) {
        1 if n % 2 == 0 => return StatusCode::INTERNAL_SERVER_ERROR,
        2 => tokio::time::sleep(HANG).await,
        3 => tokio::time::sleep(SLOW).await,
        _ => {}
    }
    let body: Value = serde_json::from_slice(&body).expect("a delivery's body is JSON");
    inbox.taken.lock().unwrap().push(Received { id, body });
    StatusCode::NO_CONTENT
}

impl Receiver {
    pub async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut receiver = Receiver { port, inbox: Arc::default(), stop: None, server: None };
        receiver.serve(listener);
        receiver
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (stop, stopped) = oneshot::channel::<()>();
        let app = axum::Router::new().route("/hook", post(take)).with_state(self.inbox.clone());
        self.server = Some(tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        }));
        self.stop = Some(stop);
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    pub fn set_secret(&self, secret: &str) {
        *self.inbox.secret.lock().unwrap() = secret.to_owned();
    }

    pub fn set_mode(&self, mode: Mode) {
        self.inbox.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Closes its port: deliveries are refused until [`Receiver::up`].
    pub async fn down(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
    }

    /// Listens on its port again.
    pub async fn up(&mut self) {
        let listener =
            tokio::net::TcpListener::bind(("127.0.0.1", self.port)).await.expect("the receiver's port again");
        self.serve(listener);
    }

    pub fn taken(&self) -> Vec<Received> {
        self.inbox.taken.lock().unwrap().clone()
    }

    pub fn bad_signatures(&self) -> usize {
        self.inbox.bad_signatures.load(Ordering::Relaxed)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}
