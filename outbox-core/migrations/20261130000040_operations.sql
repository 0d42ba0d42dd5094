-- Operations: dropping a parked outbox row keeps it. `outbox parked drop`
-- sets `discarded_at` and a reason; the row stays parked (out of the relay's
-- queue and of `outbox parked list`) for the audit trail, is never
-- published nor deleted by the retention job, and `outbox parked requeue
-- --id N` puts it back in the queue.
ALTER TABLE outbox_event
    ADD COLUMN IF NOT EXISTS discarded_at   timestamptz,
    ADD COLUMN IF NOT EXISTS discard_reason text;
