-- Every key is scoped by wallet, so the tables can be spread over several Postgres nodes by wallet
-- id (Citus, README "Scaling out"): a distributed table's primary and unique keys, and the foreign
-- keys between distributed tables, must include the column it is distributed by. On one Postgres
-- this changes nothing a request sees: ids stay unique (they are UUIDs made by one writer each),
-- and what a key no longer checks across wallets is checked where it is written and by `walletlock
-- audit`, as noted below.

-- Ledger entries: by (wallet_id, id). A refund is an entry of the wallet its payment left, and a
-- capture's `pay` entry is on the wallet of its hold, so those references keep the wallet.
alter table ledger_entry drop constraint ledger_entry_refund_of_fkey;
alter table ledger_entry drop constraint ledger_entry_hold_id_fkey;
alter table ledger_entry drop constraint ledger_entry_pkey;
alter table ledger_entry add primary key (wallet_id, id);
alter table ledger_entry add constraint ledger_entry_refund_of_fkey
    foreign key (wallet_id, refund_of) references ledger_entry (wallet_id, id);

-- Holds: by (wallet_id, id).
alter table hold drop constraint hold_pkey;
alter table hold add primary key (wallet_id, id);
alter table ledger_entry add constraint ledger_entry_hold_id_fkey
    foreign key (wallet_id, hold_id) references hold (wallet_id, id);
drop index ledger_entry_hold;
create unique index ledger_entry_hold on ledger_entry (wallet_id, hold_id) where hold_id is not null;

-- Transfers live with the paying wallet: by (from_wallet, id). Their two legs are entries of two
-- wallets, and a refund's transfer pays back from the wallet the refunded one paid into, so the
-- references from a leg to its transfer, from a refund to the transfer it refunds, and to the
-- paid wallet cannot be keys between rows that may sit on two nodes. The writer makes all of them
-- in one transaction, under both wallets' leases and row locks (the paid wallet's row is locked,
-- so it exists), and `walletlock audit` checks each: every transfer has its two legs, refunds
-- never exceed what they refund.
alter table ledger_entry drop constraint ledger_entry_transfer_id_fkey;
alter table transfer drop constraint transfer_refund_of_fkey;
alter table transfer drop constraint transfer_to_wallet_fkey;
alter table transfer drop constraint transfer_pkey;
alter table transfer add primary key (from_wallet, id);
drop index ledger_entry_transfer_leg;
-- A wallet is on one side of a transfer (from_wallet <> to_wallet), so it has one leg of it.
create unique index ledger_entry_transfer_leg on ledger_entry (wallet_id, transfer_id)
    where transfer_id is not null;
-- A transfer found by its id alone (GET /transfers/{id}, a refund naming it).
create index transfer_id on transfer (id);

-- Idempotency keys live with the wallet whose money their request moves: `wallet_id`, the wallet
-- of a `wallet:<id>` scope. A key of wallet creation (scope `wallets`) has no wallet yet (a
-- created wallet's id may be generated, and a retry must find the key whatever id its body names),
-- so all of them share the empty `wallet_id`: one place, one node, and creation is rare.
alter table idempotency_key add column wallet_id text;
update idempotency_key set wallet_id = case when scope like 'wallet:%' then substr(scope, 8) else '' end;
alter table idempotency_key alter column wallet_id set not null;
alter table idempotency_key add constraint idempotency_key_wallet_of_scope
    check (wallet_id = case when scope like 'wallet:%' then substr(scope, 8) else '' end);
alter table idempotency_key drop constraint idempotency_key_pkey;
alter table idempotency_key add primary key (wallet_id, caller, scope, key);
alter table idempotency_key drop constraint idempotency_key_entry_id_key;
alter table idempotency_key add constraint idempotency_key_entry_id_key unique (wallet_id, entry_id);
