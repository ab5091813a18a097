-- The rows a round writes for movements between wallets, as composite types beside those of
-- 0013: a round's one statement inserts the transfers and movements its jobs decided, if their
-- wallets' writes matched (a movement's wallets are one group, written all or none).
--
-- transfer_write: a transfer row (the two-leg case keeps a row of its own), or a refund of one.
create type transfer_write as (
    id          uuid,
    from_wallet text,
    to_wallet   text,
    amount      int8,
    reference   text,
    refund_of   uuid
);

-- movement_write: a movement of many legs, living with its first leg's wallet.
create type movement_write as (
    id        uuid,
    wallet_id text,
    legs      int2,
    reference text
);
