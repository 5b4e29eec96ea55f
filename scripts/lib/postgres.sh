# shellcheck shell=bash
#
# Finds or starts a PostgreSQL for idemflow and exports DATABASE_URL.
# Sourced by scripts/test and scripts/checkout; also usable on its own:
#
#   bash -c 'source scripts/lib/postgres.sh; idemflow_postgres_up;
#            psql "$DATABASE_URL" -c "select version()"'
#   bash -c 'source scripts/lib/postgres.sh; idemflow_postgres_explain'
#            (what it would do here, and why; changes nothing)
#
# idemflow_postgres_up tries, in order (IDEMFLOW_POSTGRES=auto):
#   1. DATABASE_URL already set: check that it answers and use it.
#   2. A server at 127.0.0.1:$IDEMFLOW_POSTGRES_PORT, user postgres, trust auth.
#   3. PostgreSQL binaries found: start a throwaway cluster in a temp dir,
#      stopped and deleted when the calling shell exits (EXIT trap).
#   4. No binaries, but root with apt-get (a fresh Debian/Ubuntu machine):
#      install them (apt-get update; apt-get install postgresql), then 3.
#   5. None of these: fail loudly, naming the command that would install
#      PostgreSQL. Database tests are never skipped silently.
#
# The choice itself is idemflow_postgres_decide: a pure function of the facts
# (gathered by _idemflow_pg_gather_facts), tested case by case without
# touching the machine by scripts/tests/postgres-decision.sh.
#
# The URL names the superuser's `postgres` database because #[sqlx::test]
# creates (and drops) a fresh database per test from that connection.
#
# Settings (environment):
#   IDEMFLOW_POSTGRES           auto (default) | local | throwaway
#                               local: only step 2; throwaway: only steps 3-5.
#                               A forced mode ignores a preset DATABASE_URL.
#   IDEMFLOW_POSTGRES_PORT      port probed in step 2 (default 5432)
#   IDEMFLOW_POSTGRES_BIN_GLOB  where to look for server binaries besides PATH
#                               (default '/usr/lib/postgresql/*/bin', where
#                               Debian's packages put them)
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

_idemflow_pg_local_url() {
  printf 'postgres://postgres@127.0.0.1:%s/postgres\n' "$IDEMFLOW_POSTGRES_PORT"
}

# True if the local server answers (a fact for the decision; changes nothing).
_idemflow_pg_local_answers() {
  # Without any client tool, an open port is the best evidence we can get;
  # a wrong guess shows up as connection errors in the first database test.
  if ! _idemflow_pg_have_client; then
    _idemflow_pg_port_in_use "$IDEMFLOW_POSTGRES_PORT" || return 1
    _idemflow_pg_say "no psql/pg_isready: assuming the server on port" \
      "$IDEMFLOW_POSTGRES_PORT accepts user postgres without a password"
  else
    _idemflow_pg_answers "$(_idemflow_pg_local_url)" || return 1
  fi
}

_idemflow_pg_use_local() {
  DATABASE_URL=$(_idemflow_pg_local_url)
  export DATABASE_URL
  _idemflow_pg_source="local server at 127.0.0.1:$IDEMFLOW_POSTGRES_PORT (user postgres)"
}

# ------------------------------------------------------- 3: throwaway -------

# Prints "VERSION DIR" for each directory holding initdb, pg_ctl and postgres: the
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
    [[ -x $dir/initdb && -x $dir/pg_ctl && -x $dir/postgres ]] || continue
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
  # (The decision only starts one where binaries were found; this is a guard.)
  _idemflow_pg_find_bindir ||
    _idemflow_pg_die "no PostgreSQL binaries (initdb, pg_ctl, postgres) found on PATH or" \
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

# ---------------------------------------------------------- 4: install ------

# Prints the Debian package that brings the server: `postgresql` (on Debian
# and Ubuntu, the distribution's supported version, e.g. postgresql-15 on
# Debian 12), else the highest versioned postgresql-NN apt knows.
_idemflow_pg_package() {
  if apt-cache show postgresql >/dev/null 2>&1; then
    printf 'postgresql\n'
    return
  fi
  apt-cache pkgnames postgresql- 2>/dev/null | grep -E '^postgresql-[0-9]+$' |
    sort -V | tail -n 1 | grep .
}

