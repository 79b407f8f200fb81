"""Throughput and MFU of the pipeline at real shapes, random weights (nothing to download).

    python scripts/benchmark.py                       # 2 GPUs: Qwen3-8B-shaped target on 0, drafter on 1
    python scripts/benchmark.py --preset small        # 1 GPU: a smaller target, both stages on GPU 0
    python scripts/benchmark.py --preset smollm2-135m --skip scaling,beside   # 1 GPU: the GPU demo's shapes
    python scripts/benchmark.py --generation --gen-model builtin:smollm2-135m-instruct   # generation engine

In one run: drafter step time eager / compiled / compiled+graph; target batch time eager / graph;
whole-pipeline tokens/s eager vs compiled; 1 vs 2 drafter threads; drafter step time with and
without the target running beside it; MFU of each stage from the formulas printed; peak memory;
the SM clock and board power during the drafter step's timings (nvidia-smi), and the step's
share of the peak at that clock.
"""

import argparse
import functools
import gc
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import decoding  # noqa: E402
from dflash_train import target_model  # noqa: E402
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402
from dflash_train import checkpoints as ck  # noqa: E402
from dflash_train import command_line as cli  # noqa: E402
from dflash_train import kernels as kn  # noqa: E402
from dflash_train import target_stage as ts  # noqa: E402
from dflash_train import helpers  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16
PEAK_MHZ = 1830  # the SM clock PEAK_FLOPS counts: 132 SMs x 4096 bf16 FLOP a clock (H100/H200 SXM)

PRESETS = {
    # Qwen3-8B shapes
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6),
    # Qwen3-1.7B shapes: fits beside its drafter on one GPU
    "small": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6),
    # SmolLM2-135M-Instruct shapes (the built-in target; Qwen3 layers of its sizes): the GPU demo's drafter
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5),
}
# batch rows x row length of each preset unless given: the largest that fits an H200 at Qwen3-8B
# shapes, one row of the small target, and the GPU demo's 8 x 2048
PRESET_BATCH = {"qwen3-8b": (4, 3072), "small": (1, 3072), "smollm2-135m": (8, 2048)}


# -----------------------------------------------------------------------------
# FLOP formulas (matmuls only; attention scores excluded, as MFU is quoted in docs/benchmarks.md)

def layer_param_groups(c):
    """(q/k/v projection params, o_proj + MLP params) of one decoder layer."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return h * (q + 2 * kv), h * q + 3 * h * c.intermediate_size


def linear_params_per_layer(c):
    return sum(layer_param_groups(c))


def target_flops_per_token(c, layers_run):
    return 2 * linear_params_per_layer(c) * layers_run


def drafter_flops_per_step(c, n_feat_layers, draft_layers, rows, length, anchors, block):
    """Useful training FLOPs: 6 x params x the rows each draft-layer matmul runs on, every draft
    position, except two that DFlashDraftModel.draft_hidden skips: the first layer's q/k/v projections
    run on one row per anchor and one mask row (the mask rows are one vector there), the last
    layer's o_proj and MLP on the predicting slots 1..block-1 alone. The context path (fc: no
    input grad; k/v projections: forward + both grads); the frozen LM head forward + input grad on
    the predicting slots (slot 0 holds the anchor token and gets no logits)."""
    P = rows * anchors * block
    T = rows * length
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    qkv, o_mlp = layer_param_groups(c)
    first_rows, last_rows = rows * anchors + 1, rows * anchors * (block - 1)
    layers = 6 * (qkv + o_mlp) * draft_layers * P - 6 * qkv * (P - first_rows) - 6 * o_mlp * (P - last_rows)
    context = 4 * n_feat_layers * h * h * T + 6 * 2 * h * kv * draft_layers * T
    head = 4 * h * c.vocab_size * rows * anchors * (block - 1)
    return layers + context + head


def attention_pairs(anchors, doc_ids, block):
    """(query, key) pairs the drafter's attention mask lets through: each of a block's slots sees
    its anchor's document up to the anchor, and its own block."""
    return int(((anchors - dm.context_starts(anchors, doc_ids)) + block).sum()) * block


def drafter_attention_flops_per_step(dcfg, batch, anchors, block, draws=8):
    """Attention FLOPs a step on the pairs the mask lets through (not the tiles flex_attention
    computes): Q K^T and P V, forward and twice that backward, averaged over a few anchor draws
    of the batch. Reported beside the MFU, which excludes attention, never inside it."""
    doc, mask = batch["doc_ids"].cpu(), batch["loss_mask"].cpu()
    g = torch.Generator().manual_seed(0)
    pairs = 0.0
    for _ in range(draws):
        chosen, _ = dm.DFlashDraftModel.select_anchors(torch.rand(doc.shape, generator=g), mask, doc, anchors)
        pairs += attention_pairs(chosen, doc, block) / draws
    return 3 * 4 * dcfg.num_attention_heads * dcfg.head_dim * pairs * dcfg.num_hidden_layers


FORMULA = ("target: 2 * linear_params_per_layer * layers_run per token; drafter per step: "
           "6 * draft_layer_params * P - 6 * qkv_params * (P - rows*anchors - 1) - 6 * (o+mlp)_params * rows*anchors "
           "+ (4 * n*H*H + 12 * H*kv_dim * layers) * T + 4 * H * V * P * (block-1)/block, "
           "P = rows*anchors*block draft positions, T = rows*max_length context tokens; attention excluded")


# -----------------------------------------------------------------------------
# Building blocks at the benchmark's shapes

def make_settings(a, compile):
    argv = ["--max-length", str(a.max_length), "--token-budget", str(a.rows * a.max_length),
            "--num-anchors", str(a.anchors), "--block-size", str(a.block), "--num-draft-layers", str(a.draft_layers),
            "--ce-chunk-size", str(a.ce_chunk), "--log-interval", str(a.log_interval), "--save-interval", "1000000",
            "--output-dir", a.output_dir, "--eval-prompts", "0", "--queue-depth", "2", "--loss", a.loss,
            "--distill-top-k", str(a.distill_top_k)]
    return cli.Settings.of_flags(argv + (["--compile"] if compile else []), drafter_attention=a.drafter_attention)


