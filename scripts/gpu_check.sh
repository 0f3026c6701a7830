#!/usr/bin/env bash
# The GPU acceptance run: one GPU, one 10-minute call. Installs autopar offline against the
# machine's own torch, then runs scripts/gpu_check.py: the kernel tests compiled on the GPU,
# parallelize at world 1 under NCCL on a ~1 B-parameter GPT (plain DP, ZeRO-1/2/3, offload,
# recompute, fusions on/off) against eager PyTorch and torch.compile with predicted vs
# measured step time and peak memory, checkpoint save / load / export on the GPU, a
# transformers Llama, and `autopar plan / dump / run / tune / verify / demo`.
# Prints one table, writes it to $OUT/gpu_check.txt (or out/gpu_check.txt, or --out FILE),
# logs beside it; exits non-zero on any failure.
#   bash scripts/gpu_check.sh             on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   the same checks on the CPU at tiny sizes
#   bash scripts/gpu_check.sh --skip tune,demo   leave sections or commands out ("profile": the
#                                                by-kind profile that follows the table)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --no-install "* ]]; then
    # no network there: the machine's torch, triton, transformers, safetensors ... stay as they are
    python3 -m pip install --no-deps --no-build-isolation --no-index -e . -q || {
        echo "gpu_check: installing autopar (pip install --no-deps --no-build-isolation --no-index -e .) failed" >&2
        exit 1
    }
fi
args=()
skip="" out="" dry=0 prev=""
for a in "$@"; do
    [[ "$a" == "--no-install" ]] || args+=("$a")
    case "$prev" in --skip) skip="$a" ;; --out) out="$a" ;; esac
    case "$a" in --skip=*) skip="${a#--skip=}" ;; --out=*) out="${a#--out=}" ;; --dry-run) dry=1 ;; esac
    prev="$a"
done
python3 scripts/gpu_check.py ${args[@]+"${args[@]}"}
rc=$?
# then where the step's time goes, by kind of work, predicted against profiled (eager and the
# bf16-mixed autopar step of the same 1.1 B GPT), after a 3 s GEMM loop (burst against sustained
# TFLOP/s, clock, power): scripts/gpu_profile.py --by-kind --sustained 3, beside the table
if [[ $dry == 0 && ",$skip," != *",profile,"* ]]; then
    dir="$(dirname "${out:-${OUT:-out}/gpu_check.txt}")"
    python3 scripts/gpu_profile.py --only eager,mixed --by-kind --sustained 3 --steps 3 --out "$dir" || {
        echo "gpu_check: scripts/gpu_profile.py --by-kind failed" >&2
        rc=1
    }
fi
exit $rc
