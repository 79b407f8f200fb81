"""The target stage's graphed forward at the benchmark's Qwen3-8B shapes (4 x 3072 tokens, flex
under the document block mask) in three compiled forms:

  layers             each decoder layer compiled on its own (what the stage runs: --compile-target)
  whole              the whole base model compiled as one graph, so each layer's last residual
                     add can fuse into the next layer's input norm
  whole-rope-eager   the same with the rotary embedding left eager: cos and sin are inputs of the
                     graph (in `whole` inductor recomputes them inside the attention kernels)

A form's name may add, after "+": cd, compiled with inductor's coordinate descent tuning (it
times each generated pointwise and reduction kernel's block sizes and warps: the stage's norms,
residual adds and SiLU-times-up); tile128 or tile64, the document BlockMask in tiles of that size
instead of the stage's own (replica.mask_tile: 64 on Hopper, the flex kernel's tiles).

    python scripts/experiments/target_compile_forms.py [--forms layers,whole,whole-rope-eager,layers+cd,layers+tile128]

Per form: compile-and-capture time, eight replays timed one by one after the capture (the card's
clock moves under its power limit), the mean of 20 replays after 2 and its MFU, the idle time
between kernels inside a replay (profiler timeline, mean of 3 replays) with its largest sources,
the largest kernels, and the largest difference of the features from the first form's. On an
H100 (docs/benchmarks.md, forty-seventh session): `layers` the fastest; in a replay the GPU is
idle about 2 ms of 275."""
import argparse, os, sys, time, types
from collections import Counter
import torch
import torch._inductor.config  # noqa: F401  (torch._inductor.config.patch below)
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm  # noqa: E402
import scripts.benchmark as bench  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

DEV = "cuda:0"
ROWS, LENGTH = bench.PRESET_BATCH["qwen3-8b"]


def compile_whole(replica, rope_eager):
    """The replica's forward through its whole base model compiled once; the captured layers'
    outputs are collected by dm.capture_layer_outputs's hooks, registered once for good (new hooks
    at every call would make dynamo recompile)."""
    model = replica.model
    base = getattr(model, model.base_model_prefix)
    if rope_eager:
        for m in base.modules():
            if "RotaryEmbedding" in type(m).__name__:
                m.forward = torch.compiler.disable(m.forward)
    outputs = dm.capture_layer_outputs(model, replica.layer_ids).__enter__()  # never exited
    compiled = torch.compile(base, dynamic=False)

    def forward(input_ids, position_ids, doc_ids):
        mask = replica.mask(doc_ids)
        with replica.use_attention:
            compiled(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        return torch.cat(outputs, dim=-1)
    replica.forward = forward


def idle_between_kernels(call, replays=3):
    """ms busy, ms idle and kernels a replay; the idle ms a replay by (kernel before, kernel after);
    the profiler's kernels, largest total time first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    idle, last = Counter(), kernels[0]
    for e in kernels[1:]:
        gap = e.time_range.start - last.time_range.end
        if gap > 0:
            idle[(last.name[:60], e.name[:60])] += gap / replays / 1e3
        if e.time_range.end > last.time_range.end:
            last = e
    largest = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return busy / replays / 1e3, sum(idle.values()), len(kernels) // replays, idle, largest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--forms", default="layers,whole,whole-rope-eager")
    a = p.parse_args()
    cfg = Qwen3Config(**bench.PRESETS["qwen3-8b"])
    layer_ids = dm.default_target_layer_ids(cfg.num_hidden_layers, 5)
    flops = bench.target_flops_per_token(cfg, max(layer_ids) + 1) * ROWS * LENGTH
    batch = bench.synthetic_batch(types.SimpleNamespace(rows=ROWS, max_length=LENGTH), cfg.vocab_size, DEV)
    first = None
    for form in a.forms.split(","):
        torch.manual_seed(0)  # the same weights in every form
        replica = bench.build_target(cfg, DEV, layer_ids, "flex")
        t0 = time.perf_counter()
        shape, *changes = form.split("+")
        for change in changes:
            if change.startswith("tile"):
                replica.mask_tile = int(change[4:])
            elif change != "cd":  # a form measured under a name it did not run
                raise SystemExit(f"unknown change {change!r} in form {form!r}: cd, tile64 or tile128")
        if shape == "layers":
            replica.set_compiled_layers(True)
        else:
            compile_whole(replica, rope_eager=shape == "whole-rope-eager")
        with torch._inductor.config.patch(coordinate_descent_tuning="cd" in changes):  # read as it compiles: at the capture's first forwards
            replica.capture(ROWS, LENGTH)
        print(f"== {form}: mask tile {replica.mask_tile}")
        print(f"== {form}: compiled and captured in {time.perf_counter() - t0:.0f} s", flush=True)
        call = lambda: replica.features(batch)  # noqa: E731
        features = call()[:, :512].float().clone()
        first = features if first is None else first
        print(f"max |diff| of the features from the first form's: {(features - first).abs().max().item():.4f} "
              f"(largest feature {first.abs().max().item():.1f})")
        each = []
        for _ in range(8):
            each.append(bench.time_cuda(call, 1, DEV) * 1e3)
        print("replays one by one: " + ", ".join(f"{t:.1f}" for t in each) + " ms")
        t = bench.time_cuda(call, 20, DEV, warmup=2)
        print(f"mean of 20 after 2: {t * 1e3:.1f} ms, MFU {flops / t / bench.PEAK_FLOPS:.1%}", flush=True)
        busy, idle, n, by_pair, largest = idle_between_kernels(call)
        print(f"a replay: kernels busy {busy:.1f} ms, idle between them {idle:.2f} ms, {n} kernels; largest idle:")
        for (before, after), ms in by_pair.most_common(4):
            print(f"  {ms:6.3f} ms  {before}  ->  {after}")
        print("largest kernels (ms a replay, calls a replay):")
        for e in largest[:8]:
            print(f"  {e.device_time_total / 3e3:7.2f} {e.count // 3:4d}  {e.key[:90]}", flush=True)
        replica = None
        torch.compiler.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
