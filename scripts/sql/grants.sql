-- idemflow's least-privilege grants: everything the runtime role (the DATABASE_URL of the
-- services and workers) may do with the engine's objects, and nothing more.
-- docs/operations.md, "Least privilege", explains each line; tests/it/roles.rs runs this very
-- file (with the psql variable replaced by a role name), so the two cannot drift apart.
--
-- Run it as the owner role (the role `idemflow migrate` runs as, owner of the database and so of
-- its `public` schema) after every `idemflow migrate`. Running it again changes nothing:
--
--   psql "$OWNER_DATABASE_URL" -v ON_ERROR_STOP=1 -v runtime_role=idemflow_runtime \
--        -f scripts/sql/grants.sql
--
-- :"runtime_role" is psql's interpolation of that variable as a quoted identifier. The operator
-- console runs as this role; in read-only mode it may run as the read-only role of
-- scripts/sql/grants-read-only.sql instead.

BEGIN;

-- Only the owner creates objects in the schema. PostgreSQL 15 and later no longer let every
-- role create in `public`; a database created by an older version (or restored from one) still
-- does. USAGE is what names in the schema need to resolve.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO :"runtime_role";

-- The keys table. SELECT: the look-up, the reports, and every WHERE clause of the writes.
-- INSERT: the claim (through its function, idemflow_claim, below). UPDATE: the fenced
-- writes (advance, finish, renew, postpone), the takeovers, end-lease, and the row locks of
-- `FOR UPDATE SKIP LOCKED` (the resumer's scan, retention). DELETE: retention and the forget
-- policy. Revoked first, so a re-run also takes back anything granted by hand since
-- (TRUNCATE, REFERENCES, TRIGGER).
REVOKE ALL ON TABLE idempotency_keys FROM :"runtime_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE idempotency_keys TO :"runtime_role";

-- Response bodies stored apart: written by the finish (an upsert), read by replays, deleted by
-- retention with their keys.
REVOKE ALL ON TABLE idempotency_responses FROM :"runtime_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE idempotency_responses TO :"runtime_role";

-- The idempotent consumer's records (docs/consumer.md). INSERT: a message's identity, with its
-- effects. SELECT: a duplicate's fingerprint. UPDATE: the row locks of retention's
-- `FOR UPDATE SKIP LOCKED`. DELETE: retention.
REVOKE ALL ON TABLE processed_messages FROM :"runtime_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE processed_messages TO :"runtime_role";

-- The fencing tokens: nextval() in the look-up (a new key's token) and in both takeovers. USAGE
-- allows nextval and currval, not setval: the runtime role cannot move the sequence back and
-- make a token repeat.
REVOKE ALL ON SEQUENCE idempotency_keys_fence FROM :"runtime_role";
GRANT USAGE ON SEQUENCE idempotency_keys_fence TO :"runtime_role";

-- No temporary objects. PostgreSQL gives every role TEMPORARY on a database (through PUBLIC),
-- and a session's temporary schema is searched first for relation names unless a search path
-- says otherwise: a temporary view can then stand in for a table in any function that names the
-- table unqualified, and a SECURITY DEFINER function would run it with its owner's rights. The
-- engine's own functions resolve nothing there (a fixed path, pg_temp last, qualified names), and
-- it uses no temporary table; this takes the means away from every role, so an application's
-- functions are covered too. A role of yours that needs temporary tables gets them back by name:
-- GRANT TEMPORARY ON DATABASE <database> TO <role>.
DO $temporary$
BEGIN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
END
$temporary$;

-- The claim's function (the migration claim_function): a new key's claim calls it. It runs with
-- its caller's rights, or with its owner's where it quiets a lost race's ERROR line (and then does
-- nothing but the claim: it takes the key's claim lock and inserts one row).
GRANT EXECUTE ON FUNCTION idemflow_claim(bigint, text, text, bytea, text, jsonb, bigint, bigint)
    TO :"runtime_role";

-- The migrations' history is the owner's alone: a runtime role cannot make the migrator skip or
-- re-run a migration.
REVOKE ALL ON TABLE _sqlx_migrations FROM :"runtime_role";

-- Nothing else: the migrations create no other function for the runtime role (besides the claim's,
-- the engine calls only built-ins that every role may execute: pg_advisory_xact_lock,
-- pg_try_advisory_xact_lock(_shared), pg_notify; the partitioned layout's trigger functions run with their owner's rights, on a fixed search path,
-- and are executable by no one else), the partitions of a partitioned keys table are reached through it and need no grant,
-- LISTEN/NOTIFY and SET LOCAL of statement_timeout and idle_in_transaction_session_timeout need
-- no grant, and advisory locks none either.

COMMIT;
