-- The SQLite engine's tables: the same rows as PostgreSQL's (docs/protocol.md), in SQLite's types.
--
-- Times are integers read off one machine's clock (SQLite's, which is the operating system's):
-- milliseconds since the Unix epoch for leases and finishes. Every process sharing the file runs
-- on that machine, so every lease is compared with one clock.
CREATE TABLE idempotency_keys (
    -- Compared byte by byte (SQLite's BINARY collation), as PostgreSQL's "C".
    tenant           TEXT    NOT NULL CHECK (length(CAST(tenant AS BLOB)) BETWEEN 1 AND 128),
    key              TEXT    NOT NULL CHECK (length(CAST(key AS BLOB)) BETWEEN 1 AND 255),
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    workflow         TEXT    NOT NULL,
    -- The request input as JSON text, so a resumer in another process can start from the first
    -- phase.
    request          TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'started' CHECK (state IN ('started', 'done')),
    recovery_point   TEXT    NOT NULL DEFAULT 'start',
    phase_output     TEXT,
    -- The lease's end (ms since the epoch); only the owner may advance the key before it.
    locked_until     INTEGER,
    -- The fencing token: drawn from idempotency_fence, so it never repeats for a key, across
    -- deletes included.
    lock_version     INTEGER NOT NULL,
    -- The token of the claim that created this row: names this life of the key (a body stored
    -- apart carries it, so a replay never reads another life's body).
    life             INTEGER NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 1,
    last_error       TEXT,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    response_apart   INTEGER NOT NULL DEFAULT 0 CHECK (response_apart IN (0, 1)),
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    PRIMARY KEY (tenant, key),
    CONSTRAINT started_keys_hold_a_lease CHECK (state <> 'started' OR locked_until IS NOT NULL),
    CONSTRAINT done_keys_hold_a_response CHECK (
        state <> 'done' OR (response_status IS NOT NULL AND response_headers IS NOT NULL
                            AND (response_body IS NOT NULL OR response_apart = 1)
                            AND finished_at IS NOT NULL)
    )
) STRICT;

-- The resumer's scan: started keys by lease end. Finished keys never enter it.
CREATE INDEX idempotency_keys_started_lease ON idempotency_keys (locked_until) WHERE state = 'started';

-- Retention: finished keys by the end of their window's start.
CREATE INDEX idempotency_keys_finished ON idempotency_keys (finished_at) WHERE state = 'done';

-- The fencing tokens' counter (SQLite has no sequences): one row, only ever incremented, inside
-- the write transaction that uses the token.
CREATE TABLE idempotency_fence (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
) STRICT;
INSERT INTO idempotency_fence (id, last) VALUES (1, 0);

-- Response bodies stored apart from their key's row, one per key, naming the life they belong to.
CREATE TABLE idempotency_responses (
    tenant TEXT    NOT NULL,
    key    TEXT    NOT NULL,
    life   INTEGER NOT NULL,
    body   BLOB    NOT NULL,
    PRIMARY KEY (tenant, key)
) STRICT;
