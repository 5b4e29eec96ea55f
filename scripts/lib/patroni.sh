# shellcheck shell=bash
#
# A two-node PostgreSQL cluster under Patroni, on loopback, for the failover tests
# (tests/it/failover_patroni.rs): a one-node etcd as Patroni's store, two Patroni nodes in
# synchronous mode, and HAProxy in front, sending clients to whichever node answers Patroni's
# `GET /primary` with 200. Every config is generated into a temp dir; nothing outside it is
# touched.
#
# Sourced by scripts/test-ha, for idemflow_require_patroni: installs patroni, etcd-server and
# haproxy (Debian packages, as root with apt-get) when missing, or fails saying how.
#
# Run by the tests, as a command:
#   scripts/lib/patroni.sh up           makes the temp dir, starts everything, waits until node1
#                                       leads with node2 as its synchronous standby and HAProxy
#                                       reaches node1; prints the dir, then NAME=VALUE lines
#                                       (also in DIR/cluster.env)
#   scripts/lib/patroni.sh crash DIR NODE   SIGKILLs NODE's Patroni and its postmaster at once:
#                                       the host is gone, nothing shuts down cleanly
#   scripts/lib/patroni.sh switchover DIR   patronictl switchover --force to the other node
#   scripts/lib/patroni.sh down DIR     SIGKILLs every process it started, removes DIR
#
# Environment (scripts/test-ha sets both):
#   IDEMFLOW_PG_BINDIR  PostgreSQL's server binaries
#   IDEMFLOW_PG_OWNER   as root, the system user everything runs as (PostgreSQL refuses root)
#
# The settings, and how they bound the switch, are in docs/operations.md, "Running behind
# Patroni".

# Patroni's DCS timings: the leader key lives `ttl` seconds unless renewed; each node acts every
# `loop_wait`; a store or PostgreSQL call is retried for `retry_timeout`. Patroni wants
# loop_wait + 2 * retry_timeout <= ttl. On loopback, with one etcd, these can be far shorter than
# Patroni's defaults (30/10/10); a dead leader is replaced within ttl + loop_wait.
IDEMFLOW_PATRONI_TTL=${IDEMFLOW_PATRONI_TTL:-10}
IDEMFLOW_PATRONI_LOOP_WAIT=${IDEMFLOW_PATRONI_LOOP_WAIT:-1}
IDEMFLOW_PATRONI_RETRY_TIMEOUT=${IDEMFLOW_PATRONI_RETRY_TIMEOUT:-4}

_idemflow_patroni_die() {
  printf 'patroni: error: %s\n' "$*" >&2
  exit 1
}

_idemflow_patroni_say() { printf 'patroni: %s\n' "$*" >&2; }

# Installs what the Patroni tests need, or fails naming the packages: never skipped.
idemflow_require_patroni() {
  idemflow_require patroni /usr/bin/patroni /usr/local/bin/patroni || return 1
  idemflow_require etcd-server /usr/bin/etcd /usr/local/bin/etcd || return 1
  idemflow_require haproxy /usr/sbin/haproxy /usr/bin/haproxy /usr/local/sbin/haproxy || return 1
  idemflow_require curl /usr/bin/curl || return 1
}

# The first of the commands named that is installed.
_idemflow_patroni_which() {
  local name
  for name in "$@"; do
    command -v "$name" 2>/dev/null && return 0
  done
  return 1
}

