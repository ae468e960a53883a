#!/bin/sh
# Run a Hydra build on the cluster, stage by stage: apply the workspace volume and the config, then each
# stage's Job, waiting for it to complete before the next (the members Job runs its pods in parallel).
#
#   deploy/build/run.sh [KUSTOMIZATION]      (default: this folder; an overlay of it works the same)
#
# Settings from the environment: KUBECTL (default kubectl), POLL seconds between checks (default 30).
# A failed stage stops the run with the command that shows why; fix, delete that Job and run again: the
# stages before it are complete (their Jobs stay until their TTL) and resume from the shared volume.
set -eu
KUBECTL=${KUBECTL:-kubectl}
POLL=${POLL:-30}
DIR=${1:-$(dirname "$0")}

wait_job() {
    while :; do
        state=$("$KUBECTL" get "job/$1" -o 'jsonpath={.status.conditions[?(@.status=="True")].type}')
        case "$state" in
            *Failed*) echo "stage $2 failed: $KUBECTL logs job/$1 (or describe job/$1)" >&2; return 1 ;;
            *Complete*) echo "stage $2 complete"; return 0 ;;
        esac
        sleep "$POLL"
    done
}

"$KUBECTL" apply -k "$DIR" -l hydra-serve.build/stage=setup
for stage in base score members finish; do
    echo "stage $stage: starting"
    "$KUBECTL" apply -k "$DIR" -l "hydra-serve.build/stage=$stage"
    wait_job "hydra-build-$stage" "$stage"
done
echo "artifact: /workspace/artifact on the hydra-build volume"
