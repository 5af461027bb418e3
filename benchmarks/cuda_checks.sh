#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: the tests that skip without one (the statistics on CUDA against the
# float64 reference and the CPU, a guard on CUDA against one on CPU, no synchronisation under CUDA's sync-debug
# mode), then the GPU statistics benchmark (benchmarks/stats_cuda.py) at 64K, 1M and 8M tokens.
#
# Usage: benchmarks/cuda_checks.sh [OUT_DIR]   (default runs/cuda_checks: logs and stats_cuda.json)
# Needs torch with CUDA, numpy, pyyaml, pytest, pytest-timeout and hypothesis; runs rl_guard from this checkout.
# PYTHON names the interpreter (default python3). Exit status: non-zero if the tests or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/cuda_checks}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available() and torch.cuda.get_device_name())" \
  | tee "$out/device.txt"
timeout 240 "$py" -m pytest -p no:cacheprovider -p no:logging -rs tests/stats/test_cuda_engines.py tests/stats/test_sync_count.py \
  tests/benchmarks/test_stats_cuda_benchmark.py 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
timeout 240 "$py" benchmarks/stats.py --device cuda --sizes 64K,1M,8M --json "$out/stats_cuda.json" 2>&1 | tee "$out/stats_cuda.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench"
exit $(( tests != 0 || bench != 0 ))
