//! Every statement the SQLite store sends, in one place (as `idemflow_pg::statements` is for
//! PostgreSQL). Times are milliseconds since the Unix epoch read off SQLite's clock, the
//! operating system's: [`NOW_MS`] is stable within a statement.

/// Now, in milliseconds since the Unix epoch (SQLite 3.42's `unixepoch('subsec')`).
macro_rules! now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

/// The statements' clock (the `now_ms!` macro of this module) as a constant, for documentation
/// and tests.
pub const NOW_MS: &str = now_ms!();

/// The key's journal with one entry appended: a JSON object of `at` (now, [`now_ms!`]) and the
/// arguments given (the rest of a `json_object`'s: `'event', 'phase', 'token', ?3, …`). At most
/// 64 entries (`idemflow_store::JOURNAL_LIMIT`): when full, the second goes, so the claim stays
/// first. Each statement that changes a key appends its own entry: never a statement of its own.
macro_rules! journal_with {
    ($($entry:literal),+ $(,)?) => {
        concat!(
            "journal = json_insert(CASE WHEN json_array_length(journal) >= 64 \
                 THEN json_remove(journal, '$[1]') ELSE journal END, '$[#]', json_object('at', ",
            now_ms!(),
            ", ",
            $($entry),+,
            ")), "
        )
    };
}

/// The look-up, outside any transaction: the key's row, with what deciding needs. `?1` tenant,
/// `?2` key. `life` only when the body is stored apart.
pub const LOOK_UP: &str = concat!(
    "SELECT fingerprint, workflow, state = 'done' AS done, \
            max(coalesce(locked_until, 0) - ",
    now_ms!(),
    ", 0) AS lease_left_ms, \
            lock_version, response_status, response_headers, response_body, \
            CASE WHEN response_apart = 1 THEN life END AS life \
     FROM idempotency_keys WHERE tenant = ?1 AND key = ?2"
);

/// Inside a claim's write transaction: whether the key exists (a claim that committed since the
/// look-up). `?1` tenant, `?2` key.
pub const EXISTS: &str = "SELECT 1 FROM idempotency_keys WHERE tenant = ?1 AND key = ?2";

/// A fresh fencing token: the counter's next value, in the write transaction that uses it (SQLite
/// has one writer at a time, so no two transactions draw the same value, and the counter never
/// goes back: deleting keys does not touch it).
pub const NEXT_FENCE: &str =
    "UPDATE idempotency_fence SET last = last + 1 WHERE id = 1 RETURNING last";

/// The claim's insert, its journal starting with the `claimed` entry: `?1` tenant, `?2` key,
/// `?3` fingerprint, `?4` workflow, `?5` request (JSON text), `?6` lease in ms, `?7` the fencing
/// token, which is also the row's life, `?8` the holder (a token can be drawn twice: see the
/// migration that adds it).
pub const CLAIM: &str = concat!(
    "INSERT INTO idempotency_keys \
         (tenant, key, fingerprint, workflow, request, locked_until, lock_version, life, \
          holder, created_at, updated_at, journal) \
     VALUES (?1, ?2, ?3, ?4, ?5, ",
    now_ms!(),
    " + ?6, ?7, ?7, ?8, ",
    now_ms!(),
    ", ",
    now_ms!(),
    ", json_array(json_object('at', ",
    now_ms!(),
    ", 'event', 'claimed', 'token', ?7)))"
);

/// Records a completed phase (fenced), with its `phase` entry in the journal: `?1` tenant, `?2`
/// key, `?3` lock_version, `?4` recovery point, `?5` its output (JSON text), `?6` lease in ms,
/// from this statement and never shortening.
pub const ADVANCE: &str = concat!(
    "UPDATE idempotency_keys \
     SET recovery_point = ?4, phase_output = ?5, attempts = 1, last_error = NULL, ",
    journal_with!("'event', 'phase', 'token', ?3, 'point', ?4"),
    "locked_until = max(locked_until, ",
    now_ms!(),
    " + ?6), updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started'"
);

