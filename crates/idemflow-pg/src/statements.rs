//! The engine's statements on `idempotency_keys` that other code must send exactly as the engine
//! does: the benchmark's pgbench scripts are built from these texts (values substituted for the
//! `$n` parameters), never from a copy. A tidy test (tests/it/tidy.rs) fails when SQL naming
//! `idempotency_keys` appears in library code outside this crate, but where it says why.

/// The look-up: the key's row (what deciding needs, the response of a finished key) or, when
/// there is none, whether a claim of it is in flight (its claim lock is held: the shared try-lock
/// fails) and a fencing token drawn for the claim this request may make. `$1` tenant, `$2` key,
/// `$3` the key's claim lock. The second branch runs only when the first returns no row. The
/// first branch names the columns (`done`, `lease_left_ms`, `claiming`, `new_lock_version` and
/// the table's own), which is how the store reads them. The second branch also says whether the
/// connection holds the prepared claim ([`CLAIM_NAME`]; `claim_prepared`), so that a new
/// connection's first claim prepares it in its own message rather than fail once for it.
pub const LOOK_UP: &str = "(SELECT fingerprint, workflow, state = 'done' AS done, \
         ceil(extract(epoch FROM locked_until - now()) * 1000)::bigint AS lease_left_ms, \
         lock_version, response_status, response_headers, response_body, \
         CASE WHEN response_apart THEN (extract(epoch FROM created_at) * 1000000)::bigint END \
             AS life, \
         false AS claiming, NULL AS new_lock_version, NULL::boolean AS claim_prepared \
  FROM idempotency_keys WHERE tenant = $1 AND key = $2) \
 UNION ALL \
 (SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, \
         NOT pg_try_advisory_xact_lock_shared($3), \
         nextval('idempotency_keys_fence'), \
         EXISTS (SELECT FROM pg_prepared_statements WHERE name = 'idemflow_claim_v4')) \
 LIMIT 1";

/// The name the claim is prepared under on each connection.
pub const CLAIM_NAME: &str = "idemflow_claim_v4";

/// The connection's prepared claim: a call of the claim's function, `idemflow_claim` (defined by
/// the migration `claim_function`, its one definition), which takes the key's claim lock and
/// inserts the key's row. The lease is measured from the insert itself (`clock_timestamp()`), not
/// from the transaction's start. The key's journal starts with its `claimed` entry. A claim that
/// lost the race for its key (the key was claimed while this one waited for the lock) raises the
/// insert's unique violation, without an ERROR line in the server's log where the function's owner
/// may set `log_min_messages`. `$1` claim lock, `$2` tenant, `$3` key, `$4` fingerprint, `$5`
/// workflow, `$6` request, `$7` lease in ms, `$8` fencing token.
pub const PREPARE_CLAIM: &str = "PREPARE idemflow_claim_v4 \
     (bigint, text, text, bytea, text, jsonb, bigint, bigint) AS \
     SELECT idemflow_claim($1, $2, $3, $4, $5, $6, $7, $8)";

/// The claim's function, called by name where a prepared statement cannot stick: its arguments
/// are [`PREPARE_CLAIM`]'s parameters, in their order.
pub const CLAIM_FUNCTION: &str = "idemflow_claim";

/// The migration that defines the claim's function (its one definition; running it again defines
/// the function anew, e.g. once its owner may quiet a lost race).
pub const DEFINE_CLAIM: &str = include_str!("../migrations/20261204000100_claim_function.sql");

/// An entry's time in a key's journal: milliseconds since the Unix epoch by the server's clock,
/// read when the statement writing the entry runs. Every statement that changes a key appends
/// its entry to the key's `journal` itself (never a statement of its own), keeping at most
/// [`idemflow_store::JOURNAL_LIMIT`] entries: when full, `journal - 1` drops the second, so the
/// claim stays first.
pub const JOURNAL_AT: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// Ends the claim's message: the point a failed first attempt rolls back to, undoing its phases'
/// effects and keeping the claim, so its failure is recorded under a claim that never left (a
/// claim rolled back entirely frees the key, and may not be taken again: another request may have
/// been told it is free).
pub const CLAIMED_SAVEPOINT: &str = "SAVEPOINT idemflow_claimed";

