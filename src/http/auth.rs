//! Bearer-token authentication for the `/wallets` routes.
//!
//! Each caller has a name and one or more tokens (several at once, so a token can be rotated
//! without downtime: add the new one, move the clients, remove the old one). A request must send
//! `Authorization: Bearer <token>`; a missing or unknown token is a 401 with `WWW-Authenticate`,
//! decided before the body is read or anything is stored. Tokens are compared as SHA-256 digests
//! in constant time, against every configured token, so the time taken says nothing about how
//! close a guess was or which caller it resembled. The health endpoints stay open.
//!
//! A caller owns the wallets it opens and sees no other ([`Access`]), unless the same list grants
//! it more: `grant <caller> every-wallet` (an operator, a back office) or `grant <caller>
//! pays-into <other>` (its transfers may pay into `other`'s wallets).

use super::ApiContext;
use super::error::ApiError;
use crate::domain::Access;
use axum::{
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The shortest token accepted: 16 characters, so tokens are not guessable passwords.
const MIN_TOKEN_LEN: usize = 16;

/// Who may call the API, with which tokens, and what each caller may use.
#[derive(Clone)]
pub struct Callers {
    /// (caller, SHA-256 of one of its tokens). Never the tokens themselves.
    tokens: Arc<[(Arc<str>, [u8; 32])]>,
    /// Each caller's access, grants included.
    access: Arc<HashMap<Arc<str>, Access>>,
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Callers").field("tokens", &self.tokens.len()).finish()
    }
}

impl Callers {
    /// Parses `caller:token` entries and `grant` entries (see the module doc), separated by
    /// commas or newlines; blank lines and lines starting with `#` are skipped. A caller may
    /// appear with several tokens; a grant must name callers that have one.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut tokens = Vec::new();
        let mut grants = Vec::new();
        for entry in spec.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty() && !e.starts_with('#')) {
            if let Some(grant) = entry.strip_prefix("grant ") {
                grants.push(grant.split_whitespace().collect::<Vec<_>>());
                continue;
            }
            let Some((caller, token)) = entry.split_once(':') else {
                return Err("each API token is `caller:token`".into());
            };
            valid_caller(caller)?;
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
        let mut access: HashMap<Arc<str>, Access> = tokens
            .iter()
            .map(|(caller, _): &(Arc<str>, _)| (caller.clone(), Access::own_wallets(caller)))
            .collect();
        let unknown = |name: &str| format!("grant: {name:?} has no API token");
        for grant in grants {
            match grant[..] {
                [caller, "every-wallet"] => {
                    access.get_mut(caller).ok_or_else(|| unknown(caller))?.every_wallet = true;
                }
                [caller, "pays-into", payee] => {
                    if !access.contains_key(payee) {
                        return Err(unknown(payee));
                    }
                    let granted = access.get_mut(caller).ok_or_else(|| unknown(caller))?;
                    granted.pays_into = granted.pays_into.iter().cloned().chain([Arc::from(payee)]).collect();
                }
                _ => {
                    return Err(
                        "a grant is `grant <caller> every-wallet` or `grant <caller> pays-into <caller>`"
                            .into(),
                    );
                }
            }
        }
        Ok(Self { tokens: tokens.into(), access: Arc::new(access) })
    }

    /// The access of the caller whose token this is. Every configured token is compared, in
    /// constant time.
    pub fn authenticate(&self, presented: &[u8]) -> Option<Access> {
        let presented = digest(presented);
        let mut found = None;
        for (caller, token) in self.tokens.iter() {
            if bool::from(presented.ct_eq(token)) {
                found = Some(caller);
            }
        }
        found.and_then(|caller| self.access.get(caller)).cloned()
    }
}

fn valid_caller(caller: &str) -> Result<(), String> {
    let valid = (1..=64).contains(&caller.len())
        && caller.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid { Ok(()) } else { Err(format!("caller names are 1 to 64 of [A-Za-z0-9_-], not {caller:?}")) }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Lets a request through only with a known bearer token, and records its caller's access.
pub async fn require_token(State(ctx): State<ApiContext>, mut request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim().as_bytes().to_vec());
    let Some(access) = presented.and_then(|token| ctx.callers.authenticate(&token)) else {
        return ApiError::Unauthorized.into_response();
    };
    tracing::Span::current().record("caller", &*access.caller);
    request.extensions_mut().insert(access);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_authenticate_their_caller_and_nothing_else() {
        let callers =
            Callers::parse("shop:0123456789abcdef, shop:fedcba9876543210\nbank:bank-token-0000000").unwrap();
        let caller = |token: &[u8]| callers.authenticate(token).map(|access| access.caller);
        assert_eq!(caller(b"0123456789abcdef"), Some("shop".into()));
        assert_eq!(caller(b"fedcba9876543210"), Some("shop".into()), "rotation");
        assert_eq!(caller(b"bank-token-0000000"), Some("bank".into()));
        for wrong in [&b""[..], b"0123456789abcde", b"0123456789abcdef0", b"shop:0123456789abcdef"] {
            assert_eq!(callers.authenticate(wrong), None, "{wrong:?}");
        }
    }

    #[test]
    fn a_caller_owns_its_wallets_unless_a_grant_says_more() {
        let callers = Callers::parse(
            "shop:0123456789abcdef, bank:bank-token-0000000, ops:ops-token-00000000\n\
             grant ops every-wallet\ngrant shop pays-into bank",
        )
        .unwrap();
        let shop = callers.authenticate(b"0123456789abcdef").unwrap();
        assert!(shop.may_use(Some("shop")) && !shop.may_use(Some("bank")) && shop.may_pay_into(Some("bank")));
        let bank = callers.authenticate(b"bank-token-0000000").unwrap();
        assert!(!bank.may_pay_into(Some("shop")), "a grant goes one way");
        assert!(callers.authenticate(b"ops-token-00000000").unwrap().may_use(Some("bank")));
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
            "shop:0123456789abcdef, grant bank every-wallet",
            "shop:0123456789abcdef, grant shop pays-into bank",
            "shop:0123456789abcdef, grant shop everything",
        ] {
            assert!(Callers::parse(bad).is_err(), "{bad:?}");
        }
    }
}
