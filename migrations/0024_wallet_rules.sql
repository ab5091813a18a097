-- What a wallet's owner sets on it beside its balance (crate::domain::Rules), as one JSON object,
-- set and changed under the wallet's lease by the same fenced write as its balance, so every
-- movement is decided with the rules set before it:
--   "monitors": balance monitors (docs/api/events.md), `{"below": n}` and `{"above": n}`; a
--     movement that crosses one writes a `wallet.balance_below` or `wallet.balance_above` event
--     with its entry, and the monitor's amount in `event.monitor`;
--   "overdraft", "per_payment", "velocity", "timezone": its limits (docs/api/limits.md), each
--     velocity limit with what its current window has taken ("used"), which the same write keeps.
alter table wallet add column rules jsonb not null default '{}';
alter table event add column monitor int8;

-- An overdraft moves the floor: a balance may go down to minus it, and no further. The entry's
-- own check cannot see the wallet's overdraft; the wallet's row, which every entry's write
-- updates in the same statement, can.
alter table wallet drop constraint wallet_balance_check;
alter table wallet add constraint wallet_balance_check
    check (balance >= -coalesce((rules ->> 'overdraft')::int8, 0));
alter table ledger_entry drop constraint ledger_entry_balance_after_check;
-- What holds reserve stays within what may be spent: the balance and the overdraft.
alter table wallet drop constraint wallet_held_within_balance;
alter table wallet add constraint wallet_held_within_balance
    check (held <= balance + coalesce((rules ->> 'overdraft')::int8, 0));
