-- A wallet's id and owner checked without a bounded repetition. Postgres checks every CHECK
-- constraint of a row at each update of it, whatever columns the update sets, so these two ran at
-- every movement of money; and its regex engine expands `{1,64}` into 64 states, which made the
-- two checks cost more than the rest of a wallet's update (the commit that added this says by how
-- much). The rule is the same: one or more of those characters, and at most 64 of them.
alter table wallet drop constraint wallet_id_check;
alter table wallet add constraint wallet_id_check check (id ~ '^[A-Za-z0-9_-]+$' and length(id) <= 64);
alter table wallet drop constraint wallet_owner_check;
alter table wallet add constraint wallet_owner_check check (owner ~ '^[A-Za-z0-9_-]+$' and length(owner) <= 64);
