-- Webhooks: endpoints a caller registers to receive its wallets' events (docs/api/webhooks.md),
-- delivered by the replicas under a lease per endpoint (src/wallet/webhooks/).
--
-- An endpoint's place in the feed (`after_*`, an event cursor: src/ledger/event.rs): every event
-- up to it has been delivered, or waits in `webhook_pending` behind its wallet's failed one. It is
-- moved only by the holder of the endpoint's lease, conditionally on where it was and on `fence`
-- (the highest dispatcher lease that moved it): a paused dispatcher's late move is refused.
create table webhook_endpoint (
    id              uuid primary key,
    owner           text not null,
    url             text not null,
    -- Of these types only, of these wallets only (empty: every one of the owner's).
    types           text[] not null default '{}',
    wallet_ids      text[] not null default '{}',
    secret          text not null,
    enabled         bool not null default true,
    disabled_reason text,
    after_position  int8 not null,
    after_wallet    text not null default '',
    after_seq       int8 not null default 0,
    fence           int8 not null default 0,
    created_at      timestamptz not null default now(),
    updated_at      timestamptz not null default now()
);
create index webhook_endpoint_owner on webhook_endpoint (owner, created_at);

-- A wallet whose event `seq` an endpoint did not take: it and the wallet's later events (up to
-- the endpoint's place) wait for it, retried at `next_attempt_at`, while other wallets' go on.
create table webhook_pending (
    endpoint_id     uuid not null references webhook_endpoint on delete cascade,
    wallet_id       text not null,
    seq             int8 not null,
    attempts        int4 not null,
    first_failed_at timestamptz not null,
    next_attempt_at timestamptz not null,
    last_error      text not null,
    primary key (endpoint_id, wallet_id)
);

-- Every delivery attempt, for `GET /webhook-endpoints/{id}/attempts`.
create table webhook_attempt (
    endpoint_id  uuid not null references webhook_endpoint on delete cascade,
    attempted_at timestamptz not null,
    event_id     text not null,
    status       int2,
    latency_ms   int4 not null,
    error        text
);
create index webhook_attempt_by_endpoint on webhook_attempt (endpoint_id, attempted_at desc);
