# shellcheck shell=bash
#
# Finds or starts a PostgreSQL for idemflow and exports DATABASE_URL.
# Sourced by scripts/test and scripts/checkout; also usable on its own:
#
#   bash -c 'source scripts/lib/postgres.sh; idemflow_postgres_up;
#            psql "$DATABASE_URL" -c "select version()"'
#
# idemflow_postgres_up tries, in order (IDEMFLOW_POSTGRES=auto):
#   1. DATABASE_URL already set: check that it answers and use it.
#   2. A server at 127.0.0.1:$IDEMFLOW_POSTGRES_PORT, user postgres, trust auth.
#   3. PostgreSQL binaries found: start a throwaway cluster in a temp dir,
#      stopped and deleted when the calling shell exits (EXIT trap).
#   4. None of these: fail loudly. Database tests are never skipped silently.
#
# The URL names the superuser's `postgres` database because #[sqlx::test]
# creates (and drops) a fresh database per test from that connection.
#
# Settings (environment):
#   IDEMFLOW_POSTGRES           auto (default) | local | throwaway
#                               local: only step 2; throwaway: only step 3.
#                               A forced mode ignores a preset DATABASE_URL.
#   IDEMFLOW_POSTGRES_PORT      port probed in step 2 (default 5432)
#   IDEMFLOW_POSTGRES_BIN_GLOB  where to look for server binaries besides PATH
#                               (default '/usr/lib/postgresql/*/bin')
#   IDEMFLOW_POSTGRES_OS_USER   system user that owns the throwaway cluster when
#                               running as root (default idemflow-pg)
#
# After idemflow_postgres_up: DATABASE_URL is exported and
# idemflow_postgres_banner prints which PostgreSQL is used.
#
# The throwaway cluster owns the EXIT trap of the shell that sourced this file:
# callers must not replace that trap, and must not `exec` their last command
# (the trap would never run and the cluster would be left behind).

