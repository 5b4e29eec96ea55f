//! Every statement the MySQL/MariaDB store sends, in one place (as `idemflow_pg::statements` is
//! for PostgreSQL). Parameters are `?`, bound in the order they appear. Times are milliseconds
//! since the Unix epoch by the server's clock in UTC ([`NOW_MS`]: `UTC_TIMESTAMP` does not
//! depend on a session's time zone, and is fixed for the length of a statement).
//!
//! The SQL is what MariaDB 10.6+ and MySQL 8.4 both accept, except where a constant says
//! otherwise (see docs/engines.md for the table of differences).

/// Now, in milliseconds since the Unix epoch, UTC.
macro_rules! now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// The statements' clock (the `now_ms!` macro of this module) as a constant, for documentation
/// and tests.
pub const NOW_MS: &str = now_ms!();

/// True only inside a transaction: part of every owner's write that records a phase's work. A
/// phase that ended the engine's transaction (a `COMMIT`, a statement MariaDB commits around, a
/// deadlock's rollback) leaves the connection in autocommit, where that write would commit alone,
/// apart from the effects it vouches for: there it matches no row (`idemflow_store::Standing`).
macro_rules! still_open {
    () => {
        "@@in_transaction = 1"
    };
}

/// The check of `still_open!` (the predicate every advance and finish carries) as a constant, for
/// tests.
pub const STILL_OPEN: &str = still_open!();

/// How the engine's transaction stands after a phase ran in it, read before anything else is
/// sent, so the diagnostics area still holds the phase's last statement's condition: whether
/// the connection is in a transaction, and the error number that statement ended with (0 for
/// none). `GET DIAGNOSTICS` reads the area without clearing it.
pub const STANDING: &str = "GET DIAGNOSTICS @idemflow_conditions = NUMBER; \
     GET DIAGNOSTICS CONDITION 1 @idemflow_errno = MYSQL_ERRNO; \
     SELECT CAST(@@in_transaction AS SIGNED), \
            CAST(IF(@idemflow_conditions > 0, @idemflow_errno, 0) AS SIGNED)";

/// `journal = ` the key's journal with one entry appended: a JSON object of `at` (now,
/// [`now_ms!`]) and the arguments given (the rest of a `JSON_OBJECT`'s: `'event', 'phase', …`).
/// At most 64 entries (`idemflow_store::JOURNAL_LIMIT`): when full, the second goes, so the claim
/// stays first. Each statement that changes a key appends its own entry: never a statement of its
/// own. It comes first in its statement's `SET`, so whatever it reads of the row (`fence`,
/// `attempts`, `recovery_point`) is the row before the statement, whether the server assigns
/// from left to right (MySQL, MariaDB's default) or all at once (MariaDB's
/// `SIMULTANEOUS_ASSIGNMENT`): a token is `life * 1048576 + fence + 1` where the statement
/// advances the fence.
macro_rules! journal_with {
    ($($entry:literal),+ $(,)?) => {
        concat!(
            "journal = JSON_ARRAY_APPEND(IF(JSON_LENGTH(journal) >= 64, \
                 JSON_REMOVE(journal, '$[1]'), journal), '$', JSON_OBJECT('at', ",
            now_ms!(),
            ", ",
            $($entry),+,
            ")), "
        )
    };
}

/// The claim's journal: its `claimed` entry. Without a token: an insert cannot read the
/// `AUTO_INCREMENT` value (the life) it draws, so the report writes in the claim's token,
/// life × 2²⁰, as it reads the journal ([`KEY_REPORT`]).
macro_rules! claim_journal {
    () => {
        concat!(
            "JSON_ARRAY(JSON_OBJECT('at', ",
            now_ms!(),
            ", 'event', 'claimed'))"
        )
    };
}

/// How many tokens one life of a key can hold: the fence is the token's low 20 bits (see the
/// migration). A life whose fence reached the last is never taken over again.
pub const FENCES_PER_LIFE: i64 = 1 << 20;

