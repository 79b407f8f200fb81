"""A worker fault for the tests: the last drafter worker of all (over several machines, the last
machine's) raises at a chosen step, the way a real failure inside a step would.

In-process, patch DrafterWorker.train_step with faulty_train_step(step) (pytest's monkeypatch).
As a command it patches the trainer, then runs it or the smoke test with the given flags:

    python tests/fault_inject.py STEP train|smoke [flags...]
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_dflash_pipeline as tp  # noqa: E402


def faulty_train_step(step, train_step=tp.DrafterWorker.train_step):
    def faulty(worker, s, batch):
        last = worker.averager.cluster.world_size * worker.averager.num_workers - 1
        if s == step and worker.global_rank == last:
            raise RuntimeError(f"fault injected at step {step}")
        return train_step(worker, s, batch)
    return faulty


if __name__ == "__main__":
    step, program, flags = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    tp.DrafterWorker.train_step = faulty_train_step(step)
    if program == "train":
        sys.exit(tp.main(flags))
    sys.argv = [os.path.join(ROOT, "scripts", "smoke_test.py")] + flags
    runpy.run_path(sys.argv[0], run_name="__main__")
