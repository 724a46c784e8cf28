#!/bin/bash
# Issue 42 on a lent GPU, call A (device tool: `run` with carry [".whl"], from the repository root;
# the wheels: bash bench/gpu/wheels.sh here first): profile_hardware, profile_model (compiled
# blocks, host and device apart over micro-batch sizes), search, then stage=train for each of
# the 12 layouts (mbs 1/2/4/8 x recompute none/selective/full), predicted beside measured
# (bench/gpu/rows.py), and the profiles and summaries back as $OUT/profiles_a.tgz.
# ~10 min on an H200. Then issue42_b.sh on the same warm machine.
# CPU dry run (tiny, cluster=local, one task; ~40 s): DRY=1 OUT=/tmp/out bash bench/gpu/issue42_a.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || [ -n "$DRY" ] || exit 9
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if [ -n "$DRY" ]; then
  C="cluster=local cluster.tasks_per_node=1"; M="model=tiny"; SEQ=128; D=/tmp/dryprof; SEQS="[64,128]"; MBS="1 2"; GBS=4
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  C="cluster=gpu_node cluster.device_mem_GiB=140"; M="model=llama2_7b model.layers=4"; SEQ=2048; D=/dev/shm/prof; SEQS="[1024,2048]"; MBS="1 2 4 8"; GBS=8
fi
P="$C $M profiles_dir=$D"
T="train.pp=1 train.tp=1 train.seq_len=$SEQ train.global_batch_size=$GBS train.keep_checkpoints=0 train.plot=false train.steps=7 train.timing_warmup_steps=3"
s() { local t0=$SECONDS; "$@"; local rc=$?; echo "== rc=$rc wall=$((SECONDS - t0)) s: ${*:2:6}"; }
s timeout 40 python3 -m orchestrator stage=profile_hardware $P profile_hardware.max_time_s=0.05 > $OUT/a_hw.log 2>&1
s timeout 170 python3 -m orchestrator stage=profile_model $P "profile_model.seq_lens=$SEQS" profile_model.plot=false > $OUT/a_pm.log 2>&1
tail -12 $OUT/a_pm.log
python3 - $D <<'PY'
import json, glob, sys
for f in glob.glob(sys.argv[1] + "/*/model/*.json"):
    d = json.load(open(f)); x = d["fits"]["1"]
    print("method.host_device:", d["method"].get("host_device")); print("compiled:", d["method"].get("compiled"))
    print("host_us", x.get("host_us"), "per token", x.get("host_us_per_token")); print("device_us", x.get("device_us"))
    print("resid", {k: round(max(map(abs, v)), 3) for k, v in (x.get("device_rel_residuals") or {}).items()})
    for p in d["points"]:
        print(p["seq_len"], p.get("compiled"), round(p["block_fwd_us"]), round(p["block_bwd_us"]), [(h["micro_batch_size"], round(h.get("block_fwd_device_us", 0)), round(h.get("block_fwd_host_us", 0)), round(h.get("block_bwd_device_us", 0))) for h in p.get("host_device", [])])
PY
s timeout 60 python3 -m orchestrator stage=search $P search.seq_len=$SEQ search.global_batch_size=$GBS > $OUT/a_search.log 2>&1
grep -iE "pick|fastest|s/iter|mbs|micro" $OUT/a_search.log | head -12
# Recompute none first, largest micro-batch first (the search's candidates, then mbs 1: the host
# lead's question), then selective and full. After each layout its row is printed and the rows
# and profiles in $OUT are rewritten: a call cut by the device budget still returns what ran.
for rc in none selective full; do for mbs in $(echo $MBS | tr ' ' '\n' | sort -rn); do
  L=$D/logs/train_${mbs}_$rc.log; mkdir -p $D/logs  # $OUT returns 8 files at most: the logs travel in the tgz
  s timeout 45 python3 -m orchestrator stage=train $P $T train.micro_batch_size=$mbs train.recompute=$rc > $L 2>&1 || tail -5 $L
  cp $L $OUT/a_train.log
  python3 bench/gpu/rows.py $D > $OUT/a_rows.txt; grep -- "mbs${mbs}x" $OUT/a_rows.txt | grep -E "$([ $rc = none ] && echo '1f1b +pred' || echo "rc$rc")" | tail -1
  tar czf $OUT/profiles_a.tgz --exclude='*.ckpt' --exclude='*.png' -C $D . 2>/dev/null  # the profiles and summaries: price other formulas offline
done; done
cat $OUT/a_rows.txt; ls -la $OUT | tail -3