/// Ends the message of every transaction the engine begins but a claim's (which ends with
/// [`CLAIMED_SAVEPOINT`]): a savepoint only the engine's transaction has, so that one a failed
/// statement aborted can still be asked whose it is (`Transaction::standing`).
pub const BEGUN_SAVEPOINT: &str = "SAVEPOINT idemflow_begun";

/// The start of the message that begins each of the engine's transactions under `limits`, as
/// the engine sends it: [`crate::BEGIN`], the engine's mark on its own transaction (which every
/// owner's write checks), and a `SET LOCAL` per limit. A claim's message goes on with the claim
/// and [`CLAIMED_SAVEPOINT`], every other with [`BEGUN_SAVEPOINT`]. The benchmark's scripts
/// begin their transactions with it.
pub fn begin_message(limits: &idemflow_store::Limits) -> String {
    crate::transaction::begin_statement(limits)
}

/// Back to [`CLAIMED_SAVEPOINT`].
pub const BACK_TO_CLAIM: &str = "ROLLBACK TO SAVEPOINT idemflow_claimed";

// Every statement on one key names it by the primary key and says `state <> 'done'`, never
// `state = 'started'`: on a generic plan (a prepared statement's from its sixth execution) the
// latter made the partial index of started keys look cheaper than the primary key, and that
// index still holds every key finished since the last vacuum, so each write scanned them all
// (tests/it/plans.rs; docs/ARCHITECTURE.md). A key is `started` or `done`: the same rows.
/// Records a completed phase (fenced), and its `phase` entry in the journal: `$1` tenant, `$2`
/// key, `$3` lock_version, `$4` recovery point, `$5` its output, `$6` lease in ms, measured from
/// this statement and never shortening.
pub const ADVANCE: &str = "UPDATE idempotency_keys \
 SET recovery_point = $4, phase_output = $5, attempts = 1, last_error = NULL, \
     locked_until = greatest(locked_until, \
                             clock_timestamp() + $6::bigint * interval '1 millisecond'), \
     journal = CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 ELSE journal END \
         || jsonb_build_object('at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'phase', 'token', $3::bigint, 'point', $4::text), \
     updated_at = now() \
 WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done' \
   AND current_setting('idemflow.transaction', true) = 'open'";

/// Stores the response and marks the key done (fenced), with its `finished` entry in the
/// journal: `$1` tenant, `$2` key, `$3` lock_version, `$4` recovery point, `$5` status, `$6`
/// headers, `$7` body.
pub const FINISH: &str = "UPDATE idempotency_keys \
 SET state = 'done', recovery_point = $4, phase_output = NULL, locked_until = NULL, \
     response_status = $5, response_headers = $6, response_body = $7, response_apart = false, \
     finished_at = clock_timestamp(), \
     journal = CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 ELSE journal END \
         || jsonb_build_object('at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'finished', 'token', $3::bigint, 'status', $5::smallint), \
     updated_at = now() \
 WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done' \
   AND current_setting('idemflow.transaction', true) = 'open'";

