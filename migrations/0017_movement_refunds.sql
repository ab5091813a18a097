-- Refunds of movements (`POST /movements/{id}/refund`): a refund is a movement of its own, every
-- leg of the original back by its share of the amount refunded, naming the original in
-- `refund_of`. What the refunds of one movement give back on a leg never adds up to more than that
-- leg moved: each refund is decided with every wallet of the original locked under its lease (or
-- its row lock), where every refund of it waits; `walletlock audit` checks it.
alter table movement add column refund_of uuid;
create index movement_refund_of on movement (refund_of) where refund_of is not null;
alter type movement_write add attribute refund_of uuid;

-- Captures of part of a held movement: each leg takes its share of the amount captured, in
-- proportion to its own. A debit leg whose share is nothing has its hold captured of 0, with no
-- entry (its whole amount released), so a held movement's holds still settle together.
alter table hold drop constraint hold_check2;
alter table hold add constraint hold_capture_entry
    check ((status = 'captured' and captured > 0) = (capture_entry is not null));
