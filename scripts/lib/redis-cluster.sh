# shellcheck shell=bash
#
# A Redis Cluster of the test command's own: three primaries and three replicas on loopback, each
# a `redis-server` in cluster mode with no persistence, under a temporary directory, joined by
# `redis-cli --cluster create --cluster-replicas 1`. The Redis engine's tests run their
# conformance suite and the foreign-only schedule explorer on it as on one Redis
# (tests/it/conformance.rs, tests/it/simulate.rs: `…::redis_cluster::…`). Nothing but the
# redis-server package (which brings redis-cli) is needed; without it this fails at once, saying
# what to install. The failover and resharding tests start clusters of their own
# (tests/it/support/redis.rs), since they kill a primary and move slots.
#
#   idemflow_redis_cluster_up   starts the cluster, waits until every node says cluster_state:ok,
#                               and exports REDIS_CLUSTER_URLS (every node's URL, comma-separated)
#                               and REDIS_CLUSTER_URL (the first). The nodes are stopped, and the
#                               directory removed, when the calling shell exits (its EXIT trap,
#                               run before whatever EXIT trap was set before). Where
#                               REDIS_CLUSTER_URLS is set already, it is used as it is.
#
# Settings (environment):
#   REDIS_CLUSTER_URLS            a cluster to use instead of starting one
#   IDEMFLOW_REDIS_SERVER         the redis-server binary (default: redis-server on the PATH)
#   IDEMFLOW_REDIS_CLUSTER_PORT   the first of six consecutive ports (default: the first free run
#                                 from 7100; each node's cluster bus takes its port + 10000 too)

_idemflow_redis_cluster_dir=
_idemflow_redis_cluster_previous_trap=

_idemflow_redis_cluster_die() {
  printf 'redis-cluster: error: %s\n' "$*" >&2
  exit 1
}

_idemflow_redis_cluster_say() {
  printf 'redis-cluster: %s\n' "$*" >&2
}

# True if something accepts TCP connections on 127.0.0.1:$1.
_idemflow_redis_cluster_taken() {
  timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" 2>/dev/null
}

# The first of six consecutive ports, from $1 up, free with their bus ports (+10000).
_idemflow_redis_cluster_ports_from() {
  local first=$1 port ok
  while ((first < 10000)); do
    ok=1
    for ((port = first; port < first + 6; port++)); do
      if _idemflow_redis_cluster_taken "$port" || _idemflow_redis_cluster_taken $((port + 10000)); then
        ok=0
        break
      fi
    done
    if ((ok)); then
      printf '%s\n' "$first"
      return 0
    fi
    first=$((first + 6))
  done
  return 1
}

# EXIT trap: stops every node (SIGKILL after SHUTDOWN NOSAVE fails), removes the directory, then
# runs the EXIT trap that was set before (the throwaway PostgreSQL's), keeping the exit status.
_idemflow_redis_cluster_down() {
  local status=$? pidfile
  set +e
  if [[ -n $_idemflow_redis_cluster_dir && -d $_idemflow_redis_cluster_dir ]]; then
    for pidfile in "$_idemflow_redis_cluster_dir"/*/redis.pid; do
      [[ -f $pidfile ]] || continue
      kill -9 "$(cat "$pidfile")" 2>/dev/null
    done
    rm -rf "$_idemflow_redis_cluster_dir"
    _idemflow_redis_cluster_say "stopped, $_idemflow_redis_cluster_dir removed"
    _idemflow_redis_cluster_dir=
  fi
  if [[ -n $_idemflow_redis_cluster_previous_trap ]]; then
    (exit "$status")
    eval "$_idemflow_redis_cluster_previous_trap"
  fi
  exit "$status"
}

# Waits up to $1 seconds for "$2…" (a command) to succeed; dies naming $3 otherwise.
_idemflow_redis_cluster_wait() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      _idemflow_redis_cluster_die "timed out after ${seconds}s waiting for $what" \
        "(logs under $_idemflow_redis_cluster_dir/*/redis.log)"
    fi
    sleep 0.2
  done
}

