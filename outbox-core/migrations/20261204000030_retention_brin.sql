-- Retention's bound on the consumer tables: a BRIN index (a summary of
-- `processed_at` per 128 pages) on `processed_event` and `inbox_event`, so
-- that a cleanup pass reads only the pages that may hold rows past the
-- window (a pass with nothing to delete reads next to nothing) instead of
-- every page of the tables. Like the outbox's `ix_outbox_event_created_brin`:
-- an insert into a range not yet summarized costs nothing, so the consumers'
-- write path keeps its rate; the multi-minmax summaries keep a few intervals
-- per range, so the rows that land in pages freed by earlier passes widen no
-- range to the whole table.
--
-- Built in this migration's transaction, not CONCURRENTLY: these tables may
-- be partitioned (`outbox partitions enable`), and PostgreSQL cannot build
-- an index on a partitioned table concurrently. A BRIN build is one
-- sequential read of the table without a sort (seconds for millions of
-- rows); meanwhile the table's writers (consumers storing dedup and inbox
-- rows) wait. See README.md in this directory for the rule on indexes.
CREATE INDEX IF NOT EXISTS ix_processed_event_processed_brin
    ON processed_event USING brin (processed_at timestamptz_minmax_multi_ops);
CREATE INDEX IF NOT EXISTS ix_inbox_event_processed_brin
    ON inbox_event USING brin (processed_at timestamptz_minmax_multi_ops);
