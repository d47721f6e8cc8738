#!/usr/bin/env bash
# lm-eval-harness through this server (`local-completions`) against lm-eval's own `hf` backend, on the
# same weights in float32, on the two local tasks in evals/lm_eval/tasks (JSON files made here; no hub).
#
#   LM_EVAL=/path/to/venv/bin/lm_eval bash evals/lm_eval/compare.sh     # from the repository root
#
# lm-eval lives in its own venv (pip install torch==2.13.0 "lm-eval[api,hf]"): its pins need not match ours.
# Starts `serve run` on a float32 copy of serve_config.yaml, runs both backends, prints both tables.
set -euo pipefail -m
LM_EVAL=${LM_EVAL:-lm_eval}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/lm-eval-compare}
PORT=${PORT:-8000}
TASKS=ls_capitals,ls_arithmetic
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

# The safetensors folder the server loads the GGUF into: lm-eval's hf backend and its tokenizer read it.
MODEL_DIR=$($PY -c "
from lookahead_core.models.loading import DEFAULT_MODEL, DEFAULT_CACHE_DIR, dequantized_gguf, resolve_model_path
print(dequantized_gguf(*resolve_model_path(DEFAULT_MODEL), DEFAULT_CACHE_DIR))")

sed -e 's/dtype: auto/dtype: float32/' -e "s/port: 8000/port: $PORT/" serve_config.yaml > "$OUT/serve_fp32.yaml"
# Ray's and HAProxy's files in this user's private folder, as `make serve` starts them (deployments/ray_env.py)
umask 077
env=$($PY deployments/ray_env.py env "$OUT/serve_fp32.yaml")
eval "$env"
if curl -sf "localhost:$PORT/health" > /dev/null; then echo "a server already answers on port $PORT: stop it first" >&2; exit 1; fi
.venv/bin/serve run "$OUT/serve_fp32.yaml" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
curl -sf "localhost:$PORT/health" | $PY -c "import json, sys; h = json.load(sys.stdin); print('server:', h['model'], h['dtype'])"

echo "== local-completions (this server) =="
$LM_EVAL --model local-completions --tasks $TASKS --include_path evals/lm_eval/tasks \
  --model_args "model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
  --output_path "$OUT/server" --log_samples 2>&1 | grep -v "^\s*$" | tail -n 8
echo "== hf (lm-eval's own backend, float32) =="
$LM_EVAL --model hf --tasks $TASKS --include_path evals/lm_eval/tasks \
  --model_args "pretrained=$MODEL_DIR,dtype=float32" --batch_size 1 --device cpu \
  --output_path "$OUT/hf" --log_samples 2>&1 | grep -v "^\s*$" | tail -n 8
echo "== per sample =="
$PY -m evals.lm_eval.compare_samples "$OUT/server" "$OUT/hf"