# As root with apt-get (the decision checked both): installs the server
# binaries, then finds them under IDEMFLOW_POSTGRES_BIN_GLOB. Its output is
# shown (on stderr): this is the slow step of a fresh machine's first run.
_idemflow_pg_install() {
  local package
  _idemflow_pg_say "no PostgreSQL here: installing it with apt-get (once: later runs find it)"
  export DEBIAN_FRONTEND=noninteractive
  _idemflow_pg_say "apt-get update"
  apt-get update -q >&2 ||
    _idemflow_pg_die "apt-get update failed (see above); fix the package sources," \
      "or set DATABASE_URL to a PostgreSQL"
  package=$(_idemflow_pg_package) ||
    _idemflow_pg_die "apt knows no PostgreSQL server package (postgresql or postgresql-NN);" \
      "install PostgreSQL by hand, or set DATABASE_URL"
  _idemflow_pg_say "apt-get install -y --no-install-recommends $package"
  apt-get install -y -q --no-install-recommends "$package" >&2 ||
    _idemflow_pg_die "apt-get install $package failed (see above); install PostgreSQL" \
      "by hand, or set DATABASE_URL"
  _idemflow_pg_find_bindir ||
    _idemflow_pg_die "installed $package, but found no initdb, pg_ctl and postgres on PATH" \
      "or under $IDEMFLOW_POSTGRES_BIN_GLOB"
  _idemflow_pg_say "installed $package: server binaries in $_idemflow_pg_bindir"
}

# --------------------------------------------------------------- decision ---

# The choice, as a pure function: it reads only its arguments (all six
# required, as key=value) and changes nothing, so that a table of cases can
# test it on any machine (scripts/tests/postgres-decision.sh).
#
#   idemflow_postgres_decide mode=auto|local|throwaway|OTHER url=yes|no \
#     local=yes|no bindir=DIR-OR-EMPTY root=yes|no apt=yes|no
#
#   mode    IDEMFLOW_POSTGRES          url   DATABASE_URL is set
#   local   127.0.0.1:PORT answers     bindir  where initdb, pg_ctl, postgres are ("" = none)
#   root    we run as root             apt   apt-get is on PATH
#
# Prints one word:
#   use-url            use DATABASE_URL (after checking that it answers)
#   use-local          use the server at 127.0.0.1:PORT
#   throwaway          start a throwaway cluster from the binaries in bindir
#   install-throwaway  apt-get install PostgreSQL, then a throwaway cluster
#   fail-local         forced local, and nothing answers there
#   fail-not-root      nothing usable; apt-get is here but needs root (sudo)
#   fail-no-apt        nothing usable, and no apt-get to install it with
#   fail-mode          IDEMFLOW_POSTGRES is none of auto, local, throwaway
# Returns 2 (and prints nothing on stdout) on a malformed argument.
idemflow_postgres_decide() {
  local arg key value mode="" url="" local_answers="" bindir="" root="" apt=""
  local -A seen=()
  for arg in "$@"; do
    key=${arg%%=*}
    value=${arg#*=}
    if [[ $arg != *=* ]]; then
      printf 'idemflow_postgres_decide: not key=value: %s\n' "$arg" >&2
      return 2
    fi
    case $key in
      mode) mode=$value ;;
      bindir) bindir=$value ;;
      url | local | root | apt)
        if [[ $value != yes && $value != no ]]; then
          printf 'idemflow_postgres_decide: %s must be yes or no, not "%s"\n' "$key" "$value" >&2
          return 2
        fi
        case $key in
          url) url=$value ;;
          local) local_answers=$value ;;
          root) root=$value ;;
          apt) apt=$value ;;
        esac
        ;;
      *)
        printf 'idemflow_postgres_decide: unknown fact: %s\n' "$key" >&2
        return 2
        ;;
    esac
    seen[$key]=1
  done
  for key in mode url local bindir root apt; do
    if [[ -z ${seen[$key]:-} ]]; then
      printf 'idemflow_postgres_decide: missing fact: %s\n' "$key" >&2
      return 2
    fi
  done

  case $mode in
    auto | local | throwaway) ;;
    *) echo fail-mode && return 0 ;;
  esac
  # 1. Only auto honours a preset DATABASE_URL; a forced mode ignores it.
  if [[ $mode == auto && $url == yes ]]; then
    echo use-url
  # 2. The local server (never asked for in throwaway mode).
  elif [[ $mode != throwaway && $local_answers == yes ]]; then
    echo use-local
  elif [[ $mode == local ]]; then
    echo fail-local
  # 3. Binaries already here.
  elif [[ -n $bindir ]]; then
    echo throwaway
  # 4. and 5. Nothing here: install if we can, else say how.
  elif [[ $apt == no ]]; then
    echo fail-no-apt
  elif [[ $root == no ]]; then
    echo fail-not-root
  else
    echo install-throwaway
  fi
}

