# shellcheck shell=bash
#
# System packages the tests need beyond PostgreSQL, installed by the scripts themselves so that a
# fresh machine needs nothing but the two commands of the README.
#
#   idemflow_require PACKAGE PATTERN...  returns at once if any file matches a PATTERN (a glob,
#                                        quoted by the caller so it is matched after the install
#                                        too); otherwise installs the Debian PACKAGE (as root, with
#                                        apt-get) and checks again; fails loudly, naming the
#                                        command, when it cannot.

# Whether any file matches one of the glob patterns given.
idemflow_any_file() {
  local pattern
  for pattern in "$@"; do
    compgen -G "$pattern" >/dev/null && return 0
  done
  return 1
}

idemflow_require() {
  local package="$1"
  shift
  idemflow_any_file "$@" && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    printf '\n==> installing %s (the tests need it)\n' "$package" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq "$package" >&2 || true
    idemflow_any_file "$@" && return 0
  fi
  printf 'error: the tests need %s, which is not installed and could not be installed here.\n' "$package" >&2
  printf '       Debian/Ubuntu: sudo apt-get install %s\n' "$package" >&2
  return 1
}

# libfaketime: tests/it/clock_skew.rs runs a process with its clock shifted by an hour.
idemflow_require_libfaketime() {
  if [[ -n ${IDEMFLOW_LIBFAKETIME:-} ]]; then
    return 0
  fi
  idemflow_require libfaketime \
    '/usr/lib/*/faketime/libfaketime.so.1' '/usr/lib/faketime/libfaketime.so.1' \
    '/usr/lib64/faketime/libfaketime.so.1'
}

# redis-server: the Redis Cluster the test command starts (scripts/lib/redis-cluster.sh, with
# redis-cli, which the package brings), and the Redis tests that need servers of their own (a
# cluster to kill a primary of or move slots in, a server filled with 100k keys to measure)
# start them beside the shared one (tests/it/support/redis.rs: own_server, own_cluster);
# Debian's redis-server package ships the binary.
idemflow_require_redis_server() {
  if [[ -n ${IDEMFLOW_REDIS_SERVER:-} ]]; then
    return 0
  fi
  idemflow_require redis-server '/usr/bin/redis-server' '/usr/local/bin/redis-server'
}

# promtool: scripts/check-deploy checks the Prometheus alert rules under deploy/prometheus, runs
# their unit tests and parses the dashboard's queries. Debian's prometheus package ships it as
# /usr/bin/promtool, with the server (and, recommended, the node exporter) as services the check
# never uses.
idemflow_require_promtool() {
  idemflow_require prometheus '/usr/bin/promtool' '/usr/local/bin/promtool'
}

# chromium and chromedriver: tests/it/browser.rs (and the console's tests) drive headless
# Chromium over WebDriver with idemflow_testrig::browser. Debian's chromium package ships
# /usr/bin/chromium, chromium-driver ships /usr/bin/chromedriver; IDEMFLOW_CHROMIUM and
# IDEMFLOW_CHROMEDRIVER name others.
idemflow_require_chromium() {
  if [[ -z ${IDEMFLOW_CHROMIUM:-} ]]; then
    idemflow_require chromium '/usr/bin/chromium' || return 1
  fi
  if [[ -z ${IDEMFLOW_CHROMEDRIVER:-} ]]; then
    idemflow_require chromium-driver '/usr/bin/chromedriver' || return 1
  fi
}

# pgbouncer: tests/it/pgbouncer.rs runs the engine behind a PgBouncer in transaction pooling mode,
# which needs PgBouncer 1.21+ (max_prepared_statements: without it sqlx's prepared statements land
# on other clients' server connections). Debian 12 packages 1.18, so when the one found is older,
# the release Debian 13 packages is built once from Debian's own source archive (checked against
# its SHA-256) into a cache every user can run it from, and IDEMFLOW_PGBOUNCER names it.
IDEMFLOW_PGBOUNCER_VERSION=1.24.1
IDEMFLOW_PGBOUNCER_SHA256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
IDEMFLOW_PGBOUNCER_SOURCE="https://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_${IDEMFLOW_PGBOUNCER_VERSION}.orig.tar.gz"