/// [`FINISH`] for a response stored out of the key's row: the key is marked done with its status
/// and headers and no body, and the body goes to `idempotency_responses`, in one statement. The
/// insert reads the update's `RETURNING`, so a fenced-out owner writes neither, and a crash leaves
/// both or neither (one transaction). The body row carries the key's `created_at`, which names
/// this life of the key. `ON CONFLICT`: a body left by an earlier life of the key (a partition
/// drop deletes the bodies of its keys only after the keys have left) is replaced, never served,
/// and its `created_at` with it, so that drop then spares it. The same parameters as [`FINISH`];
/// `$7` is the body.
pub const FINISH_APART: &str = "WITH finished AS ( \
     UPDATE idempotency_keys \
     SET state = 'done', recovery_point = $4, phase_output = NULL, locked_until = NULL, \
         response_status = $5, response_headers = $6, response_body = NULL, \
         response_apart = true, finished_at = clock_timestamp(), \
         journal = CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 ELSE journal END \
             || jsonb_build_object( \
                    'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                    'event', 'finished', 'token', $3::bigint, 'status', $5::smallint), \
         updated_at = now() \
     WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done' \
       AND current_setting('idemflow.transaction', true) = 'open' \
     RETURNING tenant, key, created_at) \
 INSERT INTO idempotency_responses (tenant, key, created_at, body) \
 SELECT tenant, key, created_at, $7 FROM finished \
 ON CONFLICT (tenant, key) DO UPDATE SET body = excluded.body, created_at = excluded.created_at";

/// The body of a response stored apart ([`FINISH_APART`]) for one life of its key: `$1` tenant,
/// `$2` key, `$3` the life, the key's `created_at` in microseconds since the Unix epoch, as the
/// look-up read it (`life`). A body of another life (the key deleted and claimed again between
/// the look-up and this read) is not this row's, and is not read.
pub const RESPONSE_APART: &str = "SELECT body FROM idempotency_responses \
     WHERE tenant = $1 AND key = $2 \
       AND (extract(epoch FROM created_at) * 1000000)::bigint = $3";

/// A fresh fencing token.
pub const NEXT_FENCE: &str = "SELECT nextval('idempotency_keys_fence')";

/// The fencing token this session drew last (what the look-up drew for a claim).
pub const LAST_FENCE: &str = "currval('idempotency_keys_fence')";

/// `sql` with each `$n` replaced by `values[n - 1]`: for tools that must send the engine's
/// statements where they cannot bind (pgbench scripts). Values are SQL expressions, inserted as
/// they are.
pub fn with_values(sql: &str, values: &[&str]) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits: String = rest[at + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        match digits
            .parse::<usize>()
            .ok()
            .and_then(|n| values.get(n.wrapping_sub(1)))
        {
            Some(value) => out.push_str(value),
            None => {
                out.push('$');
                out.push_str(&digits);
            }
        }
        rest = &rest[at + 1 + digits.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_replaced_by_number_not_by_prefix() {
        let sql = "SELECT $1, $10, $2::bigint, '$' || $3";
        let values = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
        assert_eq!(
            with_values(sql, &values),
            "SELECT a, j, b::bigint, '$' || c"
        );
    }

    #[test]
    fn every_change_of_a_key_appends_to_its_journal_within_the_limit() {
        for (statement, event) in [
            (DEFINE_CLAIM, "'claimed'"),
            (ADVANCE, "'phase'"),
            (FINISH, "'finished'"),
            (FINISH_APART, "'finished'"),
        ] {
            assert!(statement.contains(JOURNAL_AT), "{statement}");
            assert!(statement.contains(event), "{statement}");
        }
        for statement in [ADVANCE, FINISH, FINISH_APART] {
            assert!(
                statement.contains(&format!(
                    "jsonb_array_length(journal) >= {} THEN journal - 1",
                    idemflow_store::JOURNAL_LIMIT
                )),
                "{statement}"
            );
        }
    }

    #[test]
    fn the_writes_that_record_a_phases_work_run_only_in_the_engines_transaction() {
        for statement in [ADVANCE, FINISH, FINISH_APART] {
            assert!(
                statement.contains(crate::transaction::STILL_OPEN),
                "{statement}"
            );
        }
    }

    #[test]
    fn the_look_up_asks_for_the_claim_by_its_name() {
        assert!(LOOK_UP.contains(&format!("name = '{CLAIM_NAME}'")));
        assert!(PREPARE_CLAIM.starts_with(&format!("PREPARE {CLAIM_NAME} ")));
    }
}
