//! A TCP proxy that can black-hole its traffic: the network path of a partition, where neither
//! end hears a reset. Connections stay open and every byte is acknowledged by the proxy's own TCP
//! stack, so TCP keepalives and `tcp_user_timeout` see a healthy peer; only an application's own
//! bound notices.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct TcpProxy {
    pub port: u16,
    black_hole: Arc<AtomicBool>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Forwards every connection made to `127.0.0.1:<port>` to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let black_hole = Arc::new(AtomicBool::new(false));
        let dropping = black_hole.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, dropping.clone()));
                tokio::spawn(pump(server_read, client_write, dropping.clone()));
            }
        });
        Self { port, black_hole, accepting }
    }

    /// From now on, every byte either way is read and dropped, on the open connections and on new
    /// ones alike.
    pub fn black_hole(&self) {
        self.black_hole.store(true, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    black_hole: Arc<AtomicBool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if black_hole.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
