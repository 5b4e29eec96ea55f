-- The claim of a new key as a function, `idemflow_claim`, so that a claim that loses the race for
-- its key writes no ERROR line to the server's log. This file is its one definition: running it
-- again (as a migration, or by hand with psql) defines it anew, keeping its owner.
--
-- The race: two copies of one request both look their key up before either claims it, so both
-- claim. The second waits for the first's claim lock (an advisory lock on the key); once the
-- first commits, the key is taken. The engine then answers the second from the first's row, as
-- it should; it learns of the loss only from an error (the claim is sent as its transaction's
-- `BEGIN` message, whose results are not returned), and PostgreSQL logs every error a client
-- receives at `log_min_messages` = warning, the default. An operator who alerts on ERROR lines was
-- paged for a request that was served correctly.
--
-- So the function, having taken the claim lock, looks for the key first (a query of its own:
-- at Read Committed, which the engine states for every transaction, its snapshot is taken after
-- the lock was granted and sees the winner's committed row), and raises the same error the
-- insert would (unique_violation on idempotency_keys_pkey) with `log_min_messages` set to fatal
-- for the rest of the transaction, which that error ends at once. Nothing else is quieted: any
-- other error in the insert, or outside the function, is logged as before. The unique index still
-- decides: a writer that is not the engine cannot make a second row.
--
-- `log_min_messages` may be set only by a superuser or (PostgreSQL 15 and later) a role granted
-- `SET ON PARAMETER log_min_messages`. When the function's owner (this role, or its owner when it
-- exists already) may, the function runs with its owner's rights (SECURITY DEFINER) and quiets
-- the lost race; otherwise it runs with its caller's and raises the error logged, as before. To
-- quiet it later: as a superuser, `GRANT SET ON PARAMETER log_min_messages TO <owner role>`, then
-- run this file again as the owner (docs/operations.md, "A racing duplicate's ERROR line").
--
-- Either way the search path is fixed (`pg_catalog`, the table's schema, `pg_temp` last) and the
-- table's name qualified, and only the roles granted EXECUTE may call it (scripts/sql/grants.sql).
DO $define$
DECLARE
    keys regclass := pg_catalog.to_regclass('idempotency_keys');
    schema text;
    owner oid;
    quiet boolean;
BEGIN
    SELECT n.nspname INTO schema
    FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = keys;

    -- CREATE OR REPLACE keeps an existing function's owner: whether it may quiet is the owner's.
    SELECT p.proowner INTO owner
    FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
    WHERE n.nspname = schema AND p.proname = 'idemflow_claim';
    owner := coalesce(owner, (SELECT r.oid FROM pg_catalog.pg_roles AS r
                              WHERE r.rolname = current_user));
    SELECT r.rolsuper INTO quiet FROM pg_catalog.pg_roles AS r WHERE r.oid = owner;
    IF NOT quiet AND pg_catalog.current_setting('server_version_num')::int >= 150000 THEN
        -- (Run as text: the function does not exist before PostgreSQL 15.)
        EXECUTE 'SELECT pg_catalog.has_parameter_privilege($1, ''log_min_messages'', ''SET'')'
            INTO quiet USING owner;
    END IF;

    EXECUTE pg_catalog.format($function$
        CREATE OR REPLACE FUNCTION %1$I.idemflow_claim(
            lock bigint, tenant text, key text, fingerprint bytea, workflow text,
            request jsonb, lease_ms bigint, token bigint) RETURNS void
            LANGUAGE plpgsql VOLATILE %2$s
            SET search_path = pg_catalog, %1$I, pg_temp
        AS $body$
        BEGIN
            PERFORM pg_catalog.pg_advisory_xact_lock($1);
            IF EXISTS (SELECT FROM %1$I.idempotency_keys AS k WHERE k.tenant = $2 AND k.key = $3)
            THEN
                %3$s
                RAISE EXCEPTION 'duplicate key value violates unique constraint "idempotency_keys_pkey"'
                    USING ERRCODE = 'unique_violation', CONSTRAINT = 'idempotency_keys_pkey',
                          TABLE = 'idempotency_keys',
                          DETAIL = 'Another request claimed the key while this one waited for its claim lock.';
            END IF;
            INSERT INTO %1$I.idempotency_keys
                (tenant, key, fingerprint, workflow, request, locked_until, lock_version, journal)
            VALUES ($2, $3, $4, $5, $6, clock_timestamp() + $7 * interval '1 millisecond', $8,
                    jsonb_build_array(jsonb_build_object(
                        'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint,
                        'event', 'claimed', 'token', $8)));
        END
        $body$
    $function$,
        schema,
        CASE WHEN quiet THEN 'SECURITY DEFINER' ELSE 'SECURITY INVOKER' END,
        CASE WHEN quiet
             THEN 'PERFORM pg_catalog.set_config(''log_min_messages'', ''fatal'', true);'
             ELSE '' END);

    EXECUTE pg_catalog.format(
        'REVOKE EXECUTE ON FUNCTION %1$I.idemflow_claim(bigint, text, text, bytea, text, jsonb, '
        'bigint, bigint) FROM PUBLIC', schema);
END
$define$;
