//! The delivery of events to the endpoints, run by every replica: each endpoint by one replica at
//! a time, under the endpoint's lease (or, while Redis is out, a session lock in Postgres).
//!
//! A *pass* of an endpoint reads the events after its place in the feed and delivers them, each
//! wallet's in order and many wallets at once; a wallet whose event the endpoint does not take
//! waits (`webhook_pending`), its later events held back for that endpoint, and is retried with
//! exponential backoff and jitter, while every other wallet's events go on. The pass then moves
//! the endpoint's place, conditionally on where it found it and on its lease's fence
//! ([`store::finish_pass`]): a dispatcher paused past its lease, whose deliveries another replica
//! has since made again, moves nothing. So an event is delivered at least once (a duplicate keeps
//! its `webhook-id`), and each wallet's in the order of their numbers.

use super::WebhookSettings;
use super::deliver::{Delivered, Sender};
use crate::domain::EventCursor;
use crate::lease::{Lease, LeaseClient, LeaseError};
use crate::ledger::StoreError;
use crate::ledger::event::{self, EventFilter, StoredEvent};
use crate::ledger::webhook::{self as store, Attempt, Endpoint, Failing, Health, PassWrite, Pending};
use crate::telemetry::metrics::{WEBHOOK_DELIVERIES, WEBHOOK_ENDPOINTS_DISABLED, WEBHOOK_LAG};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use sqlx::{PgConnection, PgPool};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// An event's body as the API shows it (the HTTP layer's), which is what an endpoint receives.
pub type RenderEvent = fn(&StoredEvent) -> Vec<u8>;

/// How often each replica looks for endpoints to serve.
const TICK: Duration = Duration::from_millis(200);
/// Events read at a time; a pass reads on while pages come back full, for up to [`PASS_FOR`].
const PAGE: i64 = 200;
const PASS_FOR: Duration = Duration::from_secs(2);
/// Passes a replica runs at once: each holds a Postgres connection of the replica's pool, which
/// the movements of money need more.
const PASSES_AT_ONCE: usize = 2;
/// Wallets delivered to at once, within a pass (each wallet's events one after another).
const WALLETS_AT_ONCE: usize = 16;
/// The first retry comes after about this long, each next one after twice as long, up to
/// [`LONGEST_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const LONGEST_BACKOFF: Duration = Duration::from_secs(3600);
/// A failing endpoint's probes back off the same way up to this: one request every few seconds
/// costs nothing, and a receiver that comes back is found within it, its backlog drained at once.
const LONGEST_PROBE_BACKOFF: Duration = Duration::from_secs(5);
/// How long the attempts are kept.
const KEEP_ATTEMPTS: Duration = Duration::from_secs(7 * 24 * 3600);

/// The lease an endpoint's dispatcher holds.
fn lease_name(endpoint: Uuid) -> String {
    format!("webhook-endpoint:{endpoint}")
}

/// When a wallet that failed `attempts` times is tried again: exponential, with jitter (a random
/// time between half and all of it), so endpoints coming back are not hit by every retry at once.
pub fn next_attempt(attempts: i32, now: DateTime<Utc>) -> DateTime<Utc> {
    backed_off(attempts, now, LONGEST_BACKOFF)
}

fn backed_off(attempts: i32, now: DateTime<Utc>, longest: Duration) -> DateTime<Utc> {
    let doubled = FIRST_BACKOFF.saturating_mul(1u32 << attempts.clamp(1, 20).saturating_sub(1) as u32);
    let backoff = doubled.min(longest);
    let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() * 0.5);
    now + chrono::Duration::from_std(jittered).unwrap_or_default()
}

/// The replica's dispatcher. Cheap to clone.
#[derive(Clone)]
pub struct Dispatcher {
    db: PgPool,
    leases: LeaseClient,
    sender: Sender,
    settings: Arc<WebhookSettings>,
    render: RenderEvent,
    /// The endpoints a pass of this replica is serving now.
    serving: Arc<Mutex<HashSet<Uuid>>>,
}

impl Dispatcher {
    pub(in crate::wallet) fn new(
        db: PgPool,
        leases: LeaseClient,
        settings: Arc<WebhookSettings>,
        render: RenderEvent,
    ) -> Self {
        let sender = Sender::new(settings.clone());
        Dispatcher { db, leases, sender, settings, render, serving: Arc::default() }
    }

