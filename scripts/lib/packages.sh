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
