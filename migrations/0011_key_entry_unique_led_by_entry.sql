-- The unique key of a stored response's ledger entry leads with the entry, not the wallet.
--
-- Led by wallet_id (0010), it looked to a generic plan as good a way as the primary key to find a
-- key by (wallet, caller, scope, key): the round's read chose it, and each lookup on a wallet with
-- many keys (a hot one: 165,000 after a 30 s run) scanned all of them, 50 ms a lookup. Led by the
-- entry, it serves only what it is for, one entry per key, and still includes the wallet, as Citus
-- requires of a unique key on a table distributed by wallet.
alter table idempotency_key drop constraint idempotency_key_entry_id_key;
alter table idempotency_key add constraint idempotency_key_entry_id_key unique (entry_id, wallet_id);
