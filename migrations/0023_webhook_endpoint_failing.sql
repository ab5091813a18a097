-- An endpoint that answered none of a page's deliveries (refused, timed out) is failing since
-- `failing_since`: its dispatcher then reads no further into the feed for it and tries one waiting
-- wallet at `probe_at`, backed off by `probes`, until it answers one; then every wallet
-- waiting for it is tried at once (src/wallet/webhooks/dispatch.rs). So an endpoint that is down
-- costs one attempt per backoff, not one per event, and its backlog drains as soon as it is back.
alter table webhook_endpoint
    add column failing_since timestamptz,
    add column probes        int4 not null default 0,
    add column probe_at      timestamptz;