/// The look-up, outside any transaction (a consistent read: it never waits for a writer):
/// `tenant`, `key`. `life` only when the body is stored apart.
pub const LOOK_UP: &str = concat!(
    "SELECT fingerprint, workflow, state = 'done' AS done, \
            GREATEST(COALESCE(locked_until, 0) - ",
    now_ms!(),
    ", 0) AS lease_left_ms, \
            lock_version, response_status, response_headers, response_body, \
            CASE WHEN response_apart THEN life END AS life \
     FROM idempotency_keys WHERE tenant = ? AND `key` = ?"
);

/// The claim's insert as a prepared statement: `tenant`, `key`, `fingerprint`, `workflow`,
/// `request` (JSON text), the lease in ms. The engine sends the same insert with its savepoint in
/// one message ([`claim_then_savepoint`]); this form is the benchmark's raw baseline's. The row's life comes back as the insert's id (the table's AUTO_INCREMENT); its
/// token is the life times [`FENCES_PER_LIFE`]. A committed row of the key answers with a
/// duplicate-key error (1062); an uncommitted one makes the insert wait for its transaction.
pub const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys \
         (tenant, `key`, fingerprint, workflow, request, locked_until, created_at, updated_at, \
          journal) \
     VALUES (?, ?, ?, ?, ?, ",
    now_ms!(),
    " + ?, ",
    now_ms!(),
    ", ",
    now_ms!(),
    ", ",
    claim_journal!(),
    ")"
);

/// [`CLAIM`] and [`CLAIMED_SAVEPOINT`] as one message, so a new key's claim costs one round trip
/// rather than two: MySQL's protocol cannot send a prepared statement together with another, but
/// the text protocol runs several statements of one message in order, stopping at the first
/// error (a duplicate key ends it before the savepoint). The values travel as hex literals,
/// which no byte of a key, tenant or request can break out of; text columns take theirs
/// converted from those bytes as UTF-8 (the request and workflow are Rust strings, so valid).
pub fn claim_then_savepoint(
    tenant: &[u8],
    key: &[u8],
    fingerprint: &[u8],
    workflow: &str,
    request: &str,
    lease_ms: i64,
) -> String {
    claim_then_savepoint_in_life(tenant, key, fingerprint, workflow, request, lease_ms, None)
}

/// [`claim_then_savepoint`], the row's life given rather than drawn when `life` is set: a claim
/// made again after its transaction was rolled back whole keeps the life (so the token) it drew,
/// which nobody else saw (docs/protocol.md, "A local phase at a stronger level"). An explicit
/// value in the AUTO_INCREMENT column is stored as given, and moves the counter past it if it was
/// not already; the unique index on the life refuses it if another row holds it.
pub fn claim_then_savepoint_in_life(
    tenant: &[u8],
    key: &[u8],
    fingerprint: &[u8],
    workflow: &str,
    request: &str,
    lease_ms: i64,
    life: Option<i64>,
) -> String {
    let mut sql = String::with_capacity(420 + 2 * (key.len() + request.len() + workflow.len()));
    sql.push_str(
        "INSERT INTO idempotency_keys \
             (tenant, `key`, fingerprint, workflow, request, locked_until, created_at, updated_at, \
              journal",
    );
    if life.is_some() {
        sql.push_str(", life");
    }
    sql.push_str(") VALUES (");
    for (bytes, text) in [
        (tenant, false),
        (key, false),
        (fingerprint, false),
        (workflow.as_bytes(), true),
        (request.as_bytes(), true),
    ] {
        if text {
            sql.push_str("CONVERT(");
        }
        sql.push_str("X'");
        for byte in bytes {
            sql.push(char::from(HEX[usize::from(byte >> 4)]));
            sql.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        sql.push('\'');
        if text {
            sql.push_str(" USING utf8mb4)");
        }
        sql.push_str(", ");
    }
    sql.push_str(now_ms!());
    sql.push_str(" + ");
    sql.push_str(&lease_ms.to_string());
    sql.push_str(concat!(
        ", ",
        now_ms!(),
        ", ",
        now_ms!(),
        ", ",
        claim_journal!(),
    ));
    if let Some(life) = life {
        sql.push_str(", ");
        sql.push_str(&life.to_string());
    }
    sql.push_str("); ");
    sql.push_str(CLAIMED_SAVEPOINT);
    sql
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Ends a claim's statements: a savepoint the failure record rolls back to, undoing the first
/// attempt's effects while keeping its uncommitted claim.
pub const CLAIMED_SAVEPOINT: &str = "SAVEPOINT idemflow_claimed";

/// Undoes everything since [`CLAIMED_SAVEPOINT`], keeping the claim (and the savepoint).
pub const BACK_TO_CLAIM: &str = "ROLLBACK TO SAVEPOINT idemflow_claimed";

/// Records a completed phase (fenced), with its `phase` entry in the journal: `recovery_point`
/// (for the journal), `recovery_point`, its output (JSON text), the lease in ms (from this
/// statement, never shortening), `tenant`, `key`, `lock_version`.
pub const ADVANCE: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'phase', 'token', lock_version, 'point', ?"),
    "recovery_point = ?, phase_output = ?, attempts = 1, last_error = NULL, \
         locked_until = GREATEST(locked_until, ",
    now_ms!(),
    " + ?), updated_at = ",
    now_ms!(),
    " WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started' AND ",
    still_open!()
);

/// Stores the response and marks the key done (fenced), with its `finished` entry in the journal:
/// status (for the journal), `recovery_point`, status, headers (JSON text), body (`NULL` when
/// stored apart), apart (bool), `tenant`, `key`, `lock_version`.
pub const FINISH: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'finished', 'token', lock_version, 'status', ?"),
    "state = 'done', recovery_point = ?, phase_output = NULL, locked_until = NULL, \
         response_status = ?, response_headers = ?, response_body = ?, response_apart = ?, \
         finished_at = ",
    now_ms!(),
    ", updated_at = ",
    now_ms!(),
    " WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started' AND ",
    still_open!()
);

