#!/usr/bin/env bash
# One H200 call, phases chosen by arguments (run from the repository root with .carry/tilelang-*.tar.xz carried):
#   tests     GPU tests: python -m pytest -m gpu $TESTS (default: tests, i.e. every GPU test), in TEST_WORKERS
#             pytest-xdist workers (default 6: 14 ran out of GPU memory in the V3-shape tests; --dist worksteal: an
#             idle worker takes queued tests from a busy one; engines size their KV caches from an equal share of the
#             memory, conftest.py) when the wheels phase installed pytest-xdist, else in one process
#   kernels   kernel benchmarks: python -m deepinfer_npu.kernels_cuda.bench NAME for each NAME in $KERNELS
#             (default all; BENCH_ARGS: extra arguments, e.g. "--warp-specialized --block-m 16 64" for mla_decode)
#   e2e       benchmarks/bench_decode_e2e.py with graphs, batch E2E_BATCH (default 1 16 64), prompts of E2E_PROMPT
#             tokens (default 512) (E2E_REPEAT timed windows a batch, default 5, the median reported; E2E_HF=0 leaves
#             transformers out; E2E_ARGS: more, e.g. "--quantization fp8"; E2E_AB="VAR=value ...": each such
#             setting runs the same benchmark again under it, rows carrying it in "env"; a run past the phase limit
#             gets SIGABRT and prints its threads' Python stacks into e2e.log; one whose log stops growing for
#             E2E_STALL seconds, default 45, after its first timed batch gets cuda-gdb first: e2e_gdb_N.log)
#   zos       benchmarks/bench_zos.py with graphs, batch 1 and 64
#   spec      benchmarks/bench_spec.py on the reference model: no-spec vs MTP / DFlash, concurrency 1, 32
#   profile   benchmarks/profile_decode.py, graphs, batch PROFILE_BATCH (default "1 64"); a kernel on PDL waits for
#             its predecessor, so a kernel's span includes that wait (PROFILE_ARGS: more, e.g. "--host-steps 50":
#             the host's Python functions under cProfile)
#   goldens   parity goldens (fp32, bf16) on the reference model
#   goldens-real  bf16 / fp32 goldens on parity_tests/models/deepseek-v2-lite-dims-2l (dummy_portable weights)
#   wheels    pip install the wheels carried in .carry/wheels (xgrammar, fastapi, uvicorn, openai, pytest-xdist ...,
#             absent on the host; benchmarks/device/carry_wheels.sh downloads them here)
#   structured  benchmarks/bench_structured.py on the reference model and on V2-Lite dims, concurrency 1 and 32
#   serving   benchmarks/bench_serving.py against `python -m deepinfer_npu.serve --backend cuda` (reference model)
#   throughput  benchmarks/bench_throughput.py: prefill, mixed and vLLM's V2-Lite workloads through LLM.generate
#             (THROUGHPUT_ARGS: more, e.g. "--workload prefill --profile")
#   pdlhang   the FP8 MoE graph-replay chain (tests/cuda/test_fp8_graph_replay.py as a script, HANG_ROWS rows, default
#             64, HANG_REPLAYS replays, default 3000) once per DEEPINFER_PDL_OFF value in PDL_VARIANTS (default
#             "none fp8"); a replay loop with no progress for 30 s gets cuda-gdb attached (the kernels resident and
#             where their warps are) before it is killed; each value up to PHASE_LIMIT (DEADLINE is not checked
#             between values): docs/kernels/pdl.md
#   startup   benchmarks/bench_startup.py: LLM(...) until ready, cold caches then warm (V2-Lite shape; STARTUP_ARGS)
#   savecache tar the TileLang kernel cache to $OUT/tlcache.tar.xz; copied to .carry/ and carried, the next call's
#             setup unpacks it (loadcache: a fresh machine then skips the compiles it already did)
# Rows name DEEPINFER_BENCH_COMMIT when it is set (pass the local HEAD: the copied tree's git metadata may be stale).
# DEADLINE (seconds from start, default unset) caps PHASE_LIMIT and skips phases once it has passed. Outputs under
# $OUT; each phase has its own time limit (PHASE_LIMIT seconds, default 150; goldens keep their own).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
LIM=${PHASE_LIMIT:-150}
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlcache DEEPINFER_CACHE_DIR=/tmp/dicache
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
rm -f /tmp/profile.log /tmp/e2e.log /tmp/spec.log  # a warm machine keeps /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv > "$OUT/setup.log" 2>&1
(mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site) &
[ -f .carry/tlcache.tar.xz ] && (mkdir -p /tmp/tlcache && tar -xJf .carry/tlcache.tar.xz -C /tmp/tlcache) &
python3 setup.py build_ext --inplace -q -j 16 > /tmp/build.log 2>&1 || echo "BUILD FAILED" >> /tmp/build.log &
wait
# The package as setup.py maps it (deepinfer_npu.kernels_cuda -> kernels_cuda/ ...), editable: no copies, no links.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> /tmp/build.log 2>&1 \
  || echo "INSTALL FAILED" >> /tmp/build.log
