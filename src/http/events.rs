//! The change feed: `GET /events`, every event of the caller's wallets in order, paged by cursor,
//! with long polling (`wait`).

use super::ApiContext;
use super::bodies::{EntryBody, HoldBody};
use super::error::described::{NO_WALLET, READ_UNAVAILABLE as UNAVAILABLE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::QueryParams;
use crate::domain::{Access, EventCursor, EventType, Field, InvalidInput, Monitor, WalletId};
use crate::wallet::{EventsAsked, MAX_WAIT, StoredEvent};
use axum::{
    Json,
    extract::{Extension, State},
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(events))
}

/// The path of the feed, whose requests may last [`MAX_WAIT`] longer than others.
pub(super) const PATH: &str = "/events";

const MAX_PAGE: i64 = 500;
const DEFAULT_PAGE: i64 = 100;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// The `next` of the previous page: the events after it. Opaque; without it (or empty), from
    /// the first.
    after: Option<String>,
    /// At most this many events (default 100).
    #[param(minimum = 1, maximum = 500, example = 100)]
    limit: Option<i64>,
    /// Events of these types, comma-separated (`wallet.opened`, `deposit.accepted`,
    /// `payment.accepted`, `transfer.accepted`, `movement.accepted`, `refund.accepted`,
    /// `hold.placed`, `hold.captured`, `hold.voided`, `hold.expired`).
    #[param(example = "payment.accepted,refund.accepted")]
    r#type: Option<String>,
    /// The events of this wallet only.
    #[param(example = "alice")]
    wallet_id: Option<String>,
    /// With no event to answer yet, wait up to this many seconds (0 to 30, default 0) for one.
    #[param(minimum = 0, maximum = 30, example = 1)]
    wait: Option<u64>,
}

/// A page of the feed.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = EventsPage)]
struct EventsPageBody {
    events: Vec<EventBody>,
    /// Pass as `after` for the events that follow (the same one when this page is empty); null
    /// only when there has been no event yet and none was asked after.
    #[schema(required = true)]
    next: Option<String>,
}

/// What happened to a wallet: written by the very commit that moved its money, so it exists if
/// and only if that movement did.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Event)]
pub struct EventBody {
    /// Unique to the event: `<wallet id>.<sequence>`.
    #[schema(example = "alice.7")]
    id: String,
    /// The event's place in the feed: pass it as `after` to read on from it.
    cursor: String,
    r#type: EventType,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", example = "alice")]
    wallet_id: String,
    /// The wallet's events are numbered 1, 2, 3, ... with no gap, in the order they happened.
    #[schema(minimum = 1, example = 7)]
    sequence: i64,
    created_at: DateTime<Utc>,
    /// The ledger entry it is about; omitted for a hold placed or settled without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    entry: Option<EntryBody>,
    /// The hold it is about, as the event left it; omitted for an entry of no hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    hold: Option<HoldBody>,
    /// The monitor a `wallet.balance_below` or `wallet.balance_above` event crossed (its entry
    /// is the movement that crossed it); omitted for other events.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    monitor: Option<Monitor>,
}

/// An event as a webhook delivers it: its body here, as JSON.
pub fn render(event: &StoredEvent) -> Vec<u8> {
    serde_json::to_vec(&EventBody::from(event.clone())).unwrap_or_default()
}

impl From<StoredEvent> for EventBody {
    fn from(event: StoredEvent) -> Self {
        EventBody {
            id: format!("{}.{}", event.wallet_id(), event.seq()),
            cursor: event.cursor.to_string(),
            r#type: event.kind,
            wallet_id: event.cursor.wallet_id,
            sequence: event.cursor.seq,
            created_at: event.created_at,
            entry: event.entry.map(EntryBody::from),
            hold: event.hold.map(HoldBody::from),
            monitor: event.monitor,
        }
    }
}

/// The events of the caller's wallets, in the order of the feed: each wallet's in the order they
/// happened, every committed event exactly once to a reader that reads on from each page's
/// `next`. With `wait`, a page with no event yet is answered as soon as one is written (within
/// about 200 ms), or empty once the wait is over.
#[utoipa::path(
    get,
    path = "/events",
    tag = "events",
    security(("bearer" = [])),
    params(EventsQuery),
    responses(
        (status = 200, description = "A page of events", body = EventsPageBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_cursor`, `invalid_limit`, `invalid_event_type`, `invalid_wallet_id`, \
                           `invalid_wait`, `invalid_query`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn events(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    QueryParams(query): QueryParams<EventsQuery>,
) -> Result<Json<EventsPageBody>, ApiError> {
    // An empty `after` is none: a reader's first request may send the cursor it has not got yet.
    let after = query
        .after
        .as_deref()
        .filter(|cursor| !cursor.is_empty())
        .map(|cursor| {
            EventCursor::parse(cursor)
                .ok_or(InvalidInput { field: Field::Cursor, rule: "a `next` of this feed" })
        })
        .transpose()?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(InvalidInput { field: Field::Limit, rule: "an integer from 1 to 500" }.into());
    }
    let types = match query.r#type.as_deref() {
        None => Vec::new(),
        Some(types) => types
            .split(',')
            .map(|name| {
                EventType::parse(name)
                    .ok_or(InvalidInput { field: Field::EventType, rule: "event types, comma-separated" })
            })
            .collect::<Result<_, _>>()?,
    };
    let wallet_id = query.wallet_id.as_deref().map(WalletId::parse).transpose()?;
    let wait = Duration::from_secs(query.wait.unwrap_or(0));
    if wait > MAX_WAIT {
        return Err(InvalidInput { field: Field::Wait, rule: "whole seconds from 0 to 30" }.into());
    }
    let asked = EventsAsked { after, types, wallet_id, limit, wait };
    let draining = ctx.draining.clone();
    let page = ctx.wallets.events(&access, asked, move || draining.is_draining()).await?;
    Ok(Json(EventsPageBody {
        events: page.events.into_iter().map(EventBody::from).collect(),
        next: page.next.map(|cursor| cursor.to_string()),
    }))
}
