#!/usr/bin/env bash
# The local streamrl stack, everything on 127.0.0.1:
#   Prefect server (SQLite under the stack dir, analytics off, HTTP basic auth with a credential
#   generated at each start into <stack>/auth and the Prefect profile), the process work pools `local`
#   (runs' supervisors), `learner` and `generators` (the processes of runs placed on pools), the
#   deployments of deploy/prefect.yaml, one process worker per pool, and SeaweedFS (S3) with S3=1.
# With DOCKER=1, `learner` and `generators` are Docker work pools instead (deploy/docker/pool.json,
#   run by deploy/docker/worker.py: each flow run a container of the streamrl image, `make image`),
#   on the internal Docker network `streamrl`. On the host's address there (the gateway) listen
#   only SeaweedFS's S3 endpoint (always on) and the API gate (deploy/docker/api_gate.py: each
#   container may act on its own flow run only, with a credential of its own); a firewall chain
#   (iptables, root) refuses the containers every other port of the host. The run's S3 keys
#   reach the containers through the volume `streamrl-secrets` (with <stack>/secrets.env,
#   `NAME=value` lines, when it exists).
#
#   scripts/stack.sh up       start what is not running yet (a no-op when all of it is up)
#   scripts/stack.sh down     stop all of it (safe to repeat)
#   scripts/stack.sh status   what runs where; exits 1 unless the server and workers are up
#
# Environment:
#   STREAMRL_STACK_DIR       state, logs and PID files (default: ./.stack)
#   STREAMRL_PREFECT_PORT    server port (default: the last one used, else 4200, else a free port)
#   STREAMRL_PREFECT_PROFILE Prefect profile pointed at the server and made active while the
#                            stack is up (default: streamrl; empty: leave profiles alone)
#   STREAMRL_STACK_TIMEOUT   seconds to wait for each component to come up (default: 180)
#   S3=1                     also start SeaweedFS; its endpoint and keys go to <stack>/s3.env
#   DOCKER=1                 Docker pools for the learner and generators (above; implies S3=1)
#   STREAMRL_IMAGE           their image (default: streamrl:cpu)
#   VENV                     the virtualenv with streamrl installed (default: ./.venv)
#
# The stack dir is private (0700) and what the stack writes there is too (0600): the API
# credential (auth), the gate's key (flow-run.key), the S3 keys (s3.env), the database, logs.
# The profile's file (profiles.toml, which then holds the credential) is made 0600. The UI asks
# for a password: give it the whole `admin:<token>` line of <stack>/auth.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
[[ "$VENV" = /* ]] || VENV="$ROOT/$VENV"
PREFECT="$VENV/bin/prefect"
PY="$VENV/bin/python"
STACK="${STREAMRL_STACK_DIR:-.stack}"
[[ "$STACK" = /* ]] || STACK="$ROOT/$STACK"
PROFILE="${STREAMRL_PREFECT_PROFILE-streamrl}"
TIMEOUT="${STREAMRL_STACK_TIMEOUT:-180}"
HOST=127.0.0.1  # the Prefect server's address, and SeaweedFS's without Docker
GATEWAY=""      # Docker mode: the host's address on the containers' network (S3, the API gate)
[[ -f "$STACK/gateway" ]] && GATEWAY="$(<"$STACK/gateway")"
POOLS=(local learner generators)
DOCKER_POOLS=(learner generators)  # Docker pools with DOCKER=1; `local` runs the supervisors
IMAGE="${STREAMRL_IMAGE:-streamrl:cpu}"
FIREWALL=STREAMRL-GATEWAY          # the iptables chain of what containers may reach on the host
NETWORK=streamrl                   # the names deploy/docker/pool.json uses
SECRETS_VOLUME=streamrl-secrets
USER_UMASK="$(umask)"  # what flow runs get: the runs they write are the user's to share
umask 077              # everything the stack writes itself is private

# A phrase of each component's command line: proof that a PID file names a process of ours.
SERVER_SIG="server start"
S3_SIG="weed"
GATE_SIG="deploy.docker.api_gate"

say() { printf '%s\n' "$*"; }
die() { printf 'stack: %s\n' "$*" >&2; exit 1; }
show() { [[ "$1" == "$ROOT"/* ]] && printf '%s' "${1#"$ROOT"/}" || printf '%s' "$1"; }

alive() {  # alive PID: running and not a zombie
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ -n "$state" && "$state" != Z* ]]
}

running() {  # running NAME SIGNATURE: print the component's PID if it is up
    local file="$STACK/$1.pid" pid
    [[ -f "$file" ]] || return 1
    pid="$(<"$file")"
    [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid" || return 1
    ps -o args= -p "$pid" 2>/dev/null | grep -q -- "$2" || return 1
    printf '%s' "$pid"
}

descendants() {  # descendants PID: every process below PID
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        printf '%s\n' "$child"
        descendants "$child"
    done
}

stop() {  # stop NAME SIGNATURE GRACE_S [WAIT_FOR_SELF]: SIGTERM to it and everything below
    # it; after GRACE_S (at once when 0) SIGKILL to what is left. WAIT_FOR_SELF=0 waits only for
    # what runs below (flow runs): an idle Prefect 3.6 worker does not exit on SIGTERM.
    local name="$1" pid below waited_for p left waited=0
    if pid="$(running "$1" "$2")"; then
        below="$(descendants "$pid" | tr '\n' ' ')"
        waited_for="$below"
        [[ "${4:-1}" == 0 ]] || waited_for="$pid $below"
        if (($3 > 0)); then
            kill -TERM "$pid" $below 2>/dev/null || true
            while ((waited < $3 * 10)); do
                left=0
                for p in $waited_for; do alive "$p" && left=1; done
                ((left)) || break
                sleep 0.1
                waited=$((waited + 1))
            done
        fi
        for p in "$pid" $below; do  # what started during the grace period goes too
            alive "$p" && below="$below $(descendants "$p" | tr '\n' ' ')"
        done
        kill -KILL -- "-$pid" 2>/dev/null || true
        kill -KILL "$pid" $below 2>/dev/null || true
        for p in "$pid" $below; do
            while alive "$p"; do sleep 0.1; done
        done
        say "stopped $name (pid $pid)"
    fi
    rm -f "$STACK/$name.pid"
}

launch() {  # launch NAME LOG COMMAND...: detached in its own session, PID file written
    local name="$1" log="$2"
    shift 2
    setsid "$@" >"$log" 2>&1 </dev/null &
    printf '%s' "$!" >"$STACK/$name.pid"
}

port_free() {
    "$PY" - "$1" "$HOST" <<'PY'
import socket, sys
with socket.socket() as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is fine
    try:
        sock.bind((sys.argv[2], int(sys.argv[1])))
    except OSError:
        sys.exit(1)
PY
}

pick_port() {
    if [[ -n "${STREAMRL_PREFECT_PORT:-}" ]]; then
        port_free "$STREAMRL_PREFECT_PORT" || die "port $STREAMRL_PREFECT_PORT is in use; set STREAMRL_PREFECT_PORT to a free port"
        printf '%s' "$STREAMRL_PREFECT_PORT"
        return
    fi
    local last=""
    [[ -f "$STACK/port" ]] && last="$(<"$STACK/port")"
    for candidate in $last 4200; do
        if port_free "$candidate"; then
            printf '%s' "$candidate"
            return
        fi
    done
    free_port_on "$HOST"
}

free_port_on() {  # free_port_on ADDRESS: a port the kernel hands out there
    "$PY" -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$1"
}

healthy() {
    "$PY" - "$1/health" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError:
    sys.exit(1)
PY
}

wait_for() {  # wait_for NAME SIGNATURE LOG CHECK...: until CHECK passes or NAME dies
    local deadline=$((SECONDS + TIMEOUT))
    until "${@:4}"; do
        running "$1" "$2" >/dev/null || { tail -n 30 "$3" >&2; die "$1 exited; log: $(show "$3")"; }
        ((SECONDS < deadline)) || { tail -n 30 "$3" >&2; die "$1 not up after ${TIMEOUT}s; log: $(show "$3")"; }
        sleep 1
    done
}

active_profile() {
    "$PY" -c 'from prefect.settings import load_profiles; print(load_profiles().active_name or "")'
}

api_url() { printf 'http://%s:%s/api' "$HOST" "$(<"$STACK/port")"; }

# -- Docker mode (DOCKER=1) --------------------------------------------------------------------

# shellcheck source=scripts/stack_docker.sh
source "$ROOT/scripts/stack_docker.sh"

pool_type() {  # pool_type POOL: its worker type, empty when there is no such pool
    "$PY" - "$1" <<'PY'
import sys
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
with get_client(sync_client=True) as client:
    try:
        print(client.read_work_pool(sys.argv[1]).type)
    except ObjectNotFound:
        pass
PY
}

new_credential() {  # a fresh `admin:<random token>` into <stack>/auth (0600)
    "$PY" -c 'import secrets; print("admin:" + secrets.token_urlsafe(32), end="")' >"$STACK/auth"
    chmod 600 "$STACK/auth"
}

use_credential() {  # the clients this script starts (deploy, workers) authenticate with it
    if [[ -f "$STACK/auth" ]]; then
        PREFECT_API_AUTH_STRING="$(<"$STACK/auth")"
        export PREFECT_API_AUTH_STRING
    fi
}

start_server() {
    local port log="$STACK/server.log"
    port="$(pick_port)"
    printf '%s' "$port" >"$STACK/port"
    new_credential
    say "starting the Prefect server on $HOST:$port (SQLite: $(show "$STACK/prefect.db"); basic auth: $(show "$STACK/auth"))"
    # The UI's own API address: without it the UI calls port 4200 whatever port the server has.
    PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT=false \
        PREFECT_SERVER_UI_API_URL="$(api_url)" \
        PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STACK/prefect.db" \
        PREFECT_SERVER_API_AUTH_STRING="$(<"$STACK/auth")" \
        launch server "$log" env -u PREFECT_API_URL -u PREFECT_API_AUTH_STRING \
        "$PREFECT" server start --host "$HOST" --port "$port"
    wait_for server "$SERVER_SIG" "$log" healthy "$(api_url)"
    say "Prefect server healthy: http://$HOST:$port"
}

use_profile() {
    [[ -n "$PROFILE" ]] || return 0
    local previous
    previous="$(active_profile)"
    [[ "$previous" == "$PROFILE" ]] || printf '%s' "$previous" >"$STACK/previous-profile"
    "$PY" -c 'import sys; from prefect.settings import load_profiles; sys.exit(sys.argv[1] not in load_profiles().names)' "$PROFILE" \
        || "$PREFECT" profile create "$PROFILE" >/dev/null
    # The credential goes from its file into the profile, never through a command line.
    "$PY" - "$PROFILE" "$(api_url)" "$STACK/auth" <<'PY'
import os, sys
from pathlib import Path

from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_URL,
    get_current_settings,
    load_profiles,
    save_profiles,
)

name, url, auth = sys.argv[1], sys.argv[2], Path(sys.argv[3]).read_text()
profiles = load_profiles()
profiles.update_profile(name, {PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: auth})
save_profiles(profiles)
os.chmod(get_current_settings().profiles_path, 0o600)
PY
    "$PREFECT" profile use "$PROFILE" >/dev/null
    say "Prefect profile '$PROFILE' is active: PREFECT_API_URL=$(api_url), with the stack's credential"
}

restore_profile() {
    [[ -n "$PROFILE" && -f "$STACK/previous-profile" && -x "$PY" ]] || return 0
    local previous
    previous="$(<"$STACK/previous-profile")"
    rm -f "$STACK/previous-profile"
    [[ -n "$previous" && "$(active_profile)" == "$PROFILE" ]] || return 0
    "$PREFECT" profile use "$previous" >/dev/null 2>&1 || true
    say "Prefect profile '$previous' is active again"
}

worker_sig() {  # a pool's worker's command line
    if docker_pool "$1"; then
        printf 'deploy.docker.worker --pool %s ' "$1"
    else
        printf 'worker start --pool %s ' "$1"
    fi
}

deploy() {
    (
        cd "$ROOT"
        local pool want have
        for pool in "${POOLS[@]}"; do
            want=process
            docker_pool "$pool" && want=docker
            have="$(pool_type "$pool")"
            if [[ -n "$have" && "$have" != "$want" ]]; then  # the stack's mode changed
                "$PREFECT" work-pool delete "$pool" >/dev/null
                have=""
            fi
            if [[ "$want" == docker ]]; then
                [[ -n "$have" ]] || "$PREFECT" work-pool create "$pool" --type docker >/dev/null
                "$PREFECT" work-pool update "$pool" \
                    --base-job-template deploy/docker/pool.json >/dev/null
            elif [[ -z "$have" ]]; then
                "$PREFECT" work-pool create "$pool" --type process >/dev/null
            fi
        done
        # STREAMRL_ROOT stays a placeholder in the deployments: the worker fills it in.
        env -u STREAMRL_ROOT "$PREFECT" deploy --all --no-prompt \
            --prefect-file deploy/prefect.yaml >"$STACK/deploy.log" 2>&1
    ) || { tail -n 30 "$STACK/deploy.log" >&2; die "prefect deploy failed; log: $(show "$STACK/deploy.log")"; }
    say "work pools ${POOLS[*]} ready; deployed: $(grep -o "Deployment '[^']*'" "$STACK/deploy.log" | cut -d"'" -f2 | tr '\n' ' ')"
}

start_seaweedfs() {
    say "starting SeaweedFS (S3) in $(show "$STACK/seaweedfs")"
    (cd "$ROOT" && "$PY" - "$STACK" "${GATEWAY:-$HOST}" <<'PY'
import os, shlex, sys
from pathlib import Path

from storage.seaweedfs import SeaweedFS

stack, host = Path(sys.argv[1]), sys.argv[2]
server = SeaweedFS(data_dir=stack / "seaweedfs", host=host).start()
# The server outlives this process (its own session); `scripts/stack.sh down` kills it.
(stack / "seaweedfs.pid").write_text(str(server._process.pid))
lines = [f"export {key}={shlex.quote(value)}" for key, value in server.env.items()]
path = stack / "s3.env"
path.write_text("\n".join(lines) + "\n")
os.chmod(path, 0o600)
PY
    ) || die "SeaweedFS did not start; log: $(show "$STACK/seaweedfs/weed.log")"
}

start_worker() {  # start_worker POOL
    local pool="$1" log="$STACK/worker-$1.log"
    say "starting a worker for pool '$pool' (log: $(show "$log"))"
    (
        [[ -f "$STACK/s3.env" ]] && running seaweedfs "$S3_SIG" >/dev/null && source "$STACK/s3.env"
        cd "$ROOT"
        : >"$log"  # private, as the rest of the stack dir; the flow runs it starts are not
        umask "$USER_UMASK"
        if docker_pool "$pool"; then  # its containers get the gate and a credential of their own
            STREAMRL_GATE_URL="$(gate_url)" STREAMRL_GATE_KEY_FILE="$STACK/flow-run.key" \
                PATH="$VENV/bin:$PATH" launch "worker-$pool" "$log" \
                "$PY" -m deploy.docker.worker --pool "$pool" --name "streamrl-$pool"
        else
            STREAMRL_ROOT="$ROOT" PATH="$VENV/bin:$PATH" launch "worker-$pool" "$log" \
                "$PREFECT" worker start --pool "$pool" --name "streamrl-$pool" --install-policy never
        fi
    )
    wait_for "worker-$pool" "$(worker_sig "$pool")" "$log" grep -q "started" "$log"
}

workers_up() {
    local pool
    for pool in "${POOLS[@]}"; do
        running "worker-$pool" "$(worker_sig "$pool")" >/dev/null || return 1
    done
}

stop_workers() {
    local pool
    for pool in "${POOLS[@]}"; do
        stop "worker-$pool" "$(worker_sig "$pool")" 30 0
    done
}

up() {
    mkdir -p "$STACK"
    chmod 700 "$STACK"
    printf '*\n' >"$STACK/.gitignore"
    local want_s3=0 fresh_s3=0 want_docker=0 mode=process
    [[ "${S3:-0}" == 1 ]] && want_s3=1
    [[ "${DOCKER:-0}" == 1 ]] && want_docker=1 want_s3=1
    if running server "$SERVER_SIG" >/dev/null || running seaweedfs "$S3_SIG" >/dev/null; then
        local up_docker=0
        docker_mode && up_docker=1 mode=Docker
        if ((want_docker != up_docker)); then
            die "the stack is up with $mode pools; stop it first (make down), then start it again"
        fi
    elif ((want_docker)); then
        check_docker
        [[ -z "$(docker ps -q --filter label=org.streamrl.stack=local)" ]] \
            || die "flow-run containers of another Docker stack are running (docker ps --filter label=org.streamrl.stack=local): one Docker stack per machine; stop that one first"
        GATEWAY="$(network_gateway)"
        printf '%s' "$GATEWAY" >"$STACK/gateway"
        : >"$STACK/docker"
    else
        GATEWAY=""
        rm -f "$STACK/docker" "$STACK/gateway"
    fi
    printf '%s' "$HOST" >"$STACK/host"  # the server's address, for clients of the stack
    ((want_docker)) && check_docker
    if running server "$SERVER_SIG" >/dev/null && workers_up \
        && { ((want_s3 == 0)) || running seaweedfs "$S3_SIG" >/dev/null; } \
        && { ! docker_mode || running gate "$GATE_SIG" >/dev/null; }; then
        say "the stack is already up"
        status
        return 0
    fi
    trap '(($? == 0)) || say "stack: up did not finish; logs in $(show "$STACK"), stop what runs with: make down" >&2' EXIT
    export PREFECT_API_URL
    local fresh_server=0
    if running server "$SERVER_SIG" >/dev/null; then
        PREFECT_API_URL="$(api_url)"
    else
        start_server
        PREFECT_API_URL="$(api_url)"
        use_profile
        fresh_server=1
    fi
    use_credential
    deploy
    if ((want_s3)) && ! running seaweedfs "$S3_SIG" >/dev/null; then
        start_seaweedfs
        fresh_s3=1
    fi
    # A worker started before SeaweedFS lacks its credentials: restart it.
    ((fresh_s3)) && stop_workers
    if docker_mode; then
        if ((fresh_server)); then  # a new server credential: a new gate, a new key for both
            stop gate "$GATE_SIG" 5
            stop_workers
            new_gate_key
        fi
        running gate "$GATE_SIG" >/dev/null || start_gate
        guard_gateway
        write_secrets
    fi
    local pool
    for pool in "${POOLS[@]}"; do
        running "worker-$pool" "$(worker_sig "$pool")" >/dev/null || start_worker "$pool"
    done
    status
}

down() {
    stop_workers
    if docker_mode; then
        remove_containers
        unguard_gateway
    fi
    stop gate "$GATE_SIG" 5
    stop server "$SERVER_SIG" 30
    stop seaweedfs "$S3_SIG" 0
    if docker_mode; then remove_network; fi  # nothing listens on its gateway any more
    rm -f "$STACK/s3.env" "$STACK/docker" "$STACK/host" "$STACK/gateway"
    restore_profile
    say "the stack is down"
}

status() {
    local pid missing=0
    say "streamrl stack ($(show "$STACK")):"
    if docker_mode; then
        say "  Docker pools    ${DOCKER_POOLS[*]}: image $IMAGE, network $NETWORK (the host is $GATEWAY there: S3 and the API gate only)"
        if pid="$(running gate "$GATE_SIG")"; then
            say "  API gate        up    pid $pid  $(gate_url) (the containers' API)  log $(show "$STACK/gate.log")"
        else
            say "  API gate        down"
            missing=1
        fi
    fi
    if pid="$(running server "$SERVER_SIG")"; then
        say "  prefect server  up    pid $pid  UI http://$HOST:$(<"$STACK/port")  API $(api_url)"
        [[ -f "$STACK/auth" ]] && say "    basic auth:   the UI's password is the line in $(show "$STACK/auth")"
    else
        say "  prefect server  down"
        missing=1
    fi
    local pool
    for pool in "${POOLS[@]}"; do
        if pid="$(running "worker-$pool" "$(worker_sig "$pool")")"; then
            say "  worker          up    pid $pid  pool '$pool'  log $(show "$STACK/worker-$pool.log")"
        else
            say "  worker          down  pool '$pool'"
            missing=1
        fi
    done
    if pid="$(running seaweedfs "$S3_SIG")"; then
        say "  seaweedfs (S3)  up    pid $pid  $(grep -o 'AWS_ENDPOINT_URL=.*' "$STACK/s3.env")"
        say "    credentials:  source $(show "$STACK/s3.env")   (bucket: streamrl)"
    else
        say "  seaweedfs (S3)  down  (start it with: make up S3=1)"
    fi
    return "$missing"
}

[[ -x "$PREFECT" || "${1:-}" == down ]] || die "no Prefect in $(show "$VENV"); run: make setup"
case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) die "usage: scripts/stack.sh up|down|status" ;;
esac
