//! Extractors that turn every rejection into the API's problem format.

use super::error::ApiError;
use crate::domain::{Field, InvalidInput, Metadata};
use crate::idempotency::IdempotencyKey;
use crate::wallet::WalletId;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::{header, request::Parts};
use serde::de::DeserializeOwned;

/// A JSON body: `Content-Type: application/json`, at most [`super::BODY_LIMIT`] bytes, and
/// matching `T` exactly (unknown and duplicate fields are refused by `T`'s serde attributes).
/// Keeps the raw bytes, which an idempotency key's fingerprint covers.
#[derive(Debug)]
pub struct JsonBody<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !is_json(request.headers().get(header::CONTENT_TYPE)) {
            return Err(ApiError::UnsupportedMediaType(
                "send the body as JSON, with Content-Type: application/json".into(),
            ));
        }
        let raw = Bytes::from_request(request, state).await?;
        let axum::Json(value) = axum::Json::<T>::from_bytes(&raw)?;
        Ok(Self { value, raw })
    }
}

/// A JSON body that may be left out: none at all (no bytes, no `Content-Type`) is `T::default()`,
/// and one sent is read as [`JsonBody`] reads it.
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub JsonBody<T>);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        if request.headers().get(header::CONTENT_TYPE).is_none() {
            let raw = Bytes::from_request(request, state).await?;
            if raw.is_empty() {
                return Ok(Self(JsonBody { value: T::default(), raw }));
            }
            return Err(ApiError::UnsupportedMediaType(
                "send the body as JSON, with Content-Type: application/json".into(),
            ));
        }
        JsonBody::from_request(request, state).await.map(Self)
    }
}

/// `application/json`, or any `application/*+json`, with or without parameters.
pub(super) fn is_json(content_type: Option<&axum::http::HeaderValue>) -> bool {
    let Some(essence) = content_type.and_then(|v| v.to_str().ok()).and_then(|v| v.split(';').next()) else {
        return false;
    };
    let essence = essence.trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Query parameters matching `T`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct QueryParams<T>(pub T);

/// Query parameters matching `T`, and beside them the `metadata[key]=value` pairs (which `T`,
/// refusing unknown parameters, cannot name): a filter on metadata, held to its rule.
#[derive(Debug)]
pub struct QueryWithMetadata<T>(pub T, pub Metadata);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for QueryWithMetadata<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Ok(axum::extract::RawQuery(raw)) =
            axum::extract::RawQuery::from_request_parts(parts, state).await;
        let (mut rest, mut pairs) = (form_urlencoded::Serializer::new(String::new()), Vec::new());
        for (name, value) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            match name.strip_prefix("metadata[").and_then(|key| key.strip_suffix(']')) {
                Some(key) => pairs.push((key.to_owned(), value.into_owned())),
                None => {
                    rest.append_pair(&name, &value);
                }
            }
        }
        // What is left, as a URI of its own for `Query` to read as it reads any (its rejections are
        // the API's `invalid_query`).
        let uri = axum::http::Uri::try_from(format!("/?{}", rest.finish()))
            .map_err(|_| ApiError::from(InvalidInput { field: Field::Metadata, rule: Metadata::RULE }))?;
        let axum::extract::Query(value) = axum::extract::Query::<T>::try_from_uri(&uri)?;
        Ok(Self(value, Metadata::from_pairs(pairs)?))
    }
}

/// The `{id}` segment of a wallet route, validated before anything else is read.
#[derive(Debug, utoipa::IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
pub struct WalletPath(
    /// The wallet's id: 1 to 64 characters of `A-Z`, `a-z`, `0-9`, `_` and `-`.
    #[param(
        value_type = String,
        min_length = 1,
        max_length = 64,
        pattern = "^[A-Za-z0-9_-]{1,64}$",
        example = "alice"
    )]
    pub WalletId,
);

impl<S: Send + Sync> FromRequestParts<S> for WalletPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state).await?;
        let id = WalletId::parse(&id)?;
        tracing::Span::current().record("wallet_id", id.as_str());
        Ok(Self(id))
    }
}

/// The optional `Idempotency-Key` header; a malformed or repeated one is a 400.
#[derive(Debug, utoipa::IntoParams)]
#[into_params(names("Idempotency-Key"), parameter_in = Header)]
pub struct IdempotencyHeader(
    /// Makes a retried request apply once: the same key with the same request gets the first
    /// response again (with `Idempotent-Replayed: true`), and charges nothing. 1 to 255 printable
    /// ASCII characters (HTTP strips a leading or trailing space, so none is documented).
    #[param(
        value_type = Option<String>,
        nullable = false,
        min_length = 1,
        max_length = 255,
        pattern = "^[\\x21-\\x7E]([\\x20-\\x7E]{0,253}[\\x21-\\x7E])?$",
        example = "order-1001"
    )]
    pub Option<IdempotencyKey>,
);

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyHeader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let mut values = parts.headers.get_all("idempotency-key").iter();
        match (values.next(), values.next()) {
            (None, _) => Ok(Self(None)),
            (Some(value), None) => Ok(Self(Some(IdempotencyKey::parse(value.as_bytes())?))),
            (Some(_), Some(_)) => Err(ApiError::BadRequest {
                code: &super::error::codes::INVALID_IDEMPOTENCY_KEY,
                detail: "send one Idempotency-Key header, not several".into(),
            }),
        }
    }
}

/// Declares `$name`, the `{id}` segment of a route whose id is a UUID: its OpenAPI parameter
/// (described as `$what`) and its extractor, which answers 400 with `$field`'s rule broken for
/// anything but a UUID. One declaration per resource (holds, transfers, movements), one shape.
macro_rules! uuid_path {
    ($(#[$doc:meta])* $name:ident, $what:literal, $field:expr) => {
        $(#[$doc])*
        #[derive(Debug, utoipa::IntoParams)]
        #[into_params(names("id"), parameter_in = Path)]
        pub struct $name(
            #[doc = $what]
            #[param(value_type = String, format = Uuid)]
            pub uuid::Uuid,
        );

        impl<S: Send + Sync> axum::extract::FromRequestParts<S> for $name {
            type Rejection = $crate::http::error::ApiError;

            async fn from_request_parts(
                parts: &mut axum::http::request::Parts,
                state: &S,
            ) -> Result<Self, Self::Rejection> {
                Ok(Self($crate::http::extract::uuid_in_path(parts, state, $field).await?))
            }
        }
    };
}
pub(crate) use uuid_path;

/// A `{id}` path segment that must be a UUID, else `field`'s rule is broken.
pub async fn uuid_in_path<S: Send + Sync>(
    parts: &mut Parts,
    state: &S,
    field: crate::domain::Field,
) -> Result<uuid::Uuid, ApiError> {
    let Path(id) = Path::<String>::from_request_parts(parts, state).await?;
    uuid::Uuid::parse_str(&id).map_err(|_| crate::domain::InvalidInput { field, rule: "a UUID" }.into())
}
