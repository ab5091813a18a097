-- A stored response names the ledger entry it reports (`entry_id`), and both are written by one
-- statement, the key only for a wallet whose entries that statement wrote; the ledger is
-- append-only (0002's trigger refuses every UPDATE and DELETE), so an entry once named cannot go.
-- The foreign key checked that again for every payment, and its check locked the entry just
-- written (FOR KEY SHARE): a query, a row lock and a WAL record per payment, for a fact the write
-- already guarantees. `walletlock audit` still reports any stored response whose entry is missing.
-- The unique index stays: no entry is reported by two keys.
alter table idempotency_key drop constraint idempotency_key_entry_id_fkey;