# Every node says cluster_state:ok, and every replica's link to its primary is up (a replica that
# never synced is never promoted).
_idemflow_redis_cluster_ok() {
  local cli=$1 port replication
  shift
  for port in "$@"; do
    "$cli" -p "$port" cluster info | grep -q '^cluster_state:ok' || return 1
    replication=$("$cli" -p "$port" info replication) || return 1
    if grep -q '^role:slave' <<<"$replication"; then
      grep -q '^master_link_status:up' <<<"$replication" || return 1
    fi
  done
}

idemflow_redis_cluster_up() {
  if [[ -n ${REDIS_CLUSTER_URLS:-} ]]; then
    _idemflow_redis_cluster_say "using REDIS_CLUSTER_URLS=$REDIS_CLUSTER_URLS"
    export REDIS_CLUSTER_URL=${REDIS_CLUSTER_URL:-${REDIS_CLUSTER_URLS%%,*}}
    return 0
  fi
  local server cli first port ports=() nodes=() urls=()
  server=${IDEMFLOW_REDIS_SERVER:-$(command -v redis-server || true)}
  [[ -n $server && -x $server ]] ||
    _idemflow_redis_cluster_die "no redis-server: the Redis Cluster tests need one and are never" \
      "skipped (Debian/Ubuntu: apt-get install -y redis-server; or IDEMFLOW_REDIS_SERVER)"
  cli=$(command -v redis-cli || true)
  [[ -n $cli ]] ||
    _idemflow_redis_cluster_die "no redis-cli, which joins the nodes into a cluster" \
      "(Debian/Ubuntu: apt-get install -y redis-tools, which redis-server brings)"
  first=$(_idemflow_redis_cluster_ports_from "${IDEMFLOW_REDIS_CLUSTER_PORT:-7100}") ||
    _idemflow_redis_cluster_die "no six consecutive free ports (and their bus ports) below 10000"
  _idemflow_redis_cluster_dir=$(mktemp -d /tmp/idemflow-redis-cluster.XXXXXX)
  _idemflow_redis_cluster_previous_trap=$(trap -p EXIT | sed -e "s/^trap -- '//" -e "s/' EXIT\$//")
  trap _idemflow_redis_cluster_down EXIT
  trap 'exit 129' HUP
  trap 'exit 130' INT
  trap 'exit 143' TERM
  for ((port = first; port < first + 6; port++)); do
    ports+=("$port")
    nodes+=("127.0.0.1:$port")
    urls+=("redis://127.0.0.1:$port")
    mkdir -p "$_idemflow_redis_cluster_dir/$port"
    "$server" --port "$port" --bind 127.0.0.1 --cluster-enabled yes \
      --cluster-config-file nodes.conf --cluster-node-timeout 1500 \
      --save '' --appendonly no --daemonize yes \
      --dir "$_idemflow_redis_cluster_dir/$port" \
      --pidfile "$_idemflow_redis_cluster_dir/$port/redis.pid" \
      --logfile "$_idemflow_redis_cluster_dir/$port/redis.log" ||
      _idemflow_redis_cluster_die "$server did not start on port $port"
  done
  for port in "${ports[@]}"; do
    _idemflow_redis_cluster_wait 20 "the node on port $port to answer" "$cli" -p "$port" ping
  done
  "$cli" --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes \
    >"$_idemflow_redis_cluster_dir/create.log" 2>&1 ||
    _idemflow_redis_cluster_die "redis-cli --cluster create failed:" \
      "$(tail -5 "$_idemflow_redis_cluster_dir/create.log")"
  _idemflow_redis_cluster_wait 60 "cluster_state:ok on every node, every replica synced" \
    _idemflow_redis_cluster_ok "$cli" "${ports[@]}"
  REDIS_CLUSTER_URLS=$(
    IFS=,
    printf '%s' "${urls[*]}"
  )
  export REDIS_CLUSTER_URLS
  export REDIS_CLUSTER_URL=${urls[0]}
  _idemflow_redis_cluster_say "3 primaries and 3 replicas on ports ${ports[0]}-${ports[5]}" \
    "(REDIS_CLUSTER_URLS=$REDIS_CLUSTER_URLS)"
}
