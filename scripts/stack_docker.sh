# The local stack's Docker mode (`make up DOCKER=1`): the containers' network, the API gate in
# front of the server, the firewall chain on the gateway, the secret volume, the flow runs'
# containers; `make down` removes all of them. Sourced by scripts/stack.sh, whose settings
# (STACK, NETWORK, GATEWAY, ...) and helpers (launch, stop, wait_for, ...) it uses; not run on
# its own.
# shellcheck shell=bash

docker_mode() { [[ -f "$STACK/docker" ]]; }  # the running stack was started with DOCKER=1

docker_pool() {  # docker_pool POOL: a Docker pool of the running stack
    docker_mode && [[ " ${DOCKER_POOLS[*]} " == *" $1 "* ]]
}

network_gateway() {  # the host's address on the containers' network (made when missing)
    docker network inspect "$NETWORK" >/dev/null 2>&1 \
        || docker network create --internal "$NETWORK" >/dev/null \
        || die "could not create the Docker network $NETWORK"
    docker network inspect -f '{{(index .IPAM.Config 0).Gateway}}' "$NETWORK"
}

check_docker() {
    command -v docker >/dev/null && docker info >/dev/null 2>&1 \
        || die "DOCKER=1 needs a running Docker daemon; make image starts one (as root)"
    command -v iptables >/dev/null && iptables -L INPUT -n >/dev/null 2>&1 \
        || die "DOCKER=1 needs iptables as root, to keep the containers off the host's other ports; run make up DOCKER=1 as root"
    docker image inspect "$IMAGE" >/dev/null 2>&1 \
        || die "no image $IMAGE; build it: make image"
}

write_secrets() {  # the run's credentials into the volume the pools mount (0600, the image's user)
    {
        cat "$STACK/s3.env"
        if [[ -f "$STACK/secrets.env" ]]; then cat "$STACK/secrets.env"; fi
    } | docker run --rm -i --network none --user root -v "$SECRETS_VOLUME:/secrets" \
        --entrypoint sh "$IMAGE" -c 'umask 077 && cat > /secrets/env && chown -R streamrl: /secrets' \
        || die "could not write the volume $SECRETS_VOLUME"
}

new_gate_key() {  # the key of the containers' credentials (deploy/docker/api_gate.py), 0600
    "$PY" -c 'import secrets, sys; sys.stdout.buffer.write(secrets.token_bytes(32))' >"$STACK/flow-run.key"
    chmod 600 "$STACK/flow-run.key"
}

gate_url() { printf 'http://%s:%s/api' "$GATEWAY" "$(<"$STACK/gate-port")"; }

start_gate() {  # the API gate on the gateway, in front of the server (new port: workers restart)
    local log="$STACK/gate.log" port=""
    [[ -f "$STACK/gate-port" ]] && port="$(<"$STACK/gate-port")"
    [[ -n "$port" ]] && "$PY" - "$port" "$GATEWAY" <<'PY' || port=""
import socket, sys
with socket.socket() as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((sys.argv[2], int(sys.argv[1])))
PY
    if [[ -z "$port" ]]; then
        port="$(free_port_on "$GATEWAY")"
        printf '%s' "$port" >"$STACK/gate-port"
        stop_workers  # they hand the gate's address to their containers
    fi
    [[ -f "$STACK/flow-run.key" ]] || new_gate_key
    say "starting the API gate on $GATEWAY:$port (log: $(show "$log"))"
    (cd "$ROOT" && launch gate "$log" "$PY" -m deploy.docker.api_gate --listen "$GATEWAY:$port" \
        --upstream "http://$HOST:$(<"$STACK/port")" --auth-file "$STACK/auth" \
        --key-file "$STACK/flow-run.key")
    wait_for gate "$GATE_SIG" "$log" healthy "$(gate_url)"
}

guard_gateway() {  # containers reach the host only at the gate and S3 (the chain is made anew)
    local bridge s3_port
    bridge="br-$(docker network inspect -f '{{.Id}}' "$NETWORK" | cut -c1-12)"
    s3_port="$(grep -o 'AWS_ENDPOINT_URL=.*' "$STACK/s3.env" | grep -o '[0-9]*$')"
    iptables -N "$FIREWALL" 2>/dev/null || iptables -F "$FIREWALL"
    iptables -A "$FIREWALL" -p tcp -d "$GATEWAY" --dport "$(<"$STACK/gate-port")" -j ACCEPT
    iptables -A "$FIREWALL" -p tcp -d "$GATEWAY" --dport "$s3_port" -j ACCEPT
    iptables -A "$FIREWALL" -j REJECT
    iptables -C INPUT -i "$bridge" -j "$FIREWALL" 2>/dev/null \
        || iptables -I INPUT -i "$bridge" -j "$FIREWALL"
}

unguard_gateway() {
    command -v iptables >/dev/null || return 0
    local rule
    while rule="$(iptables -S INPUT 2>/dev/null | grep -m1 -- "-j $FIREWALL\$")"; do
        iptables ${rule/-A/-D} || break
    done
    iptables -F "$FIREWALL" 2>/dev/null && iptables -X "$FIREWALL" 2>/dev/null || true
}

remove_containers() {  # the flow runs' containers (labelled by deploy/docker/pool.json)
    command -v docker >/dev/null && docker info >/dev/null 2>&1 || return 0
    local ids
    ids="$(docker ps -aq --filter label=org.streamrl.stack=local)"
    if [[ -n "$ids" ]]; then
        docker rm -f $ids >/dev/null
        say "removed $(wc -w <<<"$ids") container(s) of flow runs"
    fi
    docker volume rm "$SECRETS_VOLUME" >/dev/null 2>&1 || true
}

remove_network() {  # the containers' network, once its containers and the gate on it are gone
    command -v docker >/dev/null && docker info >/dev/null 2>&1 || return 0
    docker network inspect "$NETWORK" >/dev/null 2>&1 || return 0
    if docker network rm "$NETWORK" >/dev/null; then
        say "removed the Docker network $NETWORK"
    else
        say "could not remove the Docker network $NETWORK (containers still on it: docker network inspect $NETWORK)" >&2
    fi
}