/// Stores the response in the row and marks the key done (fenced), with its `finished` entry in
/// the journal: `?1` tenant, `?2` key, `?3` lock_version, `?4` recovery point, `?5` status, `?6`
/// headers (JSON text), `?7` body.
pub const FINISH: &str = concat!(
    "UPDATE idempotency_keys \
     SET state = 'done', recovery_point = ?4, phase_output = NULL, locked_until = NULL, \
         response_status = ?5, response_headers = ?6, response_body = ?7, response_apart = 0, ",
    journal_with!("'event', 'finished', 'token', ?3, 'status', ?5"),
    "finished_at = ",
    now_ms!(),
    ", updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started' \
     RETURNING life"
);

/// [`FINISH`] with the body left out of the row (`response_apart`): the same parameters but the
/// body; the row's life comes back for [`STORE_APART`].
pub const FINISH_APART: &str = concat!(
    "UPDATE idempotency_keys \
     SET state = 'done', recovery_point = ?4, phase_output = NULL, locked_until = NULL, \
         response_status = ?5, response_headers = ?6, response_body = NULL, response_apart = 1, ",
    journal_with!("'event', 'finished', 'token', ?3, 'status', ?5"),
    "finished_at = ",
    now_ms!(),
    ", updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started' \
     RETURNING life"
);

/// The body of a response stored apart, for its key's life (`?3`), in the transaction of
/// [`FINISH_APART`]. A body an earlier life left is replaced, never served.
pub const STORE_APART: &str = "INSERT INTO idempotency_responses (tenant, key, life, body) \
     VALUES (?1, ?2, ?3, ?4) \
     ON CONFLICT (tenant, key) DO UPDATE SET life = excluded.life, body = excluded.body";

/// The body stored apart for one life of its key: `?1` tenant, `?2` key, `?3` life.
pub const RESPONSE_APART: &str =
    "SELECT body FROM idempotency_responses WHERE tenant = ?1 AND key = ?2 AND life = ?3";

/// Extends the lease of a started key (fenced), never shortening it: `?1` tenant, `?2` key, `?3`
/// lock_version, `?4` lease in ms, `?5` the owner's holder (the one who drew this token: the
/// lease is renewed for that owner only).
pub const RENEW_LEASE: &str = concat!(
    "UPDATE idempotency_keys SET locked_until = max(locked_until, ",
    now_ms!(),
    " + ?4) WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND holder = ?5 \
       AND state = 'started'"
);

/// Takes over a started key whose lease is over, naming the token the taker saw, with its
/// `taken_over` entry in the journal: `?1` tenant, `?2` key, `?3` the token seen, `?4` the new
/// token, `?5` lease in ms, `?6` who takes it (`resumer` or `retry`), `?7` the taker's holder.
pub const TAKE_OVER: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'taken_over', 'token', ?4, 'by', ?6, 'attempt', attempts + 1"),
    "lock_version = ?4, holder = ?7, locked_until = ",
    now_ms!(),
    " + ?5, attempts = attempts + 1, updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started' \
       AND locked_until <= ",
    now_ms!(),
    " RETURNING recovery_point, phase_output, request, workflow, attempts, last_error"
);

/// Started keys whose lease is over, oldest lease first: `?1` how many.
pub const DUE: &str = concat!(
    "SELECT tenant, key, lock_version FROM idempotency_keys \
     WHERE state = 'started' AND locked_until <= ",
    now_ms!(),
    " ORDER BY locked_until LIMIT ?1"
);

/// One batch of retention: finished keys whose window (`?1` ms, from their finish) is over, at
/// most `?2`; each key's body apart goes with it.
pub const EXPIRE_BATCH: &str = concat!(
    "DELETE FROM idempotency_keys WHERE rowid IN ( \
         SELECT rowid FROM idempotency_keys \
         WHERE state = 'done' AND finished_at < ",
    now_ms!(),
    " - ?1 ORDER BY finished_at LIMIT ?2) \
     RETURNING tenant, key, life"
);

