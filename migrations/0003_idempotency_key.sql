-- Idempotency keys: a retried request with the same key gets the first request's response again
-- instead of running twice. A row is first a claim (the request is in flight), then, in the same
-- transaction as the balance change it records, the stored response.
create table idempotency_key (
    -- What the key is unique within: a wallet (`wallet:<id>`) or wallet creation (`wallets`).
    scope        text not null,
    key          text not null check (length(key) between 1 and 255),
    -- SHA-256 of method, path and body: the same key with another request is refused.
    fingerprint  bytea not null check (length(fingerprint) = 32),
    -- The in-flight request's token; null once its response is stored.
    claim        uuid,
    claimed_at   timestamptz not null default now(),
    -- The stored response, byte for byte.
    status       smallint check (status between 100 and 599),
    content_type text,
    body         bytea,
    -- The ledger entry the stored response reports, for responses that moved money.
    entry_id     uuid unique references ledger_entry (id),
    created_at   timestamptz not null default now(),
    expires_at   timestamptz not null,
    primary key (scope, key),
    -- In flight (a claim, no response) or done (a response, no claim); never both or neither.
    check ((claim is null) = (status is not null and content_type is not null and body is not null))
);

create index idempotency_key_expires_at on idempotency_key (expires_at);
