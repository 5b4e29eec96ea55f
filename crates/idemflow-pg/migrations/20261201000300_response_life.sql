-- A body stored apart names the life of its key: the key row's `created_at`, copied by the
-- statement that stores the body (statements::FINISH_APART). A key deleted and claimed again is
-- another life with another `created_at`, so whoever deletes the bodies of keys that are gone
-- (a partition drop, which deletes the bodies after the keys have left: docs/protocol.md,
-- "Partitioned expiry") can tell an old life's body from the new life's and spare the new one.
ALTER TABLE idempotency_responses ADD COLUMN created_at timestamptz;

UPDATE idempotency_responses AS apart SET created_at = keys.created_at
FROM idempotency_keys AS keys
WHERE keys.tenant = apart.tenant AND keys.key = apart.key;