def build_target(cfg, device, layer_ids, attention="dense", distillation=None):
    from transformers import AutoModelForCausalLM
    cfg = type(cfg)(**cfg.to_dict())
    if distillation is None:
        cfg.num_hidden_layers = max(layer_ids) + 1  # only the layers that are run are built
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return ts.TargetReplica(model.eval().requires_grad_(False), layer_ids, torch.device(device), attention,
                            distillation=distillation)


def build_drafter(cfg, a, device, embed, head):
    dcfg = dm.make_drafter_config(cfg, mask_token_id=cfg.vocab_size - 1, num_draft_layers=a.draft_layers,
                                  block_size=a.block)
    torch.manual_seed(0)
    d = dm.DFlashDraftModel(dcfg).to(device).train()
    d.set_target_parts(torch.nn.Embedding.from_pretrained(embed.to(device)), head.to(device))
    return d


def fake_run(args, target_hidden_size):
    """What a DrafterWorker reads from its Run when driven directly, without the pipeline."""
    return types.SimpleNamespace(lr_for_step=lambda s: args.lr, target_hidden_size=target_hidden_size, log=print)


def synthetic_batch(a, vocab, device, seed=0, target_hidden_size=None):
    """A packed batch of random tokens; with target_hidden_size, the target stage's outputs too
    (features, and the top-k distribution for --loss kl/mix)."""
    g = torch.Generator().manual_seed(seed)
    R, L = a.rows, a.max_length
    doc = torch.zeros(R, L, dtype=torch.long)
    pos = torch.zeros(R, L, dtype=torch.long)
    for r in range(R):  # a few documents per row, like packed chat data
        cuts = sorted(torch.randint(1, L, (3,), generator=g).tolist())
        for i, (s, e) in enumerate(zip([0] + cuts, cuts + [L])):
            doc[r, s:e], pos[r, s:e] = i, torch.arange(e - s)
    b = {"input_ids": torch.randint(0, vocab - 2, (R, L), generator=g), "loss_mask": torch.ones(R, L),
         "doc_ids": doc, "position_ids": pos}
    if target_hidden_size:
        b["target_hidden"] = torch.randn(R, L, target_hidden_size, generator=g).to(torch.bfloat16)
    if target_hidden_size and a.loss != "ce":
        k = a.distill_top_k
        b["target_top_ids"] = torch.randint(0, vocab, (R, L, k), generator=g, dtype=torch.int32)
        b["target_top_probs"] = torch.rand(R, L, k, generator=g).softmax(-1) * 0.9
    return {k: v.to(device) for k, v in b.items()}