    /// Serves the endpoints no other replica serves, until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut purged = Instant::now();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(TICK) => {}
            }
            if let Err(err) = self.tick(&stop).await {
                tracing::debug!(error = %err, "webhook endpoints not read; the next tick tries again");
            }
            if purged.elapsed() > Duration::from_secs(600) {
                purged = Instant::now();
                let before = Utc::now() - chrono::Duration::from_std(KEEP_ATTEMPTS).unwrap_or_default();
                if let Ok(mut conn) = self.db.acquire().await {
                    let _ = store::purge_attempts(&mut conn, before).await;
                }
            }
        }
    }

    /// Takes the lease of each endpoint that no pass of this replica serves now, all in one round
    /// trip, and starts a pass of each one taken; while Redis is out, the row's lock stands in.
    async fn tick(&self, stop: &CancellationToken) -> Result<(), StoreError> {
        let endpoints = store::enabled(&mut *self.db.acquire().await?).await?;
        let idle: Vec<Endpoint> = {
            let serving = self.serving.lock().expect("not poisoned");
            let room = PASSES_AT_ONCE.saturating_sub(serving.len());
            let mut idle: Vec<Endpoint> =
                endpoints.into_iter().filter(|e| !serving.contains(&e.id)).collect();
            // In no fixed order, so that every endpoint is tried by some replica, whichever others
            // the replicas hold.
            rand::seq::SliceRandom::shuffle(idle.as_mut_slice(), &mut rand::rng());
            idle.truncate(room);
            idle
        };
        if idle.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = idle.iter().map(|e| lease_name(e.id)).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let taken = self.leases.try_acquire_each(&names).await;
        for (endpoint, lease) in idle.into_iter().zip(taken) {
            let hold = match lease {
                Ok(Some(lease)) => EndpointHold::Lease(Box::new(lease)),
                Ok(None) => continue,
                Err(LeaseError::Unavailable(_)) => EndpointHold::SessionLock,
                Err(err) => {
                    tracing::warn!(endpoint = %endpoint.id, error = %err, "an endpoint's lease not taken");
                    continue;
                }
            };
            self.serving.lock().expect("not poisoned").insert(endpoint.id);
            let (this, stop) = (self.clone(), stop.clone());
            tokio::spawn(async move {
                let id = endpoint.id;
                if let Err(err) = this.serve(endpoint.id, hold, &stop).await {
                    tracing::warn!(endpoint = %id, error = %err, "a pass of an endpoint failed; the next one goes on");
                }
                this.serving.lock().expect("not poisoned").remove(&id);
            });
        }
        Ok(())
    }

    /// One pass of endpoint `id` under `hold`.
    async fn serve(&self, id: Uuid, hold: EndpointHold, stop: &CancellationToken) -> Result<(), StoreError> {
        match hold {
            EndpointHold::Lease(mut lease) => {
                lease.keep_alive();
                let outcome = self.pass(&mut *self.db.acquire().await?, id, Some(&mut lease), stop).await;
                let _ = (*lease).release().await;
                outcome
            }
            EndpointHold::SessionLock => {
                // Redis is out: a lock of this connection's session keeps other replicas' passes
                // out. Not a row lock: that would hold a transaction open for the pass, and an
                // open transaction holds back every reader of the feed (see `ledger::event`).
                let mut conn = self.db.acquire().await?;
                if !store::try_lock_endpoint(&mut conn, id).await? {
                    return Ok(());
                }
                let outcome = self.pass(&mut conn, id, None, stop).await;
                store::unlock_endpoint(&mut conn, id).await?;
                outcome
            }
        }
    }

    /// Delivers endpoint `id`'s waiting wallets that are due, then the events after its place,
    /// page by page, each page's outcome written before the next is read.
    async fn pass(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        mut lease: Option<&mut Lease>,
        stop: &CancellationToken,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        loop {
            let Some(endpoint) = store::find(&mut *conn, id, None).await? else { return Ok(()) };
            if !endpoint.enabled || stop.is_cancelled() {
                return Ok(());
            }
            let fence = match lease.as_deref_mut() {
                None => endpoint.fence,
                // Redis's counter went back below the fence that moved the endpoint last: lift it.
                Some(lease) if lease.fence() < endpoint.fence => {
                    match lease.advance_fence(endpoint.fence).await {
                        Ok(fence) => fence,
                        Err(_) => return Ok(()),
                    }
                }
                Some(lease) => lease.fence(),
            };
            if lease.as_deref().is_some_and(Lease::is_lost) {
                return Ok(());
            }
            let full = self.page(conn, &endpoint, fence).await?;
            if !full || started.elapsed() > PASS_FOR {
                return Ok(());
            }
        }
    }

    /// One page of a pass; whether it was full (more events may follow at once).
    ///
    /// An endpoint that answers (or is not known not to) gets its due waiting wallets and the
    /// next events after its place. One that answered none of a page's deliveries is failing
    /// ([`Failing`]): it gets one waiting wallet at its probe's time, and nothing more until it
    /// answers a delivery; then every waiting wallet is due at once.
    async fn page(
        &self,
        conn: &mut PgConnection,
        endpoint: &Endpoint,
        fence: i64,
    ) -> Result<bool, StoreError> {
        let now = Utc::now();
        if endpoint.failing.is_some_and(|failing| failing.probe_at > now) {
            return Ok(false);
        }
        let horizon = event::horizon(&mut *conn).await?;
        let mut pending = store::pending(&mut *conn, endpoint.id).await?;
        let mut pass = PassWrite::default();
        let waiting: HashSet<String> = pending.iter().map(|p| p.wallet_id.clone()).collect();
        // With no wallet waiting (a replay moved its place back), the next events probe it.
        let probing = endpoint.failing.is_some() && !pending.is_empty();
        if probing {
            // The probe: the wallet that has waited for its attempt the longest.
            pending.sort_by_key(|p| p.next_attempt_at);
            pending.truncate(1);
            pending.iter_mut().for_each(|p| p.next_attempt_at = now);
        }
        // The waiting wallets that are due: their events up to the endpoint's place, in order.
        let mut due: Vec<(Pending, Vec<StoredEvent>)> = Vec::new();
        for waiter in pending.into_iter().filter(|p| p.next_attempt_at <= now) {
            let filter = EventFilter {
                after: Some(EventCursor {
                    position: 0,
                    wallet_id: waiter.wallet_id.clone(),
                    seq: waiter.seq - 1,
                }),
                until: Some(endpoint.after.clone()),
                owner: Some(endpoint.owner.clone()),
                types: endpoint.types.clone(),
                wallet_id: Some(waiter.wallet_id.clone()),
                limit: PAGE,
                ..EventFilter::default()
            };
            let events = event::page(&mut *conn, &filter, horizon).await?;
            due.push((waiter, events));
        }
        // Then the events after its place, unless it is failing.
        let filter = EventFilter {
            after: Some(endpoint.after.clone()),
            owner: Some(endpoint.owner.clone()),
            types: endpoint.types.clone(),
            wallets: endpoint.wallet_ids.clone(),
            limit: PAGE,
            ..EventFilter::default()
        };
        let events = if probing { Vec::new() } else { event::page(&mut *conn, &filter, horizon).await? };
        let full = events.len() as i64 == PAGE;
        pass.after = events.last().map(|e| e.cursor.clone());
        let mut by_wallet: HashMap<String, Vec<StoredEvent>> = HashMap::new();
        for stored in events {
            by_wallet.entry(stored.wallet_id().to_owned()).or_default().push(stored);
        }
        let mut work: Vec<WalletWork> = Vec::new();
        for (waiter, mut events) in due {
            // A waiting wallet that can catch up in this page goes on with its events after the
            // endpoint's place; one with more before it leaves them for a later page, which reads
            // them up to the place this page moves to.
            let more = events.len() as i64 == PAGE;
            let after = by_wallet.remove(&waiter.wallet_id).unwrap_or_default();
            if !more {
                events.extend(after);
            }
            work.push(WalletWork { wallet: waiter.wallet_id.clone(), events, waiter: Some((waiter, more)) });
        }
        // A wallet waiting and not due has its events held back (read again once it is).
        by_wallet.retain(|wallet, _| !waiting.contains(wallet));
        work.extend(by_wallet.into_iter().map(|(wallet, events)| WalletWork {
            wallet,
            events,
            waiter: None,
        }));

        let answers = Answers::default();
        let outcomes: Vec<WalletOutcome> = futures::stream::iter(work)
            .map(|work| self.deliver_wallet(endpoint, work, now, &answers))
            .buffer_unordered(WALLETS_AT_ONCE)
            .collect()
            .await;
        pass.health = answers.health(endpoint.failing, now);
        if let Some(Health::Failing(failing)) = pass.health {
            let over = (now - failing.since).to_std().unwrap_or_default() > self.settings.retry_for;
            if over {
                pass.disable = Some(format!(
                    "deliveries failed for longer than {:?}: the endpoint answered none since {}",
                    self.settings.retry_for, failing.since
                ));
            }
        }
        for outcome in outcomes {
            pass.attempts.extend(outcome.attempts);
            match outcome.waits {
                Some(waiter) => {
                    let over =
                        (now - waiter.first_failed_at).to_std().unwrap_or_default() > self.settings.retry_for;
                    if over && pass.disable.is_none() {
                        pass.disable = Some(format!(
                            "deliveries failed for longer than {:?}: {}",
                            self.settings.retry_for, waiter.last_error
                        ));
                    }
                    pass.pending.push(waiter);
                }
                None if outcome.was_waiting => pass.caught_up.push(outcome.wallet),
                None => {}
            }
        }
        if pass.is_empty() {
            // Nothing new: no write (an idle endpoint costs its dispatcher two reads a tick).
            return Ok(false);
        }
        let written = store::finish_pass(&mut *conn, endpoint.id, fence, &endpoint.after, &pass).await?;
        if written && pass.disable.is_some() {
            metrics::counter!(WEBHOOK_ENDPOINTS_DISABLED.name).increment(1);
            tracing::warn!(endpoint = %endpoint.id, reason = pass.disable.as_deref(), "webhook endpoint disabled");
        }
        // A probe answered: the waiting wallets, all due now, go on at once.
        Ok(written && (full || pass.health == Some(Health::Recovered)))
    }

    /// Delivers `events`, one wallet's in order, until one is not taken. A wallet that was waiting
    /// (`waiter`, with whether `more` of its events wait past these) waits on from there, or has
    /// caught up. Once the page has seen the endpoint answer nothing (and take nothing), the
    /// wallet's events are held back untried: it waits, due at once, for the endpoint's probe.
    async fn deliver_wallet(
        &self,
        endpoint: &Endpoint,
        work: WalletWork,
        now: DateTime<Utc>,
        answers: &Answers,
    ) -> WalletOutcome {
        let WalletWork { wallet, events, waiter } = work;
        let was_waiting = waiter.is_some();
        let mut attempts = Vec::with_capacity(events.len());
        let mut last_taken = None;
        for stored in &events {
            if answers.none_yet() {
                let before = waiter.as_ref().map(|(w, _)| w).filter(|w| w.seq == stored.seq());
                let waits = Pending {
                    wallet_id: wallet.clone(),
                    seq: stored.seq(),
                    attempts: before.map_or(0, |w| w.attempts),
                    first_failed_at: before.map_or(now, |w| w.first_failed_at),
                    next_attempt_at: now,
                    last_error: before.map_or_else(
                        || "not tried: the endpoint answers no delivery".to_owned(),
                        |w| w.last_error.clone(),
                    ),
                };
                return WalletOutcome { wallet, attempts, waits: Some(waits), was_waiting };
            }
            let event_id = format!("{}.{}", stored.wallet_id(), stored.seq());
            let attempted_at = Utc::now();
            let delivered: Delivered =
                self.sender.deliver(&endpoint.url, &endpoint.secret, &event_id, (self.render)(stored)).await;
            answers.note(&delivered);
            let outcome = if delivered.taken() { "delivered" } else { "failed" };
            metrics::counter!(WEBHOOK_DELIVERIES.name, "outcome" => outcome).increment(1);
            attempts.push(Attempt {
                event_id,
                attempted_at,
                status: delivered.status.map(|s| s as i16),
                latency_ms: delivered.latency.as_millis().min(i32::MAX as u128) as i32,
                error: delivered.error.clone(),
            });
            if let Some(error) = delivered.error {
                // The same event failing again counts on; another starts afresh.
                let before =
                    waiter.as_ref().map(|(w, _)| w).filter(|w| w.seq == stored.seq() && w.attempts > 0);
                let tried = before.map_or(0, |w| w.attempts) + 1;
                let waits = Pending {
                    wallet_id: wallet.clone(),
                    seq: stored.seq(),
                    attempts: tried,
                    first_failed_at: before.map_or(attempted_at, |w| w.first_failed_at),
                    next_attempt_at: next_attempt(tried, now),
                    last_error: error,
                };
                return WalletOutcome { wallet, attempts, waits: Some(waits), was_waiting };
            }
            let lag = (Utc::now() - stored.created_at).to_std().unwrap_or_default();
            metrics::histogram!(WEBHOOK_LAG.name).record(lag);
            last_taken = Some(stored.seq());
        }
        if let Some((waiter, true)) = &waiter {
            // More of its events wait: from the next one, at once.
            let seq = last_taken.map_or(waiter.seq, |seq| seq + 1);
            let waits =
                Pending { seq, attempts: 0, first_failed_at: now, next_attempt_at: now, ..waiter.clone() };
            return WalletOutcome { wallet, attempts, waits: Some(waits), was_waiting };
        }
        WalletOutcome { wallet, attempts, waits: None, was_waiting }
    }
}