export PYTHONPATH=/tmp/site
python3 -c "import deepinfer_npu.kernels_cuda, deepinfer_npu._core" >> /tmp/build.log 2>&1 \
  || echo "IMPORT FAILED: deepinfer_npu.kernels_cuda / the C++ core" >> /tmp/build.log
tail -3 /tmp/build.log >> "$OUT/setup.log"; el "setup done"; tail -2 /tmp/build.log
filt() { grep -v "tilelang.jit.kernel:INFO\|USDT:\|^INFO" ; }
# gpu_dump PID FILE: the CUDA kernels resident in process PID and where their warps and lanes are, into FILE
gpu_dump() { timeout 90 cuda-gdb -p "$1" -batch -ex "info cuda kernels" -ex "info cuda sms" -ex "info cuda warps" \
  -ex "info cuda lanes" -ex "bt" > "$2" 2>&1; head -40 "$2"; }
for phase in "$@"; do
  el "phase $phase"
  if [ -n "${DEADLINE:-}" ]; then left=$(( DEADLINE - ($(date +%s) - T0) )); LIM=$(( left < ${PHASE_LIMIT:-150} ? left : ${PHASE_LIMIT:-150} ))
    [ $LIM -lt 10 ] && { echo "skip $phase: deadline"; continue; }; fi
  case $phase in
    tests) x=""; python3 -c "import xdist" 2>/dev/null && x="-n ${TEST_WORKERS:-6} --dist worksteal"
             rm -f "$OUT/test_failures.log" "$OUT/test_durations.log"  # conftest.py writes them as tests end
             export TEST_FAILURE_LOG="$OUT/test_failures.log" TEST_DURATION_LOG="$OUT/test_durations.log"
             # a test running longer than the limit less 20 s prints every thread's stack (pytest's faulthandler:
             # per test, so one that starts late and hangs is killed at the limit without it)
             timeout -k 10 $LIM python3 -m pytest -m gpu ${TESTS:-tests} $x -q -rs -p no:cacheprovider --durations 15 \
             -o faulthandler_timeout=$(( LIM > 40 ? LIM - 20 : 20 )) 2>&1 \
             | filt | grep -v "PytestBenchmarkWarning\|warner(" > "$OUT/tests.log"; tail -40 "$OUT/tests.log"
             pkill -9 -f "python3 -m pytest" 2>/dev/null; pkill -9 -f "xdist" 2>/dev/null  # workers a timeout left
             [ -f "$OUT/test_failures.log" ] && grep "^==== FAILED" "$OUT/test_failures.log" | sort -u | head -40
             [ -f "$OUT/test_durations.log" ] && { echo "slowest:"; sort -rn "$OUT/test_durations.log" | head -15
               awk '{n[$2]++} END {for (k in n) printf "%s %d  ", k, n[k]; print ""}' "$OUT/test_durations.log"; } ;;
    kernels) for k in ${KERNELS:-all}; do echo "== $k"
             timeout $LIM python3 -m deepinfer_npu.kernels_cuda.bench $k ${BENCH_ARGS:-} --out "$OUT/h200_kernels.jsonl" 2>&1 \
             | filt | grep -v '^{' | tail -8; done
             python3 -c "
import json
for l in open('$OUT/h200_kernels.jsonl'):
    r = json.loads(l); print({k: v for k, v in r.items() if k not in ('date', 'commit', 'hardware', 'command')})
