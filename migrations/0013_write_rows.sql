-- The rows a round's one statement writes, as composite types: the statement takes one array of
-- each (`unnest($1::wallet_write[])`) instead of one array per column, so a column is added in
-- one place, and the statement's parameters are five, not forty-two.
--
-- wallet_write: one wallet's compare-and-set, from the state its writer read to the state it
-- decided, under `fence`. Wallets of one `grp` are written all or none: the legs of one movement.
create type wallet_write as (
    id           text,
    grp          int4,
    fence        int8,
    read_fence   int8,
    read_version int8,
    read_balance int8,
    read_held    int8,
    owner        text,
    balance      int8,
    held         int8,
    version      int8
);

-- entry_write: a ledger entry to append, if its wallet's write matched.
create type entry_write as (
    id            uuid,
    wallet_id     text,
    seq           int8,
    kind          text,
    amount        int8,
    balance_after int8,
    fence         int8,
    reference     text,
    hold_id       uuid,
    transfer_id   uuid,
    refund_of     uuid
);

-- hold_placed and hold_settled: a hold placed, and one settled, with their wallet's write.
create type hold_placed as (
    id         uuid,
    wallet_id  text,
    amount     int8,
    expires_at timestamptz,
    reference  text,
    fence      int8
);

create type hold_settled as (
    id            uuid,
    wallet_id     text,
    status        text,
    captured      int8,
    capture_entry uuid
);

-- key_write: a response to store for an idempotency key (stored with `wallet_id`), if the write
-- of `depends_on` matched.
create type key_write as (
    depends_on   text,
    wallet_id    text,
    caller       text,
    scope        text,
    key          text,
    fingerprint  bytea,
    status       int2,
    content_type text,
    body         bytea,
    entry_id     uuid
);
