#!/bin/sh
# The image's entrypoint: the run's credentials from a mounted secret, then the command.
#
# The Docker work pools (deploy/docker/pool.json) mount the volume `streamrl-secrets` read-only
# at /run/secrets/streamrl; its file `env` holds `NAME=value` lines (AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, WANDB_API_KEY, ...), which become the environment
# of the flow run. Credentials so stay out of job variables, which Prefect stores with every
# flow run and shows in its UI (on Kubernetes the pools' secretRef does the same).
set -eu
secrets="${STREAMRL_SECRETS_FILE:-/run/secrets/streamrl/env}"
if [ -f "$secrets" ]; then
    set -a
    . "$secrets"
    set +a
fi
exec "$@"
