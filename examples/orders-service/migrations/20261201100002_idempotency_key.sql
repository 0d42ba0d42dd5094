-- POST /orders with an Idempotency-Key places at most one order per key:
-- a repeated request finds the order the key placed (a concurrent one waits
-- on this index for the first to commit). Orders placed without a key have
-- none (NULLs never conflict).
ALTER TABLE orders ADD COLUMN idempotency_key text UNIQUE;
