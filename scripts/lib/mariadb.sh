# shellcheck shell=bash
#
# The MariaDB (or MySQL) the MariaDB engine's tests run against: the server at MARIADB_URL if
# set, else mysql://root@127.0.0.1:3306/test. Those tests never skip; this check makes a missing
# server fail in a second, before anything is built, saying what to install or start.
#
#   idemflow_mariadb_up   returns when a MySQL-protocol server answers there; otherwise prints
#                         what to do and exits 1.
#
# Settings (environment):
#   MARIADB_URL   the server the tests use (its host and port are checked here)

# Host and port of a mysql:// URL (default port 3306), as "host port".
idemflow_mariadb_address() {
  local url=$1 authority host port
  authority=${url#*://}
  authority=${authority%%/*}
  authority=${authority##*@}
  host=${authority%%:*}
  port=3306
  [[ $authority == *:* ]] && port=${authority##*:}
  printf '%s %s\n' "${host:-127.0.0.1}" "$port"
}

# True if something at host $1, port $2 greets as a MySQL-protocol server: its handshake packet
# (a 3-byte length, sequence 0, then protocol version 10). A bare TCP accept is not enough: a
# port taken by another server would pass.
idemflow_mariadb_answers() {
  local host=$1 port=$2 greeting
  greeting=$(timeout 5 bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 1
    head -c 5 <&3 | od -An -tx1
  ' _ "$host" "$port" 2>/dev/null) || return 1
  greeting=${greeting// /}
  [[ ${greeting:6:4} == 000a ]]
}

idemflow_mariadb_up() {
  local url=${MARIADB_URL:-mysql://root@127.0.0.1:3306/test} host port
  read -r host port < <(idemflow_mariadb_address "$url")
  if idemflow_mariadb_answers "$host" "$port"; then
    printf 'mariadb: the server at %s:%s answers (the MariaDB engine tests use it)\n' "$host" "$port" >&2
    return 0
  fi
  printf 'mariadb: error: no MariaDB or MySQL server answers at %s:%s.\n' "$host" "$port" >&2
  printf '         The MariaDB engine tests (tests/it/conformance.rs, engines.rs: mod mariadb) need a\n' >&2
  printf '         real server, user root with an empty password, and are never skipped.\n' >&2
  printf '         Debian/Ubuntu: sudo apt-get install -y mariadb-server, then sudo service mariadb start;\n' >&2
  printf '         or set MARIADB_URL to a server (mysql://user:password@host:port/database).\n' >&2
  exit 1
}
