-- A wallet: its balance, and the two counters that make every write to it conditional.
create table wallet (
    id         text primary key check (id ~ '^[A-Za-z0-9_-]{1,64}$'),
    balance    bigint not null check (balance >= 0),
    -- Bumped by one per ledger entry; always the seq of the wallet's newest entry.
    version    bigint not null check (version >= 1),
    -- The highest fencing token a lease holder has claimed this row with.
    fence      bigint not null default 0 check (fence >= 0),
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now()
);

-- Version and fence only grow: a write that would move either back is a bug, refused here
-- whatever code sent it.
create function wallet_counters_only_grow() returns trigger
language plpgsql as $$
begin
    if new.version < old.version or new.fence < old.fence then
        raise exception 'wallet %: version and fence only grow', old.id
            using errcode = 'check_violation';
    end if;
    return new;
end
$$;

create trigger wallet_counters_only_grow
    before update on wallet
    for each row execute function wallet_counters_only_grow();