/// The body apart of one deleted life: `?1` tenant, `?2` key, `?3` life.
pub const DELETE_APART: &str =
    "DELETE FROM idempotency_responses WHERE tenant = ?1 AND key = ?2 AND life = ?3";

/// Started keys whose lease is over, of the named workflows (`?1`, a JSON array of names), oldest
/// lease first: `?2` how many.
pub const DUE_OF: &str = concat!(
    "SELECT tenant, key, lock_version, workflow FROM idempotency_keys \
     WHERE state = 'started' AND locked_until <= ",
    now_ms!(),
    " AND workflow IN (SELECT value FROM json_each(?1)) ORDER BY locked_until LIMIT ?2"
);

/// Postpones a key after a failed attempt (fenced), with a new token and a `failed` entry in the
/// journal (the recovery point the attempt began at, the error): `?1` tenant, `?2` key, `?3`
/// lock_version, `?4` the new token, `?5` ms until the lease ends, `?6` the error.
pub const POSTPONE: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'failed', 'token', ?4, 'point', recovery_point, 'error', ?6"),
    "locked_until = ",
    now_ms!(),
    " + ?5, lock_version = ?4, last_error = ?6, updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started'"
);

/// Deletes a started key its owner holds (the forget policy): `?1` tenant, `?2` key, `?3`
/// lock_version. A started key has no body apart.
pub const DELETE_OWNED: &str = "DELETE FROM idempotency_keys \
     WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started'";

/// Ends a started key's lease now and advances its fence, with a `lease_ended` entry in the
/// journal: `?1` tenant, `?2` key, `?3` the token seen, `?4` the new token.
pub const END_LEASE: &str = concat!(
    "UPDATE idempotency_keys SET ",
    journal_with!("'event', 'lease_ended', 'token', ?4, 'by', 'operator'"),
    "locked_until = min(locked_until, ",
    now_ms!(),
    "), lock_version = ?4, updated_at = ",
    now_ms!(),
    " WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = 'started' \
     RETURNING lock_version"
);

/// What an operator sees of a key (`idemflow inspect`, `list --stuck`): the columns of
/// `idemflow_store::KeyReport`, by name.
macro_rules! report_columns {
    () => {
        concat!(
            "tenant, key, workflow, state, recovery_point, journal, \
             CASE WHEN state = 'started' THEN locked_until - ",
            now_ms!(),
            " END AS lease_left_ms, \
             lock_version, attempts, last_error, response_status, \
             coalesce(length(response_body), \
                      (SELECT length(body) FROM idempotency_responses AS apart \
                       WHERE apart.tenant = idempotency_keys.tenant \
                         AND apart.key = idempotency_keys.key \
                         AND apart.life = idempotency_keys.life)) AS response_bytes, \
             lower(hex(fingerprint)) AS fingerprint_hex, \
             (",
            now_ms!(),
            " - created_at) / 1000 AS age_seconds"
        )
    };
}

/// One key's report: `?1` tenant, `?2` key.
pub const KEY_REPORT: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ?1 AND key = ?2"
);

/// Started keys that look stuck, past their lease or with at least `?1` attempts, oldest lease
/// first, at most `?2`.
pub const STUCK_KEYS: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE state = 'started' AND (locked_until <= ",
    now_ms!(),
    " OR attempts >= ?1) ORDER BY locked_until, tenant, key LIMIT ?2"
);

/// One key's stored request and response, as stored (`idemflow_store::KeyBodies`): `?1` tenant,
/// `?2` key. A body stored apart is read with its row, and only the one of the row's life.
pub const KEY_BODIES: &str = concat!(
    "SELECT request, response_status, response_headers, response_apart, \
            coalesce(response_body, \
                     (SELECT body FROM idempotency_responses AS apart \
                      WHERE apart.tenant = idempotency_keys.tenant \
                        AND apart.key = idempotency_keys.key \
                        AND apart.life = idempotency_keys.life)) AS response_body, \
            CASE WHEN state = 'done' THEN (",
    now_ms!(),
    " - finished_at) / 1000 END AS finished_seconds_ago \
     FROM idempotency_keys WHERE tenant = ?1 AND key = ?2"
);

