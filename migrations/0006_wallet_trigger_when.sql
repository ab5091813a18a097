-- The guard that version and fence only grow (0001) now runs its function only when a write would
-- move one back: the trigger's WHEN condition is evaluated in the executor, so the common write (a
-- claim or a commit, every payment twice) no longer starts a PL/pgSQL call. Same rule, same name,
-- same error.
drop trigger wallet_counters_only_grow on wallet;

create trigger wallet_counters_only_grow
    before update on wallet
    for each row
    when (new.version < old.version or new.fence < old.fence)
    execute function wallet_counters_only_grow();
