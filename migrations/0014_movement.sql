-- A movement: money between 2 to 16 wallets at once (a payment split between a merchant, a
-- platform's fee and a tax wallet), every leg or none. Its legs are ledger entries like a
-- transfer's: a `transfer_out` of each wallet it takes from and a `transfer_in` of each it pays
-- into, carrying its id in `transfer_id` (a transfer is the two-leg case, with a row of its own in
-- `transfer`). They sum to zero, one leg a wallet (the unique index of 0010); `walletlock audit`
-- checks both. A movement lives with its first leg's wallet.
create table movement (
    id         uuid not null,
    wallet_id  text not null references wallet (id),
    legs       int2 not null check (legs between 2 and 16),
    reference  text check (length(reference) <= 256),
    created_at timestamptz not null,
    primary key (wallet_id, id)
);

-- A movement found by its id alone (GET /movements/{id}).
create index movement_id on movement (id);

create trigger movement_append_only
    before update or delete on movement
    for each statement execute function append_only();
