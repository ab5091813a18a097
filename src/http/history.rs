//! A wallet's history: its entries filtered and paged either way (or exported whole, as CSV or
//! NDJSON, streamed), its balance as of an instant, and a statement of a period. None takes a
//! lease or waits for a movement.

use super::ApiContext;
use super::bodies::EntryBody;
use super::error::described::{NO_WALLET, READ_UNAVAILABLE as UNAVAILABLE, UNAUTHORIZED};
use super::error::{ApiError, PROBLEM_JSON, ProblemDocument};
use super::extract::{QueryParams, QueryWithMetadata, WalletPath};
use crate::domain::{Access, EntryKind, Field, InvalidInput};
use crate::wallet::{Entry, EntryFilter, Order, WalletError};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::{
    Json,
    extract::{Extension, State},
};
use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::{router::OpenApiRouter, routes};

/// The history routes, each at the path and method of its `#[utoipa::path]`.
pub fn router() -> OpenApiRouter<ApiContext> {
    OpenApiRouter::default().routes(routes!(entries)).routes(routes!(balance_at)).routes(routes!(statement))
}

/// At most this many entries per page, and per read of an export.
pub(super) const MAX_PAGE: i64 = 500;
pub(super) const DEFAULT_PAGE: i64 = 50;
/// An export reads the ledger this many entries at a time: what a replica holds of it at once.
pub const EXPORT_CHUNK: i64 = 1000;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct EntriesQuery {
    /// Entries written at or after this instant (RFC 3339).
    #[param(example = "2026-12-01T00:00:00Z")]
    from: Option<String>,
    /// Entries written before this instant (RFC 3339).
    #[param(example = "2027-01-01T00:00:00Z")]
    to: Option<String>,
    /// Entries of these kinds, comma-separated (`open`, `deposit`, `pay`, `transfer_out`,
    /// `transfer_in`, `refund`).
    #[param(example = "pay,refund")]
    kind: Option<String>,
    /// Entries with this reference.
    #[param(example = "order-1001")]
    reference: Option<String>,
    /// `asc` (oldest first, the default) or `desc`.
    #[param(example = "asc")]
    order: Option<String>,
    /// At most this many entries (default 50); an export (`Accept: text/csv` or
    /// `application/x-ndjson`) has every entry selected, and no limit.
    #[param(minimum = 1, maximum = 500, example = 50)]
    limit: Option<i64>,
    /// The `next_cursor` of the previous page, or the `cursor` of an export's last line: the
    /// entries after it, in the same order. Opaque.
    cursor: Option<String>,
}

/// A page of a wallet's entries.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = EntriesPage)]
struct EntriesPage {
    entries: Vec<EntryBody>,
    /// Pass as `cursor` (with the same filters) for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<String>,
}