/// The body of a response stored apart, for its key's life, in the transaction of [`FINISH`]
/// (which holds the key's row): `tenant`, `key`, life, body. A body an earlier life left is
/// replaced, never served. (`VALUES()` in `ON DUPLICATE KEY UPDATE`: MariaDB's form, which MySQL
/// 8.4 still accepts with a deprecation warning.)
pub const STORE_APART: &str = "INSERT INTO idempotency_responses (tenant, `key`, life, body) \
     VALUES (?, ?, ?, ?) \
     ON DUPLICATE KEY UPDATE life = VALUES(life), body = VALUES(body)";

/// The body stored apart for one life of its key: `tenant`, `key`, life.
pub const RESPONSE_APART: &str =
    "SELECT body FROM idempotency_responses WHERE tenant = ? AND `key` = ? AND life = ?";

/// Extends the lease of a started key (fenced), never shortening it: the lease in ms,
/// `tenant`, `key`, `lock_version`, the owner's holder (a takeover's token can be drawn twice:
/// the lease is renewed for the owner that drew it, see the migration that adds the holder).
pub const RENEW_LEASE: &str = concat!(
    "UPDATE idempotency_keys SET locked_until = GREATEST(locked_until, ",
    now_ms!(),
    " + ?) WHERE tenant = ? AND `key` = ? AND lock_version = ? AND holder = ? \
       AND state = 'started'"
);

/// Takes over a started key whose lease is over, naming the token the taker saw; the fence
/// advances, so the taker's token is the seen one plus one; the journal gets its `taken_over`
/// entry: who takes it (`resumer` or `retry`), the taker's holder, the lease in ms, `tenant`,
/// `key`, the token seen.
pub const TAKE_OVER: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!(
        "'event', 'taken_over', 'token', life * 1048576 + fence + 1, 'by', ?, \
         'attempt', attempts + 1"
    ),
    "fence = fence + 1, holder = ?, locked_until = ",
    now_ms!(),
    " + ?, attempts = attempts + 1, updated_at = ",
    now_ms!(),
    " WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started' \
       AND locked_until <= ",
    now_ms!(),
    " AND fence < 1048575"
);

/// What a taker goes on with, read in its transaction right after [`TAKE_OVER`] (MySQL has no
/// `UPDATE … RETURNING`): `tenant`, `key`.
pub const TAKEN: &str = "SELECT recovery_point, phase_output, request, workflow, attempts, \
            last_error, lock_version \
     FROM idempotency_keys WHERE tenant = ? AND `key` = ?";

