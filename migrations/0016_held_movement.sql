-- Held movements: a movement placed as an authorization (`POST /movements` with `hold`) reserves
-- each debit leg with a hold of its own on that leg's wallet, all expiring at once, and writes no
-- entry yet; capturing it writes every leg's entry (each debit's `transfer_out` names its hold) and
-- settles every hold `captured`; voiding it settles every hold `voided`; past `expires_at` every
-- hold counts as expired. The legs are written together (one group of the round's write, under
-- every wallet's lease), so a held movement's holds are all captured, or none is; `walletlock
-- audit` checks that.
--
-- A held movement keeps its legs as asked, since none has an entry until it is captured.
alter table movement add column expires_at timestamptz;
alter table movement add column leg_wallets text[];
alter table movement add column leg_amounts int8[];
alter table movement add constraint movement_held_legs check (
    (expires_at is null) = (leg_wallets is null)
    and (leg_wallets is null) = (leg_amounts is null)
    and (leg_wallets is null or cardinality(leg_wallets) = legs and cardinality(leg_amounts) = legs)
);

-- The held movement a hold reserves a debit leg of (never changes, like the rest of a hold). Such a
-- hold is settled through its movement alone, never by `/holds/{id}/capture` or `/void`.
alter table hold add column movement_id uuid;
create index hold_movement on hold (movement_id) where movement_id is not null;

-- A capture's entry names its hold: a `pay` for a hold of one wallet, a `transfer_out` for a
-- held movement's debit leg.
alter table ledger_entry drop constraint ledger_entry_hold_is_a_payment;
alter table ledger_entry add constraint ledger_entry_hold_is_a_payment
    check (hold_id is null or kind in ('pay', 'transfer_out'));

-- The round's one statement writes them too (0013, 0015).
alter type hold_placed add attribute movement_id uuid;
alter type movement_write add attribute expires_at timestamptz;
alter type movement_write add attribute leg_wallets text[];
alter type movement_write add attribute leg_amounts int8[];