/// The wallet's entries that the filters select, in order of version (`order`): a page as JSON,
/// or every one of them streamed as CSV or NDJSON (by `Accept`), each line with its cursor to
/// resume from. A cursor stays valid while entries are added: a page never repeats or skips one.
#[utoipa::path(
    get,
    path = "/wallets/{id}/entries",
    tag = "history",
    security(("bearer" = [])),
    params(
        WalletPath,
        EntriesQuery,
        ("metadata" = Option<HashMap<String, String>>, Query, style = DeepObject, explode,
            description = "Entries whose metadata has each key at its value: `metadata[order_id]=o-1001`; \
                           up to 16 keys, held to the rule of a movement's `metadata`"),
    ),
    responses(
        (status = 200, description = "A page of entries (JSON), or all of them (`text/csv`, `application/x-ndjson`)",
            body = EntriesPage,
            content(
                (EntriesPage = "application/json"),
                (String = "text/csv"),
                (String = "application/x-ndjson"),
            )),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_time`, `invalid_kind`, `invalid_reference`, \
                           `invalid_metadata`, `invalid_order`, `invalid_limit`, `invalid_cursor`, `invalid_query`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn entries(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    headers: HeaderMap,
    QueryWithMetadata(query, metadata): QueryWithMetadata<EntriesQuery>,
) -> Result<Response, ApiError> {
    let order = match query.order.as_deref() {
        None | Some("asc") => Order::Asc,
        Some("desc") => Order::Desc,
        Some(_) => return Err(InvalidInput { field: Field::Order, rule: "`asc` or `desc`" }.into()),
    };
    let from = query.from.as_deref().map(|at| instant(at, Field::PeriodStart)).transpose()?;
    let to = query.to.as_deref().map(|at| instant(at, Field::PeriodEnd)).transpose()?;
    if let (Some(from), Some(to)) = (from, to) {
        ends_after(from, to)?;
    }
    let kinds = match query.kind.as_deref() {
        None => Vec::new(),
        Some(kinds) => kinds.split(',').map(entry_kind).collect::<Result<_, _>>()?,
    };
    let reference = crate::domain::reference(query.reference)?;
    let after = query.cursor.as_deref().map(|cursor| Cursor::parse(cursor, order)).transpose()?;
    let export = Export::asked(&headers);
    let limit = match (export, query.limit) {
        (Some(_), _) => EXPORT_CHUNK,
        (None, limit) => limit.unwrap_or(DEFAULT_PAGE),
    };
    if !(1..=MAX_PAGE).contains(&limit) && export.is_none() {
        return Err(InvalidInput { field: Field::Limit, rule: "an integer from 1 to 500" }.into());
    }
    let filter = EntryFilter { from, to, kinds, reference, metadata, order, after, limit };
    if let Some(export) = export {
        let mut chunks = Box::pin(ctx.wallets.entry_chunks(&access, &id, filter).await?);
        // The first chunk before the status: a database that does not answer is still a 503.
        let first = chunks.try_next().await?.unwrap_or_default();
        return Ok(export.stream(order, first, chunks));
    }
    let page = ctx.wallets.entries(&access, &id, &filter).await?;
    let next_cursor =
        (page.len() as i64 == limit).then(|| page.last().map(|last| Cursor::of(last, order))).flatten();
    let entries = page.into_iter().map(EntryBody::from).collect();
    Ok(Json(EntriesPage { entries, next_cursor }).into_response())
}

/// A streamed export's format, as `Accept` asks (or `walletlock export --format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Export {
    Csv,
    Ndjson,
}

/// The columns of an export's CSV, in order: an entry's fields (its metadata as a JSON object, or
/// empty), then the cursor after it.
const CSV_HEADER: &str = "id,wallet_id,version,kind,amount,balance,fence,reference,metadata,transfer_id,refund_of,hold_id,created_at,cursor\n";

impl Export {
    /// The export `Accept` asks for, if any (else a page of JSON).
    fn asked(headers: &HeaderMap) -> Option<Export> {
        let accept = headers.get(header::ACCEPT)?.to_str().ok()?.to_ascii_lowercase();
        let types = accept.split(',').map(|media| media.split(';').next().unwrap_or("").trim());
        types.into_iter().find_map(|media| match media {
            "text/csv" => Some(Export::Csv),
            "application/x-ndjson" => Some(Export::Ndjson),
            _ => None,
        })
    }

    fn content_type(self) -> &'static str {
        match self {
            Export::Csv => "text/csv; charset=utf-8",
            Export::Ndjson => "application/x-ndjson",
        }
    }

    /// What the export starts with: the CSV's header line (NDJSON has none).
    pub fn header(self) -> &'static str {
        if self == Export::Csv { CSV_HEADER } else { "" }
    }

    /// One entry as a line of the export, with the cursor after it.
    pub fn line(self, entry: Entry, order: Order) -> String {
        let cursor = Cursor::of(&entry, order);
        match self {
            Export::Ndjson => {
                let mut line = serde_json::to_value(EntryBody::from(entry)).unwrap_or_default();
                line["cursor"] = serde_json::Value::String(cursor);
                let mut text = line.to_string();
                text.push('\n');
                text
            }
            Export::Csv => {
                let optional = |value: Option<uuid::Uuid>| value.map(|id| id.to_string()).unwrap_or_default();
                let metadata =
                    entry.metadata.pairs().map(|pairs| serde_json::to_string(pairs).unwrap_or_default());
                let fields = [
                    entry.id.to_string(),
                    csv_field(&entry.wallet_id),
                    entry.version.to_string(),
                    entry.kind.as_str().to_owned(),
                    entry.amount.to_string(),
                    entry.balance.to_string(),
                    entry.fence.to_string(),
                    csv_field(entry.reference.as_deref().unwrap_or("")),
                    csv_field(metadata.as_deref().unwrap_or("")),
                    optional(entry.transfer_id),
                    optional(entry.refund_of),
                    optional(entry.hold_id),
                    entry.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    cursor,
                ];
                let mut text = fields.join(",");
                text.push('\n');
                text
            }
        }
    }

    /// The response: `first` (already read), then the rest of the entries as the client takes
    /// them. A read that fails part way ends the body early (the status is sent by then): the
    /// client resumes from the last line's cursor.
    fn stream(
        self,
        order: Order,
        first: Vec<Entry>,
        rest: impl futures::Stream<Item = Result<Vec<Entry>, WalletError>> + Send + 'static,
    ) -> Response {
        let chunk = move |entries: Vec<Entry>| {
            let mut text = String::new();
            for entry in entries {
                text.push_str(&self.line(entry, order));
            }
            Bytes::from(text)
        };
        let header = Bytes::from_static(self.header().as_bytes());
        let first = futures::stream::iter([Ok::<_, std::io::Error>(header), Ok(chunk(first))]);
        let rest = rest.map_ok(chunk).map_err(|err| {
            tracing::warn!(error = %err, "an export ended early");
            std::io::Error::other(err.to_string())
        });
        let mut response = Body::from_stream(first.chain(rest)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(self.content_type()));
        // nginx passes it on as it comes rather than buffering the whole export first.
        headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
        response
    }
}

