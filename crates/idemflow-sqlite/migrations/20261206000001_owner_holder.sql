-- Who among the owners that drew a token holds the key. SQLite draws a token from the fence row
-- inside the claim's or takeover's transaction, so a draw that rolls back is drawn again by the
-- next taker. Each claim and takeover writes a random holder beside its token, and the one
-- question put to the row alone, whether an owner's uncommitted claim or takeover committed
-- under a phase that ended the transaction (a lease renewal), names both (docs/ARCHITECTURE.md).
-- Keys claimed before it hold 0.
ALTER TABLE idempotency_keys ADD COLUMN holder INTEGER NOT NULL DEFAULT 0;
