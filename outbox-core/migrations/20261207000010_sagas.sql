-- Sagas: one row per saga instance, keyed by the saga's name and its
-- correlation id. `state` is the saga's value (JSON), `stage` its stage's
-- name (for lists and for the stage check without decoding the state),
-- `version` counts the steps applied, `timeouts` maps a pending timeout's
-- name to its id (the id of the scheduled message that fires it): a timeout
-- whose id is not there changes nothing. `completed_at` is set once, by the
-- step that completes the saga; later messages are ignored.
CREATE TABLE IF NOT EXISTS outbox_saga (
    saga_type    text        NOT NULL,
    saga_id      text        NOT NULL,
    state        jsonb       NOT NULL,
    stage        text        NOT NULL,
    version      bigint      NOT NULL DEFAULT 1,
    timeouts     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    started_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    PRIMARY KEY (saga_type, saga_id)
);

-- Retention: completed instances, oldest first.
CREATE INDEX IF NOT EXISTS ix_outbox_saga_completed
    ON outbox_saga (completed_at) WHERE completed_at IS NOT NULL;

-- "Stuck" lists: running instances by their last step.
CREATE INDEX IF NOT EXISTS ix_outbox_saga_running
    ON outbox_saga (saga_type, updated_at) WHERE completed_at IS NULL;
