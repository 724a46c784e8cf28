#!/bin/bash
# Issue 42's figures on a lent GPU, as many as the device time allows, in calls that resume.
#   here, once:        bash bench/gpu/wheels.sh
#   device `run`:      BUDGET_S=560 bash bench/gpu/issue42.sh     (carry [".whl"], timeout_s 600)
#   then at once, on the still-warm machine (it is let go ~30 s after a call), with what is left:
#                      BUDGET_S=<device s left - 40> bash bench/gpu/issue42.sh   (timeout_s BUDGET_S + 30)
# A step that finished (rc 0, or a layout's own failure, e.g. out of memory) is not run again:
# markers in $D/.issue42 (/dev/shm). A fresh machine starts over, unless an earlier call's
# $OUT/profiles.tgz is carried as .gpuprof/profiles.tgz (carry [".whl", ".gpuprof"]) and was
# measured on the same GPU. A step starts only after the step it needs, and only if its
# estimate fits in what is left of BUDGET_S (a later, shorter one may); one the budget cuts
# short runs again next call. The order:
#   1. profile_hardware, profile_model (compiled blocks, host and device apart, mbs 1-8), search
#   2. bench/plain_loop.py at mbs 8 and 2 with these profiles: stage=train beside the plain
#      loop, eager and compiled (tokens/s, 1.0x?); its stage=train summaries are the matrix's
#      recompute-none rows for mbs 8 and 2
#   3. stage=train, mbs 4 and 1 with no recompute
#   4. stage=tune (top 3), then a held-out layout trained with its calibration, both in a copy
#      of the profiles ($D/tuned): the matrix's rows stay uncalibrated
#   5. the MoE model cut to fit: profile_model at mbs 1, stage=train
#   6. stage=train, selective and full recompute x mbs 8/4/2/1; then two more held-out layouts
# After each step, in $OUT (8 files come back at most): progress.txt (a line per step),
# rows.txt (bench/gpu/rows.py: predicted beside measured per summary, then the calibrated
# held-out ones), plain_mbs*.json (the bench's rows), last.log (the step's log), profiles.tgz
# (profiles, summaries, the bench's rows, every log).
# CPU dry run (tiny, cluster=local, one task; ~100 s):
#   rm -rf /tmp/dryprof; DRY=1 OUT=/tmp/out BUDGET_S=900 bash bench/gpu/issue42.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
BUDGET_S=${BUDGET_S:-560}; BUDGET_S=${BUDGET_S%.*}
[[ $BUDGET_S =~ ^[0-9]+$ ]] || { echo "BUDGET_S must be a number of seconds"; exit 2; }
if [ -z "$DRY" ] && [ ! -d /tmp/site/hydra ]; then  # a warm machine's second call has them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || { echo "pip install of .whl/ failed: run bash bench/gpu/wheels.sh here, carry [\".whl\"]"; exit 9; }
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
if [ -n "$DRY" ]; then
  C="cluster=local cluster.tasks_per_node=1"; CL=local; M="model=tiny"; MODEL=tiny; SEQ=128; D=/tmp/dryprof; SEQS="[64,128]"; MBS="4 2 1"; GBS=4
  BENCH="--model tiny --layers 4 --seq 128 --gbs 4 --steps 3 --warmup 2 --compile-backend eager"
  MOE="model=tiny_moe"; MSEQ=128; MSEQS="[64,128]"; X=4  # CPU: estimates / 4
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  C="cluster=gpu_node cluster.device_mem_GiB=140"; CL=gpu_node; M="model=llama2_7b model.layers=4"; MODEL=llama2_7b; SEQ=2048; D=/dev/shm/prof; SEQS="[1024,2048]"; MBS="8 4 2 1"; GBS=8
  BENCH="--model llama2_7b --layers 4 --seq 2048 --gbs 8 --steps 9 --warmup 3 --train-arg cluster.device_mem_GiB=140"
  MOE="model=mixtral_8x7b model.layers=2"; MSEQ=4096; MSEQS="[2048,4096]"; X=1