def time_cuda(fn, n, device, warmup=0):
    """Seconds a call of fn, over n calls after warmup untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n


def nvidia_smi_query(gpu_id, fields, *options):
    """The nvidia-smi command that reads fields of one card as bare CSV numbers."""
    return ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"--id={gpu_id}", *options]


@functools.cache
def power_field(gpu_id):
    """nvidia-smi's field for the board power: power.draw.instant where the card reads it, since on
    recent cards power.draw is a mean over the last second and reads low for a timing shorter than
    that; else power.draw. Raises OSError without nvidia-smi."""
    try:
        probe = subprocess.run(nvidia_smi_query(gpu_id, "power.draw.instant"), capture_output=True, text=True,
                               timeout=10, check=True)
        float(probe.stdout)  # "[N/A]" is not a reading
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError):
        return "power.draw"
    return "power.draw.instant"


class ClockAndPower:
    """The SM clock and board power nvidia-smi reads every 100 ms while a timing runs: a card at
    its power limit runs the same kernels at a lower clock, so the same step differs from one
    machine to the next. Only readings taken after the timing began count: nvidia-smi takes its
    first as it starts, so entering waits for that one and drops it (a timing under 100 ms may
    then have none). The power is power_field's. figures() is {} with no GPU (gpu_id None), no
    nvidia-smi, or no reading while the timing ran."""

    def __init__(self, gpu_id):
        self.gpu_id, self.proc, self.samples = gpu_id, None, []

    def __enter__(self):
        if self.gpu_id is None:
            return self
        try:
            query = nvidia_smi_query(self.gpu_id, f"clocks.sm,{power_field(self.gpu_id)}", "--loop-ms=100")
            self.proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi
            return self
        if select.select([self.proc.stdout], [], [], 10)[0]:
            self.proc.stdout.readline()  # the card before the timing
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.kill()  # nothing of nvidia-smi's to clean up; once it is gone, reading its output cannot block
        self.proc.wait()
        out = self.proc.stdout.read()  # through the stream the first readline used: with what it buffered
        for line in out.splitlines():
            try:
                sample = [float(v) for v in line.split(",")]
            except ValueError:  # "[N/A]" or a message: not a sample
                continue
            if len(sample) == 2:
                self.samples.append(sample)

    def figures(self):
        if not self.samples:
            return {}
        return {"sm_mhz": sum(s[0] for s in self.samples) / len(self.samples),
                "power_w": sum(s[1] for s in self.samples) / len(self.samples)}


def nvidia_smi_id(device):
    """nvidia-smi's name for a torch CUDA device: its UUID, so CUDA_VISIBLE_DEVICES cannot mismatch
    them; None for any other device (ClockAndPower then reads nothing)."""
    if torch.device(device).type != "cuda":
        return None
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def card_text(reading):
    """', 1419 MHz, 695 W' of a ClockAndPower reading; '' without one."""
    return f", {reading['sm_mhz']:.0f} MHz, {reading['power_w']:.0f} W" if reading else ""


def share_at_clock(mfu, reading):
    """'; 78.0% of the peak at 1419 MHz': with the card's mean SM clock during a timing, the share
    of the peak at that clock (a card at its power limit runs slower, the code's share stays); ''
    without a reading."""
    if "sm_mhz" not in reading:
        return ""
    return f"; {mfu * PEAK_MHZ / reading['sm_mhz']:.1%} of the peak at {reading['sm_mhz']:.0f} MHz"


def drafter_rate_line(mode, timing, tokens, flops, attn_flops):
    """A drafter timing's tokens/s and MFU (with the share of the peak at the card's clock)."""
    step_s = timing["step_s"]
    mfu = flops / step_s / PEAK_FLOPS
    return (f"  drafter {mode}: {tokens / step_s:,.0f} tokens/s, MFU {mfu:.1%} "
            f"({(flops + attn_flops) / step_s / PEAK_FLOPS:.1%} counting attention)" + share_at_clock(mfu, timing))


def drafter_worker(a, cfg, device, embed, head, target_hidden_size, compile, rank=0, averager=None):
    args = make_settings(a, compile=compile)
    d = build_drafter(cfg, a, device, embed, head)
    return tp.DrafterWorker(rank, torch.device(device), d, args, averager or tp.GradAverager(1),
                            fake_run(args, target_hidden_size))


def drafter_step_times(a, cfg, device, embed, head, target_hidden_size, report):
    """Eager, compiled (no graph) and compiled+graph drafter step times on one device; the
    compiled and graphed timings use one worker (compiled once, then captured), which is
    returned for the later sections (None without the compiled mode)."""
    batch = synthetic_batch(a, cfg.vocab_size, device, target_hidden_size=target_hidden_size)
    gpu_id = nvidia_smi_id(device)
    out = {}

    def measure(mode, w, prepare):
        torch.cuda.reset_peak_memory_stats(device)
        with torch.cuda.stream(w.stream):
            t0 = time.perf_counter()
            prepare()
            torch.cuda.synchronize(device)
            warm = time.perf_counter() - t0
            step = [100]

            def one():
                step[0] += 1
                w.train_step(step[0], batch)
            with ClockAndPower(gpu_id) as card:
                t = time_cuda(one, a.iters, device)
        reading = card.figures()
        peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
        out[mode] = {"step_s": t, "warmup_s": warm, "peak_gb": peak_gb, **reading}
        report(f"drafter {mode:20s}: {t * 1e3:8.1f} ms/step  (warm-up {warm:.0f}s, peak {peak_gb:.1f} GB"
               f"{card_text(reading)})")

    graphed = None
    for compile in [m == "compiled" for m in a.step_modes.split(",")]:
        w = drafter_worker(a, cfg, device, embed, head, target_hidden_size, compile)

        def warm_steps():  # the first compiles: its time is the compile cost
            for s in range(3):
                t0 = time.perf_counter()
                w.train_step(s + 1, batch)
                torch.cuda.synchronize(device)
                report(f"  warm-up step {s + 1}: {time.perf_counter() - t0:.1f}s")
        measure("compiled" if compile else "eager", w, warm_steps)
        if compile and a.profile:
            with torch.cuda.stream(w.stream):
                kernels = profile_kernels(lambda s: w.train_step(1000 + s, batch), device, a.profile, report)
        if compile:
            measure("graph", w, lambda: w.capture(a.rows, target_hidden_size))
            graphed = w
            # the compiled step again, after the graph (the GPU as warm as for the graph's timing):
            # so the order of the two does not decide which looks faster
            w.graphs, graphs = None, w.graphs
            try:
                measure("compiled after graph", w, lambda: None)
            except torch.OutOfMemoryError:  # an 80 GB card: its activations do not fit beside the graph's pool
                report("drafter compiled after graph: skipped, out of memory beside the graph's memory pool")
            w.graphs = graphs
            if a.profile:  # the same table of the graph's replays, and where the two differ
                with torch.cuda.stream(w.stream):
                    replayed = profile_kernels(lambda s: w.train_step(2000 + s, batch), device,
                                               a.profile + ".graph", report)
                kernel_differences(kernels, replayed, a.profile + ".diff", report)
        w = None  # the eager worker's memory goes before the compiled one is built
        torch.cuda.empty_cache()
    return out, graphed


def kernel_category(name):
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "matmul (cuBLAS)"
    if "flex" in n or n.startswith("triton_tem"):
        return "flex_attention (triton templates)"
    if "block_attention" in n:
        return "block attention (dm's Triton kernels)"
    if "ce_rows" in n:
        return "LM-head CE reductions (kn.ce_rows)"
    if n.startswith(("triton_red", "triton_per")):
        return "fused reductions (triton)"
    if n.startswith("triton_poi"):
        return "fused pointwise (triton)"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "other"


def profile_kernels(step, device, path, report, steps=3, call="step"):
    """GPU time per kernel over a few calls of `step` (the compiled step, or a graph's replays:
    CUPTI records the kernels of a replay one by one): by category, and the 40 largest, written
    to `path`; `call` names what one call of `step` is. Returns {kernel name: (ms a call, calls a call)}."""
    from torch.profiler import ProfilerActivity, profile
    for s in range(2):
        step(s)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for s in range(steps):
            step(10 + s)
        torch.cuda.synchronize(device)
    matmul_shapes(prof, steps, path + ".matmuls")
    # Not the annotated ranges on the GPU's timeline (the optimizer's step, "Optimizer.step#AdamW.step"):
    # their kernels are counted already
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and not e.key.startswith("Optimizer.")]
    time_of = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    total = sum(time_of(e) for e in kernels) or 1
    by_cat = {}
    for e in kernels:
        c = kernel_category(e.key)
        by_cat[c] = by_cat.get(c, 0) + time_of(e)
    lines = [f"GPU kernel time per {call}: {total / steps / 1e3:.1f} ms (mean of {steps})"]
    lines += [f"  {c:36s} {t / steps / 1e3:8.1f} ms  {t / total:6.1%}"
              for c, t in sorted(by_cat.items(), key=lambda x: -x[1])]
    lines.append(f"largest kernels (ms per {call}, calls per {call}, name):")
    for e in sorted(kernels, key=time_of, reverse=True)[:40]:
        lines.append(f"  {time_of(e) / steps / 1e3:8.2f} {e.count // steps:5d}  {e.key[:150]}")
    for l in lines[:len(by_cat) + 1]:
        report(l)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return {e.key: (time_of(e) / steps / 1e3, e.count / steps) for e in kernels}


def matmul_shapes(prof, steps, path):
    """Per matmul op, its operands' shapes and its kernels (a profile recorded with shapes; not a
    graph's replays, whose kernels have no op: nothing is written for them): calls and ms a step
    of the op's own kernels and TFLOP/s, largest first, written to `path`."""
    rows = {}
    for e in prof.events():
        if e.name not in ("aten::mm", "aten::addmm") or not e.kernels:
            continue
        shapes = [tuple(x) for x in e.input_shapes]
        a, b = (shapes[1], shapes[2]) if e.name == "aten::addmm" else (shapes[0], shapes[1])
        key = (e.name, tuple(s for s in shapes if s), " + ".join(sorted({k.name[:60] for k in e.kernels})))
        t, n, flop = rows.get(key, (0.0, 0, 0))
        rows[key] = (t + sum(k.duration for k in e.kernels), n + 1, flop + 2 * math.prod(a) * b[-1])
    if not rows:
        return
    lines = ["matmuls by operand shapes (ms a step, calls a step, TFLOP/s, op, shapes, kernels):"]
    for (op, shapes, kernels), (t, n, flop) in sorted(rows.items(), key=lambda r: -r[1][0]):
        tflops = flop / (t * 1e-6) / 1e12
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:5.1f} {tflops:6.0f}  {op} {shapes} {kernels}")
    lines.append(f"  {sum(t for t, _, _ in rows.values()) / steps / 1e3:8.2f} ms a step in all")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def kernel_differences(before, after, path, report, shown=12):
    """Per kernel name, ms a step and calls a step in two profiles (profile_kernels' tables),
    largest difference first: all of them to `path`, the first `shown` to the report."""
    names = sorted(set(before) | set(after),
                   key=lambda k: -abs(after.get(k, (0, 0))[0] - before.get(k, (0, 0))[0]))
    total = lambda d: sum(t for t, _ in d.values())
    lines = [f"kernel time a step: {total(before):.1f} ms -> {total(after):.1f} ms "
             f"({total(after) - total(before):+.2f}); by kernel (ms before, after, difference, calls before, after):"]
    for k in names:
        (t0, c0), (t1, c1) = before.get(k, (0, 0)), after.get(k, (0, 0))
        lines.append(f"  {t0:8.2f} {t1:8.2f} {t1 - t0:+7.2f} {c0:6.1f} {c1:6.1f}  {k[:150]}")
    for l in lines[:shown + 1]:
        report(l)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def target_batch_times(a, replica, report):
    """The target stage eager and graphed, with the dense document mask (transformers' SDPA) and
    with flex_attention under a document BlockMask; the replica is left in --target-attention.
    Returns ({timing: seconds a batch}, the card's clock and power during the timing of the path a
    run takes: flex, compiled layers, graphed)."""
    batch = synthetic_batch(a, replica.model.config.vocab_size, replica.device)
    out = {}
    for attention in ("dense", "flex"):
        replica.drop_capture()
        replica.set_attention(attention)
        name = "" if attention == "dense" else "flex "
        t = time_cuda(lambda: replica.target_hidden(batch), a.iters, replica.device)
        out[f"{name}eager"] = t
        report(f"target {name + 'eager':11s}: {t * 1e3:8.1f} ms/batch")
        replica.capture(a.rows, a.max_length)
        t = time_cuda(lambda: replica.target_hidden(batch), a.iters, replica.device)
        out[f"{name}graph"] = t
        report(f"target {name + 'graph':11s}: {t * 1e3:8.1f} ms/batch")
    replica.drop_capture()
    # flex with the decoder layers compiled (--compile-target), then back to plain layers
    t0 = time.perf_counter()
    replica.set_compiled_layers(True)
    replica.capture(a.rows, a.max_length)
    report(f"target compiled layers: compiled and captured in {time.perf_counter() - t0:.0f}s")
    with ClockAndPower(nvidia_smi_id(replica.device)) as card:
        t = time_cuda(lambda: replica.target_hidden(batch), a.iters, replica.device)
    out["flex compiled graph"], reading = t, card.figures()
    report(f"target flex compiled graph: {t * 1e3:8.1f} ms/batch{card_text(reading)}")
    if a.profile:  # the path a run takes (--compile on a GPU): its graph's replays, kernel by kernel
        report(f"target flex compiled graph ({a.profile}.target):")
        profile_kernels(lambda s: replica.target_hidden(batch), replica.device, a.profile + ".target", report,
                        call="batch")
    replica.drop_capture()
    replica.set_compiled_layers(False)
    replica.set_attention(a.target_attention)
    return out, reading


