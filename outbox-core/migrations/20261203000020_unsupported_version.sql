-- Dead-letter reason for an event whose schema version the handler's type
-- does not read (newer than it declares, or older than its upcasters):
-- kept byte for byte so it can be retried once a handler that reads it runs.
ALTER TABLE dead_letter DROP CONSTRAINT IF EXISTS dead_letter_reason_check;
ALTER TABLE dead_letter ADD CONSTRAINT dead_letter_reason_check CHECK (reason IN (
    'not_json', 'no_event_id', 'unknown_event_type', 'payload_mismatch', 'oversized',
    'handler_failed', 'invalid_headers', 'no_key', 'unsupported_version'));
