-- Who among the owners that drew a token holds the key. A takeover draws its token inside its
-- transaction (the fence column), so a takeover that rolls back leaves its token to the next
-- taker. Each takeover writes a random holder beside its token, and the one question put to the
-- row alone, whether an owner's uncommitted takeover committed under a phase that ended the
-- transaction (a lease renewal), names both (docs/ARCHITECTURE.md). A claim's token, its life
-- times 2^20, is never drawn twice: a claim leaves the holder at 0.
ALTER TABLE idempotency_keys ADD COLUMN holder BIGINT NOT NULL DEFAULT 0;