# Whether `pgbouncer --version` of $1 says 1.21 or later.
idemflow_pgbouncer_recent() {
  local version major minor
  version=$("$1" --version 2>/dev/null | sed -n 's/^PgBouncer \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)
  [[ -n $version ]] || return 1
  major=${version%%.*}
  minor=${version#*.}
  ((major > 1 || (major == 1 && minor >= 21)))
}

idemflow_require_pgbouncer() {
  if [[ -n ${IDEMFLOW_PGBOUNCER:-} ]]; then
    return 0
  fi
  idemflow_require pgbouncer '/usr/sbin/pgbouncer' '/usr/bin/pgbouncer' '/usr/local/sbin/pgbouncer' \
    '/usr/local/bin/pgbouncer' || return 1
  local found
  for found in /usr/sbin/pgbouncer /usr/bin/pgbouncer /usr/local/sbin/pgbouncer /usr/local/bin/pgbouncer; do
    if [[ -x $found ]] && idemflow_pgbouncer_recent "$found"; then
      export IDEMFLOW_PGBOUNCER="$found"
      return 0
    fi
  done
  # Root's home is not readable by the user the test runs pgbouncer as: a shared cache then.
  local cache
  if [[ $(id -u) -eq 0 ]]; then
    cache=/var/cache/idemflow/pgbouncer-$IDEMFLOW_PGBOUNCER_VERSION
  else
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/idemflow/pgbouncer-$IDEMFLOW_PGBOUNCER_VERSION
  fi
  if [[ -x $cache/bin/pgbouncer ]] && idemflow_pgbouncer_recent "$cache/bin/pgbouncer"; then
    export IDEMFLOW_PGBOUNCER="$cache/bin/pgbouncer"
    return 0
  fi
  printf '\n==> building pgbouncer %s (the installed one is older than 1.21)\n' \
    "$IDEMFLOW_PGBOUNCER_VERSION" >&2
  idemflow_require libevent-dev '/usr/include/event2/event.h' || return 1
  idemflow_require libssl-dev '/usr/include/openssl/ssl.h' || return 1
  idemflow_require pkg-config '/usr/bin/pkg-config' || return 1
  idemflow_require curl '/usr/bin/curl' || return 1
  local work
  work=$(mktemp -d)
  if ! (
    set -e
    cd "$work"
    curl -fsSL --retry 3 -o source.tar.gz "$IDEMFLOW_PGBOUNCER_SOURCE"
    echo "$IDEMFLOW_PGBOUNCER_SHA256  source.tar.gz" | sha256sum -c --quiet -
    tar xzf source.tar.gz
    cd "pgbouncer-$IDEMFLOW_PGBOUNCER_VERSION"
    ./configure --prefix="$cache" >configure.log 2>&1
    make -j"$(nproc)" >make.log 2>&1
    make install >install.log 2>&1
  ) >&2; then
    printf 'error: building pgbouncer %s failed (logs in %s)\n' "$IDEMFLOW_PGBOUNCER_VERSION" "$work" >&2
    return 1
  fi
  rm -rf "$work"
  chmod -R a+rX "$(dirname "$cache")"
  export IDEMFLOW_PGBOUNCER="$cache/bin/pgbouncer"
}

# schemathesis: scripts/schemathesis runs it against the checkout service's OpenAPI document.
# A Python tool, pinned, installed with pip into a virtual environment of its own under the cache
# (once; later runs find it), so nothing is installed into the system's Python. Without python3's
# venv module (Debian ships it apart, as python3-venv) it installs that first. Fails loudly: the
# step is part of the suite and never skipped. IDEMFLOW_SCHEMATHESIS names another `st`.
IDEMFLOW_SCHEMATHESIS_VERSION=4.32.5
idemflow_require_schemathesis() {
  if [[ -n ${IDEMFLOW_SCHEMATHESIS:-} ]]; then
    return 0
  fi
  local cache
  if [[ $(id -u) -eq 0 ]]; then
    cache=/var/cache/idemflow/schemathesis-$IDEMFLOW_SCHEMATHESIS_VERSION
  else
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/idemflow/schemathesis-$IDEMFLOW_SCHEMATHESIS_VERSION
  fi
  if [[ -x $cache/bin/st ]] && "$cache/bin/st" --version 2>/dev/null | grep -qF "$IDEMFLOW_SCHEMATHESIS_VERSION"; then
    export IDEMFLOW_SCHEMATHESIS="$cache/bin/st"
    return 0
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    idemflow_require python3 '/usr/bin/python3' || return 1
  fi
  # ensurepip is what Debian's python3 lacks without python3-venv.
  if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    idemflow_require python3-venv '/usr/lib/python3*/ensurepip/__init__.py' || return 1
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
      printf 'error: schemathesis needs python3 with its venv module; install python3-venv\n' >&2
      return 1
    fi
  fi
  printf '\n==> installing schemathesis %s into %s\n' "$IDEMFLOW_SCHEMATHESIS_VERSION" "$cache" >&2
  rm -rf "$cache"
  mkdir -p "$(dirname "$cache")"
  if ! python3 -m venv "$cache" >&2 \
    || ! "$cache/bin/pip" install --quiet --disable-pip-version-check \
      "schemathesis==$IDEMFLOW_SCHEMATHESIS_VERSION" >&2 \
    || ! "$cache/bin/st" --version >/dev/null 2>&1; then
    rm -rf "$cache"
    printf 'error: schemathesis %s could not be installed (python3 -m venv, then pip install)\n' \
      "$IDEMFLOW_SCHEMATHESIS_VERSION" >&2
    return 1
  fi
  export IDEMFLOW_SCHEMATHESIS="$cache/bin/st"
}
