//! Wake-ups on release: a waiter is told the moment a contended lease is released, instead of
//! polling for it blindly.
//!
//! A waiter that finds a lease busy marks it contended (the acquire script does that) and
//! subscribes to the lease's release channel; a holder that releases a contended lease publishes on
//! that channel (the release script does that, in the same round trip). One Redis Pub/Sub
//! connection per [`super::LeaseClient`] carries every subscription of the process; a background
//! task reads it and wakes the waiter of each channel. Subscriptions are counted, so a channel is
//! subscribed while anyone here waits on it.
//!
//! A lost notification (the Pub/Sub connection dropped, a message raced a subscription) costs at
//! most one bounded poll: waiters never wait longer than the poll fallback before trying again.
//! The listener reconnects on its own, and resubscribes what is being waited on.

use super::topology::WakeSource;
use deadpool_redis::redis::aio::PubSubSink;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// The longest a waiter waits for its channel's subscription before it relies on its poll.
const SUBSCRIBE_WAIT: Duration = Duration::from_millis(500);

/// How long the listener waits before reconnecting a dropped Pub/Sub connection.
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

/// The process's release notifications.
pub struct Wakeups {
    source: WakeSource,
    /// Guarded by a std mutex: never held across an `.await`.
    state: Mutex<State>,
    /// Told each time the listener has (re)connected and subscribed every watched channel.
    subscribed: Notify,
}

#[derive(Default)]
struct State {
    /// The subscribing half of the current connection; `None` while (re)connecting.
    sink: Option<PubSubSink>,
    /// Channel → (number of waiters, how to wake them).
    channels: HashMap<String, (usize, Arc<Notify>)>,
    /// Whether the listener task runs.
    listening: bool,
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakeups").finish_non_exhaustive()
    }
}

impl Wakeups {
    pub fn new(source: WakeSource) -> Arc<Self> {
        Arc::new(Self { source, state: Mutex::new(State::default()), subscribed: Notify::new() })
    }

    /// Registers interest in `channel`: once this returns, a release published on it wakes the
    /// returned guard (unless Pub/Sub is down, when the caller's bounded poll covers it).
    pub async fn watch(self: &Arc<Self>, channel: &str) -> Watch {
        // Made before the state is read, so a subscription the listener completes after that read
        // still reaches us.
        let listener_subscribed = self.subscribed.notified();
        let (notify, subscribe_with, start_listener, connected) = {
            let mut state = self.state.lock().expect("wakeups lock");
            let connected = state.sink.is_some();
            let start_listener = !std::mem::replace(&mut state.listening, true);
            let entry =
                state.channels.entry(channel.to_owned()).or_insert_with(|| (0, Arc::new(Notify::new())));
            entry.0 += 1;
            let first = entry.0 == 1;
            let notify = entry.1.clone();
            (notify, if first { state.sink.clone() } else { None }, start_listener, connected)
        };
        if start_listener {
            tokio::spawn(self.clone().listen());
        }
        if let Some(mut sink) = subscribe_with {
            // A failure here leaves the waiter on its poll fallback; the listener resubscribes
            // every watched channel when it reconnects.
            let _ = tokio::time::timeout(SUBSCRIBE_WAIT, sink.subscribe(channel)).await;
        } else if start_listener && !connected {
            // The first wait of this client has just started the listener, which subscribes this
            // channel once it is connected: wait for that (bounded), or a release published
            // meanwhile goes unheard until the poll fallback. (While it reconnects later, waiters
            // do not wait for it: their poll covers them.)
            let _ = tokio::time::timeout(SUBSCRIBE_WAIT, listener_subscribed).await;
        }
        Watch { wakeups: self.clone(), channel: channel.to_owned(), notify }
    }

    fn unwatch(self: &Arc<Self>, channel: &str) {
        let sink = {
            let mut state = self.state.lock().expect("wakeups lock");
            let Some(entry) = state.channels.get_mut(channel) else { return };
            entry.0 -= 1;
            if entry.0 > 0 {
                return;
            }
            state.channels.remove(channel);
            state.sink.clone()
        };
        if let Some(mut sink) = sink {
            let channel = channel.to_owned();
            tokio::spawn(async move {
                let _ = sink.unsubscribe(channel).await;
            });
        }
    }

    /// Keeps one Pub/Sub connection up and wakes the waiter of each message's channel.
    async fn listen(self: Arc<Self>) {
        loop {
            match self.source.connect().await {
                Ok(pubsub) => {
                    let (mut sink, mut messages) = pubsub.split();
                    let watched: Vec<String> = {
                        let mut state = self.state.lock().expect("wakeups lock");
                        state.sink = Some(sink.clone());
                        state.channels.keys().cloned().collect()
                    };
                    if !watched.is_empty() {
                        let _ = sink.subscribe(&watched).await;
                    }
                    self.subscribed.notify_waiters();
                    let mut idle_check = tokio::time::interval(Duration::from_secs(1));
                    loop {
                        let message = tokio::select! {
                            message = messages.next() => match message {
                                Some(message) => message,
                                None => break,
                            },
                            _ = idle_check.tick() => {
                                // Only this task still holds the wake-ups: their client is gone.
                                if Arc::strong_count(&self) == 1 {
                                    return;
                                }
                                continue;
                            }
                        };
                        let notify = {
                            let state = self.state.lock().expect("wakeups lock");
                            state.channels.get(message.get_channel_name()).map(|(_, notify)| notify.clone())
                        };
                        if let Some(notify) = notify {
                            // A stored permit if the waiter is between polls: it will not miss this.
                            notify.notify_one();
                        }
                    }
                    self.state.lock().expect("wakeups lock").sink = None;
                    tracing::debug!("lease wake-up connection closed; reconnecting");
                }
                Err(err) => tracing::debug!(error = %err, "lease wake-up connection failed; retrying"),
            }
            if Arc::strong_count(&self) == 1 {
                return;
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }
}

/// Interest in one release channel; unsubscribes (when it was the last) on drop.
pub struct Watch {
    wakeups: Arc<Wakeups>,
    channel: String,
    notify: Arc<Notify>,
}

impl Watch {
    /// Completes when a release is published on the channel, or after `fallback`.
    pub async fn released_or(&self, fallback: Duration) {
        let _ = tokio::time::timeout(fallback, self.notify.notified()).await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.wakeups.unwatch(&self.channel);
    }
}
