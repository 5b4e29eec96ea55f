-- The MySQL/MariaDB engine's tables: the same rows as PostgreSQL's (docs/protocol.md), in
-- InnoDB's types. SQL both MariaDB (10.6 or later) and MySQL 8.4 accept; docs/engines.md lists
-- what differs between them.
--
-- Keys, tenants and fingerprints are VARBINARY: compared byte for byte, with no collation and no
-- padding. Every text collation of MariaDB pads (`utf8mb4_bin` included), so 'a' and 'a ' would be
-- one key, and a case-insensitive one would make 'Key-A' and 'key-a' one key too.
--
-- Times are integers: milliseconds since the Unix epoch by the server's clock in UTC
-- (UTC_TIMESTAMP(6), whatever a session's time zone), as the SQLite engine keeps them.
CREATE TABLE idempotency_keys (
    tenant           VARBINARY(128) NOT NULL,
    `key`            VARBINARY(255) NOT NULL,
    fingerprint      BINARY(32)     NOT NULL,
    workflow         VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    -- The request input as JSON text, so a resumer in another process can start from the first
    -- phase.
    request          LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    state            ENUM('started', 'done') NOT NULL DEFAULT 'started',
    recovery_point   VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT 'start',
    phase_output     LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    -- The lease's end (ms since the epoch); only the owner may advance the key before it.
    locked_until     BIGINT,
    -- This life of the key: drawn by the claim's insert from the table's AUTO_INCREMENT, which
    -- InnoDB never hands out twice (it survives restarts and deletes; never TRUNCATE this table).
    life             BIGINT NOT NULL AUTO_INCREMENT,
    -- Takeovers, postponements and ended leases within this life, each advancing the fence.
    fence            INT NOT NULL DEFAULT 0,
    -- The fencing token: the life in the high bits, the fence in the low 20. It never repeats for
    -- a key, across deletes included: a later life's tokens are all above an earlier one's.
    lock_version     BIGINT AS (life * 1048576 + fence) VIRTUAL,
    attempts         INT NOT NULL DEFAULT 1,
    last_error       TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    response_status  SMALLINT,
    response_headers LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    response_body    LONGBLOB,
    response_apart   BOOLEAN NOT NULL DEFAULT FALSE,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    finished_at      BIGINT,
    PRIMARY KEY (tenant, `key`),
    UNIQUE KEY idempotency_keys_life (life),
    -- The resumer's scan (started keys by lease end) and retention (finished keys by finish).
    KEY idempotency_keys_state_lease (state, locked_until),
    KEY idempotency_keys_state_finished (state, finished_at),
    CONSTRAINT keys_are_not_empty CHECK (length(tenant) BETWEEN 1 AND 128 AND length(`key`) BETWEEN 1 AND 255),
    CONSTRAINT fences_stay_below_the_next_life CHECK (fence BETWEEN 0 AND 1048575),
    CONSTRAINT started_keys_hold_a_lease CHECK (state <> 'started' OR locked_until IS NOT NULL),
    CONSTRAINT done_keys_hold_a_response CHECK (
        state <> 'done' OR (response_status IS NOT NULL AND response_headers IS NOT NULL
                            AND (response_body IS NOT NULL OR response_apart)
                            AND finished_at IS NOT NULL)
    )
) ENGINE = InnoDB;

-- Response bodies stored apart from their key's row, one per key, naming the life they belong to.
CREATE TABLE idempotency_responses (
    tenant VARBINARY(128) NOT NULL,
    `key`  VARBINARY(255) NOT NULL,
    life   BIGINT         NOT NULL,
    body   LONGBLOB       NOT NULL,
    PRIMARY KEY (tenant, `key`),
    -- Retention deletes a batch's bodies by their lives (unique: each is a claim's).
    KEY idempotency_responses_life (life)
) ENGINE = InnoDB;
