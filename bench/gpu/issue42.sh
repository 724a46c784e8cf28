#!/bin/bash
# Issue 42's figures on a lent GPU, as many as the device time allows, in calls that resume.
#   here, once:        bash bench/gpu/wheels.sh
#   device `run`:      BUDGET_S=560 bash bench/gpu/issue42.sh     (carry [".whl"], timeout_s 600)
#   then at once, on the still-warm machine (it is let go ~30 s after a call), with what is left:
#                      BUDGET_S=<device seconds left - 30> bash bench/gpu/issue42.sh
# Each step runs once: a later call skips what an earlier one finished (markers in
# $D/.issue42, /dev/shm). A fresh machine starts over, unless an earlier call's
# $OUT/profiles.tgz is carried as .gpuprof/profiles.tgz (carry [".whl", ".gpuprof"]) and was
# measured on the same GPU. A step starts only if its estimate fits in what is left of
# BUDGET_S; one the budget cut short runs again next call, and nothing after it runs before it.
# In the order of what the issue's done-when needs most:
#   1. profile_hardware, profile_model (compiled blocks, host and device apart, mbs 1-8), search
#   2. bench/plain_loop.py at mbs 8 and 2 with these profiles: stage=train beside the plain
#      loop, eager and compiled (tokens/s, 1.0x?); its stage=train summaries are the matrix's
#      recompute-none rows for mbs 8 and 2
#   3. stage=train, the rest of the matrix: mbs 4, 1 (none), then selective, full x mbs 8/4/2/1
#   4. stage=tune (top 3), then held-out layouts trained with its calibration
#   5. the MoE model cut to fit: profile_model, stage=train
# After each step, in $OUT (8 files come back at most): progress.txt (a line per step),
# rows.txt (bench/gpu/rows.py: predicted beside measured per summary), plain_mbs*.json (the
# bench's rows), last.log (the step's log), profiles.tgz (profiles, summaries, every log).
# CPU dry run (tiny, cluster=local, one task; ~3 min): DRY=1 OUT=/tmp/out bash bench/gpu/issue42.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || [ -n "$DRY" ] || exit 9
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; BUDGET_S=${BUDGET_S:-560}; mkdir -p $OUT
if [ -n "$DRY" ]; then
  C="cluster=local cluster.tasks_per_node=1"; M="model=tiny"; SEQ=128; D=/tmp/dryprof; SEQS="[64,128]"; MBS="4 2 1"; GBS=4
  BENCH="--model tiny --layers 4 --seq 128 --gbs 4 --steps 3 --warmup 2 --compile-backend eager"
  MOE="model=tiny_moe"; MSEQ=128; MSEQS="[64,128]"; X=4  # CPU: estimates / 4
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  C="cluster=gpu_node cluster.device_mem_GiB=140"; M="model=llama2_7b model.layers=4"; SEQ=2048; D=/dev/shm/prof; SEQS="[1024,2048]"; MBS="8 4 2 1"; GBS=8
  BENCH="--model llama2_7b --layers 4 --seq 2048 --gbs 8 --steps 9 --warmup 3"; MOE="model=mixtral_8x7b model.layers=2"; MSEQ=4096; MSEQS="[2048,4096]"; X=1
