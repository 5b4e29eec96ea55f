-- The idempotent consumer (crates/idemflow-consumer, docs/consumer.md) on MySQL/MariaDB: one row
-- per message a subscriber applied, inserted in the same transaction as the handler's effects.
CREATE TABLE processed_messages (
    -- Compared byte for byte (VARBINARY: no collation, no padding), as the keys are.
    subscriber   VARBINARY(128) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    -- SHA-256 of the payload: the same id with another payload is refused, not acknowledged.
    fingerprint  BINARY(32)     NOT NULL,
    -- When it was applied (ms since the Unix epoch, the server's clock in UTC).
    processed_at BIGINT         NOT NULL,
    PRIMARY KEY (subscriber, message_id),
    -- Retention's scan: the oldest rows first.
    KEY processed_messages_processed_at (processed_at),
    CONSTRAINT identities_are_not_empty CHECK (length(subscriber) BETWEEN 1 AND 128 AND length(message_id) BETWEEN 1 AND 255)
) ENGINE = InnoDB;
