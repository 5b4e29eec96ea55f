# shellcheck shell=bash
#
# The Redis the Redis engine's tests (tests/it/redis_loss.rs, the conformance and explorer suites
# on Redis, the CLI's and the console's) run against: the server at REDIS_URL if set, else
# redis://127.0.0.1:6379. Those tests never skip; this check makes a missing server fail in a
# second, before anything is built, saying what to install or start.
#
#   idemflow_redis_up   returns when the server answers PING with PONG; otherwise prints what to
#                       do and exits 1.
#
# Settings (environment):
#   REDIS_URL   the server the tests use (its host and port are checked here)

# Host and port of a redis:// URL (default port 6379), as "host port".
idemflow_redis_address() {
  local url=$1 authority host port
  authority=${url#*://}
  authority=${authority%%/*}
  authority=${authority##*@}
  host=${authority%%:*}
  port=6379
  [[ $authority == *:* ]] && port=${authority##*:}
  printf '%s %s\n' "${host:-127.0.0.1}" "$port"
}

# True if something at host $1, port $2 answers an inline PING with +PONG (or with -NOAUTH: a
# Redis that wants a password, which REDIS_URL then carries). A bare TCP accept is not enough: a
# port taken by another server would pass.
idemflow_redis_answers() {
  local host=$1 port=$2 first
  first=$(timeout 5 bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "PING\r\n" >&3
    head -c 5 <&3
  ' _ "$host" "$port" 2>/dev/null) || return 1
  [[ $first == +PONG || $first == -NOAU ]]
}

idemflow_redis_up() {
  local url=${REDIS_URL:-redis://127.0.0.1:6379} host port
  read -r host port < <(idemflow_redis_address "$url")
  if idemflow_redis_answers "$host" "$port"; then
    printf 'redis: the server at %s:%s answers (the Redis engine tests use it)\n' "$host" "$port" >&2
    return 0
  fi
  printf 'redis: error: no Redis answers at %s:%s.\n' "$host" "$port" >&2
  printf '       The Redis engine tests need a real Redis and are never skipped.\n' >&2
  printf '       Debian/Ubuntu: sudo apt-get install -y redis-server, then sudo service redis-server\n' >&2
  printf '       start; or set REDIS_URL to a server.\n' >&2
  exit 1
}