" | tail -60 ;;
    e2e) x=""; [ "${E2E_HF:-1}" = 0 ] && x=--no-hf; rm -f /tmp/e2e.log; n=0
             for ab in "" ${E2E_AB:-}; do [ -n "$ab" ] && echo "== again with $ab"
             # past the limit SIGABRT: faulthandler prints every thread's Python stack (where a stalled run waits);
             # no core file
             ulimit -c 0; env $ab timeout -s ABRT -k 10 $LIM python3 -X faulthandler -m benchmarks.bench_decode_e2e --backend cuda \
             --batch ${E2E_BATCH:-1 16 64} \
             --prompt-len ${E2E_PROMPT:-512} --gen 32 --repeat ${E2E_REPEAT:-5} --gpu-state --graphs $x ${E2E_ARGS:-} \
             --out "$OUT/h200_decode_e2e_graphs.jsonl" > /tmp/e2e_raw.log 2>&1 & tpid=$!; last=""; still=0; n=$((n + 1))
             # a run whose log stops growing for E2E_STALL seconds (default 45) after its first timed batch: cuda-gdb
             # lists the resident kernels and where their warps are, then SIGABRT (Python stacks) ends it
             while kill -0 $tpid 2>/dev/null; do sleep 5; now=$(wc -c < /tmp/e2e_raw.log)
               if grep -q "engine batch=" /tmp/e2e_raw.log && [ "$now" = "$last" ]; then still=$((still + 5))
               else still=0; fi
               last=$now
               if [ $still -ge ${E2E_STALL:-45} ]; then ppid=$(pgrep -P $tpid | head -1)
                 echo "   no progress for ${still}s: cuda-gdb on $ppid -> $OUT/e2e_gdb_$n.log"
                 gpu_dump $ppid "$OUT/e2e_gdb_$n.log"
                 kill -ABRT $ppid; sleep 5; kill -9 $ppid 2>/dev/null; break; fi; done
             wait $tpid; rc=$?; filt < /tmp/e2e_raw.log > /tmp/e2e_one.log
             # each run's end now (a later timeout of the whole call must not hide it), and the whole log in $OUT
             echo "   exit $rc: $(grep -v '^{' /tmp/e2e_one.log | grep -c 'engine batch=') batches timed"
             grep -v '^{' /tmp/e2e_one.log | grep -v "kernel_cache" | grep -i "error\|traceback\|timed out" | tail -4
             cat /tmp/e2e_one.log >> /tmp/e2e.log; cp /tmp/e2e.log "$OUT/e2e.log"; done
             grep -v '^{' /tmp/e2e.log | grep -v "kernel_cache" | tail -24 ;;
    zos) timeout $LIM python3 -m benchmarks.bench_zos --backend cuda --batch 1 64 --graphs \
             --out "$OUT/h200_zos.jsonl" 2>&1 | filt > "$OUT/zos.log"; grep -v '^{' "$OUT/zos.log" | tail -8 ;;
    spec) timeout $LIM python3 -m benchmarks.bench_spec --backend cuda --methods ${SPEC_METHODS:-mtp dflash} \
             --concurrency 1 32 --graphs --max-tokens 128 --repeat ${SPEC_REPEAT:-3} --out "$OUT/h200_spec.jsonl" 2>&1 \
             | filt > /tmp/spec.log; grep -v '^{' /tmp/spec.log | tail -14 ;;
    profile) timeout $LIM python3 -m benchmarks.profile_decode --backend cuda --batch ${PROFILE_BATCH:-1 64} --graphs \
             --sequence 200 ${PROFILE_ARGS:-} 2>&1 | filt >> /tmp/profile.log; grep -v '^{' /tmp/profile.log | tail -5
             grep '^{' /tmp/profile.log > "$OUT/profile.jsonl"
             python3 -c "
import json
for l in open('$OUT/profile.jsonl'):
    r = json.loads(l); print('batch', r['batch'], 'graphs', r['graphs'], 'wall', r['wall_ms_per_step'], 'kernel', r['kernel_ms_per_step'], 'n', r['kernels_per_step'])
    for t in r['top'][:18]: print('   ', t)
    for t in r['cpu_self_top'][:6]: print('   cpu', t)
    if 'host_functions_self' in r: print('   clean wall', r['clean_wall_ms_per_step'])
    for t in r.get('host_functions_self', [])[:15]: print('   py self', t)
    for t in r.get('host_functions_cum', [])[:25]: print('   py cum', t)
