-- The partitioned layout's uniqueness trigger and its claim-lock function, as they must be: this
-- file is their one definition. `idemflow_pg::partitions::adopt` runs it when it converts the
-- table, and as a migration it redefines them on a table adopted before. Nothing to do on the
-- unpartitioned layout.
--
-- Why it was redefined:
--
-- 1. A fixed, safe search path. The trigger's function runs with its owner's rights (SECURITY
--    DEFINER), so the runtime role needs no grant for it. It was defined with `SET search_path
--    FROM CURRENT`, a path that does not name `pg_temp`, and PostgreSQL then searches the
--    session's temporary schema *first* for relations: a runtime role could make a temporary view
--    named `idempotency_keys` over a function of its own, and the trigger, reading
--    `idempotency_keys` unqualified, ran that function as the owner. Now the path is `pg_catalog`,
--    the table's schema, then `pg_temp` last, and every name in the bodies is qualified besides.
--    (`idemflow_claim_lock` takes no SET clause: PostgreSQL writes a SQL function into the calling
--    expression only without one, docs/benchmarks.md "The claim lock's function"; its names are
--    qualified instead, and it runs with its caller's rights.)
-- 2. Read Committed only. The trigger's look for the key needs a snapshot taken after the claim
--    lock was granted, which only Read Committed gives a statement; under Repeatable Read (a
--    database's or role's `default_transaction_isolation`) a second claim took its snapshot
--    before waiting for the lock, did not see the first claim's committed row, and inserted a
--    second row of the key in its own partition. The engine states READ COMMITTED in every
--    transaction it begins; the trigger refuses any other level, so a writer that is not the
--    engine cannot make a second row either.
DO $define$
DECLARE
    keys regclass := to_regclass('idempotency_keys');
    schema text;
BEGIN
    IF keys IS NULL OR (SELECT relkind FROM pg_catalog.pg_class WHERE oid = keys) <> 'p' THEN
        RETURN;
    END IF;
    SELECT n.nspname INTO schema
    FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = keys;

    -- The claim lock of a key, as the engine computes it (claim_lock.rs): the first 8 bytes of
    -- SHA-256("idemflow claim" NUL tenant NUL key), big-endian, as a signed bigint. STABLE, as
    -- its body is (convert_to is): PostgreSQL then writes the body into the trigger's expression
    -- instead of running a SQL function on each insert.
    EXECUTE pg_catalog.format($function$
        CREATE OR REPLACE FUNCTION %1$I.idemflow_claim_lock(tenant text, key text) RETURNS bigint
            LANGUAGE sql STABLE STRICT PARALLEL SAFE
            RETURN CAST(CAST('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(
                       pg_catalog.sha256('\x6964656d666c6f7720636c61696d00'::pg_catalog.bytea
                           OPERATOR(pg_catalog.||) pg_catalog.convert_to(tenant, 'UTF8')
                           OPERATOR(pg_catalog.||) '\x00'::pg_catalog.bytea
                           OPERATOR(pg_catalog.||) pg_catalog.convert_to(key, 'UTF8')),
                       1, 8), 'hex') AS pg_catalog."bit"(64)) AS pg_catalog.int8)
    $function$, schema);

    -- PL/pgSQL: at Read Committed its query takes a snapshot of its own, after the lock.
    EXECUTE pg_catalog.format($function$
        CREATE OR REPLACE FUNCTION %1$I.idempotency_keys_one_row_per_key() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER
            SET search_path = pg_catalog, %1$I, pg_temp
        AS $body$
        BEGIN
            IF pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
                RAISE EXCEPTION 'a key is inserted into the partitioned keys table only at READ COMMITTED, not %%',
                                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
                    USING ERRCODE = 'feature_not_supported',
                          HINT = 'Begin the transaction with ISOLATION LEVEL READ COMMITTED: '
                                 'the uniqueness check needs a snapshot taken after the claim lock.';
            END IF;
            PERFORM pg_catalog.pg_advisory_xact_lock(%1$I.idemflow_claim_lock(NEW.tenant, NEW.key));
            IF EXISTS (SELECT 1 FROM %1$I.idempotency_keys AS k
                       WHERE k.tenant = NEW.tenant AND k.key = NEW.key) THEN
                RAISE EXCEPTION 'duplicate key value violates unique constraint "idempotency_keys_pkey"'
                    USING ERRCODE = 'unique_violation', CONSTRAINT = 'idempotency_keys_pkey',
                          TABLE = 'idempotency_keys',
                          DETAIL = 'The key exists in a partition of the keys table.';
            END IF;
            RETURN NEW;
        END
        $body$
    $function$, schema);

    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                   WHERE tgrelid = keys AND tgname = 'idempotency_keys_one_row_per_key') THEN
        EXECUTE pg_catalog.format(
            'CREATE TRIGGER idempotency_keys_one_row_per_key BEFORE INSERT ON %1$I.idempotency_keys '
            'FOR EACH ROW EXECUTE FUNCTION %1$I.idempotency_keys_one_row_per_key()', schema);
    END IF;

    -- Nobody calls them but the trigger.
    EXECUTE pg_catalog.format(
        'REVOKE EXECUTE ON FUNCTION %1$I.idemflow_claim_lock(text, text) FROM PUBLIC', schema);
    EXECUTE pg_catalog.format(
        'REVOKE EXECUTE ON FUNCTION %1$I.idempotency_keys_one_row_per_key() FROM PUBLIC', schema);
END
$define$;
