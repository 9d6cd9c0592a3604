#!/usr/bin/env bash
# Submit a ringleader job to a running Ray cluster (one started with `ray up deploy/cluster.yaml`,
# or KubeRay): the driver runs on the head node, the workers wherever Ray places them.
#
#   RAY_ADDRESS=http://HEAD:8265 deploy/submit.sh examples/digits.yaml \
#       --set checkpoint.every_steps=50 --set checkpoint.path=s3://BUCKET/ringleader/digits
#
# Everything after the script name is passed to `ringleader run`. Inside the job, RAY_ADDRESS is
# set by Ray, so `ringleader run` joins the cluster instead of starting a local Ray.
#
# Ray runs the entrypoint through a shell on the head node. Each word after `--` is passed as
# its own argument, and `ray job submit` (2.60) joins them with shlex.join, so a value such as
# `--set checkpoint.path='s3://b/$(id)'` arrives as text (tests/multiprocess/test_deploy.py checks this
# against Ray's own CLI). Do not pre-join the words into one string: Ray would quote it again.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:=http://127.0.0.1:8265}"
# The entrypoint is public to anyone who can list the cluster's jobs (`ray job list`, the
# dashboard, `ps` on the head), so a value carrying a credential (s3://KEY:SECRET@..., a
# ?token=...) is refused before anything is sent; jobspec/redaction.py decides what is one.
python3 - "$@" <<'CHECK' || exit 2
import sys
from jobspec.redaction import redact
for word in sys.argv[1:]:
    if redact(word) != word:
        sys.exit(
            f"deploy/submit.sh: {redact(word)!r} carries a credential, which the job's entrypoint would show "
            "to anyone who can list jobs; give it to the storage through its own environment on the cluster "
            "(e.g. the nodes' AWS credentials), not on the command line"
        )
CHECK
exec ray job submit --address "$RAY_ADDRESS" --runtime-env deploy/runtime_env.yaml \
    -- python -m ringleader run --no-progress "$@"
