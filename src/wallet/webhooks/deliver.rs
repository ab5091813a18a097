//! One delivery: the event's JSON POSTed to the endpoint, signed as the Standard Webhooks
//! specification says (<https://www.standardwebhooks.com>), so a consumer verifies it with an
//! existing library; and which addresses a replica may be made to call.

use super::WebhookSettings;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A new signing secret: `whsec_` and 32 random bytes in base64, as the specification writes
/// secrets.
pub fn new_secret() -> String {
    format!("whsec_{}", BASE64.encode(rand::random::<[u8; 32]>()))
}

/// The `webhook-signature` of a message: `v1,` and the base64 HMAC-SHA256, keyed with the secret's
/// bytes, of `<webhook-id>.<webhook-timestamp>.<body>`.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> String {
    let key = BASE64.decode(secret.strip_prefix("whsec_").unwrap_or(secret)).unwrap_or_default();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes a key of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

/// Whether a replica may call `ip` for a caller: not loopback, private, link-local, shared,
/// multicast or unspecified, which would let a caller reach the replicas' own network.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                // Shared address space (carrier-grade NAT), 100.64.0.0/10.
                || (a == 100 && (64..128).contains(&b)))
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public(IpAddr::V4(v4)),
            None => {
                let first = v6.segments()[0];
                !(v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    // Unique local fc00::/7, link-local fe80::/10.
                    || (first & 0xfe00) == 0xfc00
                    || (first & 0xffc0) == 0xfe80)
            }
        },
    }
}

