-- Events: what happened to a wallet (opened, a deposit, a payment, a transfer's leg, a hold placed
-- or settled, ...), written by the very statement or transaction that moved the money, so an event
-- exists if and only if its movement committed. The row names what it is about (the entry, the
-- hold) rather than copying it: those rows are the one place for each fact, and never change in
-- what an event shows of them.
--
-- `seq` numbers a wallet's events 1, 2, 3, ... with no gap, in the order they happened; the
-- wallet's `event_seq` is its last. `position` orders the feed across wallets: the id of the
-- transaction that wrote the event, raised to the wallet's previous event's position if that was
-- higher (`wallet.event_position`), so along a wallet it never goes down. The feed shows only the
-- events whose position is below the oldest transaction still running (`src/ledger/event.rs`
-- says why that shows each event exactly once, in order).
create table event (
    wallet_id  text not null,
    seq        int8 not null check (seq >= 1),
    position   xid8 not null,
    type       text not null,
    entry_id   uuid,
    hold_id    uuid,
    created_at timestamptz not null,
    primary key (wallet_id, seq)
);
create index event_feed on event (position, wallet_id, seq);

alter table wallet add column event_seq int8 not null default 0;
alter table wallet add column event_position xid8 not null default '0';

-- Events are never changed or removed.
create function event_append_only() returns trigger
language plpgsql as $$
begin
    raise exception 'events are append-only' using errcode = 'restrict_violation';
end
$$;

create trigger event_append_only
    before update or delete on event
    for each statement execute function event_append_only();