/// A CSV field (RFC 4180): quoted, its quotes doubled, when it holds a comma, a quote or a line
/// break. Only free text (a reference) and ids can hold them; a crate for one rule is not worth it.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

/// A position in a wallet's ledger, for one order: the entries after it are those past its
/// version that way. Opaque to clients (`a` or `d`, then the version), so a cursor of one order
/// is refused for the other.
pub struct Cursor;

impl Cursor {
    fn of(entry: &Entry, order: Order) -> String {
        let way = if order == Order::Asc { 'a' } else { 'd' };
        format!("{way}{}", entry.version)
    }

    /// The version `cursor` stands after, if it is one of `order`'s.
    pub fn parse(cursor: &str, order: Order) -> Result<i64, InvalidInput> {
        let way = if order == Order::Asc { "a" } else { "d" };
        cursor
            .strip_prefix(way)
            .filter(|digits| !digits.starts_with('0') && digits.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|digits| digits.parse::<i64>().ok())
            .ok_or(InvalidInput {
                field: Field::Cursor,
                rule: "a cursor returned by this endpoint, with the same order",
            })
    }
}

/// An instant of history: RFC 3339, and not in the future (whose history is not written yet).
fn instant(text: &str, field: Field) -> Result<DateTime<Utc>, InvalidInput> {
    let at = DateTime::parse_from_rfc3339(text)
        .map_err(|_| InvalidInput { field, rule: "an RFC 3339 instant, such as 2026-12-01T00:00:00Z" })?;
    let at = at.with_timezone(&Utc);
    if at > Utc::now() {
        return Err(InvalidInput { field, rule: "an instant not in the future" });
    }
    Ok(at)
}

/// A period's end, after its start.
fn ends_after(from: DateTime<Utc>, to: DateTime<Utc>) -> Result<(), InvalidInput> {
    if to > from {
        Ok(())
    } else {
        Err(InvalidInput { field: Field::PeriodEnd, rule: "an instant after `from`" })
    }
}