/// Resolves endpoints' host names to public addresses only, unless the host is one the operator
/// allows (`WEBHOOK_ALLOW_HOSTS`): the check is made on the addresses the request then connects
/// to, so a name that resolves elsewhere later (DNS rebinding) cannot slip past it.
struct PublicOnly {
    allowed: Arc<[String]>,
}

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allowed = self.allowed.iter().any(|host| host.eq_ignore_ascii_case(name.as_str()));
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let usable: Vec<SocketAddr> =
                found.into_iter().filter(|addr| allowed || is_public(addr.ip())).collect();
            if usable.is_empty() {
                let refused = format!("{host} resolves to no address a webhook may be sent to");
                return Err(Box::<dyn std::error::Error + Send + Sync>::from(refused));
            }
            Ok(Box::new(usable.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Why a URL may not be an endpoint's, or `None`.
pub fn refuse_url(url: &str, settings: &WebhookSettings) -> Option<String> {
    let Ok(parsed) = reqwest::Url::parse(url) else { return Some("not a URL".into()) };
    if !matches!(parsed.scheme(), "https" | "http") {
        return Some("not an http or https URL".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Some("a URL with credentials in it".into());
    }
    let Some(host) = parsed.host_str() else { return Some("a URL without a host".into()) };
    if url.len() > 2048 {
        return Some("longer than 2048 characters".into());
    }
    if settings.allows(host) {
        return None;
    }
    match parsed.host() {
        Some(url::Host::Ipv4(ip)) if !is_public(IpAddr::V4(ip)) => {
            Some(format!("{ip} is not a public address"))
        }
        Some(url::Host::Ipv6(ip)) if !is_public(IpAddr::V6(ip)) => {
            Some(format!("{ip} is not a public address"))
        }
        Some(url::Host::Domain(name))
            if name.eq_ignore_ascii_case("localhost") || name.ends_with(".localhost") =>
        {
            Some(format!("{name} is this machine"))
        }
        _ => None,
    }
}

/// How one delivery went.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// The endpoint's answer, if any.
    pub status: Option<u16>,
    pub latency: Duration,
    /// Why it did not take the event: none when it answered 2xx.
    pub error: Option<String>,
}

impl Delivered {
    pub fn taken(&self) -> bool {
        self.error.is_none()
    }
}

/// The HTTP client of the deliveries: bounded in time, following no redirect, calling public
/// addresses only (see [`PublicOnly`]).
#[derive(Debug, Clone)]
pub struct Sender {
    client: reqwest::Client,
    settings: Arc<WebhookSettings>,
}

impl Sender {
    pub fn new(settings: Arc<WebhookSettings>) -> Self {
        let builder = || {
            reqwest::Client::builder()
                .timeout(settings.timeout)
                .connect_timeout(settings.timeout.min(Duration::from_secs(5)))
                .redirect(reqwest::redirect::Policy::none())
                .dns_resolver(Arc::new(PublicOnly { allowed: settings.allow_hosts.clone().into() }))
                .user_agent(concat!("walletlock-webhooks/", env!("CARGO_PKG_VERSION")))
                .pool_max_idle_per_host(32)
        };
        // HTTPS endpoints are verified against the system's roots (as Postgres's and Redis's TLS
        // is); without any, the replica still serves, and each https delivery fails saying why.
        let client = builder().build().unwrap_or_else(|err| {
            tracing::error!(error = %err, "no system root certificates: https webhook endpoints cannot be verified");
            builder().tls_built_in_root_certs(false).build().expect("an HTTP client without roots")
        });
        Sender { client, settings }
    }

    /// POSTs `body` (the event `id`) to `url`, signed with `secret`. The answer's body is not
    /// read: only its status counts, so a large or endless one costs nothing.
    pub async fn deliver(&self, url: &str, secret: &str, id: &str, body: Vec<u8>) -> Delivered {
        let started = Instant::now();
        if let Some(refused) = refuse_url(url, &self.settings) {
            return Delivered { status: None, latency: started.elapsed(), error: Some(refused) };
        }
        let timestamp = chrono::Utc::now().timestamp();
        let signature = sign(secret, id, timestamp, &body);
        let sent = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp)
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await;
        let latency = started.elapsed();
        match sent {
            Ok(response) if response.status().is_success() => {
                Delivered { status: Some(response.status().as_u16()), latency, error: None }
            }
            Ok(response) => {
                let status = response.status();
                Delivered {
                    status: Some(status.as_u16()),
                    latency,
                    error: Some(format!("answered {status}")),
                }
            }
            Err(err) if err.is_timeout() => Delivered {
                status: None,
                latency,
                error: Some(format!("no answer within {:?}", self.settings.timeout)),
            },
            Err(err) => {
                // The chain of causes says what went wrong (refused, reset, an address refused).
                let mut why = err.to_string();
                let mut source = std::error::Error::source(&err);
                while let Some(cause) = source {
                    why = format!("{why}: {cause}");
                    source = cause.source();
                }
                Delivered { status: None, latency, error: Some(why) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_the_specifications_own_test_vector() {
        let signature = sign(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn a_new_secret_is_32_random_bytes_as_the_specification_writes_them() {
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        let bytes = BASE64.decode(a.strip_prefix("whsec_").unwrap()).unwrap();
        assert_eq!(bytes.len(), 32);
    }

    #[test]
    fn only_public_addresses_may_be_called_unless_the_operator_allows_the_host() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:10.0.0.1",
            "224.0.0.1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["93.184.216.34", "1.1.1.1", "2606:4700::1111", "::ffff:1.1.1.1"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
        let settings = WebhookSettings::default();
        for url in [
            "http://127.0.0.1:9000/hook",
            "https://[::1]/x",
            "http://localhost/x",
            "http://10.0.0.7/x",
            "ftp://example.com/x",
            "https://user:pw@example.com/x",
            "not a url",
            "http://",
        ] {
            assert!(refuse_url(url, &settings).is_some(), "{url}");
        }
        assert_eq!(refuse_url("https://hooks.example.com/walletlock?x=1", &settings), None);
        let local = WebhookSettings { allow_hosts: vec!["127.0.0.1".into()], ..WebhookSettings::default() };
        assert_eq!(refuse_url("http://127.0.0.1:9000/hook", &local), None);
        assert!(refuse_url("http://10.0.0.7/x", &local).is_some());
    }
}
