#!/usr/bin/env bash
# GuideLLM (an outside load generator, through /v1/chat/completions) and our locust users (through
# /generate) at the same load against `serve run serve_config.yaml`: 4 concurrent streams, 64 output tokens.
#
#   GUIDELLM=/path/to/venv/bin/guidellm bash loadtests/guidellm_vs_locust.sh     # from the repository root
#
# GuideLLM lives in its own venv (pip install torch==2.13.0 guidellm); it tokenizes its synthetic
# prompts with the served model's tokenizer, read from the GGUF cache folder (no hub).
set -euo pipefail -m
GUIDELLM=${GUIDELLM:-guidellm}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/guidellm-vs-locust}
STREAMS=${STREAMS:-4}
REQUESTS=${REQUESTS:-32}
DURATION=${DURATION:-120s}
mkdir -p "$OUT"
set -a; . ./configs/ray.env; set +a
export HF_HUB_OFFLINE=1

MODEL_DIR=$($PY -c "
from lookahead_core.models.loading import DEFAULT_MODEL, DEFAULT_CACHE_DIR, dequantized_gguf, resolve_model_path
print(dequantized_gguf(*resolve_model_path(DEFAULT_MODEL), DEFAULT_CACHE_DIR))")

if curl -sf "localhost:8000/health" > /dev/null; then echo "a server already answers on port 8000: stop it first" >&2; exit 1; fi
.venv/bin/serve run serve_config.yaml > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
curl -sf localhost:8000/health | $PY -c "import json, sys; h = json.load(sys.stdin); print('server:', h['model'], h['dtype'], h['torch_threads'], 'threads')"

echo "== GuideLLM: $STREAMS concurrent streams, synthetic 128-token prompts, 64 output tokens, $REQUESTS requests =="
$GUIDELLM run --backend "kind=openai_http,target=http://127.0.0.1:8000,model=SmolLM2-135M-Instruct" \
  --tokenizer "kind=hf_auto,model=$MODEL_DIR" \
  --data "kind=synthetic_text,prompt_tokens=128,output_tokens=64" \
  --profile "kind=concurrent,streams=$STREAMS" --constraint "kind=max_requests,count=$REQUESTS" \
  --output "kind=json,path=$OUT/guidellm.json" --disable-progress > "$OUT/guidellm.log" 2>&1 || { tail -n 40 "$OUT/guidellm.log"; exit 1; }
$PY -m loadtests.guidellm_summary "$OUT/guidellm.json"

echo "== locust: $STREAMS users (closed loop) on /generate, code prompts, 64 new tokens, $DURATION =="
$PY -m locust -f loadtests/locustfile.py --headless -u "$STREAMS" -r "$STREAMS" -t "$DURATION" --host http://127.0.0.1:8000 \
  --slo-file loadtests/slo_lenient.yaml --prompt-set code --lookahead auto --max-new-tokens 64 \
  --summary-json "$OUT/locust.json" --only-summary > "$OUT/locust.log" 2>&1 || true
$PY -c "
import json; s = json.load(open('$OUT/locust.json'))
print(json.dumps({k: s[k] for k in s if k != 'verdict'}, indent=1)[:3000])"
