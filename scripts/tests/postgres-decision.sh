#!/usr/bin/env bash
#
# Tests how scripts/lib/postgres.sh chooses a PostgreSQL, without changing the
# machine: no container, no install, no server started, nothing stopped.
#
#   1. idemflow_postgres_decide (a pure function of six facts) over the table
#      below. A `*` in a row stands for every value of that column; together
#      the rows must cover every combination of the facts for the modes auto,
#      local and throwaway exactly once, so the table is the whole specification.
#   2. Malformed arguments are refused (status 2), never guessed at.
#   3. The facts are gathered right: the highest-version directory holding
#      initdb, pg_ctl and postgres wins (fake binaries in a temp dir); and on
#      a machine made to look bare (no binaries, nothing on the port) the
#      decision is to install as root, and as a non-root user it is to fail
#      loudly naming `sudo apt-get install` (run for real: it changes nothing).
#   4. Every bash script under scripts/ and .ci/ parses (`bash -n`).
#
# Fast (a second or two); scripts/test runs it first. shellcheck is not needed;
# where it is installed, `shellcheck scripts/lib/*.sh scripts/tests/*.sh
# scripts/test scripts/checkout` should be clean too.
#
# Usage: scripts/tests/postgres-decision.sh
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# Settings from the caller's environment must not leak into the facts.
unset IDEMFLOW_POSTGRES IDEMFLOW_POSTGRES_PORT IDEMFLOW_POSTGRES_BIN_GLOB
# shellcheck source=scripts/lib/postgres.sh
source scripts/lib/postgres.sh

failures=0
checks=0
fail() {
  printf 'FAIL: %s\n' "$*" >&2
  failures=$((failures + 1))
}

# ------------------------------------------------------------ 1. the table ---

# mode       url  local bins root apt   decision
# (url: DATABASE_URL set; local: 127.0.0.1:5432 answers; bins: initdb, pg_ctl
#  and postgres found; root: running as root; apt: apt-get on PATH)
table='
auto         yes  *     *    *    *     use-url
auto         no   yes   *    *    *     use-local
auto         no   no    yes  *    *     throwaway
auto         no   no    no   yes  yes   install-throwaway
auto         no   no    no   no   yes   fail-not-root
auto         no   no    no   *    no    fail-no-apt
local        *    yes   *    *    *     use-local
local        *    no    *    *    *     fail-local
throwaway    *    *     yes  *    *     throwaway
throwaway    *    *     no   yes  yes   install-throwaway
throwaway    *    *     no   no   yes   fail-not-root
throwaway    *    *     no   *    no    fail-no-apt
bogus        *    *     *    *    *     fail-mode
""           *    *     *    *    *     fail-mode
'

# Every value of a column, or the one given.
values() { if [[ $1 == '*' ]]; then printf '%s\n' yes no; else printf '%s\n' "$1"; fi; }

declare -A covered=()
row_count=0
while read -r mode url local_ bins root apt expected; do
  [[ -n $mode ]] || continue
  row_count=$((row_count + 1))
  [[ $mode == '""' ]] && mode=""
  for u in $(values "$url"); do
    for l in $(values "$local_"); do
      for b in $(values "$bins"); do
        for r in $(values "$root"); do
          for a in $(values "$apt"); do
            bindir=""
            # A path with a space: the function must take it as one value.
            [[ $b == yes ]] && bindir="/opt/pg 15/bin"
            facts=("mode=$mode" "url=$u" "local=$l" "bindir=$bindir" "root=$r" "apt=$a")
            checks=$((checks + 1))
            got=$(idemflow_postgres_decide "${facts[@]}")
            status=$?
            if [[ $status -ne 0 || $got != "$expected" ]]; then
              fail "${facts[*]}: expected $expected, got '$got' (status $status)"
            fi
            combo="$mode $u $l $b $r $a"
            covered[$combo]=$((${covered[$combo]:-0} + 1))
          done
        done
      done
    done
  done
done <<<"$table"

# Each combination of a real mode is specified by exactly one row.
for mode in auto local throwaway; do
  for u in yes no; do for l in yes no; do for b in yes no; do for r in yes no; do for a in yes no; do
    n=${covered["$mode $u $l $b $r $a"]:-0}
    if [[ $n -ne 1 ]]; then
      fail "table: mode=$mode url=$u local=$l bins=$b root=$r apt=$a is in $n rows, not 1"
    fi
  done; done; done; done; done
done
printf 'postgres-decision: table of %d rows, %d combinations checked\n' "$row_count" "$checks"

# ------------------------------------------------- 2. malformed arguments ---

refused() {
  local out status
  checks=$((checks + 1))
  out=$(idemflow_postgres_decide "$@" 2>/dev/null)
  status=$?
  [[ $status -eq 2 && -z $out ]] || fail "accepted malformed facts ($*): status $status, printed '$out'"
}
ok_facts=(mode=auto url=no local=no bindir= root=yes apt=yes)
refused "${ok_facts[@]:1}"                          # mode missing
refused "${ok_facts[@]:0:5}"                        # apt missing
refused "${ok_facts[@]}" colour=blue                # unknown fact
refused mode=auto url=maybe local=no bindir= root=yes apt=yes
refused mode=auto url=no local=no bindir= root=1 apt=yes
refused mode=auto url=no local=no bindir= root=yes apt
refused