fn entry_kind(name: &str) -> Result<EntryKind, InvalidInput> {
    EntryKind::ALL.into_iter().find(|kind| kind.as_str() == name).ok_or(InvalidInput {
        field: Field::Kind,
        rule: "entry kinds, comma-separated: open, deposit, pay, transfer_out, transfer_in, refund",
    })
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct BalanceQuery {
    /// The instant (RFC 3339), not in the future.
    #[param(example = "2026-12-01T00:00:00Z")]
    at: String,
}

/// A wallet as of an instant.
#[derive(Debug, Serialize, ToSchema)]
struct BalanceAtBody {
    /// The instant asked about.
    at: DateTime<Utc>,
    balance: i64,
    /// What holds reserved then: placed by then, neither settled nor expired by then.
    held: i64,
    available: i64,
    /// The wallet's version then: that of `entry`.
    version: i64,
    /// The last entry written at or before `at`, whose balance this is.
    entry: EntryBody,
}

/// The wallet's balance, holds and version as of an instant: those the last entry written at or
/// before it left.
#[utoipa::path(
    get,
    path = "/wallets/{id}/balance",
    tag = "history",
    security(("bearer" = [])),
    params(WalletPath, BalanceQuery),
    responses(
        (status = 200, description = "The wallet as of `at`", body = BalanceAtBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_time` (not RFC 3339, or in the future), `invalid_query`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`wallet_not_found`; `wallet_not_yet_open`: the wallet opened after `at`"),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn balance_at(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    QueryParams(query): QueryParams<BalanceQuery>,
) -> Result<Json<BalanceAtBody>, ApiError> {
    let at = instant(&query.at, Field::At)?;
    let then = ctx.wallets.balance_at(&access, &id, at).await?;
    Ok(Json(BalanceAtBody {
        at,
        balance: then.entry.balance,
        held: then.held,
        available: then.entry.balance - then.held,
        version: then.entry.version,
        entry: then.entry.into(),
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct StatementQuery {
    /// The period's start (RFC 3339, inclusive).
    #[param(example = "2026-11-01T00:00:00Z")]
    from: String,
    /// The period's end (RFC 3339, exclusive), after `from` and not in the future.
    #[param(example = "2026-12-01T00:00:00Z")]
    to: String,
}

/// A wallet's statement of a period.
#[derive(Debug, Serialize, ToSchema)]
struct StatementBody {
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    /// As of just before `from` (0 and 0 for a wallet not yet open then).
    opening_balance: i64,
    opening_version: i64,
    /// As of just before `to`: the next period's opening.
    closing_balance: i64,
    closing_version: i64,
    /// The period's entries: those of versions `opening_version + 1` to `closing_version`.
    entries: i64,
    /// For each kind with entries in the period, how many and their amounts summed (positive:
    /// the kind says which way the money went).
    totals: Vec<KindTotalBody>,
}

#[derive(Debug, Serialize, ToSchema)]
struct KindTotalBody {
    kind: EntryKind,
    count: i64,
    amount: i64,
}

/// The wallet's statement over `[from, to)`: opening and closing balance and version, and the
/// period's entries counted and summed by kind. A statement's closing is the next period's
/// opening.
#[utoipa::path(
    get,
    path = "/wallets/{id}/statement",
    tag = "history",
    security(("bearer" = [])),
    params(WalletPath, StatementQuery),
    responses(
        (status = 200, description = "The statement", body = StatementBody),
        (status = 400, body = ProblemDocument, content_type = PROBLEM_JSON,
            description = "`invalid_wallet_id`, `invalid_time` (not RFC 3339, in the future, or `to` not after `from`), \
                           `invalid_query`"),
        (status = 401, description = UNAUTHORIZED, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("WWW-Authenticate" = String))),
        (status = 404, description = NO_WALLET, body = ProblemDocument, content_type = PROBLEM_JSON),
        (status = 503, description = UNAVAILABLE, body = ProblemDocument, content_type = PROBLEM_JSON,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
async fn statement(
    State(ctx): State<ApiContext>,
    Extension(access): Extension<Access>,
    WalletPath(id): WalletPath,
    QueryParams(query): QueryParams<StatementQuery>,
) -> Result<Json<StatementBody>, ApiError> {
    let from = instant(&query.from, Field::PeriodStart)?;
    let to = instant(&query.to, Field::PeriodEnd)?;
    ends_after(from, to)?;
    let statement = ctx.wallets.statement(&access, &id, from, to).await?;
    Ok(Json(StatementBody {
        from,
        to,
        opening_balance: statement.opening_balance,
        opening_version: statement.opening_version,
        closing_balance: statement.closing_balance,
        closing_version: statement.closing_version,
        entries: statement.closing_version - statement.opening_version,
        totals: statement
            .totals
            .into_iter()
            .map(|total| KindTotalBody { kind: total.kind, count: total.count, amount: total.amount })
            .collect(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_cursor_reads_back_in_its_own_order_only(version in 1..i64::MAX, asc in any::<bool>()) {
            let (order, other) = if asc { (Order::Asc, Order::Desc) } else { (Order::Desc, Order::Asc) };
            let entry = Entry { version, ..entry() };
            let cursor = Cursor::of(&entry, order);
            prop_assert_eq!(Cursor::parse(&cursor, order), Ok(version));
            prop_assert!(Cursor::parse(&cursor, other).is_err());
        }
    }

    #[test]
    fn cursors_not_made_here_are_refused() {
        for bad in ["", "a", "a0", "a01", "a-1", "x5", "a5 ", "a99999999999999999999", "5"] {
            assert!(Cursor::parse(bad, Order::Asc).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn csv_quotes_only_what_needs_it() {
        assert_eq!(csv_field("order-1"), "order-1");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("two\nlines"), "\"two\nlines\"");
    }

    #[test]
    fn instants_are_rfc3339_and_not_in_the_future() {
        assert!(instant("2026-01-01T00:00:00Z", Field::At).is_ok());
        assert!(instant("2026-01-01T01:00:00+01:00", Field::At).is_ok());
        assert!(instant("2026-01-01", Field::At).is_err());
        assert!(instant("yesterday", Field::At).is_err());
        let tomorrow = (Utc::now() + chrono::TimeDelta::days(1)).to_rfc3339();
        assert!(instant(&tomorrow, Field::At).is_err());
    }

    #[test]
    fn kinds_are_named_as_entries_name_them() {
        for kind in EntryKind::ALL {
            assert_eq!(entry_kind(kind.as_str()), Ok(kind));
        }
        assert!(entry_kind("payment").is_err());
        assert!(entry_kind("").is_err());
    }

    fn entry() -> Entry {
        Entry {
            id: uuid::Uuid::nil(),
            wallet_id: "w".into(),
            kind: EntryKind::Pay,
            amount: 1,
            metadata: crate::domain::Metadata::default(),
            balance: 0,
            version: 1,
            fence: 1,
            reference: None,
            transfer_id: None,
            refund_of: None,
            hold_id: None,
            created_at: Utc::now(),
        }
    }
}
