-- The idempotent consumer (crates/idemflow-consumer, docs/consumer.md) on SQLite: one row per
-- message a subscriber applied, inserted in the same write transaction as the handler's effects.
CREATE TABLE processed_messages (
    -- Compared byte by byte (BINARY), as PostgreSQL's "C".
    subscriber   TEXT    NOT NULL CHECK (length(CAST(subscriber AS BLOB)) BETWEEN 1 AND 128),
    message_id   TEXT    NOT NULL CHECK (length(CAST(message_id AS BLOB)) BETWEEN 1 AND 255),
    -- SHA-256 of the payload: the same id with another payload is refused, not acknowledged.
    fingerprint  BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    -- When it was applied (ms since the Unix epoch, this machine's clock).
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (subscriber, message_id)
) STRICT, WITHOUT ROWID;

-- Retention's scan: the oldest rows first.
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