fi
P="$C $M profiles_dir=$D"
T="train.pp=1 train.tp=1 train.seq_len=$SEQ train.global_batch_size=$GBS train.keep_checkpoints=0 train.plot=false train.steps=7 train.timing_warmup_steps=3"
DONE=$D/.issue42; STOPPED=; mkdir -p $DONE $D/logs
# A fresh machine resumes a session's earlier one from its profiles.tgz, carried as
# .gpuprof/profiles.tgz (git-ignored), if that one had the same GPU: its profiles priced these
GPU=$([ -n "$DRY" ] && echo CPU || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
RESTORE=${RESTORE:-.gpuprof/profiles.tgz}
if [ ! -e $D/.issue42.gpu ] && [ -f $RESTORE ]; then
  rm -rf /tmp/restore && mkdir -p /tmp/restore && tar xzf $RESTORE -C /tmp/restore
  if [ "$(cat /tmp/restore/.issue42.gpu 2>/dev/null)" = "$GPU" ]; then cp -a /tmp/restore/. $D/; echo "== resumed from $RESTORE"
  else echo "== $RESTORE not resumed: it was measured on '$(cat /tmp/restore/.issue42.gpu 2>/dev/null)', this is '$GPU'"; fi
fi
echo "$GPU" > $D/.issue42.gpu
echo "== call at $(date -u +%H:%M:%S), budget $BUDGET_S s, done before: $(ls $DONE | tr '\n' ' ')" | tee -a $OUT/progress.txt

keep() {  # the rows and everything measured so far, rewritten in $OUT after every step
  python3 bench/gpu/rows.py $D > $OUT/rows.txt 2>&1
  [ -d $D/tuned ] && { echo "-- after stage=tune (calibrated):"; python3 bench/gpu/rows.py $D/tuned; } >> $OUT/rows.txt 2>&1
  tar czf $OUT/profiles.tgz --exclude='*.ckpt' --exclude='*.png' -C $D . 2>/dev/null
}
# step NAME ESTIMATE_S LIMIT_S COMMAND...: COMMAND's output in $D/logs/NAME.log
step() {
  local name=$1 est=$(($2 / X)) cap=$3; shift 3
  if [ -e $DONE/$name ]; then echo "== $name: done in an earlier call ($(cat $DONE/$name))"; return 0; fi
  local left=$((BUDGET_S - SECONDS))
  [ -n "$STOPPED" ] && return 0  # the steps run in order: later ones may need this one
  if [ $left -lt $est ]; then
    STOPPED=1; echo "== $name and after: not started, ${left} s of the budget left for ~${est} s: call again" | tee -a $OUT/progress.txt; return 0
  fi
  local limit=$((cap < left - 5 ? cap : left - 5)) t0=$SECONDS
  timeout $limit "$@" > $D/logs/$name.log 2>&1; local rc=$?
  echo "== $name: rc=$rc wall=$((SECONDS - t0)) s" | tee -a $OUT/progress.txt
  # cut by the budget rather than by its own limit: run again next call, and nothing after it now
  if [ $rc -ne 124 ] || [ $limit -ge $cap ]; then echo "rc=$rc wall=$((SECONDS - t0)) s" > $DONE/$name; else STOPPED=1; fi
  [ $rc -eq 0 ] || tail -5 $D/logs/$name.log
  cp $D/logs/$name.log $OUT/last.log; keep
}
train() {  # train NAME MBS RECOMPUTE PROFILES_DIR: one layout of the matrix
  local name=$1 mbs=$2 rc=$3
  step $name 40 75 python3 -m orchestrator stage=train $C $M profiles_dir=$4 $T train.micro_batch_size=$mbs train.recompute=$rc
  grep -E "tokens/s|error|calibrat" $D/logs/$name.log 2>/dev/null | tail -2
}

step hw 20 40 python3 -m orchestrator stage=profile_hardware $P profile_hardware.max_time_s=0.05
step pm 100 170 python3 -m orchestrator stage=profile_model $P "profile_model.seq_lens=$SEQS" profile_model.plot=false
tail -4 $D/logs/pm.log 2>/dev/null
step search 15 60 python3 -m orchestrator stage=search $P search.seq_len=$SEQ search.global_batch_size=$GBS
grep -iE "pick|fastest|s/iter|mbs|micro" $D/logs/search.log 2>/dev/null | head -8

for mbs in $(echo $MBS | cut -d' ' -f1) 2; do  # the largest micro-batch and mbs 2, as the issue asks
  step bench_$mbs 110 200 python3 bench/plain_loop.py $BENCH --mbs $mbs --profiles-dir $D --keep-summaries $D --json $OUT/plain_mbs$mbs.json
  tail -8 $D/logs/bench_$mbs.log 2>/dev/null
  [ -e $DONE/bench_$mbs ] && echo "the bench's stage=train" > $DONE/train_${mbs}_none  # this row
done
for rc in none selective full; do for mbs in $MBS; do train train_${mbs}_$rc $mbs $rc $D; done; done

step tune 120 200 python3 -m orchestrator stage=tune $P search.seq_len=$SEQ search.global_batch_size=$GBS tune.top_k=3 tune.controls=false tune.steps=7
tail -16 $D/logs/tune.log 2>/dev/null
# held out: layouts tune did not train (its candidates are recompute none), priced with its
# calibration, in a copy of the profiles (their summaries would replace the matrix's rows)
if [ -e $DONE/tune ]; then
  [ -d $D/tuned ] || { mkdir -p $D/tuned.part && tar cf - -C $D --exclude=./logs --exclude=./.issue42 --exclude=./tuned.part --exclude='./*/train' . | tar xf - -C $D/tuned.part && mv $D/tuned.part $D/tuned; }
  for x in "${MBS%% *} selective" "1 none" "2 full"; do set -- $x; train heldout_$1_$2 $1 $2 $D/tuned; done
fi

Q="$C $MOE profiles_dir=$D"
step moe_pm 80 120 python3 -m orchestrator stage=profile_model $Q "profile_model.seq_lens=$MSEQS" profile_model.max_tp=1 profile_model.plot=false
step moe_train 50 70 python3 -m orchestrator stage=train $Q train.pp=1 train.tp=1 train.seq_len=$MSEQ train.global_batch_size=4 train.micro_batch_size=1 train.steps=7 train.timing_warmup_steps=3 train.keep_checkpoints=0 train.plot=false
grep -E "tokens/s|error|compile" $D/logs/moe_train.log 2>/dev/null | tail -3
echo "== rows"; cat $OUT/rows.txt; echo "== steps done: $(ls $DONE | wc -l), wall $SECONDS s"; ls $OUT
