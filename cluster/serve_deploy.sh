#!/usr/bin/env bash
# `serve deploy` against a running multi-node Ray cluster, on one machine: a head node (controller,
# proxy, ingress; no CPU for models) and a worker node started with `ray start`, each on its own
# ports; deploy configs/serve_cluster.yaml, ask the model a question, print where the replicas
# run, tear it all down. On real machines, run the `ray start` lines on each machine instead.
#
#   bash cluster/serve_deploy.sh          # ports: HEAD_PORT 6390, DASHBOARD_PORT 8266, HTTP_PORT 8000
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
HEAD_PORT=${HEAD_PORT:-6390}
DASHBOARD_PORT=${DASHBOARD_PORT:-8266}
HTTP_PORT=${HTTP_PORT:-8000}
set -a; . ./configs/ray.env; set +a

# `ray stop` below stops every Ray process on this machine: refuse to start beside another cluster.
if pgrep -f "ray/core/src/ray/raylet/raylet" >/dev/null; then
  echo "a Ray cluster is already running on this machine; stop it first (ray stop)" >&2; exit 1
fi
if curl -s -o /dev/null "http://127.0.0.1:$HTTP_PORT/"; then
  echo "port $HTTP_PORT already answers; set HTTP_PORT" >&2; exit 1
fi
trap 'rm -f "${CONFIG:-}"; $BIN/serve shutdown -y --address "http://127.0.0.1:$DASHBOARD_PORT" >/dev/null 2>&1 || true; $BIN/ray stop --force >/dev/null 2>&1 || true' EXIT

echo "== head node: GCS on $HEAD_PORT, dashboard (Serve's REST API) on $DASHBOARD_PORT, no CPU for models"
$BIN/ray start --head --port="$HEAD_PORT" --num-cpus=0 --include-dashboard=true \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats >/dev/null
echo "== worker node: one CPU (one model replica), its own ports"
$BIN/ray start --address="127.0.0.1:$HEAD_PORT" --num-cpus=1 \
  --node-manager-port=6391 --object-manager-port=6392 --runtime-env-agent-port=6393 \
  --dashboard-agent-listen-port=6394 --dashboard-agent-grpc-port=6395 --metrics-export-port=6396 \
  --min-worker-port=20000 --max-worker-port=20199 >/dev/null
$BIN/python - "$HEAD_PORT" <<'PY'
import sys, ray
ray.init(address=f"127.0.0.1:{sys.argv[1]}", log_to_driver=False, logging_level="ERROR")
for n in ray.nodes():
    print(f"   node {n['NodeID'][:8]} alive={n['Alive']} CPU={n['Resources'].get('CPU', 0):g} head={'node:__internal_head__' in n['Resources']}")
PY

echo "== serve deploy configs/serve_cluster.yaml"
CONFIG="${TMPDIR:-/tmp}/serve_cluster.$$.yaml"
sed "s/port: 8000/port: $HTTP_PORT/" configs/serve_cluster.yaml > "$CONFIG"
$BIN/serve deploy "$CONFIG" --address "http://127.0.0.1:$DASHBOARD_PORT"
for _ in $(seq 240); do
  $BIN/serve status --address "http://127.0.0.1:$DASHBOARD_PORT" | grep -q "status: RUNNING" && break
  sleep 1
done
$BIN/serve status --address "http://127.0.0.1:$DASHBOARD_PORT" | grep -v "message: ''\|last_deployed\|replica_states\|^      *RUNNING: "

echo "== a question through the proxy on the head node"
curl -s "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}' \
  | $BIN/python -c 'import json,sys; r=json.load(sys.stdin); print("  ", r["choices"][0]["message"]["content"]); print("   usage:", r["usage"])'

echo "== where the replicas run"
curl -s "http://127.0.0.1:$DASHBOARD_PORT/api/serve/applications/" | $BIN/python -c '
import json, sys
app = json.load(sys.stdin)["applications"]["lookahead"]
for name, dep in app["deployments"].items():
    for r in dep["replicas"]:
        print("  ", name + ":", r["state"], "on node", r["node_id"][:8])'
echo "== tearing down (serve shutdown, ray stop)"