/// Whether a page's deliveries were answered: any with a status (taken or not), any not at all
/// (refused, timed out: then the endpoint, not the event, is the trouble).
#[derive(Default)]
struct Answers {
    answered: AtomicBool,
    unanswered: AtomicBool,
}

impl Answers {
    fn note(&self, delivered: &Delivered) {
        let flag = if delivered.status.is_some() { &self.answered } else { &self.unanswered };
        flag.store(true, Ordering::Relaxed);
    }

    /// The endpoint has answered no delivery of the page, and left one unanswered.
    fn none_yet(&self) -> bool {
        self.unanswered.load(Ordering::Relaxed) && !self.answered.load(Ordering::Relaxed)
    }

    /// What the page says of the endpoint that was `failing` (or not) before it.
    fn health(&self, failing: Option<Failing>, now: DateTime<Utc>) -> Option<Health> {
        let answered = self.answered.load(Ordering::Relaxed);
        match failing {
            Some(_) if answered => Some(Health::Recovered),
            Some(failing) => {
                let probes = failing.probes.saturating_add(1);
                let probe_at = backed_off(probes, now, LONGEST_PROBE_BACKOFF);
                Some(Health::Failing(Failing { probes, probe_at, ..failing }))
            }
            None if self.none_yet() => {
                let probe_at = backed_off(1, now, LONGEST_PROBE_BACKOFF);
                Some(Health::Failing(Failing { since: now, probes: 1, probe_at }))
            }
            None => None,
        }
    }
}

