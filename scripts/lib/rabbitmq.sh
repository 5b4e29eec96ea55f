# shellcheck shell=bash
#
# The RabbitMQ the consumer tests (tests/it/consumer.rs) run against: the broker at AMQP_URL if
# set, else amqp://guest:guest@127.0.0.1:5672/%2f. Those tests never skip; this check makes a
# missing broker fail in a second, before anything is built, saying what to install or start.
#
#   idemflow_rabbitmq_up   returns when the broker answers the AMQP protocol header; otherwise
#                          prints what to do and exits 1.
#
# Settings (environment):
#   AMQP_URL   the broker the tests use (its host and port are checked here)

# Host and port of an amqp:// URL (default port 5672), as "host port".
idemflow_rabbitmq_address() {
  local url=$1 authority host port
  authority=${url#*://}
  authority=${authority%%/*}
  authority=${authority##*@}
  host=${authority%%:*}
  port=5672
  [[ $authority == *:* ]] && port=${authority##*:}
  printf '%s %s\n' "${host:-127.0.0.1}" "$port"
}

# True if something at host $1, port $2 answers AMQP 0-9-1's protocol header with a frame (a
# connection.start method frame begins with frame type 1). A bare TCP accept is not enough: a
# port taken by another server would pass.
idemflow_rabbitmq_answers() {
  local host=$1 port=$2 first
  first=$(timeout 5 bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "AMQP\x00\x00\x09\x01" >&3
    head -c 1 <&3 | od -An -tx1
  ' _ "$host" "$port" 2>/dev/null) || return 1
  [[ ${first// /} == 01 ]]
}

idemflow_rabbitmq_up() {
  local url=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f} host port
  read -r host port < <(idemflow_rabbitmq_address "$url")
  if idemflow_rabbitmq_answers "$host" "$port"; then
    printf 'rabbitmq: the broker at %s:%s answers (the consumer tests use it)\n' "$host" "$port" >&2
    return 0
  fi
  printf 'rabbitmq: error: no AMQP broker answers at %s:%s.\n' "$host" "$port" >&2
  printf '          The consumer tests (tests/it/consumer.rs) need a real RabbitMQ, user guest/guest,\n' >&2
  printf '          and are never skipped. Debian/Ubuntu: sudo apt-get install -y rabbitmq-server,\n' >&2
  printf '          then sudo service rabbitmq-server start; or set AMQP_URL to a broker.\n' >&2
  exit 1
}
