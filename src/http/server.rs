//! The accept loop, and a shutdown that drops no request behind nginx.
//!
//! On the shutdown signal the replica (1) starts draining: readiness fails and every response
//! carries `Connection: close`, so nginx opens its next connection elsewhere; (2) accepts the
//! connections waiting in its accept queue, then closes its listener, so a new connection is
//! refused, which nginx safely retries on another replica even for a POST (nothing was sent);
//! (3) serves the connections it has until each closes. A connection left in the queue would be
//! reset by the close after nginx may have sent a request on it (the kernel completes the handshake
//! before the replica accepts), and nginx answers 502 to a POST it cannot resend; only a handshake
//! completed in the microseconds between the last accept and the close still is. Idle keep-alive
//! connections are left for nginx to close (its upstream `keepalive_timeout` is shorter than the
//! grace), never closed from this side: closing one races with nginx sending a request on it, and
//! nginx does not resend a POST that may have reached a replica, so the client would get a 502.
//! Connections still open when the grace runs out are cut.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::net::SocketAddr;
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How long an idle keep-alive connection is kept open. Longer than nginx's upstream
/// `keepalive_timeout` (see nginx.conf), so nginx, not the replica, closes idle connections and
/// never sends a request down one the replica is closing.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Listens on `addr` with an accept queue of `backlog` connections. `TcpListener::bind` asks for
/// 128, and a burst from nginx (a new connection per concurrent request past its keep-alive pool)
/// overflows that: the kernel then drops the handshakes, nginx's connects time out and its clients
/// get errors instead of answers. The kernel caps the backlog at `net.core.somaxconn`.
pub fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // As std's bind does: a restarted replica can listen again while its old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Whether this replica is shutting down. Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    pub fn start(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then drains as the module doc says,
/// waiting at most `grace` for open connections.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    draining: Draining,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let connections = TaskTracker::new();
    let cut = CancellationToken::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(err) => {
                    // Out of file descriptors, say: back off instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        serve_connection(&connections, &router, &cut, stream);
    }

    tracing::info!("shutting down: draining connections");
    draining.start();
    for stream in accept_queued(listener) {
        serve_connection(&connections, &router, &cut, stream);
    }
    connections.close();
    if tokio::time::timeout(grace, connections.wait()).await.is_err() {
        tracing::warn!(?grace, "connections still open after the grace period; closing them");
        cut.cancel();
        connections.wait().await;
    }
}

/// The most connections [`accept_queued`] takes: what a full accept queue holds at the default
/// `LISTEN_BACKLOG` (and Linux's default `net.core.somaxconn`), so that clients connecting as
/// fast as it accepts cannot hold the close back.
const MAX_QUEUED_AT_CLOSE: usize = 4096;

/// Accepts what waits in `listener`'s accept queue, without waiting for more (at most
/// [`MAX_QUEUED_AT_CLOSE`]), and closes it.
fn accept_queued(listener: TcpListener) -> Vec<TcpStream> {
    // Straight to the socket: tokio's accept answers from its readiness, which may not know yet of
    // a connection that just arrived.
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(err) => {
            tracing::warn!(error = %err, "could not take the listener's queued connections");
            return Vec::new();
        }
    };
    let mut queued = Vec::new();
    while queued.len() < MAX_QUEUED_AT_CLOSE {
        match listener.accept() {
            Ok((stream, _peer)) => {
                match stream.set_nonblocking(true).and_then(|()| TcpStream::from_std(stream)) {
                    Ok(stream) => queued.push(stream),
                    Err(err) => tracing::warn!(error = %err, "a queued connection could not be served"),
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(err) => {
                tracing::warn!(error = %err, "accept failed while draining");
                break;
            }
        }
    }
    queued
}

/// Serves one connection as a task of `connections`, until it closes or `cut` fires.
fn serve_connection(connections: &TaskTracker, router: &Router, cut: &CancellationToken, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let service = TowerToHyperService::new(router.clone());
    let cut = cut.clone();
    connections.spawn(async move {
        // hyper answers a request it cannot parse before the router sees it: a 400, a 414, or
        // a 431 (over 100 header fields, or over `max_buf_size`), each with an empty body. It
        // offers no hook for that answer's body (`Server::on_error` in its h1 role builds a
        // bare head), so those stay bodiless. nginx's own limits catch all of them first but
        // the header count, which it does not bound (docs/api/errors.md). Raising `max_headers`
        // to what nginx can pass (thousands) would allocate that many slots per request.
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(IDLE_TIMEOUT);
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        tokio::select! {
            result = connection => if let Err(err) = result {
                tracing::debug!(error = %err, "connection ended with an error");
            },
            () = cut.cancelled() => {}
        }
    });
}

/// Completes on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    /// nginx closes an idle connection to a replica before the replica would: the `keepalive_timeout`
    /// of compose's upstream.conf (which deploy/local and the tests run too) is below IDLE_TIMEOUT.
    #[test]
    fn nginx_closes_idle_connections_before_the_replica() {
        let conf = include_str!("../../deploy/compose.d/upstream.conf");
        let keepalive =
            conf.lines().find_map(|line| line.trim().strip_prefix("keepalive_timeout ")?.strip_suffix("s;"));
        let keepalive =
            keepalive.expect("upstream.conf sets keepalive_timeout in seconds").parse().expect("seconds");
        assert!(
            std::time::Duration::from_secs(keepalive) < super::IDLE_TIMEOUT,
            "keepalive_timeout {keepalive}s"
        );
    }
}