/// What the dispatcher holds an endpoint by, for a pass.
enum EndpointHold {
    Lease(Box<Lease>),
    /// Redis is out: a session lock of the endpoint, for the pass.
    SessionLock,
}

/// One wallet's events to deliver in a page: a waiting wallet's (with whether more of its
/// events wait past these), or another's.
struct WalletWork {
    wallet: String,
    events: Vec<StoredEvent>,
    waiter: Option<(Pending, bool)>,
}

/// How one wallet's deliveries of a page went.
struct WalletOutcome {
    wallet: String,
    attempts: Vec<Attempt>,
    /// Where it waits now, if one of its events was not taken (or more of them wait).
    waits: Option<Pending>,
    was_waiting: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivered(status: Option<u16>) -> Delivered {
        let error = (status != Some(204)).then(|| "failed".to_owned());
        Delivered { status, latency: Duration::ZERO, error }
    }

    fn answers(statuses: &[Option<u16>]) -> Answers {
        let answers = Answers::default();
        statuses.iter().for_each(|&status| answers.note(&delivered(status)));
        answers
    }

    #[test]
    fn an_endpoint_fails_when_a_page_gets_no_answer_at_all_and_recovers_at_its_first_answer() {
        let now = Utc::now();
        // Answered, even with an error status: the events, not the endpoint, are refused.
        assert_eq!(answers(&[Some(500), None]).health(None, now), None);
        assert_eq!(answers(&[]).health(None, now), None);
        assert!(!answers(&[Some(500), None]).none_yet());
        let Some(Health::Failing(failing)) = answers(&[None, None]).health(None, now) else {
            panic!("refused or timed out, and nothing answered: failing")
        };
        assert_eq!((failing.since, failing.probes), (now, 1));
        assert!(failing.probe_at > now);

        let later = now + chrono::Duration::seconds(5);
        let Some(Health::Failing(still)) = answers(&[None]).health(Some(failing), later) else {
            panic!("an unanswered probe: still failing")
        };
        assert_eq!((still.since, still.probes), (now, 2), "since when it fails stays");
        assert!(still.probe_at > later);
        let long_failing = Failing { probes: 30, ..failing };
        let Some(Health::Failing(probed)) = answers(&[None]).health(Some(long_failing), later) else {
            panic!("still failing")
        };
        assert!(probed.probe_at <= later + LONGEST_PROBE_BACKOFF, "probes back off up to a few seconds");
        // A page with nothing to deliver leaves it failing.
        assert!(matches!(answers(&[]).health(Some(failing), later), Some(Health::Failing(_))));
        for answer in [Some(204), Some(500)] {
            assert_eq!(answers(&[answer]).health(Some(failing), later), Some(Health::Recovered));
        }
    }

    #[test]
    fn retries_back_off_exponentially_with_jitter_up_to_an_hour() {
        let now = Utc::now();
        for attempts in 1..=30 {
            let wait = (next_attempt(attempts, now) - now).to_std().unwrap();
            let full = FIRST_BACKOFF.saturating_mul(1 << (attempts.min(20) - 1)).min(LONGEST_BACKOFF);
            assert!(wait >= full / 2 && wait <= full, "attempt {attempts}: {wait:?} of {full:?}");
        }
    }
}