fi
BIG=${MBS%% *}
P="$C $M profiles_dir=$D"
T="train.pp=1 train.tp=1 train.seq_len=$SEQ train.global_batch_size=$GBS train.keep_checkpoints=0 train.plot=false train.steps=7 train.timing_warmup_steps=3"
DONE=$D/.issue42; CUT=; mkdir -p $DONE $D/logs
GPU=$([ -n "$DRY" ] && echo CPU || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
RESTORE=${RESTORE:-.gpuprof/profiles.tgz}
if [ ! -e $D/.issue42.gpu ] && [ -f $RESTORE ]; then  # its profiles priced these rows: same GPU only
  rm -rf /tmp/restore && mkdir -p /tmp/restore && tar xzf $RESTORE -C /tmp/restore
  if [ "$(cat /tmp/restore/.issue42.gpu 2>/dev/null)" = "$GPU" ]; then cp -a /tmp/restore/. $D/; echo "== resumed from $RESTORE"
  else echo "== $RESTORE not resumed: it was measured on '$(cat /tmp/restore/.issue42.gpu 2>/dev/null)', this is '$GPU'"; fi
fi
echo "$GPU" > $D/.issue42.gpu
echo "== call at $(date -u +%H:%M:%S), budget $BUDGET_S s, done before: $(ls $DONE | tr '\n' ' ')" | tee -a $OUT/progress.txt

keep() {  # the rows and everything measured so far, rewritten in $OUT after every step
  python3 bench/gpu/rows.py $D > $OUT/rows.txt 2>&1
  [ -d $D/tuned ] && { echo "-- held out, after stage=tune (calibrated):"; python3 bench/gpu/rows.py $D/tuned; } >> $OUT/rows.txt 2>&1
  cp $D/plain_mbs*.json $OUT/ 2>/dev/null
  tar czf $OUT/profiles.tgz.part --exclude='*.ckpt' --exclude='*.png' -C $D . 2>/dev/null && mv $OUT/profiles.tgz.part $OUT/profiles.tgz
}
# step NAME ESTIMATE_S LIMIT_S AFTER NEEDED COMMAND...: COMMAND's output in $D/logs/NAME.log.
# Runs once AFTER (a step's name, or -) has finished. NEEDED=1 (steps others run after): done
# only with rc 0, else tried again next call. NEEDED=0 (a layout): its failure (out of memory,
# its own time limit) is its result.
step() {
  local name=$1 est=$(($2 / X)) cap=$3 after=$4 needed=$5; shift 5
  [ -n "$CUT" ] && return 1
  if [ -e $DONE/$name ]; then echo "== $name: done in an earlier call ($(cat $DONE/$name))"; return 0; fi
  if [ $after != - ] && [ ! -e $DONE/$after ]; then echo "== $name: not started, $after has not finished"; return 1; fi
  local left=$((BUDGET_S - SECONDS - 5))
  if [ $left -lt $est ]; then  # a later, shorter step may fit
    echo "== $name: not started, ${left} s of the budget left for ~${est} s: call again" | tee -a $OUT/progress.txt; return 1
  fi
  local limit=$((cap < left ? cap : left)) t0=$SECONDS
  timeout -k 10 $limit "$@" > $D/logs/$name.log 2>&1; local rc=$?
  echo "== $name: rc=$rc wall=$((SECONDS - t0)) s" | tee -a $OUT/progress.txt
  [ $rc -eq 0 ] || tail -4 $D/logs/$name.log
  cp $D/logs/$name.log $OUT/last.log
  if [ $rc -eq 124 ] && [ $limit -lt $cap ]; then
    CUT=1; echo "== $name: cut by the budget: call again"  # it runs again next call
  elif [ $rc -ne 0 ] && [ $needed = 1 ]; then
    echo "== $name failed (log: $D/logs/$name.log): the steps after it wait; the next call tries it again"
  else
    echo "rc=$rc wall=$((SECONDS - t0)) s" > $DONE/$name
  fi
  keep; [ $rc -eq 0 ]
}
train() {  # train NAME MBS RECOMPUTE PROFILES_DIR: one layout of the matrix
  step $1 55 90 pm 0 python3 -m orchestrator stage=train $C $M profiles_dir=$4 $T train.micro_batch_size=$2 train.recompute=$3 \
    && grep -E "tokens/s|error" $D/logs/$1.log 2>/dev/null | tail -1
}
tuned_copy() {  # tune and its held-out layouts run in a copy of the profiles: its calibration
  # would price the matrix's later rows, and a held-out summary replace the matrix's row
  [ -d $D/tuned ] || { rm -rf $D/tuned.part; mkdir -p $D/tuned.part && tar cf - -C $D --exclude=./logs --exclude=./.issue42 --exclude=./tuned.part --exclude="./$CL/train" --exclude='./plain_mbs*' . | tar xf - -C $D/tuned.part && mv $D/tuned.part $D/tuned; }
}
heldout() {  # heldout MBS RECOMPUTE: a layout tune did not train, priced with its calibration
  [ -e $DONE/tune ] && [ -z "$CUT" ] || return 0
  grep -q "calibrated from" $D/logs/tune.log 2>/dev/null || { echo "== heldout_$1_$2: tune did not calibrate (see its log)"; return 0; }
  train heldout_$1_$2 $1 $2 $D/tuned
}

# 1
step hw 20 60 - 1 python3 -m orchestrator stage=profile_hardware $P profile_hardware.max_time_s=0.05
step pm 100 200 hw 1 python3 -m orchestrator stage=profile_model $P "profile_model.seq_lens=$SEQS" profile_model.plot=false \
  && tail -3 $D/logs/pm.log
step search 15 60 pm 1 python3 -m orchestrator stage=search $P search.seq_len=$SEQ search.global_batch_size=$GBS \
  && grep -iE "mbs" $D/logs/search.log | head -6
# 2: the bench's rows; its stage=train summary is the matrix's row only if it was kept
for mbs in $BIG 2; do
  step bench_$mbs 150 240 pm 0 python3 bench/plain_loop.py $BENCH --mbs $mbs --profiles-dir $D --keep-summaries $D --json $D/plain_mbs$mbs.json \
    && tail -6 $D/logs/bench_$mbs.log
  grep -q "stage=train summary kept" $D/logs/bench_$mbs.log 2>/dev/null && echo "the bench's stage=train" > $DONE/train_${mbs}_none
done
# 3
for mbs in $MBS; do train train_${mbs}_none $mbs none $D; done
# 4
[ -e $DONE/pm ] && tuned_copy
step tune 170 300 pm 1 python3 -m orchestrator stage=tune $C $M profiles_dir=$D/tuned search.seq_len=$SEQ search.global_batch_size=$GBS tune.top_k=3 tune.controls=false tune.steps=7 \
  && grep -E "^tune:|top [0-9]" $D/logs/tune.log | tail -6
heldout $BIG selective
# 5
Q="$C $MOE profiles_dir=$D"
step moe_pm 80 150 hw 1 python3 -m orchestrator stage=profile_model $Q "profile_model.seq_lens=$MSEQS" profile_model.max_tp=1 'profile_model.micro_batch_sizes=[1]' profile_model.plot=false
step moe_train 60 90 moe_pm 0 python3 -m orchestrator stage=train $Q train.pp=1 train.tp=1 train.seq_len=$MSEQ train.global_batch_size=4 train.micro_batch_size=1 train.steps=7 train.timing_warmup_steps=3 train.keep_checkpoints=0 train.plot=false \
  && grep -E "tokens/s|error" $D/logs/moe_train.log | tail -1
# 6
for rc in selective full; do for mbs in $MBS; do train train_${mbs}_$rc $mbs $rc $D; done; done
heldout 1 none; heldout 2 full
keep; echo "== rows"; cat $OUT/rows.txt; echo "== steps done: $(ls $DONE | wc -l), this call ${SECONDS} s"
