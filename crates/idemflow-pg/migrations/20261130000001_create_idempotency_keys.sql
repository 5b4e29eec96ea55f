-- One row per (tenant, key): the claim, its lease and fencing token, where execution stands, and
-- the stored response. See docs/protocol.md for every statement that touches it.
CREATE TABLE idempotency_keys (
    -- Tenants are text so integers, UUIDs and slugs all fit; "C" collation compares bytes, so
    -- keys that differ only by case or by Unicode normalization are different keys.
    tenant           text COLLATE "C" NOT NULL CHECK (octet_length(tenant) BETWEEN 1 AND 128),
    key              text COLLATE "C" NOT NULL CHECK (octet_length(key) BETWEEN 1 AND 255),
    fingerprint      bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- The workflow (name and version) that claimed the key; a resumer finds it by this name.
    workflow         text        NOT NULL,
    -- The request input, so a resumer in another process can start from the first phase.
    request          jsonb       NOT NULL,
    state            text        NOT NULL DEFAULT 'started' CHECK (state IN ('started', 'done')),
    -- The name of the last completed phase ('start' before any), with that phase's typed output.
    recovery_point   text        NOT NULL DEFAULT 'start',
    phase_output     jsonb,
    -- The lease: until then only the owner may advance the key. Compared with the database
    -- clock only. A started key always has one (a released key's lease is simply in the past).
    locked_until     timestamptz,
    -- The fencing token: bumped by every takeover; every owner write is conditional on it.
    lock_version     bigint      NOT NULL DEFAULT 0,
    -- Executions begun (the claim and each takeover) and the last retryable error.
    attempts         integer     NOT NULL DEFAULT 1,
    last_error       text,
    response_status  smallint,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key),
    CONSTRAINT started_keys_hold_a_lease CHECK (state <> 'started' OR locked_until IS NOT NULL),
    CONSTRAINT done_keys_hold_a_response CHECK (
        state <> 'done' OR (response_status IS NOT NULL AND response_headers IS NOT NULL AND response_body IS NOT NULL)
    )
);

-- Retention deletes finished keys by age, in batches.
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);

-- The resumer's scan: started keys ordered by lease expiry. Finished keys never enter it.
CREATE INDEX idempotency_keys_started_lease ON idempotency_keys (locked_until) WHERE state = 'started';
