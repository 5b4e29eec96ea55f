-- Fencing tokens (lock_version) are drawn from one sequence, by every claim and every takeover,
-- so a token never repeats for a key: not even when the key is deleted and claimed again, where
-- an owner of its earlier life may still be asleep holding its old token. Tokens are compared
-- for equality only; they need to be unique, not ordered.
--
-- It starts at 2^32, above every token counted from 0 before it existed.
CREATE SEQUENCE idempotency_keys_fence AS bigint START WITH 4294967296 CACHE 32
    OWNED BY idempotency_keys.lock_version;

ALTER TABLE idempotency_keys ALTER COLUMN lock_version SET DEFAULT nextval('idempotency_keys_fence');
