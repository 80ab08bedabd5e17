#!/usr/bin/env bash
# A Slurm cluster on this machine, for tests and CI: munged, a private MariaDB, slurmdbd,
# slurmctld and one slurmd per node, all started directly (no systemd), all state under one folder.
#
#   bash scripts/local_slurm.sh start [--nodes N]  # install the Debian packages if missing, configure, start, wait
#   bash scripts/local_slurm.sh status             # print the state; exit 0 when up, 3 when not
#   bash scripts/local_slurm.sh kill-node NAME     # a node loses power: SIGKILL every process of its namespace
#   bash scripts/local_slurm.sh stop               # cancel jobs, stop every daemon by its PID file, remove the network
#
# One node (the default): node `localhost` at 127.0.0.1. N nodes (2-4): nodes glm46n1..glm46nN, each a host of its
# own as container-based Slurm test clusters make them: a network namespace (its own address on a bridge that links
# those namespaces and the controller only: no route to any other address) and a UTS namespace (its own hostname),
# running its slurmd, whose jobs inherit both. The controller, slurmdbd, MariaDB and munged run on the machine
# itself (the bridge's address); munge's socket and the run directories are on the one file system, as a cluster's
# shared storage. `start` after `kill-node` brings the node back (Slurm returns it to service on registration).
#
# State folder: $GLM46_SLURM_DIR (default /tmp/glm46-slurm). It survives `stop`, so job ids keep
# counting up across restarts; `rm -rf` it after `stop` for a fresh cluster (job ids restart at 1).
# Clients find the cluster through $GLM46_SLURM_DIR/etc/slurm.conf: `export SLURM_CONF=...`, or rely
# on the /etc/slurm/slurm.conf link this script makes when that file does not exist.
# Needs root (apt-get, and slurmd runs jobs as their submitting user). Debian 12, Slurm 22.05.
set -euo pipefail
trap 'echo "[local_slurm] error: line $LINENO: $BASH_COMMAND exited $?" >&2' ERR

