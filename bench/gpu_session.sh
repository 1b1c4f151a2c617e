#!/usr/bin/env bash
# What a session with a lent GPU runs, in one call, most valuable first; each phase has its own time limit so
# that a slow one cannot starve the rest. Logs go to $OUT (default ./gpu-out). Prepare here: make gpu-wheels;
# carry .gpu-wheels. Phases (PHASES, default "epoch checks adapters"; 2026-11-28's H200 took 256 s for epoch and
# 239 s for checks: one call of 600 s holds both, and the adapters phase needs a call of its own, about 250 s a row
# of 20 B parameters):
#   suite     the CUDA bf16 conformance suite (-m gpu) but the compiled-blocks cases
#   epoch     bench/epoch.py: SD3.5-Medium's shape, issue 20's recipe, model.compile none and blocks (EPOCH_ARGS)
#   checks    the suite and the on-policy ratio with compiled blocks for every case, side by side (correctness
#             only: not beside epoch); each ratio case is its own pytest with -s, RATIO_JOBS at a time, so a
#             phase cut short keeps what finished
#   adapters  bench/adapters.py --denoiser real rows for ADAPTERS (default: those without a GPU row; flux2's 32 B
#             are saved in float8, 32 GB, where 64 GB of bfloat16 would not fit the disk, and loaded back in bfloat16)
#   oom       the embedded job under a CUDA memory cap (OOM_FRACTION of the card): a real CUDA out-of-memory error
#             must end it with one "out of GPU memory in ..." line (trainer/memory.py), no traceback (~40 s; run it
#             before adapters in that phase's call)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PHASES=${PHASES:-epoch checks adapters}
ADAPTERS=${ADAPTERS:-chroma,qwen_image_inpaint,qwen_image_edit_plus,qwen_image_edit_inpaint,flux2}
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-540} - ($(date +%s) - start) )); }

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .gpu-wheels/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
  python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, torch.cuda.get_device_name())"
} >"$OUT/env.txt" 2>&1

for phase in $PHASES; do
  echo "== $phase at $(( $(date +%s) - start )) s, $(left) s left" >>"$OUT/env.txt"
  case $phase in
    suite)
      timeout "${SUITE_S:-170}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts= -q -rfEP --timeout 150 -n 12 \
        -k "not compiled_blocks" tests/integration/test_adapter_conformance.py tests/unit/test_noise.py \
        >"$OUT/suite.log" 2>&1
      echo "suite rc $?" >>"$OUT/env.txt";;
    checks)
      budget=$(( $(left) > 75 ? $(left) - 15 : 60 ))  # what the epoch phase left
      timeout "${SUITE_S:-$budget}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts= -q -rfE --timeout 150 -n 8 \
        -k "not compiled_blocks" tests/integration/test_adapter_conformance.py tests/unit/test_noise.py \
        >"$OUT/suite.log" 2>&1 &
      suite=$!
      mkdir -p /tmp/ratio
      RF_COMPILE_MATRIX=1 python3 -m pytest -m gpu -p no:cacheprovider -o addopts= --collect-only -q \
        -k on_policy_ratio_with_compiled_blocks tests/integration/test_adapter_conformance.py | grep '::' |
        TORCHINDUCTOR_COMPILE_THREADS=2 RF_COMPILE_MATRIX=1 timeout "${RATIO_S:-$budget}" xargs -P "${RATIO_JOBS:-8}" \
        -I{} sh -c 'python3 -m pytest -p no:cacheprovider -o addopts= -q -s --timeout 280 "{}" \
        >"/tmp/ratio/$(echo "{}" | tr -c "a-zA-Z0-9_\n" _).log" 2>&1'
      echo "ratio rc $?" >>"$OUT/env.txt"
      wait $suite; echo "suite rc $?" >>"$OUT/env.txt"
      for f in /tmp/ratio/*.log; do echo "== $f"; grep -E "^E |passed|failed|rror" "$f" | head -20; done >"$OUT/ratio.log"
      grep -h "|ratio - 1|" /tmp/ratio/*.log >"$OUT/ratio_summary.txt";;
    epoch)
      timeout "${EPOCH_S:-390}" python3 bench/epoch.py --model sd3 --denoiser real --flops-prompts 1 \
        ${EPOCH_ARGS:---compile none,blocks} \
        --attention auto >"$OUT/epoch.log" 2>&1
      echo "epoch rc $?" >>"$OUT/env.txt";;
    oom)
      timeout "${OOM_S:-120}" python3 -c "import sys, torch
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]))
from trainer.main import main
sys.exit(main(sys.argv[2:]))" "${OOM_FRACTION:-0.0002}" train.warmup_steps=4 warmup.batch_size=4096 \
        warmup.micro_batch_size=4096 train.epochs=1 logging.output_dir=/tmp/oom-runs logging.progress=false \
        >"$OUT/oom.log" 2>&1
      echo "oom rc $? (expected: 1 or 2, one 'out of GPU memory in' line, no Traceback)" >>"$OUT/env.txt"
      grep -h "out of GPU memory\|Traceback" "$OUT/oom.log" >>"$OUT/env.txt";;
    adapters)
      timeout "$(( $(left) > 30 ? $(left) : 30 ))" python3 bench/adapters.py --device cuda --dtype bfloat16 \
        --denoiser real --scale 2 --gradient-checkpointing --repeats 3 --names "$ADAPTERS" >"$OUT/adapters.log" 2>&1
      echo "adapters rc $?" >>"$OUT/env.txt";;
  esac
done
echo "== done at $(( $(date +%s) - start )) s" >>"$OUT/env.txt"