IDEMFLOW_POSTGRES=${IDEMFLOW_POSTGRES:-auto}
IDEMFLOW_POSTGRES_PORT=${IDEMFLOW_POSTGRES_PORT:-5432}
IDEMFLOW_POSTGRES_BIN_GLOB=${IDEMFLOW_POSTGRES_BIN_GLOB:-/usr/lib/postgresql/*/bin}
IDEMFLOW_POSTGRES_OS_USER=${IDEMFLOW_POSTGRES_OS_USER:-idemflow-pg}

# Filled in by idemflow_postgres_up, read by the banner and the cleanup.
_idemflow_pg_source=""  # one line: where DATABASE_URL points and why
_idemflow_pg_bindir=""  # directory of the server binaries, once found
_idemflow_pg_tmpdir=""  # throwaway cluster's temp dir (data, socket, log)
_idemflow_pg_owner=""   # OS user running the throwaway cluster ("" = us)
_idemflow_pg_last_error=""  # what psql/pg_isready said when a check failed

_idemflow_pg_say() { printf 'postgres: %s\n' "$*" >&2; }
_idemflow_pg_die() {
  printf 'postgres: error: %s\n' "$*" >&2
  exit 1
}

# ---------------------------------------------------------------- clients ---

# Prints the path of a client tool (psql, pg_isready), preferring the one next
# to the server binaries so that it matches their version, then PATH.
_idemflow_pg_client() {
  local tool=$1
  if [[ -n $_idemflow_pg_bindir && -x $_idemflow_pg_bindir/$tool ]]; then
    printf '%s\n' "$_idemflow_pg_bindir/$tool"
  else
    command -v "$tool" 2>/dev/null
  fi
}

# True if psql or pg_isready is there to check a server with.
_idemflow_pg_have_client() {
  [[ -n $(_idemflow_pg_client psql) || -n $(_idemflow_pg_client pg_isready) ]]
}

# True if the URL accepts a connection. psql proves the credentials and
# database too; pg_isready only that the server is up. Never prompts for a
# password (-w): CI has no stdin. Callers check _idemflow_pg_have_client first.
# The client's complaint is kept in _idemflow_pg_last_error for messages.
_idemflow_pg_answers() {
  local url=$1 psql
  psql=$(_idemflow_pg_client psql) || psql=""
  if [[ -n $psql ]]; then
    _idemflow_pg_last_error=$(PGCONNECT_TIMEOUT=5 "$psql" -X -w -q -A -t "$url" \
      -c 'select 1' 2>&1 >/dev/null)
  else
    _idemflow_pg_last_error=$("$(_idemflow_pg_client pg_isready)" -t 5 -d "$url" 2>&1)
  fi
}

# True if something listens on 127.0.0.1:PORT (bash's /dev/tcp, no tools).
_idemflow_pg_port_in_use() {
  (: >"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Hides the password of a URL for printing.
_idemflow_pg_redact() {
  sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#' <<<"$1"
}

# ------------------------------------------------------- 1 and 2: existing ---

_idemflow_pg_use_preset_url() {
  export DATABASE_URL
  _idemflow_pg_source="DATABASE_URL from the environment"
  # A server reached without any client installed (say, in a container)
  # can't be checked here; a wrong URL then fails the first database test.
  if ! _idemflow_pg_have_client; then
    _idemflow_pg_say "no psql/pg_isready: using DATABASE_URL unchecked"
    return
  fi
  _idemflow_pg_answers "$DATABASE_URL" ||
    _idemflow_pg_die "DATABASE_URL is set but does not answer:" \
      "$(_idemflow_pg_redact "$DATABASE_URL")" \
      "(fix it, or unset it to let scripts find or start a PostgreSQL);" \
      "the client said: ${_idemflow_pg_last_error:-nothing}"
}

# True (and DATABASE_URL exported) if the local server answers.
_idemflow_pg_try_local() {
  local url="postgres://postgres@127.0.0.1:$IDEMFLOW_POSTGRES_PORT/postgres"
  # Without any client tool, an open port is the best evidence we can get;
  # a wrong guess shows up as connection errors in the first database test.
  if ! _idemflow_pg_have_client; then
    _idemflow_pg_port_in_use "$IDEMFLOW_POSTGRES_PORT" || return 1
    _idemflow_pg_say "no psql/pg_isready: assuming the server on port" \
      "$IDEMFLOW_POSTGRES_PORT accepts user postgres without a password"
  else
    _idemflow_pg_answers "$url" || return 1
  fi
  export DATABASE_URL=$url
  _idemflow_pg_source="local server at 127.0.0.1:$IDEMFLOW_POSTGRES_PORT (user postgres)"
}

# ------------------------------------------------------- 3: throwaway -------

# Prints "VERSION DIR" for each directory holding initdb and pg_ctl: the
# directory of initdb on PATH (symlinks resolved, so psql is found beside it)
# and every match of IDEMFLOW_POSTGRES_BIN_GLOB.
_idemflow_pg_bin_candidates() {
  local dir version initdb
  local -a dirs=()
  if initdb=$(command -v initdb 2>/dev/null) && command -v pg_ctl >/dev/null 2>&1; then
    dirs+=("$(dirname "$(readlink -f "$initdb")")")
  fi
  # Unquoted on purpose: the setting is a glob. No match leaves the pattern
  # itself, which the -x test below drops.
  # shellcheck disable=SC2206
  dirs+=($IDEMFLOW_POSTGRES_BIN_GLOB)
  for dir in "${dirs[@]}"; do
    [[ -x $dir/initdb && -x $dir/pg_ctl ]] || continue
    # "pg_ctl (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)" -> "15.20"
    version=$("$dir/pg_ctl" --version 2>/dev/null | awk '{print $3}') || continue
    printf '%s %s\n' "$version" "$dir"
  done
}

# Sets _idemflow_pg_bindir to the highest-version candidate; false if none.
_idemflow_pg_find_bindir() {
  local best
  best=$(_idemflow_pg_bin_candidates | sort -V -k1,1 | tail -n 1)
  [[ -n $best ]] || return 1
  _idemflow_pg_bindir=${best#* }
}

# PostgreSQL refuses to run as root, so root hands the cluster to a dedicated
# system user (created on first use), or to nobody if users can't be created.
_idemflow_pg_pick_owner() {
  if [[ $(id -u) -ne 0 ]]; then
    _idemflow_pg_owner=""
    return
  fi
  local user=$IDEMFLOW_POSTGRES_OS_USER
  if ! id -u "$user" >/dev/null 2>&1; then
    if command -v useradd >/dev/null 2>&1 &&
      useradd --system --no-create-home --shell /usr/sbin/nologin "$user"; then
      _idemflow_pg_say "created system user $user to run the throwaway cluster"
    else
      _idemflow_pg_say "could not create user $user; running the cluster as nobody"
      user=nobody
    fi
  fi
  _idemflow_pg_owner=$user
}

# Runs a command as the cluster's owner, from inside the temp dir (the owner
# may not be allowed into the caller's working directory).
_idemflow_pg_as_owner() {
  (
    cd "$_idemflow_pg_tmpdir" || exit 1
    if [[ -z $_idemflow_pg_owner ]]; then
      "$@"
    elif command -v runuser >/dev/null 2>&1; then
      runuser -u "$_idemflow_pg_owner" -- "$@"
    else
      # The owner's login shell may be nologin: name a real shell.
      su -s /bin/bash "$_idemflow_pg_owner" -c "$(printf '%q ' "$@")"
    fi
  )
}

# Prints the first port from 54329 upward that nothing listens on.
_idemflow_pg_free_port() {
  local port
  for ((port = 54329; port < 54429; port++)); do
    if ! _idemflow_pg_port_in_use "$port"; then
      printf '%s\n' "$port"
      return
    fi
  done
  _idemflow_pg_die "no free port in 54329-54428 for a throwaway PostgreSQL"
}

# Server options. fsync=off: the cluster is thrown away, so durability only
# costs time. pg_stat_statements is preloaded when this version ships it, so
# tests can rely on it as on a typical production server.
_idemflow_pg_server_options() {
  local port=$1 libdir opts
  opts="-c listen_addresses=127.0.0.1 -p $port"
  opts+=" -c unix_socket_directories=$_idemflow_pg_tmpdir"
  opts+=" -c max_connections=200 -c fsync=off"
  libdir=$("$_idemflow_pg_bindir/pg_config" --pkglibdir 2>/dev/null) ||
    libdir="$(dirname "$_idemflow_pg_bindir")/lib"
  if [[ -f $libdir/pg_stat_statements.so ]]; then
    opts+=" -c shared_preload_libraries=pg_stat_statements"
  fi
  printf '%s\n' "$opts"
}

# EXIT trap: stops the throwaway cluster and deletes its directory, keeping the
# script's exit status. `set +e` because a failing step here must not abort
# the rest of the cleanup.
_idemflow_pg_cleanup() {
  local status=$?
  set +e
  if [[ -n $_idemflow_pg_tmpdir && -d $_idemflow_pg_tmpdir ]]; then
    if [[ -f $_idemflow_pg_tmpdir/data/postmaster.pid ]]; then
      _idemflow_pg_as_owner "$_idemflow_pg_bindir/pg_ctl" stop \
        -D "$_idemflow_pg_tmpdir/data" -m fast -w -t 30 >/dev/null 2>&1 ||
        _idemflow_pg_say "could not stop the throwaway cluster cleanly"
    fi
    rm -rf "$_idemflow_pg_tmpdir"
    _idemflow_pg_say "throwaway cluster stopped and $_idemflow_pg_tmpdir removed"
  fi
  exit "$status"
}

_idemflow_pg_start_throwaway() {
  _idemflow_pg_find_bindir ||
    _idemflow_pg_die "no PostgreSQL binaries (initdb, pg_ctl) found on PATH or" \
      "under $IDEMFLOW_POSTGRES_BIN_GLOB; install PostgreSQL or set DATABASE_URL"
  _idemflow_pg_pick_owner

  # Under /tmp, not $TMPDIR: the owner must be able to reach it (TMPDIR may
  # sit under root's home), and the socket path must stay short.
  _idemflow_pg_tmpdir=$(mktemp -d /tmp/idemflow-pg.XXXXXX)
  trap _idemflow_pg_cleanup EXIT
  # A signal exits through the EXIT trap too (128 + signal number).
  trap 'exit 129' HUP
  trap 'exit 130' INT
  trap 'exit 143' TERM
  chmod 755 "$_idemflow_pg_tmpdir"
  if [[ -n $_idemflow_pg_owner ]]; then
    chown "$_idemflow_pg_owner:" "$_idemflow_pg_tmpdir"
  fi

  local dir=$_idemflow_pg_tmpdir port
  _idemflow_pg_say "initdb in $dir/data (as ${_idemflow_pg_owner:-$(id -un)})"
  # --locale=C: the minimal images CI runs on may lack other locales.
  _idemflow_pg_as_owner "$_idemflow_pg_bindir/initdb" -D "$dir/data" \
    -U postgres --auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 ||
    _idemflow_pg_fail_start "initdb failed" "$dir/initdb.log"

  # (die in $(...) only ends the subshell, hence the explicit `|| exit`.)
  port=$(_idemflow_pg_free_port) || exit 1
  # -w waits until the server accepts connections.
  _idemflow_pg_as_owner "$_idemflow_pg_bindir/pg_ctl" start -D "$dir/data" \
    -l "$dir/server.log" -w -t 60 -o "$(_idemflow_pg_server_options "$port")" \
    >/dev/null 2>&1 ||
    _idemflow_pg_fail_start "pg_ctl start failed (port $port)" "$dir/server.log"

  local url="postgres://postgres@127.0.0.1:$port/postgres"
  # pg_ctl -w saw it accept connections; this also proves user and database.
  if _idemflow_pg_have_client && ! _idemflow_pg_answers "$url"; then
    _idemflow_pg_fail_start "throwaway cluster started but does not answer at $url" \
      "$dir/server.log"
  fi
  export DATABASE_URL=$url
  _idemflow_pg_source="throwaway cluster at 127.0.0.1:$port, data in $dir/data, removed on exit"
}

# Shows the log that explains a failed start, then fails (cleanup still runs).
_idemflow_pg_fail_start() {
  local what=$1 log=$2
  if [[ -f $log ]]; then
    printf '%s\n' "--- last lines of $log:" >&2
    tail -n 20 "$log" >&2
  fi
  _idemflow_pg_die "$what"
}

# ------------------------------------------------------------------ entry ---

# Makes DATABASE_URL point at a usable PostgreSQL (see the top of this file).
idemflow_postgres_up() {
  case $IDEMFLOW_POSTGRES in
    auto) _idemflow_pg_up_auto ;;
    local)
      _idemflow_pg_note_ignored_url
      _idemflow_pg_try_local ||
        _idemflow_pg_die "IDEMFLOW_POSTGRES=local but no PostgreSQL answers at" \
          "127.0.0.1:$IDEMFLOW_POSTGRES_PORT as user postgres"
      ;;
    throwaway)
      _idemflow_pg_note_ignored_url
      _idemflow_pg_start_throwaway
      ;;
    *) _idemflow_pg_die "IDEMFLOW_POSTGRES must be auto, local or throwaway, not '$IDEMFLOW_POSTGRES'" ;;
  esac
}

_idemflow_pg_up_auto() {
  if [[ -n ${DATABASE_URL:-} ]]; then
    _idemflow_pg_use_preset_url
  elif _idemflow_pg_try_local; then
    :
  elif _idemflow_pg_find_bindir; then
    _idemflow_pg_start_throwaway
  else
    _idemflow_pg_die "no PostgreSQL: none answers at 127.0.0.1:$IDEMFLOW_POSTGRES_PORT" \
      "and no PostgreSQL binaries (initdb, pg_ctl) were found on PATH or under" \
      "$IDEMFLOW_POSTGRES_BIN_GLOB; install PostgreSQL or set DATABASE_URL"
  fi
}

_idemflow_pg_note_ignored_url() {
  if [[ -n ${DATABASE_URL:-} ]]; then
    _idemflow_pg_say "IDEMFLOW_POSTGRES=$IDEMFLOW_POSTGRES: ignoring the DATABASE_URL from the environment"
  fi
}

# Prints which PostgreSQL is used: where it came from, the URL (password
# hidden) and, when psql is there to ask, the server's version.
idemflow_postgres_banner() {
  local psql version=""
  psql=$(_idemflow_pg_client psql) || psql=""
  if [[ -n $psql ]]; then
    version=$("$psql" -X -w -q -A -t "$DATABASE_URL" -c 'show server_version' 2>/dev/null) || version=""
  fi
  {
    printf '================================================================\n'
    printf ' PostgreSQL %s\n' "${version:-(version unknown: no psql)}"
    printf ' %s\n' "$_idemflow_pg_source"
    printf ' DATABASE_URL=%s\n' "$(_idemflow_pg_redact "$DATABASE_URL")"
    printf '================================================================\n'
  } >&2
}
