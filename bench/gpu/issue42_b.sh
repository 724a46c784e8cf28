#!/bin/bash
# Issue 42 on a lent GPU, call B (after issue42_a.sh, same warm machine; carry [".whl"]): the
# plain-loop bench (stage=train beside a plain loop, eager and compiled, mbs 2 and 8), stage=tune
# and held-out layouts, the MoE model cut to fit; profiles and summaries as $OUT/profiles_b.tgz.
# CPU dry run (after issue42_a.sh's): DRY=1 OUT=/tmp/out bash bench/gpu/issue42_b.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || [ -n "$DRY" ] || exit 9
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if [ -n "$DRY" ]; then
  C="cluster=local cluster.tasks_per_node=1"; M="model=tiny"; SEQ=128; D=/tmp/dryprof; GBS=4
  BENCH="--smoke"; MOE="model=tiny_moe"; MSEQ=128; MSEQS="[64,128]"
else
  C="cluster=gpu_node cluster.device_mem_GiB=140"; M="model=llama2_7b model.layers=4"; SEQ=2048; D=/dev/shm/prof; GBS=8
  BENCH="--mbs 2 8 --steps 10"; MOE="model=mixtral_8x7b model.layers=2"; MSEQ=4096; MSEQS="[2048,4096]"
fi
P="$C $M profiles_dir=$D"
T="train.pp=1 train.tp=1 train.seq_len=$SEQ train.global_batch_size=$GBS train.keep_checkpoints=0 train.plot=false train.steps=7 train.timing_warmup_steps=3"
s() { local t0=$SECONDS; "$@"; local rc=$?; echo "== rc=$rc wall=$((SECONDS - t0)) s: ${*:2:6}"; keep; return $rc; }
# after each step: the rows and the profiles and summaries (other pricing formulas can be tried
# on them offline) rewritten in $OUT, so a call the device budget cuts short returns what ran
keep() { python3 bench/gpu/rows.py $D > $OUT/b_rows.txt 2>&1; tar czf $OUT/profiles_b.tgz --exclude='*.ckpt' --exclude='*.png' -C $D . 2>/dev/null; }
s timeout 200 python3 bench/plain_loop.py $BENCH --json $OUT/b_plain.json > $OUT/b_plain.log 2>&1
tail -12 $OUT/b_plain.log
s timeout 110 python3 -m orchestrator stage=tune $P search.seq_len=$SEQ search.global_batch_size=$GBS tune.top_k=3 tune.controls=false tune.steps=7 > $OUT/b_tune.log 2>&1
tail -22 $OUT/b_tune.log
for x in "1 none" "2 full" "8 selective"; do set -- $x
  s timeout 45 python3 -m orchestrator stage=train $P $T train.micro_batch_size=$1 train.recompute=$2 > $OUT/b_heldout.log 2>&1
  grep -E "tokens/s|calibrat" $OUT/b_heldout.log | tail -3
done
Q="$C $MOE profiles_dir=$D"
s timeout 120 python3 -m orchestrator stage=profile_model $Q "profile_model.seq_lens=$MSEQS" profile_model.max_tp=1 profile_model.plot=false > $OUT/b_moe_pm.log 2>&1
tail -3 $OUT/b_moe_pm.log
s timeout 70 python3 -m orchestrator stage=train $Q train.pp=1 train.tp=1 train.seq_len=$MSEQ train.global_batch_size=4 train.micro_batch_size=1 train.steps=7 train.keep_checkpoints=0 train.plot=false > $OUT/b_moe_train.log 2>&1
grep -E "tokens/s|error|compile" $OUT/b_moe_train.log | tail -4
cat $OUT/b_rows.txt; ls -la $OUT | tail -3
