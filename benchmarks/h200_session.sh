#!/usr/bin/env bash
# One device call on a lent H200: install the carried wheels, run the gpu-marked tests and the
# GPU experiments, each bounded in time so the call ends inside its limit; tables land in $OUT.
# Usage (through the device tool, carrying .whl): HARNESS_GIT_REV=<rev> bash benchmarks/h200_session.sh [steps]
# steps: any of tests (or its halves tests_a, tests_b: one call each on cold caches, with
#        TESTS_S=480 for tests_a) overlap_ccta plan operator multigpu nvshmem kernels bandwidth
#        operator_x2 (the operator table with one process per GPU) megatron_gpu (its GPU tests)
#        host_syncs (layer_smoke, every system: the host syncs of each layer step, m_host_syncs)
#        scale (the fused scale vs its memory bound) layer_x2 (the layer table; LAYER_ARGS adds
#        Hydra overrides) operator_x2_nvshmem layer_x2_nvshmem (the overlap rows over nvshmem into
#        the same tables; LAYER_T picks the layer's tokens per rank) exps (the harness experiments
#        named in EXPS, each bounded by EXP_S seconds, tables copied to $OUT) variants (the overlap
#        operator rows, local copy|direct x layout aligned|packed|compact, with serial, side by side) verify (the 2-GPU and
#        overlap GPU tests of the latest fixes) one_gpu (the experiments in EXPS1 on
#        one GPU, CUDA_VISIBLE_DEVICES=0: the loopback tables) producer (experiment=producer on
#        one GPU) producer_configs (its tile-configuration variants on a few workloads) order
#        (serial + overlap with auto cCTA/mgb, order remote_first|expert, operator scope, one run)
#        ccta_auto (the W=2 auto calibration sweep, then the refit into $OUT) producer_variants
#        (the tile-configuration variants on the full grid) operator_auto (serial + overlap at
#        auto cCTA/mgb/order; OVERLAP_ARGS) operator_auto_shared (the overlap rows at compact with
#        the shared consumer, auto cCTA/mgb, into the same table) operator_baselines_auto (every system, overlap at auto; OVERLAP_ARGS)
#        recalibrate
#        (the E 32/64 ccta x mgb sweep at order expert, the refit, copied into the tree for the
#        later steps) shared_loopback (compute on SMs - cCTA next to the step, one GPU) repeat
#        (N=4096 balanced cells in three processes: the run-to-run spread) producer_cutlass (the
#        CUTLASS producer against the Triton one and the references; needs build/ carried)
#        producer_layouts (the producer per layout aligned|packed|compact, order expert, Triton
#        and CUTLASS, next to the references) layouts_loopback (the overlap step per layout on
#        one GPU playing W=2) operator_layouts (serial + overlap at auto cCTA/mgb/order per
#        layout aligned|compact, one process per GPU) producer_flags (the producer at compact
#        with each flag mode, flags on and off) producer_mid (the producer at compact: the
#        flag released mid main loop, the epilogue in column slices, local rows copy|direct;
#        then without flags) producer_split (the epilogue's column slices with other tile
#        settings, local=direct, tile_m 128 and 64) producer_default (the table's producer and
#        CUTLASS at aligned|compact, local copy|direct) layouts_loopback2 (the overlap step
#        per layout aligned|compact on one GPU playing W=2) producer_ncu (Nsight Compute on the
#        expert GEMMs of NCU_WORK, with the Triton CONFIGS in NCU_CONFIGS: benchmarks/ncu_producer.py,
#        ncu_summary.py) producer_groups (the swizzle groups of one expert's bands, caps 8-64;
#        PRODUCER_CONFIGS / PRODUCER_TABLE / PRODUCER_ARGS change it) swizzle_loopback (the
#        overlap step per swizzle in SWIZZLES on one GPU playing W=2, compact, N in SWIZZLE_N)
#        producer_bmm (the shipped producer and CUTLASS at compact, local copy|direct, next to
#        the three references: grouped_mm, dense cuBLAS and batched cuBLAS of the same weights)
# consumer_loopback (the overlap step per consumer placement on one GPU playing W=2, compact:
# own SMs at cCTA OWN_CCTA, shared at SHARED_CCTA; CONSUMER_N / _E / _ROUTING / _S) consumer_x2
# (the same over NVLink, 2+ GPUs: serial and own at auto cCTA/mgb, then shared at SHARED_CCTA x
# SHARED_MGB: a sweep benchmarks/fit_autotune.py can calibrate shared from)
# consumer_correctness_x2 (the correctness matrix at consumer=shared over p2p and nvshmem)
# handshake_x2 (2+ GPUs: tests/test_handshake_gpu.py, then the overlap step per handshake
# allreduce|barrier x handshake_stream step|consumer at auto cCTA/mgb, compact, N=HS_N, E in
# HS_E, three routings, with serial)
# host_bound (one GPU playing W=2, N=HOST_N: serial and overlap own/shared, timed eager and
# queued ahead (measure.queue_ahead) into two tables with the host's time per step, then
# benchmarks/host_profile.py on one cell: where the host's time goes) layer_host (one GPU, the
# layer scope at W=1, serial and overlap, T=8192, H=LHOST_H, E=LHOST_E, balanced: the table,
# then host_profile --idle (the device's idle time per eager step and its longest gaps) and
# --launches (host us of the overlap step's parts after the dispatch) into layer_host.log)
# step_profile (benchmarks/step_profile.py under torchrun, one process per GPU: each rank's
# timeline of the timed step, serial and overlap at auto cCTA/mgb, compact, N in PROFILE_N, E in
# PROFILE_E, PROFILE_ROUTING; OVERLAP_ARGS adds overrides, e.g. the handshake_stream sweep)
# band_times (one GPU: when each band of the producer finishes, by an observer kernel, and the
# tokens' ready shares from it; BANDTIMES_ARGS, e.g. "--swizzles table,fixed1") ready_scale (one
# GPU, W=1: the producer with the ready scale prototype beside it or on SMs of its own, against
# the producer then the scale; READY_ARGS, e.g. "--n 8192 --variants beside132,own16")
# (default: the first four). Benchmarks run as modules: python3 -m benchmarks.<name>.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-results/h200_session}; mkdir -p "$OUT"
# the device's copy of the tree may carry a stale .git (rows stamped with an old HEAD, seen on
# 2026-12-01): name the revision that travelled
[ -n "${HARNESS_GIT_REV:-}" ] || echo "warning: HARNESS_GIT_REV is not set; rows take this copy's git HEAD ($(git rev-parse --short HEAD 2>/dev/null || echo none)), which may not be the tree that travelled"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
tests_a() {
  timeout "${TESTS_S:-380}" python3 -m pytest -q -m gpu -x -p no:cacheprovider --ignore=tests/test_overlap_system_gpu.py 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -15
}
tests_b() {
  timeout "${TESTS2_S:-180}" python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_overlap_system_gpu.py 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -6
}
# this host's reference folder (h200 for one GPU, h200x<n> for n GPUs): the multi-GPU steps
# resume from its committed table, never from another GPU count's (MACHINE overrides it)
MACHINE=${MACHINE:-$(n=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); [ "${n:-0}" -gt 1 ] && echo "h200x$n" || echo h200)}
resume() {  # resume <table>: start $OUT/<table> from results/reference/$MACHINE/<table> if both apply
  [ -f "$OUT/$1" ] || [ ! -f "results/reference/$MACHINE/$1" ] || cp "results/reference/$MACHINE/$1" "$OUT/"
}
# extra Hydra overrides, written as on a command line (quotes allowed): LAYER_ARGS (layer_x2),
# PRODUCER_ARGS (producer_groups), OVERLAP_ARGS (operator_auto, operator_baselines_auto,
# step_profile, handshake_x2: e.g. "'+experiment.systems.overlap.sweep.consumer=[own,shared]'")
eval "layer_args=(${LAYER_ARGS:-}) producer_args=(${PRODUCER_ARGS:-}) overlap_args=(${OVERLAP_ARGS:-})"
steps=${*:-tests overlap_ccta plan operator}
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) tests_a; tests_b ;;  # both runs, each bounded (on cold caches: two calls, below)
    tests_a) tests_a ;;  # everything but the overlap system's grid (about 7 min on cold caches)
    tests_b) tests_b ;;  # the overlap system's grid (about 2 min)
    overlap_ccta) timeout 150 python3 -m harness.run experiment=overlap_ccta progress=false table="$OUT/overlap_ccta.parquet" 2>&1 | tail -50 ;;
    plan) timeout 60 python3 -m benchmarks.plan_time --out "$OUT/plan_time.parquet" 2>&1 | tail -35 ;;
    kernels) timeout "${KERNELS_S:-400}" python3 -m benchmarks.kernels_h200 --out "$OUT" --skip nvshmem 2>&1 | tee "$OUT/kernels_h200.log" | tail -40 ;;
    bandwidth) timeout "${BANDWIDTH_S:-300}" python3 -m harness.run experiment=bandwidth progress=false table="$OUT/bandwidth.parquet" 2>&1 | tee "$OUT/bandwidth.log" | tail -30
      timeout 150 python3 -m harness.run experiment=bandwidth_nvshmem progress=false table="$OUT/bandwidth.parquet" 2>&1 | tee -a "$OUT/bandwidth.log" | tail -20 ;;
    multigpu) timeout 100 python3 -m harness.run experiment=multigpu_smoke table="$OUT/multigpu_smoke.parquet" 2>&1 | tail -25 ;;
    nvshmem) timeout 60 python3 -m harness.run experiment=multigpu_smoke table="$OUT/multigpu_smoke.parquet" 'experiment.select=[overlap]' experiment.systems.overlap.params.transport=nvshmem 2>&1 | tail -12 ;;
    operator) timeout "${OPERATOR_S:-200}" python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 progress=false table="$OUT/operator.parquet" 'experiment.grid.tokens_per_rank=[8192]' measure.iters=10 measure.warmup=3 2>&1 | tail -40 ;;
    operator_x2) resume operator.parquet
      timeout "${OPERATOR_S:-480}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$OUT/operator.parquet" 'experiment.grid.tokens_per_rank=[8192]' 2>&1 | tail -25
      python3 -m benchmarks.table_summary "$OUT/operator.parquet" ;;
    operator_x2_nvshmem) resume operator.parquet
      for n in 4096 8192; do  # one process per N: NVSHMEM refuses a buffer that grows
        timeout 150 python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$OUT/operator.parquet" 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[$n]" 'experiment.select=[overlap]' +experiment.systems.overlap.params.transport=nvshmem 2>&1 | tail -4; done ;;
    layer_x2_nvshmem) resume layer.parquet
      for t in ${LAYER_T:-8192}; do for h in 4096 8192; do  # one process per buffer size (NVSHMEM)
        timeout 200 python3 -m harness.run experiment=layer hardware.timeout_s=150 progress=false table="$OUT/layer.parquet" "experiment.grid.tokens_per_rank=[$t]" "experiment.grid.hidden=[$h]" 'experiment.select=[overlap]' +experiment.systems.overlap.params.transport=nvshmem 2>&1 | tail -4; done; done ;;
    scale) timeout 120 python3 -m benchmarks.scale_bound --out "$OUT" 2>&1 | tail -10 ;;
    scale_ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)  # the scale's kernel counters
      for n in ${SCALE_NCU_N:-4096 8192}; do
        timeout "${NCU_S:-150}" "$NCU" --clock-control none --profile-from-start off --set full -f -o "/tmp/ncu_scale_$n" python3 -m benchmarks.ncu_scale --cols "$n" --variants "${SCALE_VARIANTS:-t1_n2048_w8,t4_n512_w4,p_t2_n1024_w4}" 2>&1 | grep -v "^==PROF==" | tail -2
        "$NCU" -i "/tmp/ncu_scale_$n.ncu-rep" --page raw --csv > "$OUT/ncu_scale_${n}_raw.csv"; done
      python3 -m benchmarks.ncu_summary "$OUT"/ncu_scale_*_raw.csv --out "$OUT/scale_ncu.parquet" --impls "${SCALE_VARIANTS:-t1_n2048_w8,t4_n512_w4,p_t2_n1024_w4}" ;;
    layer_x2) resume layer.parquet
      timeout "${LAYER_S:-480}" python3 -m harness.run experiment=layer hardware.timeout_s=150 progress=false table="$OUT/layer.parquet" "${layer_args[@]}" 2>&1 | tail -8
      python3 -m benchmarks.table_summary "$OUT/layer.parquet" ;;
    operator_plan) timeout "${PLAN_S:-120}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=120 progress=false table="$OUT/operator_plan.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[overlap]' 2>&1 | tail -3
      python3 -c "import pandas as pd; d=pd.read_parquet('$OUT/operator_plan.parquet'); print(d.groupby(['out','experts_per_rank'])[['latency_ms','m_plan_ms','m_plan_device_ms']].median().round(4).to_string())" ;;
    producer_ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)  # kernel counters
      for w in ${NCU_WORK:-16:moderate_skew 8:balanced 64:balanced}; do f=ncu_${w/:/_}; echo "--- $w"
        timeout "${NCU_S:-200}" "$NCU" --clock-control none --profile-from-start off --set full -f -o "/tmp/$f" python3 -m benchmarks.ncu_producer --workload "$w" --configs "${NCU_CONFIGS:-}" 2>&1 | grep -v "^==PROF==" | tail -4
        "$NCU" -i "/tmp/$f.ncu-rep" --page raw --csv > "$OUT/${f}_raw.csv"
        "$NCU" -i "/tmp/$f.ncu-rep" --page source --csv --print-source sass --kernel-name regex:_producer_kernel > "$OUT/${f}_sass.csv" 2> >(tail -3); done
      python3 -m benchmarks.ncu_summary "$OUT"/ncu_*_raw.csv --out "$OUT/producer_ncu.parquet" --impls "grouped_mm,cublas,triton_table_direct,triton_table_copy${NCU_CONFIGS:+,$NCU_CONFIGS},cutlass_1x2" ;;
    devplan_tests) timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "device_plan or device_plans" tests/test_layer_gpu.py -p no:cacheprovider 2>&1 | tail -6 ;;
    profile_stage_a) timeout 60 python3 -m benchmarks.profile_stage_a --out "$OUT" 2>&1 | tail -44 ;;
    exps) for e in ${EXPS:-models experts experts_operator}; do  # each resumes from results/<its table>
        echo "--- $e $(date +%T)"; timeout "${EXP_S:-300}" python3 -m harness.run experiment=$e progress=false 2>&1 | tail -${EXP_TAIL:-8}; done
      cp results/*.parquet "$OUT/" ;;
    one_gpu) for e in ${EXPS1:-correctness_loopback}; do  # one GPU of the host: loopback rows
        echo "--- $e (one GPU) $(date +%T)"; CUDA_VISIBLE_DEVICES=0 timeout "${EXP_S:-300}" python3 -m harness.run experiment=$e progress=false table="$OUT/$e.parquet" 2>&1 | tail -${EXP_TAIL:-8}; done ;;
    producer) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-240}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer.parquet" 2>&1 | tail -4
      python3 -c "from plots.producer import ratios; import pandas as pd; r=ratios(pd.read_parquet('$OUT/producer.parquet')); print(r.pivot_table(index=['out','experts_per_rank','routing'],columns='variant',values='vs_grouped_mm').round(3).to_string())" ;;
    producer_configs) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-150}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer.parquet" 'experiment.options.configs=[ws,stages4,group8]' 'experiment.grid.out=[8192]' 'experiment.grid.experts_per_rank=[16,64]' 'experiment.grid.routing=[balanced]' 2>&1 | tail -4
      python3 -c "import pandas as pd; d=pd.read_parquet('$OUT/producer.parquet'); d=d[d.p_config.fillna('')!='']; print(d.groupby(['experts_per_rank','p_tile_m','p_order','p_config','status'])['m_tflops'].median().round(0).to_string())" ;;
    order) timeout "${ORDER_S:-240}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$OUT/operator_order.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto '+experiment.systems.overlap.sweep.order=[remote_first,expert]' 2>&1 | tail -3
      python3 -c "from plots.variants import speedups; import pandas as pd; s=speedups(pd.read_parquet('$OUT/operator_order.parquet').query('status==\"ok\"')); print(s.pivot_table(index=['out','experts_per_rank','routing'],columns='variant',values='speedup').round(3).to_string())" ;;
    producer_cutlass) [ -f build/libmoe_cutlass_sm90.so ] || { echo "no build/libmoe_cutlass_sm90.so: make cutlass (carry build)"; continue; }
      eval "extra=(${CUTLASS_ARGS:-})"  # Hydra overrides, quoted as on a command line
      CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-300}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_cutlass.parquet" 'experiment.options.configs=[table,cutlass,cutlass_expert,cutlass_expert_c12]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[aligned]' "${extra[@]}" 2>&1 | tail -4
      python3 -c "from plots.producer import ratios; import pandas as pd; d=pd.read_parquet('$OUT/producer_cutlass.parquet'); print(d.groupby(['system','p_config','status'],dropna=False).size().to_string()); print(d[d.status!='ok'][['experts_per_rank','p_config','reason']].drop_duplicates('p_config').to_string()[:1500]); r=ratios(d); print(r.pivot_table(index=['out','experts_per_rank','routing'],columns='variant',values='vs_grouped_mm').round(3).to_string())" ;;
    producer_layouts) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-240}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_layouts.parquet" 'experiment.options.configs=[table,cutlass_expert_c12]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[aligned,packed,compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -4
      python3 -c "from plots.producer import ratios; import pandas as pd; d=pd.read_parquet('$OUT/producer_layouts.parquet'); print(d.groupby(['system','p_layout','p_config','status'],dropna=False).size().to_string()); r=ratios(d); print(r.pivot_table(index=['out','experts_per_rank','routing'],columns='variant',values='vs_grouped_mm').round(3).to_string()); print(r.groupby('variant')['vs_grouped_mm'].describe().round(3).to_string())" ;;
    producer_variants) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-270}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_variants.parquet" 'experiment.options.configs=[table,group8,stages4,g8s4]' 'experiment.systems.overlap.sweep.layout=[aligned]' 2>&1 | tail -2 ;;
    operator_auto) timeout "${ORDER_S:-150}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=120 progress=false table="$OUT/operator_auto.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto "${overlap_args[@]}" 2>&1 | tail -1
      python3 -m benchmarks.table_summary "$OUT/operator_auto.parquet" 2>&1 | tail -2  # host time and syncs per step
      python3 -m benchmarks.table_summary "$OUT/operator_auto.parquet" --by p_layout,p_consumer ;;
    handshake_x2) timeout 200 python3 -m pytest -q -m gpu tests/test_handshake_gpu.py 2>&1 | tail -3
      timeout "${HS_S:-280}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=120 progress=false table="$OUT/operator_handshake.parquet" 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[${HS_N:-4096}]" "experiment.grid.experts_per_rank=[${HS_E:-16,64}]" 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto '+experiment.systems.overlap.sweep.layout=[compact]' '+experiment.systems.overlap.sweep.handshake=[allreduce,barrier]' '+experiment.systems.overlap.sweep.handshake_stream=[step,consumer]' "${overlap_args[@]}" 2>&1 | tail -1
      python3 -m benchmarks.table_summary "$OUT/operator_handshake.parquet" --by p_handshake,p_handshake_stream,p_consumer ;;
    operator_auto_shared) timeout "${SHARED_S:-150}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=120 progress=false table="$OUT/operator_auto.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto '+experiment.systems.overlap.sweep.layout=[compact]' '+experiment.systems.overlap.sweep.consumer=[shared]' 2>&1 | tail -1
      python3 -m benchmarks.table_summary "$OUT/operator_auto.parquet" 2>&1 | tail -2  # host time and syncs per step
      python3 -m benchmarks.table_summary "$OUT/operator_auto.parquet" --by p_layout,p_consumer ;;
    operator_baselines_auto) timeout "${OPERATOR_S:-330}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$OUT/operator_baselines_auto.parquet" 'experiment.grid.tokens_per_rank=[8192]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto "${overlap_args[@]}" 2>&1 | tail -1
      python3 -m benchmarks.table_summary "$OUT/operator_baselines_auto.parquet" 2>&1 | tail -31 ;;
    recalibrate) timeout "${AUTO_S:-150}" python3 -m harness.run experiment=ccta_auto progress=false table="$OUT/ccta_auto_expert.parquet" 'experiment.grid.experts_per_rank=[32,64]' 'experiment.systems.overlap.sweep.ccta=[4,6,8,12,16,24,auto]' 2>&1 | tail -1
      python3 -m benchmarks.fit_autotune results/reference/h200/overlap_ccta.parquet results/reference/h200x2/ccta_mgb.parquet results/reference/h200x2/ccta_auto.parquet "$OUT/ccta_auto_expert.parquet" --table "$OUT/autotune_table.csv" --heldout "$OUT/autotune_heldout.parquet" 2>&1 | tail -2
      cp "$OUT/autotune_table.csv" systems/overlap/autotune_table.csv ;;  # later steps of this call use the refit
    shared_loopback) CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 hardware.timeout_s=120 progress=false 'experiment.grid.tokens_per_rank=[8192]' 'experiment.grid.world_size=[2]' 'experiment.select=[overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto +experiment.systems.overlap.params.transport=loopback table="$OUT/operator_shared_loopback.parquet" 2>&1 | tail -1 ;;
    repeat) for i in 1 2 3; do  # the same N=4096 balanced cells in three processes: run-to-run spread
        timeout 60 python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=60 progress=false 'experiment.grid.tokens_per_rank=[8192]' 'experiment.grid.out=[4096]' 'experiment.grid.routing=[balanced]' 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto table="$OUT/repeat_$i.parquet" 2>&1 | tail -1; done
      python3 -c "import pandas as pd; d=pd.concat([pd.read_parquet('$OUT/repeat_%d.parquet' % i).assign(run=i) for i in (1,2,3)]); print(d.pivot_table(index=['experts_per_rank','system'],columns='run',values=['latency_ms','latency_p90_ms']).round(3).to_string())" ;;
    ccta_auto) timeout "${AUTO_S:-300}" python3 -m harness.run experiment=ccta_auto progress=false table="$OUT/ccta_auto.parquet" 2>&1 | tail -3
      python3 -m benchmarks.fit_autotune results/reference/h200/overlap_ccta.parquet results/reference/h200x2/ccta_mgb.parquet "$OUT/ccta_auto.parquet" --table "$OUT/autotune_table.csv" --heldout "$OUT/autotune_heldout.parquet" 2>&1 | tail -4 ;;
    producer_flags) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-200}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_flags.parquet" 'experiment.options.configs=[table,warp,thread]' 'experiment.options.flags=[true,false]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2
      python3 -c "from plots.producer import ratios; import pandas as pd; d=pd.read_parquet('$OUT/producer_flags.parquet'); print(d.groupby(['system','p_config','p_flags','status'],dropna=False).size().to_string()); r=ratios(d); print(r.pivot_table(index=['out','experts_per_rank','routing'],columns='variant',values='vs_grouped_mm').round(3).to_string()); g=r.groupby('variant')['vs_grouped_mm']; print(pd.DataFrame({'min':g.min(),'med':g.median(),'max':g.max(),'ge1':g.apply(lambda s:(s>=1).sum())}).round(3).to_string())" ;;
    producer_mid) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-200}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_mid.parquet" 'experiment.options.configs=[table,mid,split4,mid4]' 'experiment.options.local=[copy,direct]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m harness.run experiment=producer progress=false table="$OUT/producer_mid.parquet" 'experiment.options.configs=[table,split4]' 'experiment.options.flags=[false]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2 ;;
    producer_split) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-200}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_split.parquet" 'experiment.options.configs=[table,split2,split4,s4st4,s4g4,s4g16,s4k128]' 'experiment.options.local=[direct]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m harness.run experiment=producer progress=false table="$OUT/producer_split.parquet" 'experiment.options.configs=[table,split4]' 'experiment.options.local=[direct]' 'experiment.systems.overlap.sweep.tile_m=[64]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2 ;;
    producer_default) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-200}" python3 -m harness.run experiment=producer progress=false table="$OUT/producer_default.parquet" 'experiment.options.configs=[table,cutlass_expert_c12]' 'experiment.options.local=[copy,direct]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[aligned,compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2 ;;
    producer_bmm) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-240}" python3 -m harness.run experiment=producer progress=false table="$OUT/${PRODUCER_TABLE:-producer_bmm}.parquet" 'experiment.options.configs=[table,cutlass_expert_c12]' 'experiment.options.local=[copy,direct]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2
      python3 -m benchmarks.producer_summary "$OUT/${PRODUCER_TABLE:-producer_bmm}.parquet" ;;
    producer_groups) CUDA_VISIBLE_DEVICES=0 timeout "${PRODUCER_S:-200}" python3 -m harness.run experiment=producer progress=false table="$OUT/${PRODUCER_TABLE:-producer_groups}.parquet" "experiment.options.configs=[${PRODUCER_CONFIGS:-table,eg8,eg16,eg32,eg64}]" "${producer_args[@]}" 'experiment.options.local=[direct]' 'experiment.systems.overlap.sweep.tile_m=[128]' 'experiment.systems.overlap.sweep.layout=[compact]' 'experiment.systems.overlap.sweep.order=[expert]' 2>&1 | tail -2
      python3 -c "import pandas as pd; d=pd.read_parquet('$OUT/${PRODUCER_TABLE:-producer_groups}.parquet'); d=d[d.status=='ok']; k=['out','experts_per_rank','routing']; g=d[d.system=='torch_grouped_mm'].set_index(k).latency_ms; o=d[d.system=='overlap'].copy(); o['r']=[g.get(tuple(x)) / l for x, l in zip(o[k].values, o.latency_ms)]; print(o.pivot_table(index=k, columns='p_config', values='r').round(3).to_string()); print(o.groupby('p_config').r.agg(['min','median',lambda s: int((s >= 1).sum()),'count']).round(3))" ;;
    swizzle_loopback) CUDA_VISIBLE_DEVICES=0 timeout "${LAYOUTS_S:-400}" python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 progress=false table="$OUT/operator_swizzle_loopback.parquet" 'experiment.grid.world_size=[2]' 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[${SWIZZLE_N:-8192}]" 'experiment.select=[overlap]' '+experiment.systems.overlap.sweep.layout=[compact]' "+experiment.systems.overlap.sweep.swizzle=[${SWIZZLES:-table,expert32,expert16}]" 2>&1 | tail -1
      python3 -c "import pandas as pd; d=pd.read_parquet('$OUT/operator_swizzle_loopback.parquet'); d=d[d.status=='ok']; d['v']=d.system+'/'+d.get('p_swizzle',pd.Series('',index=d.index)).fillna('').astype(str); p=d.pivot_table(index=['out','experts_per_rank','routing'],columns='v',values='latency_ms'); c0=p.columns[0]; [p.insert(len(p.columns),'x_'+c,p[c]/p[c0]) for c in list(p.columns)[1:]]; print(p.round(3).to_string())" ;;
    consumer_loopback) for spec in "own:${OWN_CCTA:-16}" "shared:${SHARED_CCTA:-16,32,66,132}"; do  # one table, two grids
        CUDA_VISIBLE_DEVICES=0 timeout "${CONSUMER_S:-250}" python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 progress=false table="$OUT/operator_consumer_loopback.parquet" 'experiment.grid.world_size=[2]' 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[${CONSUMER_N:-8192}]" "experiment.grid.experts_per_rank=[${CONSUMER_E:-4,8,16,32,64}]" "experiment.grid.routing=[${CONSUMER_ROUTING:-balanced,moderate_skew,stress_skew}]" 'experiment.select=[overlap]' '+experiment.systems.overlap.sweep.layout=[compact]' "+experiment.systems.overlap.sweep.consumer=[${spec%%:*}]" "+experiment.systems.overlap.sweep.ccta=[${spec#*:}]" 2>&1 | tail -1; done
      python3 -m benchmarks.consumer_summary "$OUT/operator_consumer_loopback.parquet" ;;
    consumer_x2) T="$OUT/operator_consumer_x2.parquet"  # 2+ GPUs: own SMs (auto cCTA/mgb) and serial, then shared
      timeout "${CONSUMER_S:-300}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$T" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' '+experiment.systems.overlap.sweep.layout=[compact]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto 2>&1 | tail -1
      timeout "${CONSUMER_S:-300}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$T" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[overlap]' '+experiment.systems.overlap.sweep.layout=[compact]' '+experiment.systems.overlap.sweep.consumer=[shared]' "+experiment.systems.overlap.sweep.ccta=[${SHARED_CCTA:-66,132}]" "+experiment.systems.overlap.sweep.mgb=[${SHARED_MGB:-1}]" 2>&1 | tail -1
      python3 -m benchmarks.consumer_summary "$T"; python3 -m benchmarks.table_summary "$T" | tail -18 ;;
    consumer_correctness_x2) for e in correctness correctness_nvshmem; do  # shared over p2p, then nvshmem
        timeout "${EXP_S:-240}" python3 -m harness.run experiment=$e progress=false table="$OUT/correctness_shared.parquet" 'experiment.systems.overlap.sweep.ccta=[16,132]' 'experiment.systems.overlap.sweep.mgb=[1]' 'experiment.systems.overlap.sweep.layout=[aligned,compact]' '+experiment.systems.overlap.sweep.consumer=[shared]' 2>&1 | tail -2; done ;;
    host_bound) hb=(experiment=operator hardware=h200 'experiment.grid.world_size=[2]' 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[${HOST_N:-4096}]" 'experiment.select=[serial,overlap]' '+experiment.systems.overlap.sweep.layout=[compact]')
      for q in false true; do for spec in own:16 shared:132; do  # the same cells timed eager, then queued ahead
        CUDA_VISIBLE_DEVICES=0 timeout "${HOST_S:-150}" python3 -m harness.run "${hb[@]}" hardware.world_size=1 progress=false table="$OUT/operator_host_$q.parquet" measure.queue_ahead=$q "experiment.grid.experts_per_rank=[${HOST_E:-4,16,32}]" 'experiment.grid.routing=[balanced,stress_skew]' "+experiment.systems.overlap.sweep.consumer=[${spec%%:*}]" "+experiment.systems.overlap.sweep.ccta=[${spec#*:}]" 2>&1 | tail -1; done
        python3 -c "import pandas as pd; pd.set_option('display.width',250); d=pd.read_parquet('$OUT/operator_host_$q.parquet'); d=d[d.status=='ok']; d['v']=d.system+'/'+d.get('p_consumer',pd.Series('',index=d.index)).fillna('').astype(str); print('queue_ahead=$q'); print(d.pivot_table(index=['out','experts_per_rank','routing'],columns='v',values=['latency_ms','latency_p90_ms','m_host_ms']).round(3).to_string())"; done
      for spec in own:16 shared:132; do CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m benchmarks.host_profile --steps 20 --top 25 -- "${hb[@]}" 'experiment.grid.experts_per_rank=[16]' 'experiment.grid.routing=[balanced]' "+experiment.systems.overlap.sweep.consumer=[${spec%%:*}]" "+experiment.systems.overlap.sweep.ccta=[${spec#*:}]" 2>&1 | tee -a "$OUT/host_profile.log" | grep -v "^ *$" | cut -c1-150 | head -75; done ;;
    layer_host) lh=(experiment=layer hardware.world_size=1 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.hidden=[${LHOST_H:-4096,8192}]" "experiment.grid.experts_per_rank=[${LHOST_E:-4,16,64}]" 'experiment.grid.routing=[balanced]' 'experiment.select=[serial,overlap]')
      CUDA_VISIBLE_DEVICES=0 timeout "${LHOST_S:-200}" python3 -m harness.run "${lh[@]}" progress=false table="$OUT/layer_host${LHOST_TAG:-}.parquet" 2>&1 | tail -1
      python3 -c "import pandas as pd; pd.set_option('display.width',250); d=pd.read_parquet('$OUT/layer_host${LHOST_TAG:-}.parquet'); d=d[d.status=='ok']; print(d.pivot_table(index=['hidden','experts_per_rank'],columns='system',values=['latency_ms','m_host_ms','m_plan_ms']).round(3).to_string())"
      CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m benchmarks.host_profile --idle --launches --steps 10 -- "${lh[@]}" 2>&1 | tee -a "$OUT/layer_host${LHOST_TAG:-}.log" | grep -v "^ *$" | cut -c1-160 | head -120 ;;
    layouts_loopback2) CUDA_VISIBLE_DEVICES=0 timeout "${LAYOUTS_S:-200}" python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 progress=false table="$OUT/operator_layouts_loopback.parquet" 'experiment.grid.world_size=[2]' 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[overlap]' '+experiment.systems.overlap.sweep.layout=[aligned,compact]' 2>&1 | tail -1 ;;
    layouts_loopback) CUDA_VISIBLE_DEVICES=0 timeout "${LAYOUTS_S:-200}" python3 -m harness.run experiment=operator hardware=h200 hardware.world_size=1 progress=false table="$OUT/operator_layouts_loopback.parquet" 'experiment.grid.world_size=[2]' 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' '+experiment.systems.overlap.sweep.layout=[aligned,packed,compact]' 2>&1 | tail -1 ;;
    operator_layouts) timeout "${LAYOUTS_S:-300}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=120 progress=false table="$OUT/operator_layouts.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto '+experiment.systems.overlap.sweep.layout=[aligned,compact]' 2>&1 | tail -1
      python3 -m benchmarks.table_summary "$OUT/operator_layouts.parquet" --by p_layout ;;
    variants) timeout "${VARIANTS_S:-240}" python3 -m harness.run experiment=operator hardware=h200 hardware.timeout_s=150 progress=false table="$OUT/variants.parquet" 'experiment.grid.tokens_per_rank=[8192]' 'experiment.select=[serial,overlap]' '+experiment.systems.overlap.sweep.local=[copy,direct]' '+experiment.systems.overlap.sweep.layout=[aligned,packed,compact]' 2>&1 | tail -3
      python3 -m benchmarks.table_summary "$OUT/variants.parquet" --by p_local,p_layout ;;
    step_profile) n=$(nvidia-smi -L | grep -c "^GPU")  # each rank's step timeline, one process per GPU (torchrun)
      timeout "${PROFILE_S:-300}" python3 -m torch.distributed.run --nproc-per-node "$n" -m benchmarks.step_profile --steps 20 --out "$OUT" -- experiment=operator hardware=h200 'experiment.grid.tokens_per_rank=[8192]' "experiment.grid.out=[${PROFILE_N:-4096,8192}]" "experiment.grid.experts_per_rank=[${PROFILE_E:-16,64}]" "experiment.grid.routing=[${PROFILE_ROUTING:-balanced}]" 'experiment.select=[serial,overlap]' +experiment.systems.overlap.params.ccta=auto +experiment.systems.overlap.params.mgb=auto '+experiment.systems.overlap.sweep.layout=[compact]' "${overlap_args[@]}" 2>&1 | grep -v -i "warn" | tail -"${PROFILE_TAIL:-160}" ;;
    band_times) timeout "${BANDTIMES_S:-300}" python3 -m benchmarks.band_times --out "$OUT" ${BANDTIMES_ARGS:-} 2>&1 | tee "$OUT/band_times.log" | tail -"${BANDTIMES_TAIL:-40}" ;;  # one GPU
    ready_scale) CUDA_VISIBLE_DEVICES=0 timeout "${READY_S:-300}" python3 -m benchmarks.ready_scale --out "$OUT" ${READY_ARGS:-} 2>&1 | tee "$OUT/ready_scale.log" | tail -"${READY_TAIL:-60}" ;;  # one GPU, W=1
    verify) timeout "${VERIFY_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_handshake_gpu.py tests/test_layer_routing_gpu.py tests/test_layer_gpu.py tests/test_overlap_system_gpu.py 2>&1 | tee "$OUT/pytest_gpu_verify.log" | tail -6 ;;
    host_syncs) timeout "${HS_S:-200}" python3 -m harness.run experiment=layer_smoke progress=false table="$OUT/host_syncs_layer.parquet" 2>&1 | tail -1  # every system's layer step
      python3 -m benchmarks.table_summary "$OUT/host_syncs_layer.parquet" | tail -2 ;;
    megatron_gpu) timeout 150 python3 -m pytest -q -m gpu tests/test_megatron.py -p no:cacheprovider 2>&1 | tail -8 ;;
  esac
done
echo "=== done $(date +%T)"
