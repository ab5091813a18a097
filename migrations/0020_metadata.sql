-- Metadata: the caller's own key-value pairs on a movement (at most 16 string keys and values,
-- held to that rule by `crate::domain::Metadata` before any write; null when there are none).
-- Every entry a movement writes keeps its movement's metadata, so a wallet's entries are selected
-- by it (`metadata @> ...`) with no join. A hold keeps it for its capture's entry, as it keeps its
-- reference; a transfer and a movement keep it for their own answers.
alter table ledger_entry add column metadata jsonb;
alter table hold add column metadata jsonb;
alter table transfer add column metadata jsonb;
alter table movement add column metadata jsonb;

-- The round's one statement writes them as arrays of their own beside its composite rows (0013,
-- 0015), not as attributes of those: Postgres reads a composite value only with exactly its
-- type's attributes, so a replica of the release before, still binding them as they were while
-- this migration runs, would fail every write. Added columns, nullable, cost it nothing.
