-- The orders service's own table. Its migrations share `_sqlx_migrations`
-- with the outbox's; both migrators ignore versions they do not know.
CREATE TABLE orders (
    id               uuid        PRIMARY KEY,
    customer         text        NOT NULL,
    amount_cents     bigint      NOT NULL CHECK (amount_cents > 0),
    status           text        NOT NULL DEFAULT 'pending',
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    paid_at          timestamptz,
    payment_id       uuid,
    -- How many payments were applied to the order: exactly one is right.
    payments_applied integer     NOT NULL DEFAULT 0
);
CREATE INDEX ix_orders_unpaid ON orders (created_at) WHERE paid_at IS NULL;
