-- Every change to a wallet's balance, in order. A wallet's balance always equals the signed sum
-- of its entries (open and deposit add, pay subtracts); `walletlock audit` checks it.
create table ledger_entry (
    id            uuid primary key,
    wallet_id     text not null references wallet (id),
    -- 1 for the wallet's `open` entry, then one more per entry: the wallet's version after it.
    seq           bigint not null check (seq >= 1),
    kind          text not null check (kind in ('open', 'deposit', 'pay')),
    amount        bigint not null check (amount > 0 or (kind = 'open' and amount = 0)),
    balance_after bigint not null check (balance_after >= 0),
    -- The fence of the lease under which the entry was written (0 for `open`: no lease needed).
    fence         bigint not null check (fence >= 0),
    reference     text check (length(reference) <= 256),
    created_at    timestamptz not null default now(),
    unique (wallet_id, seq)
);

-- The ledger is append-only: history is corrected by new entries, never rewritten.
create function ledger_entry_append_only() returns trigger
language plpgsql as $$
begin
    raise exception 'ledger entries are append-only' using errcode = 'restrict_violation';
end
$$;

create trigger ledger_entry_append_only
    before update or delete on ledger_entry
    for each statement execute function ledger_entry_append_only();
