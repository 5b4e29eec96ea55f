-- On a keys table adopted into the partitioned layout (docs/operations.md, "Choosing the layout"),
-- the uniqueness trigger computes each key's claim lock with `idemflow_claim_lock`. It was
-- declared IMMUTABLE, but its body calls convert_to, which is STABLE, and PostgreSQL does not
-- write a function's body into the calling expression when the body is more volatile than the
-- function says: each insert then ran it as a SQL function of its own, set up anew in every
-- transaction. Declared STABLE, as its body is, it is written in. Nothing to do on the
-- unpartitioned layout, where the function does not exist.
DO $$
BEGIN
    IF to_regprocedure('idemflow_claim_lock(text, text)') IS NOT NULL THEN
        ALTER FUNCTION idemflow_claim_lock(text, text) STABLE;
    END IF;
END
$$;
