//! Webhooks: endpoints a caller registers, and the delivery of its wallets' events to them
//! (docs/api/webhooks.md). The endpoints' rows are `crate::ledger::webhook`'s; delivering is
//! [`dispatch`]'s, run by every replica, each endpoint by one replica at a time under its lease.

mod deliver;
mod dispatch;

pub use crate::ledger::webhook::{Attempt, Endpoint, Pending};
pub use deliver::{is_public, sign};
pub use dispatch::{Dispatcher, RenderEvent};

use super::{Access, WalletError, WalletId, Wallets};
use crate::domain::{EventCursor, EventType};
use crate::ledger::event;
use crate::ledger::webhook::{self as store, EndpointSpec};
use std::time::Duration;
use uuid::Uuid;

/// How the replicas deliver.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// Hosts (names or addresses) an endpoint may be at although they are not public: the
    /// operator's own receivers (`deploy/local` allows 127.0.0.1).
    pub allow_hosts: Vec<String>,
    /// How long a delivery waits for the endpoint's answer.
    pub timeout: Duration,
    /// How long an endpoint's failures are retried before it is disabled.
    pub retry_for: Duration,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            allow_hosts: Vec::new(),
            timeout: Duration::from_secs(10),
            retry_for: Duration::from_secs(3 * 24 * 3600),
        }
    }
}

impl WebhookSettings {
    pub fn allows(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.allow_hosts.iter().any(|allowed| allowed.eq_ignore_ascii_case(host))
    }
}

/// What a caller asks an endpoint to be.
#[derive(Debug, Clone)]
pub struct EndpointAsked {
    pub url: String,
    pub types: Vec<EventType>,
    pub wallet_ids: Vec<WalletId>,
}

/// An endpoint, with what waits for it.
#[derive(Debug, Clone)]
pub struct EndpointState {
    pub endpoint: Endpoint,
    pub pending: Vec<Pending>,
}

impl Wallets {
    /// Registers an endpoint for `access`'s caller, receiving the events written from now on.
    /// [`WalletError::EndpointRefused`] for a URL it may not have; [`WalletError::NotFound`] for a
    /// wallet it may not use.
    pub async fn create_endpoint(
        &self,
        access: &Access,
        asked: EndpointAsked,
        enabled: bool,
    ) -> Result<Endpoint, WalletError> {
        let spec = self.endpoint_spec(access, asked).await?;
        let mut conn = self.connection().await?;
        let horizon = event::horizon(&mut conn).await?;
        Ok(store::create(&mut conn, &access.caller, &spec, &deliver::new_secret(), horizon, enabled).await?)
    }

    /// The caller's endpoints.
    pub async fn endpoints(&self, access: &Access) -> Result<Vec<Endpoint>, WalletError> {
        Ok(store::list(&mut *self.connection().await?, &access.caller).await?)
    }

    /// The caller's endpoint `id`, with the wallets waiting behind a failed delivery.
    pub async fn endpoint(&self, access: &Access, id: Uuid) -> Result<EndpointState, WalletError> {
        let mut conn = self.connection().await?;
        let endpoint =
            store::find(&mut conn, id, Some(&access.caller)).await?.ok_or(WalletError::EndpointNotFound)?;
        let pending = store::pending(&mut conn, id).await?;
        Ok(EndpointState { endpoint, pending })
    }

    /// Sets the caller's endpoint `id` to `asked`, enabled or not.
    pub async fn update_endpoint(
        &self,
        access: &Access,
        id: Uuid,
        asked: EndpointAsked,
        enabled: bool,
    ) -> Result<Endpoint, WalletError> {
        let spec = self.endpoint_spec(access, asked).await?;
        let mut conn = self.connection().await?;
        store::update(&mut conn, id, &access.caller, &spec, enabled)
            .await?
            .ok_or(WalletError::EndpointNotFound)
    }

    /// Gives the caller's endpoint `id` a new secret (deliveries already sent were signed with the
    /// old one).
    pub async fn rotate_endpoint_secret(&self, access: &Access, id: Uuid) -> Result<Endpoint, WalletError> {
        let mut conn = self.connection().await?;
        store::rotate(&mut conn, id, &access.caller, &deliver::new_secret())
            .await?
            .ok_or(WalletError::EndpointNotFound)
    }

    pub async fn delete_endpoint(&self, access: &Access, id: Uuid) -> Result<(), WalletError> {
        let mut conn = self.connection().await?;
        if store::delete(&mut conn, id, &access.caller).await? {
            Ok(())
        } else {
            Err(WalletError::EndpointNotFound)
        }
    }

    /// Delivers the caller's events after `after` to endpoint `id` again (those it received are
    /// sent again, with the same `webhook-id`): its place in the feed goes back there, if that is
    /// before it.
    pub async fn replay_endpoint(
        &self,
        access: &Access,
        id: Uuid,
        after: EventCursor,
    ) -> Result<Endpoint, WalletError> {
        let mut conn = self.connection().await?;
        store::replay(&mut conn, id, &access.caller, &after).await?.ok_or(WalletError::EndpointNotFound)
    }

    /// The latest `limit` delivery attempts to the caller's endpoint `id`, newest first.
    pub async fn endpoint_attempts(
        &self,
        access: &Access,
        id: Uuid,
        limit: i64,
    ) -> Result<Vec<Attempt>, WalletError> {
        let mut conn = self.connection().await?;
        store::find(&mut conn, id, Some(&access.caller)).await?.ok_or(WalletError::EndpointNotFound)?;
        Ok(store::attempts(&mut conn, id, limit).await?)
    }

    /// `asked` as stored, once its URL is one the replicas may call and its wallets the caller's.
    async fn endpoint_spec(
        &self,
        access: &Access,
        asked: EndpointAsked,
    ) -> Result<EndpointSpec, WalletError> {
        if let Some(why) = deliver::refuse_url(&asked.url, &self.webhooks) {
            return Err(WalletError::EndpointRefused(why));
        }
        for wallet in &asked.wallet_ids {
            super::history::visible(&mut *self.connection().await?, access, wallet).await?;
        }
        let wallet_ids = asked.wallet_ids.iter().map(|id| id.as_str().to_owned()).collect();
        Ok(EndpointSpec { url: asked.url, types: asked.types, wallet_ids })
    }
}
