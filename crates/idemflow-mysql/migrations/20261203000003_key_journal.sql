-- A key's journal: its timeline for operators, as JSON text (an array of small objects, oldest
-- first) in the type of the table's other JSON columns, appended by the very statement that makes
-- each change (crates/idemflow-mysql/src/statements.rs), never by a statement of its own. At most
-- 64 entries: when full, the second goes (JSON_REMOVE(journal, '$[1]')), so the claim stays first.
-- No request data: recovery-point names, tokens, times, attempts, statuses and the error text
-- `last_error` already keeps. Keys claimed before it start with an empty journal.
--
-- The claim's entry carries no token: an insert cannot read the AUTO_INCREMENT value it is drawing
-- (the life), so the report fills it in (life × 2^20, the claim's token) when it reads the journal.
--
-- An expression default (in parentheses): MySQL 8.4 takes no literal default on a TEXT column;
-- MariaDB takes either.
ALTER TABLE idempotency_keys
    ADD COLUMN journal LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT ('[]');
