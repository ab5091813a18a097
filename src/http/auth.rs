//! Bearer-token authentication for the `/wallets` routes.
//!
//! Each caller has a name and one or more tokens (several at once, so a token can be rotated
//! without downtime: add the new one, move the clients, remove the old one). A request must send
//! `Authorization: Bearer <token>`; a missing or unknown token is a 401 with `WWW-Authenticate`,
//! decided before the body is read or anything is stored. Tokens are compared as SHA-256 digests
//! in constant time, against every configured token, so the time taken says nothing about how
//! close a guess was or which caller it resembled. The health endpoints stay open.

use super::ApiContext;
use super::error::ApiError;
use axum::{
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The shortest token accepted: 16 characters, so tokens are not guessable passwords.
const MIN_TOKEN_LEN: usize = 16;

/// The authenticated caller of a request: idempotency keys are scoped by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(pub Arc<str>);

/// Who may call the API, and with which tokens.
#[derive(Clone)]
pub struct Callers {
    /// (caller, SHA-256 of one of its tokens). Never the tokens themselves.
    tokens: Arc<[(Arc<str>, [u8; 32])]>,
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Callers").field("tokens", &self.tokens.len()).finish()
    }
}

impl Callers {
    /// Parses `caller:token` entries, separated by commas or newlines; blank lines and lines
    /// starting with `#` are skipped. A caller may appear with several tokens.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut tokens = Vec::new();
        for entry in spec.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty() && !e.starts_with('#')) {
            let Some((caller, token)) = entry.split_once(':') else {
                return Err("each API token is `caller:token`".into());
            };
            let valid_caller = (1..=64).contains(&caller.len())
                && caller.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid_caller {
                return Err(format!("caller names are 1 to 64 of [A-Za-z0-9_-], not {caller:?}"));
            }
            if token.len() < MIN_TOKEN_LEN || token.bytes().any(|b| !b.is_ascii_graphic()) {
                return Err(format!(
                    "the token of {caller} must be at least {MIN_TOKEN_LEN} printable characters without spaces"
                ));
            }
            tokens.push((Arc::from(caller), digest(token.as_bytes())));
        }
        if tokens.is_empty() {
            return Err("no API token given".into());
        }
        Ok(Self { tokens: tokens.into() })
    }

    /// The caller whose token this is. Every configured token is compared, in constant time.
    pub fn authenticate(&self, presented: &[u8]) -> Option<Caller> {
        let presented = digest(presented);
        let mut found = None;
        for (caller, token) in self.tokens.iter() {
            if bool::from(presented.ct_eq(token)) {
                found = Some(caller.clone());
            }
        }
        found.map(Caller)
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Lets a request through only with a known bearer token, and records its caller.
pub async fn require_token(State(ctx): State<ApiContext>, mut request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim().as_bytes().to_vec());
    let Some(caller) = presented.and_then(|token| ctx.callers.authenticate(&token)) else {
        return ApiError::Unauthorized.into_response();
    };
    tracing::Span::current().record("caller", &*caller.0);
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_authenticate_their_caller_and_nothing_else() {
        let callers =
            Callers::parse("shop:0123456789abcdef, shop:fedcba9876543210\nbank:bank-token-0000000").unwrap();
        assert_eq!(callers.authenticate(b"0123456789abcdef"), Some(Caller("shop".into())));
        assert_eq!(callers.authenticate(b"fedcba9876543210"), Some(Caller("shop".into())), "rotation");
        assert_eq!(callers.authenticate(b"bank-token-0000000"), Some(Caller("bank".into())));
        for wrong in [&b""[..], b"0123456789abcde", b"0123456789abcdef0", b"shop:0123456789abcdef"] {
            assert_eq!(callers.authenticate(wrong), None, "{wrong:?}");
        }
    }

    #[test]
    fn weak_or_malformed_token_lists_are_refused() {
        for bad in [
            "",
            "# only a comment",
            "no-colon-here-at-all",
            "shop:short",
            "bad name:0123456789abcdef",
            "shop:0123 456789abcdef",
        ] {
            assert!(Callers::parse(bad).is_err(), "{bad:?}");
        }
    }
}
