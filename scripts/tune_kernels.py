"""Check and re-derive the tuned kernel constants on this machine's GPU.

The project's kernels run with settings measured on Hopper (H100/H200) at Qwen3-8B's shapes:

- dflash_model.BLOCK_ATTENTION_CONFIG: tiles, warps and stages of the drafter's Triton block
  attention (forward, per-block backward, per-key-tile backward);
- dflash_model.SM90_FLEX_BACKWARD: flex_attention's backward tiles for the drafter (flex path);
- target_model.SM90_FLEX_TARGET: flex_attention's forward tiles for the target stage;
- flat_adamw.FlatAdamW.BLOCK / WARPS: the AdamW kernel's launch.

On a GPU this times the settings in force against a few alternatives at the benchmark's shapes
(Qwen3-8B heads: 32 query / 8 KV heads of 128; 4 rows x 3072 tokens, 512 anchors x block 16)
and prints one line per candidate, the fastest of each kernel last; outputs are compared with
the settings in force, so a faster candidate that computes something else is flagged. Copy a
winner into the constant above only if it wins clearly on the cards you train on.

    python scripts/tune_kernels.py                 # GPU: time every kernel's candidates
    python scripts/tune_kernels.py --only flex-target,adamw
    python scripts/tune_kernels.py --compile-only  # any machine: compile the block attention for sm_90

--compile-only needs no GPU (Triton's compiler and the ptxas it ships): it prints each block
attention kernel's SASS instructions, registers and stack a thread (spills) as configured.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dflash_model as dm  # noqa: E402
from dflash_train import target_model  # noqa: E402
from dflash_train import kernels as kn  # noqa: E402
from dflash_train import target_stage as ts  # noqa: E402
from dflash_train import helpers  # noqa: E402

B, L, H, KV, D, ANCHORS, BS = 4, 3072, 32, 8, 128, 512, 16
KERNELS = ("block-attention", "flex-drafter", "flex-target", "adamw")


# --- compiling the block attention for Hopper without a GPU ----------------------------------

POINTERS = {**dict.fromkeys(("q", "k", "v", "out", "dout", "dq", "dk", "dv"), "*bf16"),
            **dict.fromkeys(("lse", "delta"), "*fp32"),
            **dict.fromkeys(("starts", "anchors", "first_block", "end_block"), "*i32")}


def compile_block_attention(heads_per_kv, rows=None, block_size=16, head_dim=128):
    """{kernel name: compiled kernel} of dflash_model's three block-attention kernels for sm_90,
    with BLOCK_ATTENTION_CONFIG's keys, warps and stages and the row layout the launches use for
    `rows` (default: each kernel's configured rows)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    c = kn.BLOCK_ATTENTION_CONFIG
    out = {}
    for kernel, name in ((kn._block_attention_fwd, "fwd"), (kn._block_attention_bwd_block, "dq"),
                         (kn._block_attention_bwd_context, "dkdv")):
        program = kn._program_rows(rows or c[f"{name}_rows"], heads_per_kv, block_size, head_dim)
        constexprs = dict(program, BLOCK_N=c[f"{name}_keys"])
        if "BLOCK_B" in kernel.arg_names:
            constexprs["BLOCK_B"] = kn._own_keys(program["P"], block_size)
        signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "fp32" if n == "sm_scale" else "i32")
                     for n in kernel.arg_names}
        # As Triton's launcher specializes them: 16-byte aligned pointers, and integers that are
        # multiples of 16 (every stride, a multiple of head_dim; A and L; not the KV head count).
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                   if signature[n] not in ("constexpr", "fp32") and n != "NKV"}
        out[kernel.__name__] = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=c[f"{name}_warps"], num_stages=c[f"{name}_stages"], **kn.TRITON_OPTIONS))
    return out


def sass_summary(kernel):
    """(SASS instructions, registers a thread, stack bytes a thread) of a compiled kernel."""
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    # an instruction's line: its offset, then an opcode (a predicate first, maybe); not .byte data
    return sum(1 for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", line)), regs, stack


# --- timing candidates on the GPU ---------------------------------------------------------------

def time_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def compare(kernel, candidates, run):
    """Times run(candidate) -> (callable, output) for each candidate (the first: the settings in
    force) and prints each one's time and largest difference from the first's output."""
    first, best = None, None
    for name, candidate in candidates:
        try:
            fn, out = run(candidate)
            ms = time_ms(fn)
        except Exception as e:  # a setting the card cannot run (shared memory, registers): say so, go on
            print(f"{kernel} {name}: failed, {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        first = out if first is None else first
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, first))
        print(f"{kernel} {name}: {ms:.3f} ms, max |diff| from the settings in force {diff:.3g}", flush=True)
        if best is None or ms < best[0]:
            best = (ms, name)
    if best is not None:
        print(f"{kernel}: fastest {best[1]} ({best[0]:.3f} ms)", flush=True)


