//! Extractors that turn every rejection into the API's problem format.

use super::error::ApiError;
use crate::wallet::WalletId;
use axum::extract::{FromRequest, FromRequestParts, Path};
use axum::http::request::Parts;

/// A JSON body: `Content-Type: application/json`, at most [`super::BODY_LIMIT`] bytes, and
/// matching `T` exactly (unknown and duplicate fields are refused by `T`'s serde attributes).
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct JsonBody<T>(pub T);

/// Query parameters matching `T`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct QueryParams<T>(pub T);

/// The `{id}` segment of a wallet route, validated before anything else is read.
#[derive(Debug)]
pub struct WalletPath(pub WalletId);

impl<S: Send + Sync> FromRequestParts<S> for WalletPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state).await?;
        let id = WalletId::parse(&id)?;
        tracing::Span::current().record("wallet_id", id.as_str());
        Ok(Self(id))
    }
}
