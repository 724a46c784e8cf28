#!/bin/bash
# The project's dependencies a lent GPU machine's image lacks (it has torch and numpy, Python
# 3.12), as wheels in .whl/ (git-ignored), for the device tool's `carry`. Run here, from the
# repository root: bash bench/gpu/wheels.sh   (then carry [".whl"] in each device call)
set -e
DEST=${1:-.whl}
mkdir -p "$DEST"; rm -f "$DEST"/*.whl  # one version of each: pip refuses two
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d "$DEST" hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4 cloudpickle==3.1.3 \
  mpi4py==4.1.2 mpich==5.0.2 pyyaml==6.0.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 typing-extensions==4.16.0
# antlr4-python3-runtime 4.9.3 (omegaconf's) is published as an sdist only: build its wheel here
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$DEST"
ls "$DEST"