def drafter_attention_inputs(dev):
    """q [B, H, A*BS, D] and k, v [B, KV, L + A*BS, D] as the drafter's layers hand them over,
    anchors sorted per row, one document a row; and an output gradient."""
    g = torch.Generator(dev).manual_seed(0)
    anchors = torch.sort(torch.randperm(L - BS, generator=g, device=dev)[:ANCHORS]).values.repeat(B, 1)
    doc_ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    Q, S = ANCHORS * BS, L + ANCHORS * BS
    q = torch.randn(B, H, Q, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, KV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, KV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    return anchors, doc_ids, q, k, v, torch.randn(B, H, Q, D, device=dev, dtype=torch.bfloat16, generator=g)


def forward_backward(attend, q, k, v, gout):
    def step():
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v)
        out.backward(gout)
        return out
    out = step()
    return step, [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


def tune_block_attention(dev):
    anchors, doc_ids, q, k, v, gout = drafter_attention_inputs(dev)
    in_force = dict(kn.BLOCK_ATTENTION_CONFIG)
    candidates = [("in force", {})]
    for kernel in ("fwd", "dq", "dkdv"):
        for rows, keys, warps, stages in ((64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2),
                                          (128, 32, 4, 3)):
            change = {f"{kernel}_rows": rows, f"{kernel}_keys": keys, f"{kernel}_warps": warps,
                      f"{kernel}_stages": stages}
            if any(in_force[key] != value for key, value in change.items()):
                candidates.append((f"{kernel} rows {rows} keys {keys} warps {warps} stages {stages}", change))

    def run(change):
        kn.BLOCK_ATTENTION_CONFIG.update(in_force, **change)
        return forward_backward(dm.block_attend(anchors, doc_ids, BS), q, k, v, gout)
    try:
        compare("block-attention", candidates, run)
    finally:
        kn.BLOCK_ATTENTION_CONFIG.update(in_force)


def tune_flex_drafter(dev):
    from torch.nn.attention.flex_attention import flex_attention
    anchors, doc_ids, q, k, v, gout = drafter_attention_inputs(dev)
    starts = dm.context_starts(anchors, doc_ids)
    block_mask = dm.flex_block_mask(starts, anchors, L, BS, dm.block_mask_mod(starts, anchors, L, BS))
    attn = torch.compile(flex_attention, dynamic=False)
    candidates = [("in force", dm.flex_kernel_options(torch.device(dev), D)), ("inductor's default", None)]
    for m1, n1, m2, n2, stages, warps in ((64, 128, 128, 64, 3, 8), (32, 128, 128, 32, 2, 4), (64, 64, 64, 64, 2, 4)):
        candidates.append((f"bwd {m1}/{n1}/{m2}/{n2} stages {stages} warps {warps}",
                           {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
                            "bwd_num_stages": stages, "bwd_num_warps": warps}))

    def run(options):
        return forward_backward(lambda q, k, v: attn(q, k, v, block_mask=block_mask, enable_gqa=True,
                                                     kernel_options=options), q, k, v, gout)
    compare("flex-drafter", candidates, run)


def tune_flex_target(dev):
    """The target stage's flex forward under its own document mask, in each config's own tiles,
    queries token-major as the stage stores them."""
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator(dev).manual_seed(0)
    q = torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    doc_ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    candidates = [("in force", target_model.target_flex_kernel_options(torch.device(dev), D)),
                  ("inductor's default", None)]
    for m, n, warps, stages in ((128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2)):
        candidates.append((f"{m} x {n} warps {warps} stages {stages}",
                           dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)))

    def run(options):
        block_mask = ts.document_block_mask(doc_ids, tile=helpers.flex_mask_tile(options))
        fn = torch.compile(lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                                  kernel_options=options), dynamic=False)
        return fn, [fn()]
    compare("flex-target", candidates, run)


def tune_adamw(dev):
    from dflash_train.flat_adamw import FlatAdamW
    # 268M parameters: a 5-layer drafter's order of size
    params = [torch.nn.Parameter(torch.randn(4096, 4096, device=dev)) for _ in range(16)]
    flat_grad = torch.randn(sum(p.numel() for p in params), device=dev).to(torch.bfloat16)
    in_force = (FlatAdamW.BLOCK, FlatAdamW.WARPS)
    settings = ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8))
    others = [(b, w) for b, w in settings if (b, w) != in_force]
    candidates = [("in force", in_force)] + [(f"block {b} warps {w}", (b, w)) for b, w in others]
    initial = [p.detach().clone() for p in params]

    def run(setting):
        for p, p0 in zip(params, initial):
            p.data.copy_(p0)
        opt = FlatAdamW(params, flat_grad, torch.tensor(1e-4, device=dev), 0.0)
        opt.BLOCK, opt.WARPS = setting
        clip = torch.ones((), device=dev)
        opt.step(clip)
        return (lambda: opt.step(clip)), [opt.flat_param.clone()]
    compare("adamw", candidates, run)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the block attention kernels for sm_90 and print their SASS size, registers, spills")
    p.add_argument("--heads-per-kv", type=int, default=H // KV)
    a = p.parse_args()
    if a.compile_only:
        for name, kernel in compile_block_attention(a.heads_per_kv).items():
            instructions, regs, stack = sass_summary(kernel)
            print(f"{name} ({kernel.metadata.num_warps} warps): {instructions} SASS instructions, {regs} registers, "
                  f"{stack} B stack a thread")
        return 0
    if not torch.cuda.is_available():
        print("error: timing needs a CUDA GPU (--compile-only runs anywhere)", file=sys.stderr)
        return 2
    torch._dynamo.config.recompile_limit = 64  # one compile per candidate
    dev = "cuda"
    print(f"{torch.cuda.get_device_name(dev)}, capability {torch.cuda.get_device_capability(dev)}; torch "
          f"{torch.__version__}", flush=True)
    tuners = {"block-attention": tune_block_attention, "flex-drafter": tune_flex_drafter,
              "flex-target": tune_flex_target, "adamw": tune_adamw}
    for name in a.only.split(","):
        if name not in tuners:
            p.error(f"--only {name}: not one of {', '.join(KERNELS)}")
        if name == "block-attention" and kn.triton is None:
            print("block-attention: triton is not installed; skipped")
            continue
        tuners[name](dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