/// Started keys whose lease is over, of the named workflows (a JSON array), oldest lease first,
/// locked, skipping those another transaction holds (another resumer's scan, an owner's write):
/// the JSON array, how many.
pub const DUE_OF: &str = concat!(
    "SELECT tenant, `key`, lock_version, workflow FROM idempotency_keys \
     WHERE state = 'started' AND locked_until <= ",
    now_ms!(),
    " AND JSON_CONTAINS(?, JSON_QUOTE(workflow)) ORDER BY locked_until LIMIT ? \
     FOR UPDATE SKIP LOCKED"
);

/// Postpones a key after a failed attempt (fenced), advancing the fence, with a `failed` entry in
/// the journal (the recovery point the attempt began at): the error (for the journal), ms until
/// the lease ends, the error, `tenant`, `key`, `lock_version`.
pub const POSTPONE: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!(
        "'event', 'failed', 'token', life * 1048576 + fence + 1, 'point', recovery_point, \
         'error', ?"
    ),
    "locked_until = ",
    now_ms!(),
    " + ?, fence = fence + 1, last_error = ?, updated_at = ",
    now_ms!(),
    " WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started' \
       AND fence < 1048575"
);

/// Deletes a started key its owner holds (the forget policy): `tenant`, `key`, `lock_version`.
/// A started key has no body apart.
pub const DELETE_OWNED: &str = "DELETE FROM idempotency_keys \
     WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started'";

/// Ends a started key's lease now and advances its fence, with a `lease_ended` entry in the
/// journal: `tenant`, `key`, the token seen.
pub const END_LEASE: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'lease_ended', 'token', life * 1048576 + fence + 1, 'by', 'operator'"),
    "locked_until = LEAST(locked_until, ",
    now_ms!(),
    "), fence = fence + 1, updated_at = ",
    now_ms!(),
    " WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = 'started' \
       AND fence < 1048575"
);