/// Keys by workflow and state, for operators.
pub const COUNTS: &str = "SELECT workflow, state, count(*) FROM idempotency_keys \
     GROUP BY workflow, state ORDER BY workflow, state";

/// Age in whole seconds of the oldest started key (`NULL`: none).
pub const OLDEST_STARTED: &str = concat!(
    "SELECT (",
    now_ms!(),
    " - min(created_at)) / 1000 FROM idempotency_keys WHERE state = 'started'"
);

/// Milliseconds since the oldest ended lease of a started key ended (0: none is due).
pub const RESUMER_LAG: &str = concat!(
    "SELECT coalesce(",
    now_ms!(),
    " - min(locked_until), 0) FROM idempotency_keys \
     WHERE state = 'started' AND locked_until <= ",
    now_ms!()
);

/// Ends a claim's statements: a savepoint the failure record rolls back to, undoing the first
/// attempt's effects while keeping its uncommitted claim.
pub const CLAIMED_SAVEPOINT: &str = "SAVEPOINT idemflow_claimed";

/// Undoes everything since [`CLAIMED_SAVEPOINT`], keeping the claim (and the savepoint).
pub const BACK_TO_CLAIM: &str = "ROLLBACK TO idemflow_claimed";

/// Started keys due now whose workflow is not in the JSON array `?1`, counted by workflow.
pub const COUNT_DUE_UNKNOWN: &str = concat!(
    "SELECT workflow, count(*) FROM idempotency_keys WHERE state = 'started' AND locked_until <= ",
    now_ms!(),
    " AND workflow NOT IN (SELECT value FROM json_each(?1)) GROUP BY workflow ORDER BY workflow"
);

/// The console's page of keys from a position, in key order: `?1` tenant, `?2` key, `?3` how many.
/// Strictly after the position.
pub const SCAN_AFTER: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE (tenant, key) > (?1, ?2) ORDER BY tenant, key LIMIT ?3"
);

/// [`SCAN_AFTER`] from the position itself.
pub const SCAN_FROM: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE (tenant, key) >= (?1, ?2) ORDER BY tenant, key LIMIT ?3"
);

/// [`SCAN_AFTER`] within one tenant: `?1` tenant, `?2` key, `?3` how many.
pub const SCAN_TENANT_AFTER: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ?1 AND key > ?2 ORDER BY key LIMIT ?3"
);

/// [`SCAN_FROM`] within one tenant.
pub const SCAN_TENANT_FROM: &str = concat!(
    "SELECT ",
    report_columns!(),
    " FROM idempotency_keys WHERE tenant = ?1 AND key >= ?2 ORDER BY key LIMIT ?3"
);

/// Started keys by workflow, with how many are due.
pub const STARTED_BY_WORKFLOW: &str = concat!(
    "SELECT workflow, count(*), coalesce(sum(locked_until <= ",
    now_ms!(),
    "), 0) FROM idempotency_keys WHERE state = 'started' GROUP BY workflow ORDER BY workflow"
);

/// Keys finished in the last minute and in the last 15 minutes (the finished index).
pub const FINISHED_LATELY: &str = concat!(
    "SELECT coalesce(sum(finished_at > ",
    now_ms!(),
    " - 60000), 0), count(*) FROM idempotency_keys WHERE state = 'done' AND finished_at > ",
    now_ms!(),
    " - 900000"
);

/// Deletes one key if its token is still `?3` and its state `?4`: `?1` tenant, `?2` key. Its life
/// names the body apart to delete with it ([`DELETE_APART`]).
pub const EXPIRE_KEY: &str = "DELETE FROM idempotency_keys \
     WHERE tenant = ?1 AND key = ?2 AND lock_version = ?3 AND state = ?4 RETURNING life, state";
