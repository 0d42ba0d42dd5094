-- The order-payment saga cancels an order that was not paid in time.
-- How many cancellations were applied to the order: at most one is right.
ALTER TABLE orders ADD COLUMN cancelled_at timestamptz;
ALTER TABLE orders ADD COLUMN cancellations_applied integer NOT NULL DEFAULT 0;
