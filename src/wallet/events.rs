//! The change feed: every wallet's events, as the movements' own writes left them (see
//! [`ledger::event`]), read without a lease, scoped to the wallets the caller may use; a reader
//! with nothing new may wait for it (long polling).

use super::{Access, WalletError, WalletId, Wallets, history::visible};
use crate::domain::{EventCursor, EventType};
use crate::ledger::event::{self, EventFilter, StoredEvent};
use crate::telemetry::metrics::EVENTS_READ;
use std::time::{Duration, Instant};

/// The longest a reader may wait for an event.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// How often a reader that waits looks again: events written by any replica show up within
/// about this long.
pub const WAIT_TICK: Duration = Duration::from_millis(200);

/// What a reader asks of the feed.
#[derive(Debug, Clone)]
pub struct EventsAsked {
    pub after: Option<EventCursor>,
    /// Of these types (every type, when empty).
    pub types: Vec<EventType>,
    pub wallet_id: Option<WalletId>,
    pub limit: i64,
    /// How long to wait for an event when there is none yet.
    pub wait: Duration,
}

/// A page of the feed: the events, and where to read on from (the last event's cursor, or the
/// one asked after when there was none).
#[derive(Debug, Clone)]
pub struct EventsPage {
    pub events: Vec<StoredEvent>,
    pub next: Option<EventCursor>,
}

impl Wallets {
    /// The events `asked` selects of the wallets `access` may use, in the feed's order: at once if
    /// there are any, else as soon as one is written, else none once `asked.wait` is over or
    /// `stop()` says the replica is going away. A wallet it may not use is [`WalletError::NotFound`].
    pub async fn events(
        &self,
        access: &Access,
        asked: EventsAsked,
        stop: impl Fn() -> bool,
    ) -> Result<EventsPage, WalletError> {
        let until = Instant::now() + asked.wait;
        if let Some(id) = &asked.wallet_id {
            visible(&mut *self.connection().await?, access, id).await?;
        }
        let filter = EventFilter {
            after: asked.after.clone(),
            owner: (!access.every_wallet).then(|| access.caller.to_string()),
            types: asked.types,
            wallet_id: asked.wallet_id.map(|id| id.as_str().to_owned()),
            limit: asked.limit,
            ..EventFilter::default()
        };
        loop {
            let events = {
                // The connection goes back to the pool between looks.
                let mut conn = self.connection().await?;
                let horizon = event::horizon(&mut conn).await?;
                event::page(&mut conn, &filter, horizon).await?
            };
            let left = until.saturating_duration_since(Instant::now());
            if !events.is_empty() || left.is_zero() || stop() {
                metrics::counter!(EVENTS_READ.name).increment(events.len() as u64);
                let next = events.last().map(|event| event.cursor.clone()).or(asked.after);
                return Ok(EventsPage { events, next });
            }
            tokio::time::sleep(left.min(WAIT_TICK)).await;
        }
    }
}
