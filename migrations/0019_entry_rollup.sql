-- What a wallet's entries add up to, by hour and kind, so a statement of a long period sums at
-- most a few hundred of these rows (and the entries of its first and last hour) instead of every
-- entry. Filled on demand by the statements themselves, for hours that are over: an hour ends
-- final (src/ledger/history.rs says when), so its row is written once and never changes.
create table entry_rollup (
    wallet_id text not null,
    hour      timestamptz not null check (date_trunc('hour', hour) = hour),
    kind      text not null,
    count     bigint not null check (count > 0),
    amount    bigint not null check (amount >= 0),
    primary key (wallet_id, hour, kind)
);

-- How far each wallet's rollups go: every hour before `until` that has entries has its rows.
create table entry_rollup_until (
    wallet_id text primary key,
    until     timestamptz not null check (date_trunc('hour', until) = until)
);