DIR=${GLM46_SLURM_DIR:-/tmp/glm46-slurm}
DIR=${DIR%/}
CLUSTER=glm46
ACCOUNT=glm46
PARTITION=debug
SLURMCTLD_PORT=${GLM46_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${GLM46_SLURMD_PORT:-6818}
SLURMDBD_PORT=${GLM46_SLURMDBD_PORT:-6819}
DB_PORT=${GLM46_SLURM_DB_PORT:-3307}   # not 3306: leave room for a system MariaDB
SLURMD_TIMEOUT=20   # seconds before the controller declares a silent node DOWN (Slurm's default: 300)
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
SYSTEM_CONF=/etc/slurm/slurm.conf

ETC=$DIR/etc RUN=$DIR/run LOG=$DIR/log
MUNGE_DIR=$DIR/munge          # owned by the munge user: munged refuses keys/sockets others can touch
DB_DATA=$DIR/mysql DB_SOCKET=$RUN/mysqld.sock
export SLURM_CONF=$ETC/slurm.conf   # every slurm command below (and slurmdbd, for its conf) reads this

log() { printf '[local_slurm] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- nodes and their network -------------------------------------------------------------------

# The node count is the one the cluster was started with (kept in $ETC/nodes), so that status, kill-node
# and stop know the layout. Namespace, link and bridge names carry a tag of the state folder: CI's cluster
# and a developer's can run side by side.
NODES_FILE=$ETC/nodes
TAG=$(printf '%s' "$DIR" | cksum | cut -c1-4)
BRIDGE=g46b$TAG
saved_nodes() { [[ -s $NODES_FILE ]] && cat "$NODES_FILE" || echo 1; }
node_names() { local i; for ((i = 1; i <= $1; i++)); do echo "glm46n$i"; done; }
netns_of() { echo "glm46-$TAG-$1"; }
veth_of() { echo "g46${TAG}h${1#glm46n}"; }
subnet() { cat "$ETC/subnet"; }   # 10.46.X: the first free one, chosen at the first multi-node start
node_addr() { echo "$(subnet).1${1#glm46n}"; }
gateway() { echo "$(subnet).1"; }

choose_subnet() {
    [[ -s $ETC/subnet ]] && return 0
    local x used
    used=$(ip -4 -o addr show | awk '{print $4}')
    for ((x = 46; x < 250; x++)); do
        grep -q "^10\.46\.$x\." <<<"$used" || { echo "10.46.$x" >"$ETC/subnet"; return 0; }
    done
    die "no free 10.46.X.0/24 subnet for the nodes' bridge"
}

# The bridge (the controller's side, at the gateway address) and one namespace per node, linked to it by a veth
# pair; $ETC/hosts names every node (each slurmd sees it as its /etc/hosts).
make_network() {
    local nodes=$1 name ns veth hosts
    choose_subnet
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$(gateway)/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    hosts="127.0.0.1 localhost"$'\n'"$(gateway) $(hostname -s)"$'\n'
    for name in $(node_names "$nodes"); do hosts+="$(node_addr "$name") $name"$'\n'; done
    for name in $(node_names "$nodes"); do
        ns=$(netns_of "$name") veth=$(veth_of "$name")
        if ! ip netns list | grep -qw "$ns"; then
            ip netns add "$ns"
            ip link add "$veth" type veth peer name eth0 netns "$ns"
            ip link set "$veth" master "$BRIDGE" up
            ip -n "$ns" addr add "$(node_addr "$name")/24" dev eth0
            ip -n "$ns" link set eth0 up
            ip -n "$ns" link set lo up
        fi
    done
    printf '%s' "$hosts" >"$ETC/hosts"
}

remove_network() {
    local name ns
    for name in $(node_names 4); do
        ns=$(netns_of "$name")
        if ip link show "$(veth_of "$name")" >/dev/null 2>&1; then ip link del "$(veth_of "$name")"; fi  # and its peer
        if ip netns list | grep -qw "$ns"; then ip netns del "$ns"; fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
}

# Every process of a node's namespace (its slurmd, slurmstepds and job tasks), SIGKILLed at once.
kill_node() {
    local name=$1 ns pids
    ns=$(netns_of "$name")
    ip netns list | grep -qw "$ns" || die "no node $name in this cluster ($DIR: $(saved_nodes) node(s))"
    pids=$(ip netns pids "$ns")
    # shellcheck disable=SC2086
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    log "killed node $name: $(wc -w <<<"$pids") process(es) of namespace $ns"
}

# --- processes ---------------------------------------------------------------------------------

# pid_alive PIDFILE NAME: the PID file names a live (not zombie) process called NAME. Killed daemons
# are reparented to a PID 1 that may never reap them, so `kill -0` alone would call a zombie alive;
# the name check guards against a recycled PID.
pid_alive() {
    local pid state
    pid=$(cat "$1" 2>/dev/null) || return 1   # not $(<"$1"): a file removed meanwhile would end the script
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/stat ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
    state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
    [[ -n $state && $state != Z && $state != X ]]
}
pid_gone() { ! pid_alive "$@"; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds.
wait_for() {
    local limit=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || { log "timed out after ${limit}s waiting for: $what"; return 1; }
        sleep 0.2
    done
}

# stop_daemon PIDFILE NAME: SIGTERM, wait up to 30 s, then SIGKILL. Never by name (pkill) since
# other Slurm or MariaDB instances may share the machine.
stop_daemon() {
    local pidfile=$1 name=$2 pid
    if ! pid_alive "$pidfile" "$name"; then rm -f "$pidfile"; return 0; fi
    pid=$(cat "$pidfile" 2>/dev/null || true)   # gone meanwhile: the daemon ended (or re-executed itself)
    [[ -n $pid ]] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_for 30 "$name (pid $pid) to exit" pid_gone "$pidfile" "$name"; then
        log "$name did not stop on SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_for 5 "$name (pid $pid) to die" pid_gone "$pidfile" "$name" || true
    fi
    rm -f "$pidfile"
    log "stopped $name"
}

# show_log FILE: the end of a daemon's log, when it failed to come up.
show_log() { [[ -f $1 ]] && { log "--- tail of $1"; tail -n 20 "$1" >&2; }; return 0; }

# --- installation ------------------------------------------------------------------------------

# Install the packages that are missing. Their post-install scripts try to start the system
# services; a policy-rc.d that says "no" keeps them from doing so (we start private daemons).
install_packages() {
    local missing=() p added_policy=
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    log "installing ${missing[*]} (apt-get, once)"
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    local rc=0
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${PACKAGES[@]}"; } >"$DIR/apt.log" 2>&1 || rc=$?
    [[ -z $added_policy ]] || rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || { show_log "$DIR/apt.log"; die "apt-get install failed"; }
}

# --- configuration -----------------------------------------------------------------------------

# Files written once and kept (the munge key, the database password); the rest is rewritten on
# every start so that an edit to this script takes effect.
write_configs() {
    mkdir -p "$ETC" "$RUN" "$LOG" "$DIR/state/slurmctld" "$DIR/spool" "$MUNGE_DIR"
    chmod 755 "$DIR" "$RUN" "$LOG"

    # munge: a random key only munged (running as `munge`) can read; its own socket, so a system
    # munged (if any) is left alone.
    chown munge:munge "$MUNGE_DIR" && chmod 700 "$MUNGE_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$MUNGE_DIR/munge.key" && chmod 400 "$MUNGE_DIR/munge.key"
    # The socket's folder must be reachable by every client (sbatch, slurmstepd, jobs).
    mkdir -p "$RUN/munge" && chown munge:munge "$RUN/munge" && chmod 755 "$RUN/munge"

    [[ -s $ETC/db.password ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$ETC/db.password")
    chmod 600 "$ETC/db.password"

    # The node as slurmd sees it, memory a little below the real one (slurmd drains a node whose
    # RealMemory is above what it measures). DefMemPerCPU: without it the first job is given the
    # whole node's memory and every other job waits.
    local topo cpus mem
    topo=$(slurmd -C | head -n 1)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$topo")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$topo")
    mem=$((mem * 95 / 100))
    topo=$(sed -e 's/^NodeName=[^ ]* //' -e 's/ RealMemory=[0-9]*//' <<<"$topo")

    local nodes controller accounting_host node_lines partition_nodes name slurmd_files
    nodes=$(saved_nodes)
    if ((nodes == 1)); then
        controller=localhost accounting_host=localhost partition_nodes=localhost
        node_lines="NodeName=localhost NodeAddr=127.0.0.1 $topo RealMemory=$mem State=UNKNOWN"
        slurmd_files="SlurmdPidFile=$RUN/slurmd.pid"$'\n'"SlurmdSpoolDir=$DIR/spool/slurmd"$'\n'"SlurmdLogFile=$LOG/slurmd.log"
    else  # the controller at the bridge's address, under the machine's name (slurmctld checks it is its host)
        controller="$(hostname -s)($(gateway))" accounting_host=$(gateway) partition_nodes="glm46n[1-$nodes]"
        mem=$((mem / nodes))
        node_lines=$(for name in $(node_names "$nodes"); do
            echo "NodeName=$name NodeAddr=$(node_addr "$name") $topo RealMemory=$mem State=UNKNOWN"
        done)
        slurmd_files="SlurmdPidFile=$RUN/slurmd-%n.pid"$'\n'"SlurmdSpoolDir=$DIR/spool/slurmd-%n"$'\n'"SlurmdLogFile=$LOG/slurmd-%n.log"
    fi

    cat >"$ETC/slurm.conf" <<EOF
# Written by scripts/local_slurm.sh: a $nodes-node cluster for tests. Edits here are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$controller
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job is held cred_expire+1 s before it may start again (121 s by default).
AuthInfo=socket=$RUN/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state/slurmctld
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmctldLogFile=$LOG/slurmctld.log
$slurmd_files
# No cgroups in a sandbox/container: track processes by parent id, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((mem / cpus))
# Schedule every second (tests wait on it) and bring the node back after a restart.
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
KillWait=5
InactiveLimit=0
MinJobAge=300
# Accounting through slurmdbd: sacct must answer, or submitit cannot tell a dead job from a running one.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$accounting_host
AccountingStoragePort=$SLURMDBD_PORT
# Connections to slurmdbd take their munge socket from here, not from AuthInfo.
AccountingStoragePass=$RUN/munge/munge.socket.2
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$node_lines
# LLN: each job goes to the least loaded nodes, so that one-node jobs and array tasks spread over the cluster.
PartitionName=$PARTITION Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP LLN=YES
EOF

    (umask 077 && cat >"$ETC/slurmdbd.conf" <<EOF
# Written by scripts/local_slurm.sh. slurmdbd refuses this file unless it is mode 600.
AuthType=auth/munge
AuthInfo=socket=$RUN/munge/munge.socket.2
DbdHost=localhost
DbdPort=$SLURMDBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(<"$ETC/db.password")
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$ETC/slurmdbd.conf"
}

# Point the default config path at ours, so plain `sinfo`/`sbatch` work without SLURM_CONF; never
# replace a real cluster's config.
link_system_conf() {
    if [[ -L $SYSTEM_CONF && ! -e $SYSTEM_CONF ]]; then rm -f "$SYSTEM_CONF"; fi   # dangling: ours from an old dir
    if [[ ! -e $SYSTEM_CONF ]]; then
        mkdir -p "$(dirname "$SYSTEM_CONF")" && ln -s "$ETC/slurm.conf" "$SYSTEM_CONF"
    elif [[ $(readlink -f "$SYSTEM_CONF") != "$(readlink -f "$ETC/slurm.conf")" ]]; then
        log "note: $SYSTEM_CONF belongs to another cluster; use: export SLURM_CONF=$ETC/slurm.conf"
    fi
}

unlink_system_conf() {
    if [[ -L $SYSTEM_CONF && $(readlink "$SYSTEM_CONF") == "$ETC/slurm.conf" ]]; then rm -f "$SYSTEM_CONF"; fi
}

# --- daemons -----------------------------------------------------------------------------------

start_munged() {
    pid_alive "$RUN/munge/munged.pid" munged && return 0
    runuser -u munge -- munged --socket="$RUN/munge/munge.socket.2" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$RUN/munge/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" </dev/null >/dev/null 2>&1 \
        || { show_log "$MUNGE_DIR/munged.log"; die "munged failed to start"; }
    wait_for 10 munged munge -n -S "$RUN/munge/munge.socket.2" || { show_log "$MUNGE_DIR/munged.log"; die "munged is not answering"; }
}

db_sql() { mariadb --no-defaults --socket="$DB_SOCKET" -uroot -e "$1"; }

# A private MariaDB: own datadir, socket and port on 127.0.0.1; root logs in over the socket only.
start_mariadb() {
    pid_alive "$RUN/mysqld.pid" mariadbd && return 0
    if [[ ! -d $DB_DATA/mysql ]]; then
        log "initialising the database in $DB_DATA"
        mariadb-install-db --no-defaults --datadir="$DB_DATA" --user=root --skip-test-db \
            --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 \
            || { show_log "$LOG/mariadb-install.log"; die "mariadb-install-db failed"; }
    fi
    # mariadbd stays in the foreground: detach it, all fds closed, so a CI step does not wait on it.
    setsid mariadbd --no-defaults --datadir="$DB_DATA" --socket="$DB_SOCKET" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$RUN/mysqld.pid" --user=root \
        --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
        --skip-log-bin </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb mariadb-admin --no-defaults --socket="$DB_SOCKET" -uroot ping \
        || { show_log "$LOG/mariadb.log"; die "mariadb is not answering"; }
    # The password is rewritten every start: it is the one slurmdbd.conf holds.
    db_sql "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
            ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(<"$ETC/db.password")';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    pid_alive "$RUN/slurmdbd.pid" slurmdbd && return 0
    slurmdbd </dev/null >/dev/null 2>&1 || { show_log "$LOG/slurmdbd.log"; die "slurmdbd failed to start"; }
    # The first start creates the tables (a few seconds).
    wait_for 60 slurmdbd sacctmgr -n list cluster || { show_log "$LOG/slurmdbd.log"; die "slurmdbd is not answering"; }
}

# The cluster must exist in the database before slurmctld registers; the account and root's
# association make `sacctmgr show assoc` meaningful (limits are not enforced).
register_cluster() {
    if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=Cluster) ]]; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if [[ -z $(sacctmgr -n -P list account "$ACCOUNT" format=Account) ]]; then
        sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=tests Organization=glm46 >/dev/null
        sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null
    fi
}

start_slurmctld() {
    pid_alive "$RUN/slurmctld.pid" slurmctld && return 0
    slurmctld </dev/null >/dev/null 2>&1 || { show_log "$LOG/slurmctld.log"; die "slurmctld failed to start"; }
    wait_for 30 slurmctld scontrol ping || { show_log "$LOG/slurmctld.log"; die "slurmctld is not answering"; }
}

slurmd_pidfile() { [[ $(saved_nodes) == 1 ]] && echo "$RUN/slurmd.pid" || echo "$RUN/slurmd-$1.pid"; }
slurmd_log() { [[ $(saved_nodes) == 1 ]] && echo "$LOG/slurmd.log" || echo "$LOG/slurmd-$1.log"; }
cluster_nodes() { [[ $(saved_nodes) == 1 ]] && echo localhost || node_names "$(saved_nodes)"; }

# A node's slurmd: on the machine (one node), or in the node's network namespace with a UTS namespace (its hostname)
# and a mount namespace in which $ETC/hosts is /etc/hosts (the rest of the file system is the machine's). Not
# `ip netns exec`, which remounts /sys without the cgroup file system that slurmd needs.
start_slurmd() {
    local name=$1
    pid_alive "$(slurmd_pidfile "$name")" slurmd && return 0
    mkdir -p "$DIR/spool/slurmd$([[ $name == localhost ]] || echo "-$name")"
    if [[ $name == localhost ]]; then
        slurmd -N localhost </dev/null >/dev/null 2>&1
    else
        nsenter --net="/run/netns/$(netns_of "$name")" unshare --uts --mount --propagation slave -- \
            sh -c 'mount --bind "$2" /etc/hosts && hostname "$1" && exec slurmd -N "$1"' sh "$name" "$ETC/hosts" \
            </dev/null >/dev/null 2>&1
    fi || { show_log "$(slurmd_log "$name")"; die "slurmd of $name failed to start"; }
}

node_usable() {
    local states
    states=$(sinfo -h -N -o %T 2>/dev/null) || return 1
    [[ $(grep -cE '^(idle|mixed|allocated|completing)' <<<"$states") == "$(cluster_nodes | wc -l)" ]]
}
no_running_jobs() { [[ -z $(squeue -h -t R,CG -o %A 2>/dev/null) ]]; }
sacct_answers() { sacct -n -X -o JobID -S now >/dev/null 2>&1; }

all_daemons_alive() {
    local name
    pid_alive "$RUN/munge/munged.pid" munged && pid_alive "$RUN/mysqld.pid" mariadbd &&
        pid_alive "$RUN/slurmdbd.pid" slurmdbd && pid_alive "$RUN/slurmctld.pid" slurmctld || return 1
    for name in $(cluster_nodes); do pid_alive "$(slurmd_pidfile "$name")" slurmd || return 1; done
}

# --- commands ----------------------------------------------------------------------------------

cmd_start() {
    local nodes=${1:-} name
    [[ $(id -u) == 0 ]] || die "run as root (apt-get, ip netns, and slurmd must run jobs as their user)"
    [[ -z $nodes || $nodes =~ ^[1-4]$ ]] || die "--nodes $nodes: from 1 to 4"
    if [[ -n $nodes && $nodes != "$(saved_nodes)" ]] && pid_alive "$RUN/slurmctld.pid" slurmctld; then
        die "the cluster in $DIR runs $(saved_nodes) node(s); stop it first to start it with $nodes"
    fi
    if all_daemons_alive && node_usable && sacct_answers; then
        log "already up ($DIR, $(saved_nodes) node(s))"
        return 0
    fi
    mkdir -p "$ETC"
    [[ -z $nodes ]] || echo "$nodes" >"$NODES_FILE"
    install_packages
    (($(saved_nodes) == 1)) || make_network "$(saved_nodes)"
    write_configs
    link_system_conf
    start_munged
    start_mariadb
    start_slurmdbd
    register_cluster
    start_slurmctld
    for name in $(cluster_nodes); do start_slurmd "$name"; done
    # A node left DOWN by an unclean stop or a kill is returned by ReturnToService=2 once its slurmd registers.
    wait_for 60 "every node to be idle" node_usable || {
        for name in $(cluster_nodes); do show_log "$(slurmd_log "$name")"; done
        show_log "$LOG/slurmctld.log"; die "nodes not idle: $(sinfo -h -N -o '%N %T %E' 2>&1)"
    }
    wait_for 30 sacct sacct_answers || die "sacct is not answering"
    log "up: partition $PARTITION on $(cluster_nodes | paste -sd, -) ($DIR); SLURM_CONF=$SLURM_CONF"
}

cmd_stop() {
    # Cancel the jobs first: their processes (under slurmstepd) would outlive slurmd.
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then
        local jobs
        jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs 2>/dev/null || true
            wait_for 15 "jobs to end" no_running_jobs || true
        fi
    fi
    local name
    for name in $(cluster_nodes); do stop_daemon "$(slurmd_pidfile "$name")" slurmd; done
    stop_daemon "$RUN/slurmctld.pid" slurmctld
    stop_daemon "$RUN/slurmdbd.pid" slurmdbd
    stop_daemon "$RUN/mysqld.pid" mariadbd
    stop_daemon "$RUN/munge/munged.pid" munged
    unlink_system_conf
    remove_network   # after the slurmds: a namespace goes when its last process does
    log "stopped ($DIR kept; remove it for a fresh cluster)"
}

# A daemon's name in `status`: its PID file's (slurmd-<node> for a node's slurmd).
label() { local file=${1%%:*}; file=${file##*/}; echo "${file%.pid}"; }

cmd_status() {
    local up=0 entry pidfile name
    for entry in munge/munged.pid:munged mysqld.pid:mariadbd slurmdbd.pid:slurmdbd slurmctld.pid:slurmctld \
        $(for name in $(cluster_nodes); do echo "$(basename "$(slurmd_pidfile "$name")"):slurmd"; done); do
        pidfile=$RUN/${entry%%:*} name=${entry##*:}
        if pid_alive "$pidfile" "$name"; then
            printf '%-16s running (pid %s)\n' "$(label "$entry")" "$(<"$pidfile")"
        else
            printf '%-16s stopped\n' "$(label "$entry")"
            up=3
        fi
    done
    if ((up == 0)); then
        sinfo -N -o '%N %P %T %c %m' || up=3
        node_usable || { echo "a node cannot run jobs"; up=3; }
        sacct_answers || { echo "sacct: not answering"; up=3; }
    fi
    echo "state folder: $DIR   SLURM_CONF=$SLURM_CONF"
    return $up
}

case ${1:-} in
    start)
        if [[ ${2:-} == --nodes ]]; then cmd_start "${3:-}"; elif [[ -z ${2:-} ]]; then cmd_start; else
            die "usage: $0 start [--nodes N]"; fi ;;
    stop) cmd_stop ;;
    status) cmd_status || exit $? ;;  # 3: not running, which is an answer, not an error
    kill-node) [[ -n ${2:-} ]] || die "usage: $0 kill-node NAME"; kill_node "$2" ;;
    *) echo "usage: $0 {start [--nodes N]|stop|status|kill-node NAME}   (state folder: \$GLM46_SLURM_DIR," \
        "default /tmp/glm46-slurm)" >&2; exit 2 ;;
esac
