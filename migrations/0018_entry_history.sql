-- A wallet's entries by time, for its history: the balance as of an instant, a statement's
-- opening and closing, and the bounds of a range of entries each find one entry here (the
-- last one written at or before an instant) instead of walking the wallet's ledger.
create index ledger_entry_time on ledger_entry (wallet_id, created_at, seq);