/// One batch of retention, locked: finished keys whose window (ms, from their finish) is over,
/// at most `batch`, skipping rows another transaction holds.
pub const EXPIRE_DUE: &str = concat!(
    "SELECT life FROM idempotency_keys \
     WHERE state = 'done' AND finished_at < ",
    now_ms!(),
    " - ? ORDER BY finished_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// Deletes finished lives of keys by their lives (unique across the table), a list of `?` that
/// [`lives`] makes follows.
pub const DELETE_DONE_LIVES: &str =
    "DELETE FROM idempotency_keys WHERE state = 'done' AND life IN ";

/// Deletes the bodies apart of deleted lives, a list of `?` that [`lives`] makes follows.
pub const DELETE_APART_LIVES: &str = "DELETE FROM idempotency_responses WHERE life IN ";

/// `statement` followed by a list of `count` placeholders: `(?, ?, ?)`.
pub fn lives(statement: &str, count: usize) -> String {
    let mut sql = String::with_capacity(statement.len() + 3 * count + 2);
    sql.push_str(statement);
    sql.push('(');
    for index in 0..count {
        if index > 0 {
            sql.push_str(", ");
        }
        sql.push('?');
    }
    sql.push(')');
    sql
}

/// Started keys due now whose workflow is not in the JSON array, counted by workflow.
pub const COUNT_DUE_UNKNOWN: &str = concat!(
    "SELECT workflow, COUNT(*) FROM idempotency_keys WHERE state = 'started' AND locked_until <= ",
    now_ms!(),
    " AND NOT JSON_CONTAINS(?, JSON_QUOTE(workflow)) GROUP BY workflow ORDER BY workflow"
);

/// Milliseconds since the oldest ended lease of a started key ended (0: none is due).
pub const RESUMER_LAG: &str = concat!(
    "SELECT CAST(COALESCE(",
    now_ms!(),
    " - MIN(locked_until), 0) AS SIGNED) FROM idempotency_keys \
     WHERE state = 'started' AND locked_until <= ",
    now_ms!()
);

/// The idempotent consumer's identity, inserted first in a delivery's transaction: subscriber,
/// message id, fingerprint. A duplicate key (1062) means the message was applied already.
pub const INSERT_IDENTITY: &str = concat!(
    "INSERT INTO processed_messages (subscriber, message_id, fingerprint, processed_at) \
     VALUES (?, ?, ?, ",
    now_ms!(),
    ")"
);

/// The fingerprint stored with a message's identity: subscriber, message id.
pub const STORED_FINGERPRINT: &str =
    "SELECT fingerprint FROM processed_messages WHERE subscriber = ? AND message_id = ?";

/// One batch of the consumer's retention: identities applied more than the ms given ago, at most
/// the number given, oldest first.
pub const EXPIRE_IDENTITIES: &str = concat!(
    "DELETE FROM processed_messages WHERE processed_at < ",
    now_ms!(),
    " - ? ORDER BY processed_at LIMIT ?"
);

/// What an operator sees of a key (`idemflow inspect`, `list --stuck`): the columns of
/// `idemflow_store::KeyReport`, by name, in the types it reads them in.
macro_rules! report_columns {
    () => {
        concat!(
            "CONVERT(tenant USING utf8mb4) AS tenant, CONVERT(`key` USING utf8mb4) AS `key`, \
             workflow, CAST(state AS CHAR) AS state, recovery_point, \
             CONVERT(CASE WHEN NOT JSON_VALID(journal) THEN journal \
                          WHEN JSON_CONTAINS_PATH(journal, 'one', '$[0]') \
                               AND NOT JSON_CONTAINS_PATH(journal, 'one', '$[0].token') \
                          THEN JSON_SET(journal, '$[0].token', life * 1048576) \
                          ELSE journal END USING utf8mb4) AS journal, \
             CASE WHEN state = 'started' THEN locked_until - ",
            now_ms!(),
            " END AS lease_left_ms, \
             lock_version, attempts, last_error, response_status, \
             CAST(COALESCE(LENGTH(response_body), \
                      (SELECT LENGTH(body) FROM idempotency_responses AS apart \
                       WHERE apart.tenant = idempotency_keys.tenant \
                         AND apart.`key` = idempotency_keys.`key` \
                         AND apart.life = idempotency_keys.life)) AS SIGNED) AS response_bytes, \
             LOWER(HEX(fingerprint)) AS fingerprint_hex, \
             (",
            now_ms!(),
            " - created_at) DIV 1000 AS age_seconds"
        )
    };
}

/// One key's report: `tenant`, `key`.
pub const KEY_REPORT: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ? AND `key` = ?"
);

/// Started keys that look stuck, past their lease or with at least the attempts given, oldest
/// lease first, at most the number given.
pub const STUCK_KEYS: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE state = 'started' AND (locked_until <= ",
    now_ms!(),
    " OR attempts >= ?) ORDER BY locked_until, tenant, `key` LIMIT ?"
);

/// One key's stored request and response, as stored (`idemflow_store::KeyBodies`): `tenant`,
/// `key`. A body stored apart is read with its row, and only the one of the row's life.
pub const KEY_BODIES: &str = concat!(
    "SELECT request, response_status, response_headers, response_apart, \
            COALESCE(response_body, \
                     (SELECT body FROM idempotency_responses AS apart \
                      WHERE apart.tenant = idempotency_keys.tenant \
                        AND apart.`key` = idempotency_keys.`key` \
                        AND apart.life = idempotency_keys.life)) AS response_body, \
            CASE WHEN state = 'done' THEN CAST((",
    now_ms!(),
    " - finished_at) DIV 1000 AS SIGNED) END AS finished_seconds_ago \
     FROM idempotency_keys WHERE tenant = ? AND `key` = ?"
);

/// Keys by workflow and state, for operators.
pub const COUNTS: &str = "SELECT workflow, CAST(state AS CHAR), COUNT(*) FROM idempotency_keys \
     GROUP BY workflow, state ORDER BY workflow, CAST(state AS CHAR)";

