//! A minimal HTTP/1.1 GET, so the container image needs no curl for its health check.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// GETs `url` (plain `http://host:port/path`) and returns the response's status code.
pub async fn probe(url: &str, limit: Duration) -> anyhow::Result<u16> {
    let rest =
        url.strip_prefix("http://").ok_or_else(|| anyhow::anyhow!("only http:// URLs are supported"))?;
    let (authority, path) =
        rest.split_once('/').map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
    let exchange = async {
        let mut stream = TcpStream::connect(authority).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut head = vec![0; 64];
        let read = stream.read(&mut head).await?;
        let status_line = String::from_utf8_lossy(&head[..read]).into_owned();
        status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse::<u16>().ok())
            .ok_or_else(|| anyhow::anyhow!("not an HTTP response: {status_line:?}"))
    };
    tokio::time::timeout(limit, exchange).await.map_err(|_| anyhow::anyhow!("no answer within {limit:?}"))?
}
