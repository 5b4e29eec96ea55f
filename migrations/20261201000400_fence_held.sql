-- A fenced write that travels in one message with the COMMIT after it must fail, not merely update
-- no row, when its fence is lost: otherwise the COMMIT, already on its way, would commit the
-- phase's effects without the key. The combined statements (crates/idemflow-pg/src/fenced_commit.rs)
-- count the rows their write changed and cast the count to this domain: any count but 1 raises
-- 23514 on the constraint `idemflow_fence_held`, the rest of the message is skipped, and the
-- transaction is rolled back. A type, not a function: nothing to grant (types are usable by
-- every role), nothing to execute.
CREATE DOMAIN idemflow_fence_held AS bigint
    CONSTRAINT idemflow_fence_held CHECK (VALUE = 1);
