-- A wallet belongs to the caller that opened it (the name of its API token): only that caller, or
-- one the token list grants every wallet, sees the wallet or moves its money; to anyone else it
-- does not exist. Wallets opened before this migration have no owner (null): only callers granted
-- every wallet see them until an operator gives them one, as the owner role:
--   update wallet set owner = 'shop' where id = 'alice';
-- The app role may not change an owner (it is granted updates of the moving columns only).
alter table wallet add column owner text check (owner ~ '^[A-Za-z0-9_-]{1,64}$');
