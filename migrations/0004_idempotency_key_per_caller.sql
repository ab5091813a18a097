-- Idempotency keys are unique per caller: two callers may use the same key for their own requests.
-- Keys stored before callers authenticated belong to the empty caller.
alter table idempotency_key add column caller text not null default '';
alter table idempotency_key alter column caller drop default;
alter table idempotency_key drop constraint idempotency_key_pkey;
alter table idempotency_key add primary key (caller, scope, key);
