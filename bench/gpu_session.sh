#!/usr/bin/env bash
# One command for a bare CUDA machine that already has its own torch and jax (with jax's CUDA
# plugin): install this tree over them (no dependency is replaced), then run the stages named,
# writing logs and JSON to $OUT (default bench/results/gpu-session).
#
#   bash bench/gpu_session.sh tests sweep          # correctness: pytest -m cuda, the model sweep
#   bash bench/gpu_session.sh bench-bf16           # bench/gpu.py, bf16 half
#   bash bench/gpu_session.sh bench-fp32           # bench/gpu.py, fp32 half
#   bash bench/gpu_session.sh probe overhead       # versions and GPU; a tiny call's host time by stage
#   bash bench/gpu_session.sh waits                # where calls wait for the GPU, per client setting
#   bash bench/gpu_session.sh host-profile         # a training step's host time under cProfile (bench/host_profile.py)
#
# Stage time limits (seconds) come from STAGE_LIMIT_<stage> (e.g. STAGE_LIMIT_sweep=300).
# The autotune results and executables persist in $FX2XLA_CACHE_DIR between stages when it is
# set by the caller; bench/gpu.py always starts cold (its own fresh cache folders).
set -u
export PYTHONUNBUFFERED=1 PJRT_DEVICE=CUDA
OUT=${OUT:-bench/results/gpu-session}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/fx2xla-install.log 2>&1 \
    || { cat /tmp/fx2xla-install.log; exit 1; }

limit() { local v="STAGE_LIMIT_$1"; echo "${!v:-$2}"; }

for stage in "$@"; do
    start=$(date +%s)
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case "$stage" in
        probe)
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
            python3 -c "import torch, jax, jaxlib, transformers; print('torch', torch.__version__, 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'transformers', transformers.__version__); print(jax.devices('cuda'))"
            ;;
        overhead)
            timeout "$(limit overhead 120)" python3 bench/gpu_probe.py --out "$OUT/probe.json" 2>&1 | tail -20
            ;;
        tests)
            # -p no:cacheprovider: the tree may be read-only for pytest's cache
            timeout "$(limit tests 300)" python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider \
                tests/gpu 2>&1 | tee "$OUT/cuda-tests.log" | tail -40
            ;;
        waits)
            timeout "$(limit waits 240)" python3 bench/gpu_waits.py --out "$OUT/waits.json" \
                --child-timeout "$(( $(limit waits 240) / 3 - 5 ))" ${WAITS_ARGS:-} > "$OUT/waits.log" 2>&1
            grep -v "^USDT\|profiler_st" "$OUT/waits.log" | tail -30
            ;;
        host-profile)
            timeout "$(limit host_profile 150)" python3 bench/host_profile.py --device cuda ${HOST_PROFILE_ARGS:-} \
                > "$OUT/host-profile.log" 2>&1
            grep -v "Warning\|warn" "$OUT/host-profile.log" | head -45
            ;;
        sweep)
            timeout "$(limit sweep 330)" python3 bench/cuda_sweep.py --deadline "$(( $(limit sweep 330) - 40 ))" \
                --out "$OUT/sweep.json" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
            tail -45 "$OUT/sweep.log"
            ;;
        bench-bf16|bench-fp32)
            dtype=$([ "$stage" = bench-bf16 ] && echo bfloat16 || echo float32)
            lim=$(limit "${stage/-/_}" 560)
            timeout "$lim" python3 bench/gpu.py --dtypes "$dtype" --deadline "$(( lim - 150 ))" \
                --out "$OUT/gpu-$dtype.json" ${BENCH_ARGS:-} > "$OUT/bench-$dtype.log" 2>&1
            tail -70 "$OUT/bench-$dtype.log"
            ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac
    echo "=== $stage: rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
done
