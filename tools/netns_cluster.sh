#!/usr/bin/env bash
# A two-node test bed on one machine: two network namespaces joined by a veth pair, and an MPI
# job whose ranks are split between them, talking over TCP across that link.
#
#   sudo tools/netns_cluster.sh [--ranks-per-node K] [--rate RATE] [--burst SIZE] [--delay TIME]
#                               [--keep-counters FILE] -- COMMAND [ARG...]
#
# runs COMMAND (e.g. `python -m mpi4py train.py`) on 2*K ranks (K: 2 by default): ranks 0..K-1
# in namespace "node 0", K..2K-1 in "node 1". Needs root and iproute2's `ip` (installed with
# apt-get if missing). The MPI is zero1_mpi.launcher's: ZERO1_MPIEXEC, else mpiexec on PATH
# (found with PYTHON, default python3); MPICH, Intel MPI and Open MPI are known (see below).
#
# The link: one veth pair created directly inside the two namespaces (nothing appears in the
# machine's own namespace), named $LINK (z1eth) on both sides, addressed 198.18.0.1/24 and
# 198.18.0.2/24 from the benchmarking range 198.18.0.0/15 (RFC 2544). The namespaces have no
# other interface than lo and no route out, and IPv6 is off on the link, so the job's traffic
# stays between these two addresses. --rate shapes each direction with a token bucket (tc tbf,
# e.g. --rate 1gbit; --burst, default 256kb); --delay adds that one-way delay each way with
# netem (e.g. --delay 0.2ms; RTT twice that), and fails, saying so, on a kernel without sch_netem.
#
# How ranks get into the namespaces: the launcher runs inside node 0's namespace and is given
# the two addresses as its hosts, with a bootstrap wrapper in place of ssh (hydra's
# -bootstrap-exec, Open MPI's plm_rsh_agent) that runs the remote command under
# `ip netns exec NODE'S-NAMESPACE`. Each node's processes also get a host name of their own
# (`unshare --uts`), as real nodes have (the three MPIs tell nodes apart by their launch daemons
# and did without; host names matter to tools that group ranks by them). Inter-node traffic is
# restricted to TCP on the link (UCX_TLS=tcp,self; FI_PROVIDER=tcp; Open MPI's btl tcp): on one
# machine UCX and libfabric would otherwise reach the other namespace's ranks through shared
# memory or CMA. Ranks within one node still use the MPI's shared memory, as on a real node.
# With more ranks than this machine has cores, Open MPI and Intel MPI are told to yield while
# they wait (see below). A --rate above ~2gbit needs a larger --burst.
#
# The job's environment also gets ZERO1_NETNS_LINK (the link's interface name, the same in both
# namespaces: a rank reads its own node's counters in /sys/class/net/$ZERO1_NETNS_LINK/statistics),
# ZERO1_NETNS_NAMES (the two namespaces, node 0 first: a rank finds its node by comparing
# /proc/self/ns/net with /run/netns/NAME) and ZERO1_NETNS_ADDRS (the two addresses).
# At the end it prints the bytes that crossed the link during the job in each direction (node
# 0's interface counters; they include the launcher's own traffic), and writes them as JSON to
# FILE with --keep-counters. Exit status: COMMAND's (the launcher's); 130/143 on SIGINT/SIGTERM.
# Everything it created (namespaces, link, processes in them, the wrapper) is removed on exit,
# also on failure or Ctrl-C; namespaces carry the script's PID, so runs can coexist. Only a
# SIGKILL leaves them: `ip netns list | grep zero1-`, `ip netns pids NAME`, `ip netns del NAME`.
set -euo pipefail

usage() {
  sed -n '5,6p' "$0" | sed 's/^# //' >&2
  exit 2
}
die() { echo "netns_cluster: $*" >&2; exit 1; }
say() { echo "netns_cluster: $*" >&2; }

per_node=2 rate="" burst=256kb delay="" counters=""
while [ $# -gt 0 ]; do
  case $1 in
    --ranks-per-node) per_node=${2:?}; shift 2 ;;
    --rate) rate=${2:?}; shift 2 ;;
    --burst) burst=${2:?}; shift 2 ;;
    --delay) delay=${2:?}; shift 2 ;;
    --keep-counters) counters=${2:?}; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "netns_cluster: unknown option $1" >&2; usage ;;
  esac