/// Age in whole seconds of the oldest started key (`NULL`: none).
pub const OLDEST_STARTED: &str = concat!(
    "SELECT CAST((",
    now_ms!(),
    " - MIN(created_at)) DIV 1000 AS SIGNED) FROM idempotency_keys WHERE state = 'started'"
);

/// The console's page of keys from a position, in key order: tenant, key, tenant, key (the
/// position twice: MariaDB walks the primary key's range for this form), how many. Strictly
/// after the position.
pub const SCAN_AFTER: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant > ? OR (tenant = ? AND `key` > ?) \
     ORDER BY tenant, `key` LIMIT ?"
);

/// [`SCAN_AFTER`] from the position itself.
pub const SCAN_FROM: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant > ? OR (tenant = ? AND `key` >= ?) \
     ORDER BY tenant, `key` LIMIT ?"
);

/// [`SCAN_AFTER`] within one tenant: tenant, key, how many.
pub const SCAN_TENANT_AFTER: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ? AND `key` > ? ORDER BY `key` LIMIT ?"
);

/// [`SCAN_FROM`] within one tenant.
pub const SCAN_TENANT_FROM: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ? AND `key` >= ? ORDER BY `key` LIMIT ?"
);

/// Started keys by workflow, with how many are due (the state-and-lease index).
pub const STARTED_BY_WORKFLOW: &str = concat!(
    "SELECT workflow, CAST(COUNT(*) AS SIGNED), CAST(COALESCE(SUM(locked_until <= ",
    now_ms!(),
    "), 0) AS SIGNED) FROM idempotency_keys WHERE state = 'started' \
     GROUP BY workflow ORDER BY workflow"
);

/// Keys finished in the last minute and in the last 15 minutes (the state-and-finish index).
pub const FINISHED_LATELY: &str = concat!(
    "SELECT CAST(COALESCE(SUM(finished_at > ",
    now_ms!(),
    " - 60000), 0) AS SIGNED), CAST(COUNT(*) AS SIGNED) FROM idempotency_keys \
     WHERE state = 'done' AND finished_at > ",
    now_ms!(),
    " - 900000"
);

/// InnoDB's estimate of the table's rows.
pub const ESTIMATED_KEYS: &str = "SELECT CAST(TABLE_ROWS AS SIGNED) FROM information_schema.TABLES \
     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idempotency_keys'";

/// The key an operator expires, locked, if it is still as shown and no owner's transaction holds
/// it (an operator's action never waits behind one): tenant, key, token, state. Its life names
/// what to delete ([`DELETE_LIFE`], [`DELETE_APART_LIFE`]).
pub const EXPIRE_KEY: &str = "SELECT life, CAST(state AS CHAR) FROM idempotency_keys \
     WHERE tenant = ? AND `key` = ? AND lock_version = ? AND state = ? FOR UPDATE SKIP LOCKED";

/// Deletes the key of one life.
pub const DELETE_LIFE: &str = "DELETE FROM idempotency_keys WHERE life = ?";

/// Deletes the body apart of one life.
pub const DELETE_APART_LIFE: &str = "DELETE FROM idempotency_responses WHERE life = ?";

#[cfg(test)]
mod claim_message_tests {
    use super::claim_then_savepoint;

    #[test]
    fn the_claims_values_travel_only_as_hex_literals() {
        let hostile = b"a'); DROP TABLE idempotency_keys; -- \\";
        let sql = claim_then_savepoint(b"t'", hostile, &[0xff; 32], "w'", "{\"x\":\"'\"}", 30_000);
        // Every quote before the clock's expressions opens or closes a hex literal.
        let (values, _) = sql
            .split_once("(TIMESTAMPDIFF")
            .expect("the clock follows the values");
        let literals: Vec<&str> = values.split('\'').skip(1).step_by(2).collect();
        assert_eq!(literals.len(), 5, "{sql}");
        assert!(
            literals
                .iter()
                .all(|literal| literal.bytes().all(|byte| byte.is_ascii_hexdigit())),
            "{sql}"
        );
        assert!(!sql.contains("DROP"), "{sql}");
        assert!(sql.ends_with("; SAVEPOINT idemflow_claimed"), "{sql}");
        assert!(sql.contains("+ 30000,"), "{sql}");
    }
}
