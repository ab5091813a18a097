-- Holds found by their id alone.
--
-- A hold is addressed by its id (`GET /holds/{id}`, its capture and its void), and the round's read
-- looks up the holds a batch settles by id. Since 0010 the primary key is (wallet_id, id), which
-- does not lead with the id: a lookup by id scanned the whole table (37 ms with 820,000 holds, and
-- growing with them). Not unique: under Citus a unique index must include the wallet, and the
-- primary key already makes (wallet_id, id) unique, an id being a fresh UUIDv7. A plain (not
-- concurrent) build, in the migration's transaction: writes to `hold` wait for it.
create index hold_id on hold (id);
