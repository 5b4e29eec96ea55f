-- idemflow's read-only role: what the operator console in read-only mode (`idemflow console
-- --read-only`, `Console::read_only`) and read-only tools need, and nothing more. The console
-- already refuses every action itself and opens its connections read-only; connecting as this
-- role makes the database refuse a write too, whatever the console does. docs/console.md
-- explains it; tests/it/console.rs runs this very file.
--
-- Run it as the owner role after every `idemflow migrate`, like scripts/sql/grants.sql (which
-- holds the runtime role's grants, and with which the full console runs). Running it again
-- changes nothing:
--
--   psql "$OWNER_DATABASE_URL" -v ON_ERROR_STOP=1 -v readonly_role=idemflow_console \
--        -f scripts/sql/grants-read-only.sql

BEGIN;

GRANT USAGE ON SCHEMA public TO :"readonly_role";

-- The keys (reports, the search, the overview) and the bodies stored apart (a key's page shows
-- its response). Revoked first, so a re-run takes back anything granted by hand since.
REVOKE ALL ON TABLE idempotency_keys FROM :"readonly_role";
GRANT SELECT ON TABLE idempotency_keys TO :"readonly_role";
REVOKE ALL ON TABLE idempotency_responses FROM :"readonly_role";
GRANT SELECT ON TABLE idempotency_responses TO :"readonly_role";

-- Nothing else: no sequence (a read draws no token), no consumer records, no migrations' history.
REVOKE ALL ON TABLE processed_messages FROM :"readonly_role";
REVOKE ALL ON SEQUENCE idempotency_keys_fence FROM :"readonly_role";
REVOKE ALL ON TABLE _sqlx_migrations FROM :"readonly_role";

COMMIT;