# --------------------------------------------------- 3. gathering the facts ---

tmp=$(mktemp -d /tmp/idemflow-decision-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# Fake server binaries: pg_ctl --version prints what the real one prints.
fake_bin() {
  local dir=$tmp/pg/$1/bin version=$2 tool
  shift 2
  mkdir -p "$dir"
  for tool in "$@"; do
    printf '#!/bin/sh\necho "%s (PostgreSQL) %s (fake)"\n' "$tool" "$version" >"$dir/$tool"
    chmod +x "$dir/$tool"
  done
}
fake_bin 90 90.1 initdb pg_ctl postgres
fake_bin 91 91.0 initdb pg_ctl postgres
fake_bin 99 99.0 initdb pg_ctl # no postgres: not a server
checks=$((checks + 1))
got=$(IDEMFLOW_POSTGRES_BIN_GLOB="$tmp/pg/*/bin" bash -c \
  'source scripts/lib/postgres.sh; _idemflow_pg_find_bindir && printf "%s\n" "$_idemflow_pg_bindir"')
[[ $got == "$tmp/pg/91/bin" ]] || fail "binaries: expected $tmp/pg/91/bin (the highest with postgres), got '$got'"

# A bare machine, as far as the scripts can see: PATH without any initdb, a
# glob that matches nothing, a port nothing listens on, no DATABASE_URL.
bare_path=""
IFS=: read -ra path_dirs <<<"$PATH"
for dir in "${path_dirs[@]}"; do
  [[ -n $dir && ! -x $dir/initdb ]] && bare_path+="${bare_path:+:}$dir"
done
bare_port=""
for ((port = 54500; port < 54600; port++)); do
  if ! _idemflow_pg_port_in_use "$port"; then
    bare_port=$port
    break
  fi
done
bare_env=(env -u DATABASE_URL -u IDEMFLOW_POSTGRES "PATH=$bare_path"
  "IDEMFLOW_POSTGRES_BIN_GLOB=$tmp/none/*/bin" "IDEMFLOW_POSTGRES_PORT=$bare_port")

if command -v apt-get >/dev/null 2>&1; then apt=yes; else apt=no; fi
if [[ $(id -u) -eq 0 ]]; then
  expected=$([[ $apt == yes ]] && echo install-throwaway || echo fail-no-apt)
else
  expected=$([[ $apt == yes ]] && echo fail-not-root || echo fail-no-apt)
fi
checks=$((checks + 1))
got=$("${bare_env[@]}" bash -c 'source scripts/lib/postgres.sh; idemflow_postgres_explain' 2>&1)
if [[ $got != *"bindir= "* || $got != *"local=no"* || $got != *"decision: $expected"* ]]; then
  fail "bare machine as $(id -un): expected decision $expected, got: $got"
fi

# As a non-root user the real entry point must fail (status 1) naming the
# command; nothing is installed or started on that path. As root, it runs as
# user nobody, from a copy of the library in the temp dir (nobody may not be
# allowed into the work tree).
if [[ $apt == yes ]]; then
  cp scripts/lib/postgres.sh "$tmp/postgres.sh"
  chmod 755 "$tmp"
  chmod 644 "$tmp/postgres.sh"
  as_user=()
  if [[ $(id -u) -eq 0 ]]; then
    if command -v runuser >/dev/null 2>&1; then
      as_user=(runuser -u nobody --)
    else
      as_user=(su -s /bin/bash nobody -c)
    fi
  fi
  checks=$((checks + 1))
  # A marker no temp dir name can hold (mktemp draws letters and digits: "UP" once matched one).
  cmd="source '$tmp/postgres.sh'; idemflow_postgres_up; echo postgres-came-up"
  if [[ ${as_user[0]:-} == su ]]; then
    got=$(cd "$tmp" && "${as_user[@]}" "$(printf '%q ' "${bare_env[@]}" bash -c "$cmd")" 2>&1)
  else
    got=$(cd "$tmp" && "${as_user[@]}" "${bare_env[@]}" bash -c "$cmd" 2>&1)
  fi
  status=$?
  if [[ $status -ne 1 || $got != *"sudo apt-get install -y postgresql"* || $got == *postgres-came-up* ]]; then
    fail "bare machine, not root: expected a loud failure naming sudo apt-get install, got status $status: $got"
  fi
fi

# ----------------------------------------------------------- 4. bash -n ---

scripts=(.ci/run)
while IFS= read -r file; do
  if head -n 1 "$file" | grep -q bash || grep -q '^# shellcheck shell=bash' "$file"; then
    scripts+=("$file")
  fi
done < <(find scripts -type f ! -name '*.patch' | sort)
for file in "${scripts[@]}"; do
  checks=$((checks + 1))
  bash -n "$file" || fail "bash -n $file"
done
printf 'postgres-decision: bash -n on %d scripts\n' "${#scripts[@]}"

if [[ $failures -gt 0 ]]; then
  printf 'postgres-decision: %d of %d checks FAILED\n' "$failures" "$checks" >&2
  exit 1
fi
printf 'postgres-decision: all %d checks pass\n' "$checks"
