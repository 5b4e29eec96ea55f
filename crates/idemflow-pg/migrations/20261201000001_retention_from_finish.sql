-- Retention keeps a key for its window after its response was stored, not after its claim: a key
-- that stayed started longer than the window (resumers down for a day, a workflow not yet
-- registered after a deploy) must still be recognised when its client retries after the finish.
ALTER TABLE idempotency_keys ADD COLUMN finished_at timestamptz;

-- Keys finished before this column existed: their last update was the finish.
UPDATE idempotency_keys SET finished_at = updated_at WHERE state = 'done';

ALTER TABLE idempotency_keys ADD CONSTRAINT done_keys_hold_a_finish_time
    CHECK (state <> 'done' OR finished_at IS NOT NULL);

-- Retention's scan: finished keys by finish time. Started keys never enter it.
CREATE INDEX idempotency_keys_finished_at ON idempotency_keys (finished_at) WHERE state = 'done';

-- Nothing reads keys by creation time any more; one index less for every claim to maintain.
DROP INDEX idempotency_keys_created_at;