# Fills _idemflow_pg_facts with the facts idemflow_postgres_decide takes, and
# _idemflow_pg_bindir. Only looks: connects at most once to 127.0.0.1:PORT,
# and only when the answer can matter (auto without DATABASE_URL, or local).
_idemflow_pg_facts=()
_idemflow_pg_local_probed=no
_idemflow_pg_gather_facts() {
  local url=no local_answers=no root=no apt=no
  _idemflow_pg_local_probed=no
  [[ -n ${DATABASE_URL:-} ]] && url=yes
  # Binaries first, so that the probe below uses the psql beside them.
  _idemflow_pg_find_bindir || _idemflow_pg_bindir=""
  if [[ $IDEMFLOW_POSTGRES == local || ($IDEMFLOW_POSTGRES == auto && $url == no) ]]; then
    _idemflow_pg_local_probed=yes
    _idemflow_pg_local_answers && local_answers=yes
  fi
  [[ $(id -u) -eq 0 ]] && root=yes
  command -v apt-get >/dev/null 2>&1 && apt=yes
  _idemflow_pg_facts=("mode=$IDEMFLOW_POSTGRES" "url=$url" "local=$local_answers"
    "bindir=$_idemflow_pg_bindir" "root=$root" "apt=$apt")
}

# ------------------------------------------------------------------ entry ---

_idemflow_pg_nothing_found() {
  printf 'no PostgreSQL: %s, and no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or under %s' \
    "$(_idemflow_pg_unanswered)" "$IDEMFLOW_POSTGRES_BIN_GLOB"
}

_idemflow_pg_unanswered() {
  if [[ $IDEMFLOW_POSTGRES == throwaway ]]; then
    printf 'IDEMFLOW_POSTGRES=throwaway'
  else
    printf 'none answers at 127.0.0.1:%s (user postgres)' "$IDEMFLOW_POSTGRES_PORT"
  fi
}

# Makes DATABASE_URL point at a usable PostgreSQL (see the top of this file).
idemflow_postgres_up() {
  local decision
  _idemflow_pg_gather_facts
  decision=$(idemflow_postgres_decide "${_idemflow_pg_facts[@]}") ||
    _idemflow_pg_die "internal: no decision for: ${_idemflow_pg_facts[*]}"
  case $decision in
    use-url | use-local | throwaway | install-throwaway) _idemflow_pg_note_ignored_url ;;
  esac
  case $decision in
    use-url) _idemflow_pg_use_preset_url ;;
    use-local) _idemflow_pg_use_local ;;
    throwaway) _idemflow_pg_start_throwaway ;;
    install-throwaway)
      _idemflow_pg_install
      _idemflow_pg_start_throwaway
      ;;
    fail-local)
      _idemflow_pg_die "IDEMFLOW_POSTGRES=local but no PostgreSQL answers at" \
        "127.0.0.1:$IDEMFLOW_POSTGRES_PORT as user postgres"
      ;;
    fail-not-root)
      _idemflow_pg_die "$(_idemflow_pg_nothing_found)." \
        "Run as root, these scripts install it themselves; as $(id -un), run" \
        "'sudo apt-get update && sudo apt-get install -y postgresql' and try again" \
        "(or set DATABASE_URL to a PostgreSQL)"
      ;;
    fail-no-apt)
      _idemflow_pg_die "$(_idemflow_pg_nothing_found), and no apt-get to install them with." \
        "Install PostgreSQL's server with this system's package manager (then set" \
        "IDEMFLOW_POSTGRES_BIN_GLOB if its binaries are not on PATH), or set DATABASE_URL"
      ;;
    fail-mode)
      _idemflow_pg_die "IDEMFLOW_POSTGRES must be auto, local or throwaway, not '$IDEMFLOW_POSTGRES'"
      ;;
    *) _idemflow_pg_die "internal: unknown decision '$decision'" ;;
  esac
}

# Prints the facts and the decision idemflow_postgres_up would act on, and
# changes nothing: a dry run of the choice on this machine.
idemflow_postgres_explain() {
  local decision
  _idemflow_pg_gather_facts
  decision=$(idemflow_postgres_decide "${_idemflow_pg_facts[@]}") || return 1
  printf 'facts:    %s\n' "${_idemflow_pg_facts[*]}"
  if [[ $_idemflow_pg_local_probed == no ]]; then
    printf '          (127.0.0.1:%s not probed: it cannot change the decision)\n' "$IDEMFLOW_POSTGRES_PORT"
  fi
  printf 'decision: %s\n' "$decision"
}

# A forced mode says so when it overrides DATABASE_URL.
_idemflow_pg_note_ignored_url() {
  if [[ $IDEMFLOW_POSTGRES != auto && -n ${DATABASE_URL:-} ]]; then
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
