-- Money between wallets: a transfer moves an amount from one wallet to another in one
-- transaction, as two ledger entries (`transfer_out` on `from_wallet`, `transfer_in` on
-- `to_wallet`) that carry its id. A transfer that refunds another names it in `refund_of`; the
-- refunds of one transfer never add up to more than it (checked by the writer under both wallets'
-- leases and row locks, and by `walletlock audit`).
create table transfer (
    id          uuid primary key,
    from_wallet text not null references wallet (id),
    to_wallet   text not null references wallet (id),
    amount      bigint not null check (amount > 0),
    reference   text check (length(reference) <= 256),
    refund_of   uuid references transfer (id),
    created_at  timestamptz not null default now(),
    check (from_wallet <> to_wallet)
);

create index transfer_refund_of on transfer (refund_of) where refund_of is not null;

-- Transfers are history, like the ledger: never rewritten.
create function append_only() returns trigger
language plpgsql as $$
begin
    raise exception '% rows are append-only', tg_table_name using errcode = 'restrict_violation';
end
$$;

create trigger transfer_append_only
    before update or delete on transfer
    for each statement execute function append_only();

-- A transfer's two legs carry its id; a `refund` entry (money back into the wallet a payment
-- left) names the `pay` entry it refunds.
alter table ledger_entry add column transfer_id uuid references transfer (id);
alter table ledger_entry add column refund_of uuid references ledger_entry (id);
alter table ledger_entry drop constraint ledger_entry_kind_check;
alter table ledger_entry add constraint ledger_entry_kind_check
    check (kind in ('open', 'deposit', 'pay', 'transfer_out', 'transfer_in', 'refund'));
alter table ledger_entry add constraint ledger_entry_transfer_legs
    check ((kind in ('transfer_out', 'transfer_in')) = (transfer_id is not null));
alter table ledger_entry add constraint ledger_entry_refund_of_payment
    check ((kind = 'refund') = (refund_of is not null));

-- One leg of each kind per transfer.
create unique index ledger_entry_transfer_leg on ledger_entry (transfer_id, kind)
    where transfer_id is not null;
create index ledger_entry_refund_of on ledger_entry (refund_of) where refund_of is not null;
