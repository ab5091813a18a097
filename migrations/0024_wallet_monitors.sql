-- Balance monitors (docs/api/events.md): each wallet's, as a JSON array of `{"below": n}` and
-- `{"above": n}` (crate::domain::Monitors), set and removed under the wallet's lease by the same
-- fenced write as its balance, so every movement is decided with the monitors set before it.
-- A movement that crosses one writes a `wallet.balance_below` or `wallet.balance_above` event with
-- its entry, and the monitor's amount in `monitor`.
alter table wallet add column monitors jsonb not null default '[]';
alter table event add column monitor int8;
