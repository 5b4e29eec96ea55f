-- Large responses out of the key's row ("pointer instead of body"): a response whose stored body
-- is larger than the runner's `response_apart_above` goes here, in the same statement (and so the
-- same transaction) that marks its key done; the key row keeps its status and headers, no body,
-- and `response_apart`. Deleted with its key, by the statement that deletes the key (retention):
-- no foreign key, so retention pays a lookup here only for keys whose response is apart, and the
-- layout stays open to a partitioned keys table (see docs/ARCHITECTURE.md, invariants).
CREATE TABLE idempotency_responses (
    tenant text COLLATE "C" NOT NULL,
    key    text COLLATE "C" NOT NULL,
    body   bytea NOT NULL,
    PRIMARY KEY (tenant, key)
);

ALTER TABLE idempotency_keys ADD COLUMN response_apart boolean NOT NULL DEFAULT false;

-- A done key holds its body in the row or apart, never both, never neither.
ALTER TABLE idempotency_keys DROP CONSTRAINT done_keys_hold_a_response;
ALTER TABLE idempotency_keys ADD CONSTRAINT done_keys_hold_a_response CHECK (
    state <> 'done' OR (
        response_status IS NOT NULL AND response_headers IS NOT NULL
        AND (response_body IS NOT NULL) <> response_apart
    )
);
