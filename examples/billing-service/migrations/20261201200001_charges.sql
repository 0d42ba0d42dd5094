-- The billing service's own table. Its migrations share `_sqlx_migrations`
-- with the outbox's; both migrators ignore versions they do not know.
--
-- No unique constraint on order_id on purpose: charging an order once is the
-- consumer's job (deduplication by event id), and the demo checks it.
CREATE TABLE charges (
    id           uuid        PRIMARY KEY,
    order_id     uuid        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX ix_charges_order ON charges (order_id);
