-- Holds: an amount reserved on a wallet now, captured (charged, in full or in part) or voided
-- later, or left to expire. A wallet's `held` is the sum of its holds still `held`, expired or
-- not: what a movement must leave untouched until those holds are settled. Its available balance
-- is `balance - held`, plus whatever of `held` has expired; a check keeps `held <= balance`, so the
-- available balance is never negative.
--
-- A hold is settled once, by its wallet's lease holder, in the statement that writes the wallet
-- row (conditional on the lease's fence and the version, like every movement): `captured` with
-- the `pay` entry that charged it, `voided`, or `expired` (released by the first movement that
-- needed its amount, or by the sweeper). Nothing moves a settled hold again.
alter table wallet add column held bigint not null default 0 check (held >= 0);
alter table wallet add constraint wallet_held_within_balance check (held <= balance);

create table hold (
    id            uuid primary key,
    wallet_id     text not null references wallet (id),
    amount        bigint not null check (amount > 0),
    status        text not null default 'held'
                  check (status in ('held', 'captured', 'voided', 'expired')),
    -- What a capture charged (at most the held amount; the rest was released).
    captured      bigint not null default 0 check (captured between 0 and amount),
    -- The `pay` entry of the capture.
    capture_entry uuid,
    expires_at    timestamptz not null,
    reference     text check (length(reference) <= 256),
    -- The fence of the lease under which the hold was placed.
    fence         bigint not null check (fence >= 0),
    created_at    timestamptz not null,
    settled_at    timestamptz,
    check ((status = 'held') = (settled_at is null)),
    check ((status = 'captured') = (capture_entry is not null)),
    check (status = 'captured' or captured = 0)
);

-- A wallet's holds still held, by expiry: what an available balance and a release of expired
-- holds look up.
create index hold_held on hold (wallet_id, expires_at) where status = 'held';

-- A hold is settled once: no write moves it out of a settled status, or changes what was held.
create function hold_settled_once() returns trigger
language plpgsql as $$
begin
    raise exception 'hold %: settled holds and held amounts never change', old.id
        using errcode = 'check_violation', constraint = 'hold_settled_once';
end
$$;

create trigger hold_settled_once
    before update on hold
    for each row
    when (old.status <> 'held' or new.amount <> old.amount or new.wallet_id <> old.wallet_id
          or new.expires_at <> old.expires_at or new.id <> old.id)
    execute function hold_settled_once();

create trigger hold_never_deleted
    before delete on hold
    for each statement execute function append_only();

-- A capture's `pay` entry names its hold; a hold has at most one entry.
alter table ledger_entry add column hold_id uuid references hold (id);
alter table ledger_entry add constraint ledger_entry_hold_is_a_payment
    check (hold_id is null or kind = 'pay');
create unique index ledger_entry_hold on ledger_entry (hold_id) where hold_id is not null;
