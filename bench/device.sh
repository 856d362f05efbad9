#!/usr/bin/env bash
# The GPU check in one go, at most 8 minutes: install what is missing (pinned CUDA torch, tunebook with the test
# tools, torchtune 0.6.1 + torchao 0.15.0, transformers, peft, liger-kernel where it installs), run the notebooks'
# cuda-flagged cells (`nbdev_test --flags cuda`) and `pytest -m cuda`, then bench/bench_device.py: tunebook,
# torchtune and transformers+peft on a Llama-3.2-1B-shaped model, bf16, eager and compiled, Liger where it
# imports; a table of tokens/s, allocator peak and MFU, and the same as JSON; then bench/bench_epoch.py: one epoch of ragged
# real rows (SmolLM2-135M-Instruct, LoRA) by tunebook padded/packed/compiled, TRL's SFTTrainer and torchtune's packed recipe
# (its JSON beside the first, *_epoch.json); with 4+ GPUs, bench/bench_mesh.py's 2-D mesh row (FSDP, HSDP 2 x 2,
# FSDP 2 x TP 2 with loss parallel; --smoke: 2 gloo ranks).
#
#   bash bench/device.sh              # on a CUDA machine (network needed only for what is not installed yet)
#   bash bench/device.sh --smoke      # on the CPU: tiny shapes, few steps, no installs, a few minutes
#   bash bench/device.sh --json PATH  # where the JSON goes (default: $OUT/device_bench.json or bench/results/)
#
# Environment: TUNEBOOK_BENCH_PY (the python for --smoke; default .venv/bin/python), TUNEBOOK_DEVICE_VENV
# (default ~/.cache/tunebook/venv-device, made with --system-site-packages so a preinstalled CUDA torch is reused), TORCH_VERSION
# (2.13.0), TORCH_INDEX (https://download.pytorch.org/whl/cu128), DEVICE_BUDGET_S (480).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
JSON=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --json) JSON="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "device.sh: unknown argument '$1' (use --smoke, --json PATH or --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$JSON" ] || JSON="${OUT:-bench/results}/device_bench.json"
mkdir -p "$(dirname "$JSON")"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  PY="${TUNEBOOK_BENCH_PY:-.venv/bin/python}"
  [ -x "$PY" ] || command -v "$PY" >/dev/null || { echo "device.sh --smoke: no python at $PY (make install, or set TUNEBOOK_BENCH_PY)" >&2; exit 2; }
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  "$PY" bench/bench_device.py --smoke --json "$JSON" --budget-s 200; rc=$?
  # the ragged-epoch row: one epoch of real rows, tunebook packed/padded vs TRL vs torchtune, LoRA (bench_epoch.py)
  "$PY" bench/bench_epoch.py --smoke --methods lora --json "${JSON%.json}_epoch.json"; rc2=$?
  "$PY" bench/bench_mesh.py --smoke --json "${JSON%.json}_mesh.json"; rc3=$?   # the 2-D mesh row: 2 gloo ranks
  [ $rc = 0 ] && [ $rc2 = 0 ] && [ $rc3 = 0 ]; exit $?
fi

START=$(date +%s)
BUDGET="${DEVICE_BUDGET_S:-480}"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
declare -A STATUS
phase() { echo; echo "######## $1 ($(left) s left)"; }

phase "install"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "device.sh: no NVIDIA GPU here (nvidia-smi finds none); on a CPU run: bash bench/device.sh --smoke" >&2
  exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
VENV="${TUNEBOOK_DEVICE_VENV:-${HOME:-/tmp}/.cache/tunebook/venv-device}"; mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
PY="$VENV/bin/python"
TV="${TORCH_VERSION:-2.13.0}"
pipi() { timeout "$(( $(left) > 60 ? $(left) - 60 : 5 ))" "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.__version__.startswith('$TV') else 1)" 2>/dev/null; then
  pipi "torch==$TV" --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" && STATUS[torch]=installed || STATUS[torch]="install failed"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device.sh: no CUDA torch here (torch: ${STATUS[torch]:-present without CUDA}); run bash bench/device.sh --smoke on a CPU" >&2
  exit 3
fi
CONSTRAINTS="$(mktemp)"; "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"  # nothing may swap torch
BENCH=$("$PY" -c "import configparser; c = configparser.ConfigParser(); c.read('settings.ini'); print(c['DEFAULT']['bench_requirements'])")
# tunebook with settings.ini's dev_requirements (the test tools, transformers, peft), as CI installs it
"$PY" -c "import tunebook, nbdev, transformers, peft" 2>/dev/null && "$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 \
  || { pipi -c "$CONSTRAINTS" -e '.[dev]' && STATUS[tunebook]=installed || STATUS[tunebook]="install failed"; }
"$PY" -c "import torchtune, torchao, trl" 2>/dev/null || { pipi -c "$CONSTRAINTS" $BENCH && STATUS[torchtune]=installed || STATUS[torchtune]="install failed"; }
"$PY" -c "import liger_kernel.transformers" 2>/dev/null || { pipi -c "$CONSTRAINTS" liger-kernel && STATUS[liger]=installed || STATUS[liger]="does not install here"; }
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(), '| transformers', transformers.__version__)"

phase "notebooks: cuda-flagged cells"
NBS=$(grep -l '"#| cuda' nbs/*.ipynb 2>/dev/null | tr '\n' ' ')
if [ -z "$NBS" ]; then STATUS[notebooks]="no cuda-flagged cells"; else
  NB_OK=1
  for nb in $NBS; do
    echo "nbdev_test --path $nb --flags cuda"
    timeout "$(( $(left) / 3 ))" "$VENV/bin/nbdev_test" --path "$nb" --flags cuda || NB_OK=0
  done
  STATUS[notebooks]=$([ $NB_OK = 1 ] && echo "passed: $NBS" || echo "FAILED (see above): $NBS")
fi

phase "pytest -m cuda"
timeout "$(( $(left) / 3 ))" "$PY" -m pytest -q -m cuda tests -x -p no:cacheprovider; rc=$?
STATUS[pytest]=$(case $rc in 0) echo passed ;; 5) echo "no cuda tests collected" ;; 124) echo "timed out" ;; *) echo "FAILED (exit $rc)" ;; esac)

phase "benchmarks"
timeout "$(( $(left) > 20 ? $(left) - 10 : 10 ))" "$PY" bench/bench_device.py --json "$JSON" --budget-s "$(( $(left) > 90 ? $(left) - 75 : 15 ))"; rc=$?
STATUS[bench]=$([ $rc = 0 ] && echo "ok: $JSON" || echo "exit $rc (see above): $JSON")
if [ "$(left)" -gt 90 ]; then  # the mixed mode too (fp32 master weights, bf16 autocast): tunebook and transformers+peft only
  phase "benchmarks: bf16-mixed"
  JSON_MIXED="${JSON%.json}_bf16_mixed.json"
  timeout "$(( $(left) - 10 ))" "$PY" bench/bench_device.py --precision bf16-mixed --frameworks tunebook,transformers+peft \
    --json "$JSON_MIXED" --budget-s "$(( $(left) > 60 ? $(left) - 40 : 15 ))"; rc=$?
  STATUS[bench_mixed]=$([ $rc = 0 ] && echo "ok: $JSON_MIXED" || echo "exit $rc (see above): $JSON_MIXED")
fi

if [ "$(left)" -gt 120 ]; then  # the ragged-epoch row on the GPU: one epoch of real rows, LoRA, with tunebook's compiled row
  phase "benchmarks: one ragged epoch"
  JSON_EPOCH="${JSON%.json}_epoch.json"
  timeout "$(( $(left) - 10 ))" "$PY" bench/bench_epoch.py --device cuda --dtype bf16-mixed --torchtune-dtype bf16 --methods lora \
    --compile --json "$JSON_EPOCH"; rc=$?
  STATUS[bench_epoch]=$([ $rc = 0 ] && echo "ok: $JSON_EPOCH" || echo "exit $rc (see above): $JSON_EPOCH")
fi

phase "benchmarks: 2-D mesh (FSDP, HSDP, FSDP x TP with loss parallel)"
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && [ "$(left)" -gt 60 ]; then
  timeout "$(( $(left) - 10 ))" "$PY" bench/bench_mesh.py --json "${JSON%.json}_mesh.json"; rc=$?
  STATUS[mesh]=$([ $rc = 0 ] && echo "ok: ${JSON%.json}_mesh.json" || echo "exit $rc (see above)")
else STATUS[mesh]="skipped: needs 4 GPUs and a minute ($(nvidia-smi -L | wc -l) GPU(s), $(left) s left)"; fi

echo; echo "######## summary ($(( $(date +%s) - START )) s)"
for k in torch tunebook torchtune liger notebooks pytest bench bench_mixed bench_epoch mesh; do [ -n "${STATUS[$k]:-}" ] && echo "  $k: ${STATUS[$k]}"; done
case "${STATUS[notebooks]}${STATUS[pytest]}${STATUS[bench]}${STATUS[bench_mixed]:-}${STATUS[bench_epoch]:-}${STATUS[mesh]:-}" in *FAILED*|*exit*) exit 1 ;; esac
