#!/usr/bin/env bash
# What a session with a lent GPU runs, in one call, most valuable first; each phase has its own time limit so
# that a slow one cannot starve the rest. Logs go to $OUT (default ./gpu-out). Prepare here: make gpu-wheels;
# carry .gpu-wheels. Phases (PHASES, default "suite epoch ratio adapters"; 2026-11-27's H100 took 70 s for the
# suite, and did not finish the others in 15 minutes of device time: give a session's first call the first two):
#   suite     the CUDA bf16 conformance suite (-m gpu) but the compiled-blocks cases
#   epoch     bench/epoch.py: SD3.5-Medium's shape, issue 20's recipe, model.compile none and blocks (EPOCH_ARGS)
#   ratio     the on-policy ratio with compiled blocks for every case
#   adapters  bench/adapters.py --denoiser real rows for ADAPTERS (default: those without a GPU row; flux2's 32 B
#             need an H200 and more than 64 GB of disk)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PHASES=${PHASES:-suite epoch ratio adapters}
ADAPTERS=${ADAPTERS:-qwen_image_edit,qwen_image_inpaint,qwen_image_edit_plus,qwen_image_edit_inpaint}
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
    ratio)  # the on-policy ratio with compiled blocks, every case (inductor compiles for minutes)
      RF_COMPILE_MATRIX=1 timeout "${RATIO_S:-300}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts= -q \
        -rfEP --timeout 280 -n 12 -k compiled_blocks tests/integration/test_adapter_conformance.py >"$OUT/ratio.log" 2>&1
      echo "ratio rc $?" >>"$OUT/env.txt"
      grep -h "|ratio - 1|" "$OUT/ratio.log" >"$OUT/ratio_summary.txt";;
    epoch)
      timeout "${EPOCH_S:-330}" python3 bench/epoch.py --model sd3 --denoiser real --flops-prompts 1 \
        ${EPOCH_ARGS:---compile none,blocks} \
        --attention auto >"$OUT/epoch.log" 2>&1
      echo "epoch rc $?" >>"$OUT/env.txt";;
    adapters)
      timeout "$(( $(left) > 30 ? $(left) : 30 ))" python3 bench/adapters.py --device cuda --dtype bfloat16 \
        --denoiser real --scale 2 --gradient-checkpointing --repeats 3 --names "$ADAPTERS" >"$OUT/adapters.log" 2>&1
      echo "adapters rc $?" >>"$OUT/env.txt";;
  esac
done
echo "== done at $(( $(date +%s) - start )) s" >>"$OUT/env.txt"