# Starts a command in the background as the owner, its output in DIR/NAME.log, its pid in
# DIR/NAME.pid.
_idemflow_patroni_spawn() {
  local name=$1
  shift
  (cd "$dir" && exec setsid bash -c '
    if [[ -z ${IDEMFLOW_PG_OWNER:-} ]]; then exec "$@"; fi
    exec setpriv --reuid="$IDEMFLOW_PG_OWNER" --regid="$(id -g "$IDEMFLOW_PG_OWNER")" \
      --init-groups -- "$@"' spawn "$@" </dev/null >"$dir/$name.log" 2>&1) &
  printf '%s\n' "$!" >"$dir/$name.pid"
}

# Kernel-picked free ports, one per argument named.
_idemflow_patroni_ports() {
  /usr/bin/python3 - "$@" <<'EOF'
import socket, sys
sockets = []
for name in sys.argv[1:]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    sockets.append(s)
    print(f"{name}={s.getsockname()[1]}")
EOF
}

# Waits up to $1 seconds for a command to succeed; fails naming $2 and the logs.
_idemflow_patroni_wait() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      local log
      for log in "$dir"/*.log; do
        printf -- '--- %s (last lines)\n' "$log" >&2
        tail -n 20 "$log" >&2
      done
      _idemflow_patroni_die "$what: not within ${seconds}s"
    fi
    sleep 0.2
  done
}

# The status of Patroni's REST `GET /$2` on port $1 is 200.
_idemflow_patroni_is() {
  [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/$2") == 200 ]]
}

_idemflow_patroni_write_node() {
  local name=$1 pg_port=$2 api_port=$3
  cat >"$dir/$name.yml" <<EOF
scope: idemflow
name: $name
log:
  level: WARNING
restapi:
  listen: 127.0.0.1:$api_port
  connect_address: 127.0.0.1:$api_port
etcd3:
  hosts: 127.0.0.1:$ETCD_PORT
bootstrap:
  dcs:
    ttl: $IDEMFLOW_PATRONI_TTL
    loop_wait: $IDEMFLOW_PATRONI_LOOP_WAIT
    retry_timeout: $IDEMFLOW_PATRONI_RETRY_TIMEOUT
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      parameters:
        max_connections: 100
        wal_log_hints: "on"
  initdb:
    - encoding: UTF8
    - locale: C
    - auth: trust
postgresql:
  listen: 127.0.0.1:$pg_port
  connect_address: 127.0.0.1:$pg_port
  data_dir: $dir/$name
  bin_dir: $IDEMFLOW_PG_BINDIR
  pgpass: $dir/$name.pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: $dir
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
EOF
}

# HAProxy sends each new connection to the node whose Patroni says it is the primary, checking
# every node each 500 ms; a node marked down has its sessions cut at once, so no client keeps
# talking to a demoted or dead primary.
_idemflow_patroni_write_haproxy() {
  cat >"$dir/haproxy.cfg" <<EOF
global
  maxconn 200
defaults
  mode tcp
  retries 2
  timeout connect 2s
  timeout client 30m
  timeout server 30m
  timeout check 1s
listen primary
  bind 127.0.0.1:$HAPROXY_PORT
  option httpchk GET /primary
  http-check expect status 200
  default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
  server node1 127.0.0.1:$NODE1_PG_PORT check port $NODE1_API_PORT
  server node2 127.0.0.1:$NODE2_PG_PORT check port $NODE2_API_PORT
listen stats
  mode http
  bind 127.0.0.1:$HAPROXY_STATS_PORT
  stats enable
  stats uri /
EOF
}

_idemflow_patroni_up() {
  [[ -n ${IDEMFLOW_PG_BINDIR:-} ]] || _idemflow_patroni_die "IDEMFLOW_PG_BINDIR is not set"
  local patroni etcd haproxy
  patroni=$(_idemflow_patroni_which patroni) || _idemflow_patroni_die "no patroni installed"
  etcd=$(_idemflow_patroni_which etcd) || _idemflow_patroni_die "no etcd installed"
  haproxy=$(_idemflow_patroni_which haproxy /usr/sbin/haproxy) ||
    _idemflow_patroni_die "no haproxy installed"
  dir=$(mktemp -d /tmp/idemflow-patroni.XXXXXX)
  chmod 755 "$dir"
  if [[ -n ${IDEMFLOW_PG_OWNER:-} ]]; then
    chown "$IDEMFLOW_PG_OWNER:" "$dir"
  fi
  printf '%s\n' "$dir"
  # A start that fails leaves nothing running: the caller never learns what to stop.
  trap _idemflow_patroni_down EXIT
  local ports
  ports=$(_idemflow_patroni_ports ETCD_PORT ETCD_PEER_PORT NODE1_PG_PORT NODE1_API_PORT \
    NODE2_PG_PORT NODE2_API_PORT HAPROXY_PORT HAPROXY_STATS_PORT)
  printf '%s\n' "$ports" >"$dir/cluster.env"
  # shellcheck disable=SC1091
  source "$dir/cluster.env"

  _idemflow_patroni_spawn etcd "$etcd" --name etcd1 --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "etcd1=http://127.0.0.1:$ETCD_PEER_PORT"
  _idemflow_patroni_wait 30 "etcd answering" curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  _idemflow_patroni_write_node node1 "$NODE1_PG_PORT" "$NODE1_API_PORT"
  _idemflow_patroni_write_node node2 "$NODE2_PG_PORT" "$NODE2_API_PORT"
  chown -R "${IDEMFLOW_PG_OWNER:-$(id -un)}:" "$dir"
  # node1 first, so that it bootstraps the cluster and leads; then node2 copies it.
  _idemflow_patroni_spawn node1 "$patroni" "$dir/node1.yml"
  _idemflow_patroni_wait 60 "node1 leading" _idemflow_patroni_is "$NODE1_API_PORT" primary
  _idemflow_patroni_spawn node2 "$patroni" "$dir/node2.yml"
  _idemflow_patroni_wait 60 "node2 the synchronous standby" \
    _idemflow_patroni_is "$NODE2_API_PORT" sync

  _idemflow_patroni_write_haproxy
  _idemflow_patroni_spawn haproxy "$haproxy" -db -f "$dir/haproxy.cfg"
  # HAProxy takes every server for up until its checks say otherwise: until the standby is marked
  # down, a client may land on it.
  _idemflow_patroni_wait 30 "HAProxy sending clients to node1 alone" _idemflow_patroni_routed node1
  trap - EXIT
  printf '%s\n' "$ports"
}

# HAProxy's stats say the server named $1 is the only one up.
_idemflow_patroni_routed() {
  local csv
  csv=$(curl -sf "http://127.0.0.1:$HAPROXY_STATS_PORT/;csv") || return 1
  [[ $(awk -F, '$1 == "primary" && $2 ~ /^node/ && $18 == "UP" { print $2 }' <<<"$csv") == "$1" ]]
}

# The pid a pid file holds (a postmaster.pid's first line), if any.
_idemflow_patroni_pid() {
  [[ -f $1 ]] && head -n 1 "$1"
}

_idemflow_patroni_crash() {
  local node=$3 patroni postmaster
  patroni=$(_idemflow_patroni_pid "$dir/$node.pid") || _idemflow_patroni_die "no $node here"
  postmaster=$(_idemflow_patroni_pid "$dir/$node/postmaster.pid") ||
    _idemflow_patroni_die "$node runs no PostgreSQL"
  kill -KILL "$patroni" "$postmaster"
}

_idemflow_patroni_switchover() {
  local leader candidate
  leader=$(patronictl -c "$dir/node1.yml" list -f json |
    /usr/bin/python3 -c 'import json, sys; print(next(m["Member"] for m in json.load(sys.stdin) if m["Role"] == "Leader"))')
  if [[ $leader == node1 ]]; then candidate=node2; else candidate=node1; fi
  patronictl -c "$dir/node1.yml" switchover --leader "$leader" --candidate "$candidate" --force
}

_idemflow_patroni_down() {
  local name pid
  for name in haproxy node1 node2 etcd; do
    pid=$(_idemflow_patroni_pid "$dir/$name.pid") && kill -KILL "$pid" 2>/dev/null || true
    pid=$(_idemflow_patroni_pid "$dir/$name/postmaster.pid") && kill -KILL "$pid" 2>/dev/null || true
  done
  # Backends outlive a SIGKILLed postmaster for a moment; the directory goes once they are gone.
  sleep 0.5
  rm -rf "$dir"
}

_idemflow_patroni_main() {
  local command=${1:-}
  dir=${2:-}
  case $command in
  up) _idemflow_patroni_up ;;
  crash) _idemflow_patroni_crash "$@" ;;
  switchover) _idemflow_patroni_switchover ;;
  down) _idemflow_patroni_down ;;
  *)
    printf 'usage: %s up | crash DIR NODE | switchover DIR | down DIR\n' "$0" >&2
    exit 2
    ;;
  esac
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -euo pipefail
  _idemflow_patroni_main "$@"
fi