def split_target_times(a, replica, report):
    """The target stage as run with --compile (flex, compiled layers, graphed) whole and split in
    --target-stages stages on the same GPU: what the stage boundaries cost (the copies between
    stages, a graph launch each), and the largest difference of their features."""
    batch = synthetic_batch(a, replica.model.config.vocab_size, replica.device)
    split = ts.TargetReplica(replica.model, replica.target_layer_ids, [replica.device] * a.target_stages,
                             a.target_attention, stack_mlps=False, distillation=replica.distillation)
    replica.set_compiled_layers(True)  # the layers are shared: the split replica's are compiled too
    out, features = {}, []
    for name, r in (("whole", replica), (f"{a.target_stages} stages", split)):
        r.capture(a.rows, a.max_length)
        out[name] = time_cuda(lambda: r.target_hidden(batch), a.iters, replica.device)
        features.append(r.target_hidden(batch).float().clone())
        r.drop_capture()
        torch.cuda.empty_cache()
        report(f"target {name:9s}: {out[name] * 1e3:8.1f} ms/batch")
    replica.set_compiled_layers(False)
    out["largest_difference"] = (features[0] - features[1]).abs().max().item()
    return out


def drafter_threads_scaling(a, cfg, first, devices, embed, head, target_hidden_size, report, steps):
    """Graphed drafter steps/s with one worker thread (`first`, already captured), then one per
    device, gradient averaging included; no target, batches resident on each device."""
    results = {}
    averager = tp.GradAverager(len(devices))
    workers = [first] + [drafter_worker(a, cfg, dev, embed, head, target_hidden_size, True, rank, averager)
                         for rank, dev in enumerate(devices[1:], 1)]
    batches = [synthetic_batch(a, cfg.vocab_size, w.device, target_hidden_size=target_hidden_size) for w in workers]
    for n in (1, len(devices)):
        if n > 1:  # recapture the first worker around the averaging, then capture the others
            first.averager = averager
            for w in workers:
                w.capture(a.rows, target_hidden_size)

        def loop(w, b):
            with torch.cuda.stream(w.stream):
                for s in range(steps):
                    w.train_step(s + 1, b)
                torch.cuda.synchronize(w.device)
        threads = [threading.Thread(target=loop, args=(w, b)) for w, b in zip(workers[:n], batches)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results[n] = n * steps / (time.perf_counter() - t0)
        report(f"drafter threads x{n}: {results[n]:.2f} steps/s" + (" (averaging every step)" if n > 1 else ""))
    t0 = time.perf_counter()  # the averaging between the two graphs, alone (it synchronizes every GPU)
    for _ in range(10):
        averager._average()
    results["averaging_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    grad_gb = first.flat_grad.numel() * first.flat_grad.element_size() / 2**30
    report(f"gradient averaging alone: {results['averaging_ms']:.1f} ms per step ({len(devices)} x {grad_gb:.1f} GB)")
    return results


def drafter_beside_target(a, cfg, w, replica, target_hidden_size, report, steps):
    """Step time of the graphed drafter worker `w` alone, and while the main thread runs eager
    target forwards."""
    b = synthetic_batch(a, cfg.vocab_size, w.device, target_hidden_size=target_hidden_size)
    tb = synthetic_batch(a, cfg.vocab_size, replica.device)
    out = {}
    # no graph: many Python calls
    eager_target = ts.TargetReplica(replica.model, replica.target_layer_ids, replica.device)
    for label, busy, interval in (("alone", False, 1e-4), ("target eager beside, switch 5ms", True, 5e-3),
                                  ("target eager beside, switch 0.1ms", True, 1e-4)):
        sys.setswitchinterval(interval)
        stop = threading.Event()

        def target_loop():
            while not stop.is_set():
                eager_target.target_hidden(tb)
                torch.cuda.synchronize(replica.device)
        th = threading.Thread(target=target_loop)
        if busy:
            th.start()
        times = []
        with torch.cuda.stream(w.stream):
            for s in range(steps):
                t0 = time.perf_counter()
                w.train_step(s + 1, b)
                torch.cuda.synchronize(w.device)
                times.append(time.perf_counter() - t0)
        stop.set()
        if busy:
            th.join()
        times.sort()
        out[label] = times[len(times) // 2]
        report(f"drafter step {label:36s}: {out[label] * 1e3:7.1f} ms (median)")
    sys.setswitchinterval(1e-4)
    return out


def ce_peak_memory(positions, hidden, vocab, chunk, device):
    """Peak memory (bytes) of the LM head + cross-entropy, forward and backward, for one chunk size
    (chunk = positions: the unchunked computation). On CPU: the child process's peak RSS."""
    code = f"""
import resource, torch, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
import dflash_model as dm
dev = {device!r}
h = torch.randn({positions}, {hidden}, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn({vocab}, {hidden}, device=dev, dtype=torch.bfloat16) * 0.02
lab = torch.randint(0, {vocab}, ({positions},), device=dev)
if dev.startswith("cuda"):
    torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
ce, _ = dm.lm_head_ce(h, w, lab, {chunk})
ce.mean().backward()
if dev.startswith("cuda"):
    print(torch.cuda.max_memory_allocated() - base)
else:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def ce_memory_table(a, report):
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    P, H, V = a.ce_positions, a.ce_hidden, a.ce_vocab
    report(f"LM head + CE peak memory, {P} draft positions, hidden {H}, vocab {V}, bf16, on {device}"
           + (" (peak RSS of a child process, includes the interpreter and torch)" if device == "cpu" else ""))
    for chunk in sorted({512, 2048, 4096, 8192, P}):
        if chunk > P:
            continue
        peak = ce_peak_memory(P, H, V, chunk, device)
        report(f"  chunk {chunk:6d}{' (unchunked)' if chunk == P else '':12s}: {peak / 2**30:6.2f} GB")


class SyntheticBatches:
    """Stand-in for BatchSequence: a few random packed batches, cycled."""

    def __init__(self, a, vocab):
        self.batches = [{k: v.pin_memory() for k, v in synthetic_batch(a, vocab, "cpu", seed=s).items()}
                        for s in range(4)]
        self.batches_per_epoch, self.packing_efficiency = 10**9, 1.0

    def iterate(self, skip, round_size=1, mine=range(1)):  # one machine: every batch is its own
        i = skip
        while True:
            yield 0, self.batches[i % len(self.batches)]
            i += 1


class ThroughputRun(tp.Run):
    """A Run that writes no checkpoints: the one at the last step (12.6 GB at these shapes) took
    17 s of every pipeline measurement and tells nothing about throughput."""

    def save(self, step):
        pass


def pipeline_throughput(a, cfg, replicas, drafter_devices, embed, head, compile, report):
    devices = [torch.device(d) for d in drafter_devices]
    settings = make_settings(a, compile)
    target_attention, compile_target = cli.resolve_target_stage(settings, [replicas[0].device])
    settings = settings.replace(target_layer_ids=replicas[0].target_layer_ids, drafter_devices=devices,
                                target_devices=[r.device for r in replicas], target_attention=target_attention,
                                compile_target=compile_target)
    for r in replicas:  # the target's layers compiled or not as the pipeline's defaults say
        r.drop_capture()
        r.set_compiled_layers(compile_target)
    drafters = [build_drafter(cfg, a, dev, embed, head) for dev in drafter_devices]
    W = len(drafter_devices)
    schedule = {"total_batches": a.pipeline_steps * W, "warmup_batches": W, "decay_batches": (a.pipeline_steps - 1) * W}
    plan = ck.RunPlan(0, 0, W, schedule, {}, {})
    log = tp.RunLog(a.output_dir, tp.Cluster())
    held_out = tp.HeldOut(settings, [], None, [], [], log)
    run = ThroughputRun(settings, plan, SyntheticBatches(a, cfg.vocab_size), drafters, log, held_out)
    t0 = time.perf_counter()
    tp.run_pipeline(run, replicas, show_progress=False)
    if run.errors:
        for where, tb in run.errors:
            print(f"error in {where}:\n{tb}")
        raise SystemExit(1)
    with open(os.path.join(a.output_dir, "metrics.jsonl")) as f:
        recs = [json.loads(l) for l in f][-max(1, (a.pipeline_steps // a.log_interval) - 1):]
    tok_s = sum(r["tokens_per_s"] for r in recs) / len(recs)
    os.remove(os.path.join(a.output_dir, "metrics.jsonl"))
    mode = "compiled+graph" if compile else "eager"
    report(f"pipeline {mode:14s}: {tok_s:,.0f} tokens/s (mean of the last {len(recs)} log intervals; "
           f"queues {recs[-1]['queue_depths']}; peak GB {recs[-1]['peak_mem_gb']}; "
           f"total {time.perf_counter() - t0:.0f}s)")
    del drafters, run
    torch.cuda.empty_cache()
    return tok_s, recs[-1]


def generation_throughput(a, report):
    """Generated tokens/s of the batched engine (decoding.generate) at a few batch sizes, eager and with
    the decode step replayed as a CUDA graph: --gen-model (a model directory or builtin:...) or,
    without one, a Qwen3-8B-shaped random-weight model. Every row decodes --gen-new-tokens (no
    stop ids), from prompts of --gen-prompt-tokens random tokens."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    if a.gen_model:
        model = target_model.load_full_target(a.gen_model, "cuda:0")
        name = a.gen_model
    else:
        with torch.device("cuda:0"):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**PRESETS["qwen3-8b"]), dtype=torch.bfloat16).eval()
        name = "Qwen3-8B-shaped (random weights)"
    n_params = sum(p.numel() for p in model.parameters())
    vocab = helpers.text_config(model.config).vocab_size
    report(f"generation: {name}, {n_params / 1e9:.2f}B parameters, prompts of {a.gen_prompt_tokens} tokens, "
           f"{a.gen_new_tokens} new tokens per row")
    def timed(fn):  # (result, seconds) of one call, the GPU's work included
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = fn()
        torch.cuda.synchronize()
        return res, time.perf_counter() - t0

    out = {}
    for batch in [int(b) for b in a.gen_batches.split(",")]:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, vocab, (a.gen_prompt_tokens,), generator=g).tolist() for _ in range(2 * batch)]
        # the model's own attention (transformers' SDPA: KV heads repeated under a mask), grouped
        # (the KV cache read once per KV head), flex (only the slots each live row uses)
        for mode, graph, attention in (("eager", False, "grouped"), ("graph, model attention", True, "model"),
                                       ("graph", True, "grouped"), ("graph, flex", True, "flex")):
            # warm-up (and capture)
            decoding.generate(model, prompts[:batch], 8, (), batch, graph=graph, decode_attention=attention)
            res, dt = timed(lambda: decoding.generate(model, prompts, a.gen_new_tokens, (), batch, graph=graph,
                                                decode_attention=attention))
            n = sum(len(t) for t, _ in res)
            out[f"{batch}_{mode}"] = n / dt
            report(f"  batch {batch:4d} {mode:22s}: {n / dt:9,.0f} generated tokens/s ({n} tokens in {dt:.1f}s, "
                   f"{2 * n_params * n / dt / PEAK_FLOPS:.1%} MFU on weights)")
        # prompt lookup: on random prompts it rarely proposes a right token, so this is the cost
        # of verifying blocks of 16 at about one token gained per step, against greedy's steps
        decoding.speculative_generate(model, prompts[:batch], 8, (), block_size=16, batch_size=batch)  # warm-up
        res, dt = timed(lambda: decoding.speculative_generate(model, prompts, a.gen_new_tokens, (), block_size=16,
                                                        batch_size=batch))
        n, steps = sum(len(t) for t, _ in res), sum(len(g) for _, g in res)
        out[f"{batch}_lookup"] = n / dt
        report(f"  batch {batch:4d} {'prompt lookup, block 16':22s}: {n / dt:9,.0f} generated tokens/s "
               f"({n / max(steps, 1):.2f} tokens per verification)")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="qwen3-8b on 2+ GPUs (target GPU 0, drafter GPU 1); small on 1 GPU; "
                   "smollm2-135m: the GPU demo's shapes")
    p.add_argument("--rows", type=int, default=None, help="rows of --max-length per batch (token budget / max length)")
    p.add_argument("--max-length", type=int, default=None, help="row length (default: the preset's)")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--ce-chunk", type=int, default=4096)
    p.add_argument("--loss", choices=("ce", "kl", "mix"), default="ce",
                   help="the drafter's loss (train_dflash_pipeline.py --loss): kl/mix add the target's top-k "
                   "distribution to each batch and run the whole target with its LM head")
    p.add_argument("--distill-top-k", type=int, default=64)
    p.add_argument("--ce-kernel", choices=("triton", "torch"), default=dm.HEAD_CE_KERNEL,
                   help="the LM-head chunk's reductions on CUDA: the Triton kernel or inductor's (dm.HEAD_CE_KERNEL)")
    p.add_argument("--drafter-attention", choices=("auto", "flex", "triton"), default="auto",
                   help="the drafter's block attention: flex_attention or dflash_model's Triton kernels; auto: the "
                   "pipeline's choice")
    p.add_argument("--attention-config", default="",
                   help="comma list of KEY=VALUE over kn.BLOCK_ATTENTION_CONFIG (the Triton kernels' rows a "
                   "program, keys a tile, warps, stages), e.g. fwd_rows=128,fwd_warps=8")
    p.add_argument("--target-attention", choices=("dense", "flex"), default="flex",
                   help="the target stage's attention in the sections after 'target' (which times both)")
    p.add_argument("--target-stages", type=int, default=2, help="split section: stages of the target on one GPU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--pipeline-steps", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--target-gpus", default=None,
                   help="GPU indices of the target stage (pipeline section), e.g. 0,1,2,3,4,5")
    p.add_argument("--drafter-gpus", default=None,
                   help="GPU indices of the drafter workers (pipeline section), e.g. 6,7")
    p.add_argument("--step-modes", default="eager,compiled", help="drafter step section: eager, compiled (then graph)")
    p.add_argument("--skip", default="",
                   help="comma list of sections to skip: step,target,split,scaling,beside,pipeline")
    p.add_argument("--output-dir", default="/tmp/dflash_bench")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--profile", default=None,
                   help="write a per-kernel GPU time table of the compiled drafter step here; "
                   "the graph's replays to FILE.graph and the two compared to FILE.diff; the target stage's "
                   "flex compiled graph to FILE.target")
    p.add_argument("--ce-memory", action="store_true",
                   help="only the LM-head/CE peak memory per chunk size (CPU or GPU)")
    p.add_argument("--ce-positions", type=int, default=16384)
    p.add_argument("--ce-hidden", type=int, default=4096)
    p.add_argument("--ce-vocab", type=int, default=151936)
    p.add_argument("--generation", action="store_true", help="only the generation engine's tokens/s")
    p.add_argument("--gen-model", default=None, help="default: a Qwen3-8B-shaped random-weight model")
    p.add_argument("--gen-batches", default="64,128,256")
    p.add_argument("--gen-prompt-tokens", type=int, default=256)
    p.add_argument("--gen-new-tokens", type=int, default=256)
    a = p.parse_args()
    if a.ce_memory:
        return ce_memory_table(a, print)
    if a.generation:
        return generation_throughput(a, print)
    n_gpu = torch.cuda.device_count()
    if n_gpu == 0:
        raise SystemExit("benchmark.py needs a CUDA GPU")
    a.preset = a.preset or ("qwen3-8b" if n_gpu >= 2 else "small")
    a.rows = a.rows or PRESET_BATCH[a.preset][0]
    a.max_length = a.max_length or PRESET_BATCH[a.preset][1]
    skip = set(a.skip.split(","))
    dm.HEAD_CE_KERNEL = a.ce_kernel
    for item in filter(None, a.attention_config.split(",")):
        key, value = item.split("=")
        if key not in kn.BLOCK_ATTENTION_CONFIG:
            raise SystemExit(f"--attention-config: {key} is not one of {', '.join(kn.BLOCK_ATTENTION_CONFIG)}")
        kn.BLOCK_ATTENTION_CONFIG[key] = int(value)
    from transformers import Qwen3Config
    cfg = Qwen3Config(**PRESETS[a.preset])
    layer_ids = dm.default_target_layer_ids(cfg.num_hidden_layers, a.draft_layers)
    # The pipeline section uses every listed GPU (e.g. 6+2: --target-gpus 0,1,2,3,4,5 --drafter-gpus 6,7);
    # the single-stage sections use the first of each.
    target_devs = [f"cuda:{i}" for i in (a.target_gpus or "0").split(",")]
    drafter_devs = [f"cuda:{i}" for i in (a.drafter_gpus or ("1" if n_gpu >= 2 else "0")).split(",")]
    target_dev, drafter_dev = target_devs[0], drafter_devs[0]
    a.drafter_attention = cli.resolve_drafter_attention(a.drafter_attention, [torch.device(drafter_dev)], cfg, a.block)
    n_used = len(set(target_devs + drafter_devs))
    target_hidden_size = len(layer_ids) * cfg.hidden_size
    lines = []

    started = time.perf_counter()

    def report(s):
        print(s, flush=True)
        lines.append(s)

    def section(name):
        report(f"[{time.perf_counter() - started:4.0f}s] {name}")

    report(f"# {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name(0)} x{n_gpu}, "
           f"torch {torch.__version__}")
    report(f"preset {a.preset}: batch {a.rows} x {a.max_length} tokens, {a.anchors} anchors/row x block {a.block}, "
           f"{a.draft_layers} draft layers, target layers {layer_ids}, LM-head CE kernel {a.ce_kernel}, "
           "drafter attention "
           f"{a.drafter_attention} {kn.BLOCK_ATTENTION_CONFIG}; target on {target_devs}, drafter on {drafter_devs}")
    report(f"FLOPs: {FORMULA}")
    results = {"preset": a.preset, "rows": a.rows, "max_length": a.max_length, "loss": a.loss}
    distillation = None if a.loss == "ce" else dict(top_k=a.distill_top_k, temperature=1.0)
    t_flops = target_flops_per_token(cfg, max(layer_ids) + 1) if distillation is None else \
        target_flops_per_token(cfg, cfg.num_hidden_layers) + 2 * cfg.hidden_size * cfg.vocab_size
    d_flops = drafter_flops_per_step(cfg, len(layer_ids), a.draft_layers, a.rows, a.max_length, a.anchors, a.block)
    tokens = a.rows * a.max_length
    report(f"target {t_flops / 1e9:.1f} GFLOP/token; drafter {d_flops / 1e12:.2f} TFLOP/step "
           f"({d_flops / tokens / 1e9:.1f} GFLOP per data token)")
    features = tokens * target_hidden_size * 2
    distribution = tokens * a.distill_top_k * 8  # int32 ids and fp32 probabilities
    report(f"target stage -> drafter per batch: features {features / 2**20:,.0f} MiB" + (
        "" if distillation is None else f", top-{a.distill_top_k} distribution {distribution / 2**20:,.0f} MiB "
        f"(+{distribution / features:.1%})"))

    # the target (on the step section's GPU too, when both share one) only where a section runs it
    replica = build_target(cfg, target_dev, layer_ids, a.target_attention, distillation) \
        if {"target", "split", "beside", "pipeline"} - skip else None
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=drafter_dev) * 0.02).to(torch.bfloat16)
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=drafter_dev) * 0.02).to(torch.bfloat16)
    dcfg = dm.make_drafter_config(cfg, cfg.vocab_size - 1, a.draft_layers, a.block)
    with torch.device("meta"):
        n_params = dm.DFlashDraftModel(dcfg).num_parameters()
    report(f"drafter params: {n_params / 1e9:.3f}B")
    attn_flops = drafter_attention_flops_per_step(dcfg, synthetic_batch(a, cfg.vocab_size, "cpu"), a.anchors, a.block)
    report(f"drafter attention (not in MFU): {attn_flops / 1e12:.2f} TFLOP/step on the (query, key) pairs its mask "
           "lets through")

    graphed = None  # the step section's captured worker: the beside and scaling sections reuse it
    if "step" not in skip:  # first: it compiles, and later sections reuse the compile caches
        section("step")
        st, graphed = drafter_step_times(a, cfg, drafter_dev, embed, head, target_hidden_size, report)
        results["drafter"] = st
        for k, v in st.items():
            report(drafter_rate_line(k, v, tokens, d_flops, attn_flops))
        if "eager" in st and "graph" in st:
            report(f"  compiled+graph vs eager: {st['eager']['step_s'] / st['graph']['step_s']:.2f}x; "
                   f"compiled vs eager {st['eager']['step_s'] / st['compiled']['step_s']:.2f}x")
    if "target" not in skip:
        section("target")
        tt, card = target_batch_times(a, replica, report)
        results["target"], results["target_card"] = tt, card
        for k, t in tt.items():
            mfu = t_flops * tokens / t / PEAK_FLOPS
            report(f"  target {k}: {tokens / t:,.0f} tokens/s, MFU {mfu:.1%}"
                   + (share_at_clock(mfu, card) if k == "flex compiled graph" else ""))
    if "split" not in skip:
        section("split")
        sp = split_target_times(a, replica, report)
        results["split"] = sp
        whole, split = sp["whole"], sp[f"{a.target_stages} stages"]
        report(f"  target whole {tokens / whole:,.0f} tokens/s, {a.target_stages} stages on one GPU "
               f"{tokens / split:,.0f} tokens/s ({whole / split:.3f}x); features differ by at most "
               f"{sp['largest_difference']:.3g}")
    if replica is not None:
        replica.drop_capture()  # its static buffers and pool: the later sections capture their own
    torch.cuda.empty_cache()
    if ({"beside", "scaling"} - skip) and graphed is None:
        graphed = drafter_worker(a, cfg, drafter_dev, embed, head, target_hidden_size, compile=True)
        graphed.capture(a.rows, target_hidden_size)
    if "beside" not in skip:
        section("beside")
        results["beside"] = drafter_beside_target(a, cfg, graphed, replica, target_hidden_size, report, 12)
    if "scaling" not in skip and n_gpu >= 2:
        section("scaling")
        other = "cuda:0" if drafter_dev != "cuda:0" else "cuda:1"
        sc = drafter_threads_scaling(a, cfg, graphed, [drafter_dev, other], embed, head, target_hidden_size, report, 30)
        results["scaling"] = sc
        report(f"  2 drafter threads vs 1: {sc[2] / sc[1]:.2f}x")
    graphed = None  # its graphs' memory: the pipeline builds its own workers
    gc.collect()
    torch.cuda.empty_cache()
    if "pipeline" not in skip:
        section("pipeline")
        replicas = [replica] + [build_target(cfg, d, layer_ids, a.target_attention, distillation)
                                for d in target_devs[1:]]
        pipe = {}
        for compile in (False, True):
            tok_s, rec = pipeline_throughput(a, cfg, replicas, drafter_devs, embed, head, compile, report)
            pipe["graph" if compile else "eager"] = tok_s
            mfu = tok_s * (t_flops + d_flops / tokens) / (PEAK_FLOPS * n_used)
            report(f"  pipeline {'compiled' if compile else 'eager'}: MFU overall {mfu:.1%} "
                   f"(target + drafter useful FLOPs over {n_used} GPU(s) peak); target stage "
                   f"{tok_s * t_flops / (PEAK_FLOPS * len(target_devs)):.1%}, drafter stage "
                   f"{tok_s * d_flops / tokens / (PEAK_FLOPS * len(drafter_devs)):.1%}")
        report(f"  pipeline compiled+graph vs eager: {pipe['graph'] / pipe['eager']:.2f}x")
        results["pipeline"] = pipe
    section("benchmark done")
    if a.json:
        write_json(a.json, results, lines)


def write_json(path, results, lines):
    """--json's file: the results and the printed lines."""
    with open(path, "w") as f:
        json.dump({"results": results, "lines": lines}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
