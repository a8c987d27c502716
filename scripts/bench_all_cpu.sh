#!/usr/bin/env bash
# The CPU runs behind results/bench/README.md, one after another (a few hours in all; most stay under
# ~10 minutes on two shared cores). Then the README's generated blocks are refreshed from the JSON files.
#
#   scripts/bench_all_cpu.sh                 # every run
#   scripts/bench_all_cpu.sh layer variance  # only the named runs (names: see RUNS below)
#   THREADS=2 scripts/bench_all_cpu.sh       # torch threads (default 1, see results/bench/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-.venv/bin/python}"
T="${THREADS:-1}"
LOGS="${LOG_DIR:-/tmp/sketchprop_bench_logs}"
mkdir -p "$LOGS"

declare -A RUNS=(
    [layer]="scripts/bench_layer.py --threads $T"
    [layer_t2]="scripts/bench_layer.py --threads 2 --shapes 768x3072 --rows 4096 --tag _t2"
    [roberta_time]="scripts/bench_model.py --models roberta-base --methods exact,paper,ours --parts bytes,time --threads $T --tag _roberta_time"
    [roberta_gauss]="scripts/bench_model.py --models roberta-base --methods exact,ours-gaussian,ours --parts bytes,time --threads $T --tag _roberta_gauss"
    [roberta_ckpt]="scripts/bench_model.py --models roberta-base --methods exact,ckpt,ckpt+ours --parts bytes,time --threads $T --tag _roberta_ckpt"
    [roberta_ckpt2]="scripts/bench_model.py --models roberta-base --methods exact,ckpt,ckpt+ours --parts time --threads $T --repeats 5 --tag _roberta_ckpt2"
    [roberta_exactskip]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ours --parts bytes,time --threads $T --tag _roberta_exactskip"
    [roberta_bytes]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,paper,ours,ours-gaussian,ckpt+ours,ours-noshare,ours-noskip --parts bytes --threads $T --tag _roberta_bytes"
    [roberta_memory]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,paper,ours,ckpt+ours --parts memory --threads $T --tag _roberta_memory"
    [minilm]="scripts/bench_model.py --models minilm --methods exact,exact-skip,ckpt,paper,ours,ours-gaussian,ckpt+ours,ours-noshare,ours-noskip --threads $T --repeats 5 --tag _minilm"
    [overhead]="scripts/backward_overhead.py --threads $T"
    [variance]="scripts/sketch_variance.py --threads $T --seeds 24"
    [layer_importance]="scripts/bench_layer.py --threads $T --shapes 768x3072 --sketches blocksrht,importance --rhos 0.2,0.1 --tag _importance"
    [minilm_importance]="scripts/bench_model.py --models minilm --methods exact,ours,ours-importance,ours-importance+alloc --rhos 0.2,0.1 --parts bytes,time --threads $T --repeats 5 --tag _minilm_importance"
    [importance_variance]="scripts/importance_variance.py --threads $T"
    [roberta_compact_bytes]="scripts/bench_model.py --models roberta-base --methods exact,ours,compact,lnstored,ours+compact,ours+lnstored,ckpt+ours+compact,ours+seeded,ours+recompute,ours+gelu,ours+lnout,ours+packed --rhos 0.5,0.2,0.1 --parts bytes --threads $T --tag _roberta_compact_bytes"
    [roberta_compact_time]="scripts/bench_model.py --models roberta-base --methods exact,ours,ours+compact,ours+seeded,ours+recompute,ours+gelu,ours+packed --rhos 0.1 --parts time --threads $T --repeats 3 --tag _roberta_compact_time"
    [roberta_compact_alone_time]="scripts/bench_model.py --models roberta-base --methods exact,ours,compact --rhos 0.1 --parts time --threads $T --repeats 3 --tag _roberta_compact_alone_time"
    [roberta_lnout_time]="scripts/bench_model.py --models roberta-base --methods exact,compact,lnstored,ours+compact,ours+lnstored --rhos 0.1 --parts time --threads $T --repeats 3 --tag _roberta_lnout_time"
    [roberta_fair]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,paper,ours,ckpt+ours,compact,ours+compact,ckpt+ours+compact,int8,int4,int2,int4+compact --parts time --threads $T --tag _roberta_fair"
    [minilm_fair]="scripts/bench_model.py --models minilm --methods exact,exact-skip,ckpt,paper,ours,ckpt+ours,compact,ours+compact,ckpt+ours+compact,int8,int4,int2,int4+compact,ours-importance,ours-importance+alloc --parts time --threads $T --tag _minilm_fair"
    [roberta_bits_time]="scripts/bench_model.py --models roberta-base --methods exact,int8,int4,int2,int4+compact --parts time --threads $T --repeats 3 --tag _roberta_bits_time"
    [bits_cost]="scripts/bits_cost.py --threads $T"
    [gelu_bits]="scripts/gelu_bits.py --threads $T"
    [equal_bytes]="scripts/equal_bytes.py --threads $T"
    [decoders_llama]="scripts/decoders.py --architectures llama --methods exact,compact,compact(mlp=input),compact(attention=recompute),ours+compact --threads $T --tag _llama"
    [decoders_llama_lean]="scripts/decoders.py --architectures llama --methods exact,compact,int4+compact,int4+lean --threads $T --tag _llama_lean"
    [decoders_llama_lora]="scripts/decoders.py --architectures llama --batch 16 --methods exact,lora,lora+ours+compact --threads $T --tag _llama_lora"
    [decoders_time]="scripts/decoders.py --architectures llama --batch 16 --methods exact,compact,compact(lm_loss=stored),ours+compact,lora,lora+ours+compact --time-steps 7 --threads $T --tag _time"
    [decoders_llama_lora_time]="scripts/decoders.py --architectures llama --batch 4 --methods exact,lora,lora+ours+compact,lora+ours+compact(mlp=recompute) --time-steps 7 --threads $T --tag _llama_lora_time"
    [decoders_gpt2]="scripts/decoders.py --architectures gpt2 --methods exact,compact,compact(attention=stored),ours+compact --threads $T --tag _gpt2"
    [decoders_gpt2_lora]="scripts/decoders.py --architectures gpt2 --batch 16 --methods exact,lora,lora+ours+compact --threads $T --tag _gpt2_lora"
    [decoders_gpt2_time]="scripts/decoders.py --architectures gpt2 --batch 16 --methods exact,compact,ours+compact,lora,lora+ours+compact --time-steps 5 --threads $T --tag _gpt2_time"
    [saved_full]="scripts/saved_tensors.py --rows full --batch 16 --seq 128 --methods exact,int4+compact,int4+lean,int4g128+lean,ckpt --threads $T"
    [saved_lean]="scripts/saved_tensors.py --batch 16 --seq 128 --methods exact,int4+compact,int4+lean,ckpt --threads $T --tag _lean"
    [lean_check]="scripts/lean_check.py --threads $T"
    [roberta_lean_time]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,int4+compact,int4+lean,int4g128+lean --parts time --threads $T --tag _roberta_lean_time"
    [roberta_lean_time_full]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,int4+compact,int4+lean,int4g128+lean --parts time --threads $T --rows full --tag _roberta_lean_time_full"
    [roberta_lean_ckpt_full]="scripts/bench_model.py --models roberta-base --methods exact,exact-skip,ckpt,int4+lean --parts time --threads $T --rows full --repeats 8 --tag _roberta_lean_ckpt_full"
    [speed_lean]="scripts/bench_speed.py --methods exact,exact-skip,ckpt,int4+compact,int4+lean --shapes 8x128 --threads 1 --eager-codecs --tag _lean"
    # torch.compile(model) on top, scaled down (full-length rows, 8x128, one thread): about 15 min
    [speed_compile]="scripts/bench_speed.py --methods exact,exact-skip,int4,compact,int4+compact,int4+lean --shapes 8x128 --rows full --threads 1 --compile-model --tag _compile"
    # every shape, row kind and thread count, eager only (4 rounds): about 1 h
    [speed_full]="scripts/bench_speed.py --eager-codecs --rounds 4 --tag _full"
    # glibc's own allocator setting (freed pages go back to the OS) beside the default, pages kept: about 30 min
    [speed_glibc]="scripts/bench_speed.py --shapes 8x128 --threads 1 --rounds 8 --eager-codecs --allocator default --tag _glibc"
    # one thread and every core by itself (--threads 1,all), eager and compiled: about 2.5 h
    [speed]="scripts/bench_speed.py --eager-codecs --compile-model"
)
ORDER=(layer layer_t2 roberta_time roberta_gauss roberta_ckpt roberta_ckpt2 roberta_exactskip roberta_bytes
       roberta_memory minilm overhead variance layer_importance minilm_importance importance_variance
       roberta_compact_bytes roberta_compact_time roberta_compact_alone_time roberta_lnout_time
       roberta_bits_time roberta_fair minilm_fair bits_cost gelu_bits equal_bytes decoders_llama decoders_llama_lean decoders_llama_lora decoders_time
       decoders_llama_lora_time
       decoders_gpt2 decoders_gpt2_lora decoders_gpt2_time saved_full saved_lean lean_check roberta_lean_time roberta_lean_time_full roberta_lean_ckpt_full speed_lean speed_compile speed_full speed_glibc speed)
if [[ $# -gt 0 ]]; then ORDER=("$@"); fi

for name in "${ORDER[@]}"; do
    [[ -n "${RUNS[$name]:-}" ]] || { echo "unknown run: $name (one of ${!RUNS[*]})" >&2; exit 2; }
    echo "=== $name: $PY ${RUNS[$name]}   [load $(cut -d' ' -f1-3 /proc/loadavg)] $(date +%T)"
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$PY" ${RUNS[$name]} > "$LOGS/$name.txt" 2>&1 || { echo "failed: see $LOGS/$name.txt"; exit 1; }
    echo "    done in $(($(date +%s) - start)) s"
done
"$PY" scripts/bench_report.py
