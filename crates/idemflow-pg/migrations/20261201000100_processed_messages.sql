-- The idempotent consumer (crates/idemflow-consumer, docs/consumer.md): one row per message a
-- subscriber applied, inserted in the same transaction as the handler's effects, so the row exists
-- exactly when the effects do. A redelivery finds it and is acknowledged without running again.
CREATE TABLE processed_messages (
    -- Whose projection applied it: each subscriber applies a message once, independently.
    subscriber   text COLLATE "C" NOT NULL CHECK (octet_length(subscriber) BETWEEN 1 AND 128),
    -- The message's own id, as the publisher set it (AMQP message-id is at most 255 bytes).
    message_id   text COLLATE "C" NOT NULL CHECK (octet_length(message_id) BETWEEN 1 AND 255),
    -- SHA-256 of the payload: the same id with another payload is refused, not acknowledged.
    fingerprint  bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, message_id)
);

-- Retention's scan: the oldest rows first, deleted by primary key in batches.
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