" ;;
    wheels) python3 -m pip install -q --no-deps --no-index .carry/wheels/*.whl 2>&1 | tail -2
             python3 -c "import xgrammar, fastapi, uvicorn, openai, xdist, jsonschema; print('wheels ok')" ;;
    structured) for shape in v2-lite reference; do timeout $LIM python3 -m benchmarks.bench_structured --backend cuda \
             --shape $shape --concurrency 1 32 --out "$OUT/h200_structured.jsonl" > "$OUT/structured_$shape.log" 2>&1
             echo "$shape rc=$?"; grep '^{' "$OUT/structured_$shape.log" | cut -c1-260; done ;;
    serving) timeout $LIM python3 -m benchmarks.bench_serving --launch "--backend cuda --max-num-seqs 64" \
             --num-prompts 128 --rates inf 16 --compare-offline --hardware "$(nvidia-smi --query-gpu=name \
             --format=csv,noheader | head -1)" --out "$OUT/h200_serving.jsonl" 2>&1 | filt | tail -6 ;;
    goldens) for dt in float32 bfloat16; do timeout 60 python3 -m deepinfer_npu.parity record --backend cuda \
             --dtype $dt --out "$OUT/cuda-$dt.json" 2>&1 | filt | tail -3; done ;;
    goldens-real) for dt in bfloat16 float32; do timeout 120 python3 -m deepinfer_npu.parity record --backend cuda \
             --dtype $dt --model parity_tests/models/deepseek-v2-lite-dims-2l --load-format dummy_portable \
             --out "$OUT/cuda-$dt-v2-lite-dims.json" 2>&1 | filt | tail -3; done ;;
    throughput) timeout $LIM python3 -m benchmarks.bench_throughput --backend cuda ${THROUGHPUT_ARGS:-} \
             --out "$OUT/h200_throughput.jsonl" 2>&1 | filt > "$OUT/throughput.log"; grep -v '^{' "$OUT/throughput.log" | tail -8
             python3 -c "
import json
for l in open('$OUT/h200_throughput.jsonl'):
    r = json.loads(l)
    if r['bench'] == 'throughput_profile':
        print(r['workload'], 'wall', r['wall_s'], 'kernel', r['kernel_s']); [print('   ', t) for t in r['top']]
        [print('    host', t) for t in r.get('host_top', [])[:10]]
        [print('    py self', t) for t in r.get('host_functions_self', [])[:12]]
        [print('    py cum', t) for t in r.get('host_functions_cum', [])[:20]]
    else:
        print({k: r.get(k) for k in ('workload', 'max_num_batched_tokens', 'req_s', 'prompt_tok_s', 'steps',
                                     'step_ms', 'host_step_ms', 'host_wait_frac', 'frac_of_tensor_core_roofline',
                                     'over_first_engine')})
" ;;
    pdlhang) for v in ${PDL_VARIANTS:-none fp8}; do log="$OUT/pdlhang_$v.log"; t0=$(date +%s)
             DEEPINFER_PDL_OFF=$v python3 tests/cuda/test_fp8_graph_replay.py ${HANG_ROWS:-64} ${HANG_REPLAYS:-3000} \
               > "$log" 2>&1 & pid=$!; last=""; still=0
             while kill -0 $pid 2>/dev/null; do sleep 5; now=$(tail -1 "$log"); secs=$(( $(date +%s) - t0 ))
               if grep -q "^captured" "$log" && [ "$now" = "$last" ]; then still=$((still + 5)); else still=0; fi
               last=$now
               if [ $still -ge 30 ] || [ $secs -ge $LIM ]; then
                 grep -q "^captured" "$log" && echo "== $v: replays stalled for ${still}s (${secs}s in): cuda-gdb" \
                   || echo "== $v: phase limit before the replays began (${secs}s; building?): cuda-gdb"
                 gpu_dump $pid "$OUT/pdlhang_${v}_gdb.log"
                 kill -9 $pid; break; fi; done
             wait $pid 2>/dev/null; echo "== DEEPINFER_PDL_OFF=$v: $(grep -v '^{' "$log" | tail -2 | tr '\n' ' ')"; done ;;
    startup) timeout $LIM python3 -m benchmarks.bench_startup --backend cuda ${STARTUP_ARGS:-} \
             --out "$OUT/h200_startup.jsonl" 2>&1 | filt | cut -c1-400 | tail -4
             python3 -c "
import json
for l in open('$OUT/h200_startup.jsonl'):
    r = json.loads(l); print(r['run'], 'import', r['import_s'], 'ready', r['ready_s'], 'warm-up', r.get('kernel_warmup_s'),
                             'first request', r['first_request_s'], 'its builds', r.get('first_request_builds'),
                             'background', r.get('background_build_s'),
                             'done after ready', r.get('background_done_after_ready_s'), 'log lines',
                             r.get('log_lines'), 'repeated', r.get('repeated_log_lines', [])[:5])
    print('   ', r.get('kernel_warmup'))
" ;;
    savecache) (set -o pipefail; tar -cf - -C /tmp/tlcache . | xz -9e > "$OUT/tlcache.tar.xz") \
             || { echo "savecache FAILED"; rm -f "$OUT/tlcache.tar.xz"; }; du -sh /tmp/tlcache "$OUT/tlcache.tar.xz" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
el "all done"
