-- A key's journal: its timeline for operators, as JSON text (an array of small objects, oldest
-- first), appended by the very statement that makes each change (crates/idemflow-sqlite/src/
-- statements.rs), never by a statement of its own. At most 64 entries: when full, the second
-- goes (json_remove(journal, '$[1]')), so the claim stays first. No request data: recovery-point
-- names, tokens, times, attempts, statuses and the error text `last_error` already keeps. Keys
-- claimed before it start with an empty journal.
ALTER TABLE idempotency_keys ADD COLUMN journal TEXT NOT NULL DEFAULT '[]';