done
[ $# -gt 0 ] || usage
[[ $per_node =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node $per_node: give a positive integer"
[ "$(id -u)" -eq 0 ] || die "needs root (it creates network namespaces)"
if ! command -v ip >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2
fi
for tool in ip unshare; do command -v $tool >/dev/null || die "$tool not found"; done
if [ -n "$rate$delay" ]; then command -v tc >/dev/null || die "tc not found (iproute2)"; fi

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
found=$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c '
import shlex, sys
from zero1_mpi.launcher import LauncherError, flavor, launcher
try:
    argv = launcher()
except LauncherError as exc:
    sys.exit(f"netns_cluster: {exc}")
print(shlex.quote(flavor(*argv)), shlex.join(argv))') || exit 1
found=${found##*$'\n'}  # its last line: importing the package may print (I_MPI_DEBUG)
eval "mpi=($found)"  # (FLAVOR LAUNCHER...)
flavor=${mpi[0]} mpiexec=("${mpi[@]:1}")

LINK=z1eth
tag=$$
names=("zero1-$tag-0" "zero1-$tag-1")
hosts=("zero1-node0-$tag" "zero1-node1-$tag")
addrs=(198.18.0.1 198.18.0.2)
created=()
tmp=""
job=""

cleanup() {
  local status=$? pids ns i
  set +e
  trap - EXIT
  trap "" INT TERM  # a second Ctrl-C does not stop the teardown
  # The launcher first (it stops its ranks itself), then what still runs in the namespaces:
  # TERM after 1 s, KILL after 2 s.
  [ -n "$job" ] && kill -TERM "$job" 2>/dev/null
  for i in $(seq 30); do
    pids=()
    for ns in "${created[@]}"; do pids+=($(ip netns pids "$ns" 2>/dev/null)); done
    [ ${#pids[@]} -eq 0 ] && break
    if [ "$i" -eq 10 ]; then kill -TERM "${pids[@]}" 2>/dev/null
    elif [ "$i" -ge 20 ]; then kill -KILL "${pids[@]}" 2>/dev/null
    fi
    sleep 0.1
  done
  [ -n "$job" ] && wait "$job" 2>/dev/null
  for ns in "${created[@]}"; do  # deleting a namespace deletes its end of the veth pair: both
    ip netns del "$ns" || say "could not delete namespace $ns"
  done
  [ -n "$tmp" ] && rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for i in 0 1; do
  ip netns add "${names[$i]}" || die "could not create namespace ${names[$i]}"
  created+=("${names[$i]}")
done
ip link add "$LINK" netns "${names[0]}" type veth peer name "$LINK" netns "${names[1]}"
for i in 0 1; do
  ns=${names[$i]}
  ip netns exec "$ns" sh -c "echo 1 >/proc/sys/net/ipv6/conf/$LINK/disable_ipv6" 2>/dev/null || true
  ip -n "$ns" addr add "${addrs[$i]}/24" dev "$LINK"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$LINK" up
  if [ -n "$delay" ]; then
    if ! err=$(tc -n "$ns" qdisc replace dev "$LINK" root netem delay "$delay" \
               ${rate:+rate "$rate"} limit 100000 2>&1); then
      if [[ $err == *nknown* || $err == *"No such file"* ]]; then
        die "--delay needs netem, and this kernel lacks sch_netem (tc: ${err//$'\n'/ })"
      fi
      die "tc netem delay $delay${rate:+ rate $rate}: $err"
    fi
  elif [ -n "$rate" ]; then
    tc -n "$ns" qdisc replace dev "$LINK" root tbf rate "$rate" burst "$burst" latency 50ms \
      || die "tc tbf rate $rate burst $burst failed"
  fi
done
if [ -n "$rate$delay" ]; then
  say "shaping: $(tc -n "${names[0]}" qdisc show dev "$LINK" | head -1)"
fi
for _ in $(seq 50); do  # wait until both ends are up
  [ "$(ip netns exec "${names[0]}" cat /sys/class/net/$LINK/operstate)" = up ] \
    && [ "$(ip netns exec "${names[1]}" cat /sys/class/net/$LINK/operstate)" = up ] && break
  sleep 0.1
done

# The bootstrap wrapper: called as `WRAPPER [ssh options] HOST COMMAND...` by the launcher, it
# runs COMMAND (a shell command line, as ssh would) in HOST's namespace, with HOST's host name.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/zero1-netns.XXXXXX")
wrapper=$tmp/netns-exec
cat >"$wrapper" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do
  case \$1 in
    -[bcDeEFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
host=\$1; shift
case \$host in
  ${addrs[0]}|${hosts[0]}) ns=${names[0]} name=${hosts[0]} ;;
  ${addrs[1]}|${hosts[1]}) ns=${names[1]} name=${hosts[1]} ;;
  *) echo "netns_cluster: no node \$host here (${addrs[*]})" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$name" "\$*"
EOF
chmod +x "$wrapper"

n=$((2 * per_node))
# Both nodes share this machine's cores: with more ranks than cores, ranks that busy-poll for
# messages starve the ones they wait for. Open MPI yields by itself only when it knows it
# oversubscribes a node, and each node here seems to have K slots; Intel MPI spins by default.
# (Open MPI: parity.py on 2 x 2 ranks, 2 cores: 101 s without, 21 s with; Intel MPI 156 s, 20 s.)
oversubscribed=$(( n > $(nproc) ))
hostlist="${addrs[0]}:$per_node,${addrs[1]}:$per_node"
export ZERO1_NETNS_LINK=$LINK ZERO1_NETNS_NAMES="${names[*]}" ZERO1_NETNS_ADDRS="${addrs[*]}"
case $flavor in
  MPICH)
    # The wheel's netmod is UCX (libfabric in other builds): TCP between the nodes.
    export UCX_TLS=tcp,self UCX_NET_DEVICES=$LINK FI_PROVIDER=tcp FI_TCP_IFACE=$LINK
    launch=("${mpiexec[@]}" -bootstrap ssh -bootstrap-exec "$wrapper" -iface "$LINK"
            -hosts "$hostlist" -n "$n")
    ;;
  "Intel MPI")
    export I_MPI_FABRICS=shm:ofi FI_PROVIDER=tcp FI_TCP_IFACE=$LINK I_MPI_HYDRA_IFACE=$LINK
    [ "$oversubscribed" = 1 ] && export I_MPI_WAIT_MODE=${I_MPI_WAIT_MODE:-1}
    launch=("${mpiexec[@]}" -bootstrap ssh -bootstrap-exec "$wrapper" -iface "$LINK"
            -hosts "$hostlist" -n "$n")
    ;;
  "Open MPI")
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    [ "$oversubscribed" = 1 ] \
      && export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
    launch=("${mpiexec[@]}" --mca plm_rsh_agent "$wrapper" --host "$hostlist" -n "$n"
            --mca oob_tcp_if_include "$LINK" --mca btl_tcp_if_include "$LINK"
            --mca pml ob1 --mca btl tcp,sm,self)
    ;;
  *) die "launcher ${mpiexec[*]} is $flavor: known are MPICH, Intel MPI and Open MPI" ;;
esac

read_counters() {
  ip netns exec "${names[0]}" cat "/sys/class/net/$LINK/statistics/tx_bytes" \
    "/sys/class/net/$LINK/statistics/rx_bytes" | tr '\n' ' '
}
read -r tx0 rx0 <<<"$(read_counters)"
shaping=${rate:+, rate $rate}${delay:+, delay $delay}
say "$flavor, $n ranks: ${names[0]} (${addrs[0]}) ranks 0-$((per_node - 1)), ${names[1]}" \
    "(${addrs[1]}) ranks $per_node-$((n - 1)); link $LINK$shaping"
start=$(date +%s.%N)
# The job runs in a session of its own: a Ctrl-C (SIGINT to this script's process group) reaches
# this script alone, whose trap stops the job in cleanup. Were the launcher in the group too, it
# could exit from the same SIGINT before bash's wait noticed it, and bash would then ignore the
# signal (it assumes the child handled it) and exit with the job's status instead of 130.
setsid ip netns exec "${names[0]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' \
  "${hosts[0]}" "${launch[@]}" "$@" &
job=$!
status=0
wait "$job" || status=$?
job=""
end=$(date +%s.%N)
read -r tx1 rx1 <<<"$(read_counters)"
out=$((tx1 - tx0)) back=$((rx1 - rx0))
seconds=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.3f", b - a}')
say "$((out + back)) bytes crossed the link in ${seconds} s (node 0 -> 1: $out, 1 -> 0: $back);" \
    "job exit status $status"
if [ -n "$counters" ]; then
  printf '{"link": "%s", "node0_to_node1_bytes": %d, "node1_to_node0_bytes": %d, ' \
    "$LINK" "$out" "$back" >"$counters"
  printf '"bytes": %d, "seconds": %s, "ranks": %d, "mpi": "%s", "exit_status": %d}\n' \
    "$((out + back))" "$seconds" "$n" "$flavor" "$status" >>"$counters"
fi
exit "$status"
