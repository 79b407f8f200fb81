"""How fast each stage runs: busy-time clocks of the target stages and drafter steps, and the
advice on splitting the GPUs between them."""

import contextlib
import threading
import time

import torch



@contextlib.contextmanager
def timed(clocks, k, device):
    """The work queued inside timed by clocks[k] (a StageClock) on device; untimed without clocks."""
    if clocks is None:
        yield
        return
    clocks[k].start(device)
    yield
    clocks[k].stop(device)




class StageClock:
    """Busy time and batch count of a stage whose work is asynchronous on a GPU: CUDA event pairs,
    read once they have completed (no host sync); wall time on CPU. The main thread starts and
    stops it, a worker thread reads it: a lock keeps the two apart."""

    def __init__(self):
        self.pending, self.seconds, self.batches, self.t0 = [], 0.0, 0, None
        self.lock = threading.Lock()

    def start(self, device):
        if device.type == "cuda":
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record(torch.cuda.current_stream(device))
        else:
            self.t0 = time.perf_counter()

    def stop(self, device):
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(device))
            with self.lock:
                self.pending.append((self.t0, end))
        else:
            with self.lock:
                self.seconds += time.perf_counter() - self.t0
                self.batches += 1

    def total(self):
        """(busy seconds, batches) of the work that has completed so far."""
        with self.lock:
            done = [p[1].query() for p in self.pending]
            self.seconds += sum(a.elapsed_time(b) for (a, b), d in zip(self.pending, done) if d) / 1000
            self.batches += sum(done)
            self.pending = [p for p, d in zip(self.pending, done) if not d]
            return self.seconds, self.batches


def split_advice(target_s, drafter_s, target_devices, drafter_devices, tokens_per_batch):
    """Which stage bounds the run and the fastest split of the same GPUs, from the busy seconds
    of one target forward per replica (target_s) and of one drafter step per worker (drafter_s),
    each a batch of tokens_per_batch. The stages run at n_target / target_s and n_drafter /
    drafter_s batches a second, the run at the smaller (gradient averaging across more drafter
    workers is not modelled). The times are taken in the run, so on a device both stages share
    each already includes the other's company, and the two overlap: the slower one bounds the
    run, and alone on a GPU each would be faster than its time here. Returns a dict with the
    figures and the log line."""
    nt, nd = len(target_devices), len(drafter_devices)
    target_rate, drafter_rate = nt * tokens_per_batch / target_s, nd * tokens_per_batch / drafter_s
    if set(target_devices) & set(drafter_devices):
        expected = tokens_per_batch / max(target_s, drafter_s)
        return {"bound": "shared", "expected_tokens_per_s": expected, "best": None,
                "line": f"split: target and drafter share {sorted({str(d) for d in target_devices + drafter_devices})} "
                        f"(target {target_s * 1e3:.0f} ms/batch, drafter {drafter_s * 1e3:.0f} ms/step, each beside "
                        f"the other): about {expected:,.0f} tokens/s; on two GPUs, 1+1 would run at "
                        f"{min(target_rate / nt, drafter_rate / nd):,.0f} or more"}
    gpus = sorted(target_devices + drafter_devices, key=lambda d: (d.type, d.index or 0))
    rate = lambda n: min(n * tokens_per_batch / target_s, (len(gpus) - n) * tokens_per_batch / drafter_s)
    best = max(range(1, len(gpus)), key=rate)
    bound = "drafter" if drafter_rate < target_rate else "target"
    flags = (f"--target-gpus {','.join(str(d.index) for d in gpus[:best])} "
             f"--drafter-gpus {','.join(str(d.index) for d in gpus[best:])}")
    line = (f"split: {bound}-bound: target {nt} x {target_s * 1e3:.0f} ms/batch = {target_rate:,.0f} tokens/s, "
            f"drafter {nd} x {drafter_s * 1e3:.0f} ms/step = {drafter_rate:,.0f}; "
            f"expected {min(target_rate, drafter_rate):,.0f} tokens/s. "
            + ("This split is the fastest of these GPUs." if best == nt else
               f"Fastest split of these {len(gpus)} GPUs: {best}+{len(gpus) - best} at about "
               f"{rate(best):,.0f} tokens/s ({flags})"))
    return {"bound": bound, "expected_tokens_per_s": min(target_rate, drafter_rate), "target_tokens_per_s": target_rate,
            "drafter_tokens_per_s": drafter_rate, "best": (best, len(gpus) - best, rate(best)),
            "flags": flags if best != nt else None, "line": line}
