#!/bin/bash
# Entrypoint wrapper of the Ascend runtime image: load the CANN environment (libraries, operator
# packages, Python paths), then run the command. KubeRay's `/bin/bash -lc` gets the same environment
# from /etc/profile.d/ascend.sh, and Ray's job drivers and workers inherit it from `ray start`.
set -e
# shellcheck disable=SC1091
source /etc/profile.d/ascend.sh
exec "$@"
