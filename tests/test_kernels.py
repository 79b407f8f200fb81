"""Tests of dflash_train/kernels.py: the Triton kernels (block attention, the LM head's cross-entropy rows) against
torch's paths, in Triton's interpreter on the CPU, and their launches compiled for Hopper."""
import os

import pytest

from dflash_train import kernels as kn
from conftest import run_interpreted


CE_ROWS_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import dflash_model as dm
from dflash_train import kernels as kn
torch.manual_seed(0)
N, D, V = 24, 32, 1000  # V not a multiple of the block: the tail is masked
h = torch.randn(N, D, dtype=torch.bfloat16)
w = (torch.randn(V, D) * 0.3).to(torch.bfloat16)
lab = torch.randint(0, V, (N,))
lab[:8] = (h @ w.t()).float().argmax(-1)[:8]  # some right guesses
for with_grad in (True, False):
    want = dm._head_ce_chunk(h, w, lab, with_grad)
    got = dm._head_ce_chunk_triton(h, w, lab, with_grad, block=256, num_warps=4)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    assert torch.equal(got[1], want[1]) and int(got[1].sum()) >= 8
    assert (got[2] is None) == (not with_grad)
    if with_grad:
        # bf16 rounding of softmax - onehot flips where lse differs in its last fp32 bit
        torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-3)
# Tied maxima: the first index wins, as torch.argmax; -inf logits add nothing
logits = torch.tensor([[1.0, 3.0, 3.0, float("-inf")] * 300], dtype=torch.bfloat16).repeat(2, 1)
ce, correct = kn.ce_rows(logits.clone(), torch.tensor([1, 2]), False, block=256, num_warps=4)
assert correct.tolist() == (logits.float().argmax(-1) == torch.tensor([1, 2])).tolist() == [True, False]
torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits.float(), torch.tensor([1, 2]), reduction="none"))
print("ok")
"""


def test_triton_ce_kernel_matches_torch_chunk_interpreted():
    # The CUDA path's LM-head reductions (kn.ce_rows), run by Triton's interpreter on the CPU
    # against the torch chunk; tests/test_gpu.py runs it compiled.
    run_interpreted(CE_ROWS_CHECK)


BLOCK_ATTENTION_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import dflash_model as dm
from dflash_train import helpers
from dflash_train import kernels as kn
torch.manual_seed(0)
# (rows, query heads, KV heads, head_dim, context length, blocks, block size): heads x slots of
# 16, 30 (padded to 32 rows) and 16 a program; a 16-slot block beside a 16-key tile; a long
# document, whose blocks see whole key tiles. Key tiles of 16 and 32, so blocks span several.
# Rows a program: 16, one block; then 48 and 64, 3 and 4 blocks of 16 rows, 1 and 2 of 30 (the
# last program short of blocks, blocks of different documents in one program).
cases = [(2, 4, 2, 32, 40, 6, 8), (1, 6, 2, 16, 50, 5, 10), (1, 2, 2, 16, 33, 3, 16), (1, 2, 1, 16, 80, 8, 8)]
configs = [(keys, rows) for rows in ((16, 16, 16), (48, 64, 64)) for keys in ((16, 16, 16), (32, 16, 32))]
for (B, H, NKV, D, L, A, bs), (keys, rows) in zip(cases * 4, [c for c in configs for _ in cases]):
    kn.BLOCK_ATTENTION_CONFIG.update(zip(("fwd_keys", "dq_keys", "dkdv_keys"), keys))
    kn.BLOCK_ATTENTION_CONFIG.update(zip(("fwd_rows", "dq_rows", "dkdv_rows"), rows))
    doc = torch.zeros(B, L, dtype=torch.long)
    # Documents a row starting on a tile's last key, one past a tile's first, and the last one
    # short like padding
    for i, first in enumerate(sorted({15 if L < 48 else 31, 17, L - 5})):
        doc[:, first:] = i + 1
    anchors = torch.sort(torch.rand(B, L).topk(A, dim=1).indices, dim=1).values
    anchors[0, 0] = 0  # a block with no context at all
    if L > 63:  # anchors on the last key of a 16- and a 32-key tile, in a document starting before both
        anchors[0, 1:3] = torch.tensor([47, 63])
    anchors = torch.sort(anchors, dim=1).values
    q = torch.randn(B, A * bs, H, D).transpose(1, 2).requires_grad_()  # DraftAttention's layout
    k, v = (torch.randn(B, NKV, L + A * bs, D).requires_grad_() for _ in range(2))
    grad_out = torch.randn(B, H, A * bs, D)
    results = []
    for attend in (helpers.sdpa_attend(dm.dense_block_mask(anchors, doc, bs)), dm.block_attend(anchors, doc, bs)):
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v)
        out.backward(grad_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {(B, H, NKV, D, L, A, bs)} {keys} {rows}: {m}")
print("ok")
"""


def test_triton_block_attention_matches_dense_mask_interpreted():
    # The CUDA training attention (dm.block_attend's kernels: forward, the per-block and the
    # per-key-tile backward), run by Triton's interpreter on the CPU in fp32 against SDPA under
    # the dense mask of the same rule; tests/test_gpu.py runs it compiled, in bf16.
    run_interpreted(BLOCK_ATTENTION_CHECK)


@pytest.mark.parametrize("heads_per_kv,rows", [(4, 64), (4, 128), (2, 128)])
def test_block_attention_kernels_compile_for_hopper(heads_per_kv, rows, monkeypatch):
    # Triton's GPU compiler, down to ptxas (which triton ships), runs without a GPU: a kernel the
    # interpreter runs may still fail to compile, which otherwise only a GPU run finds. One
    # block a program (4 heads x 16 slots in 64 rows), then 2 and 4 blocks. Under Triton 3.10's
    # default (what TRITON_DEFAULT_FP_FUSION=0 gives on 3.9) a kernel has no fused multiply-adds
    # unless its launch asks; kn.TRITON_OPTIONS asks, so the kernels stay as tuned.
    pytest.importorskip("triton")
    from scripts.tune_kernels import compile_block_attention
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    program = kn._program_rows(rows, heads_per_kv, 16, 128)
    assert program["P"] == rows // (heads_per_kv * 16) and program["BLOCK_M"] == rows
    for name, compiled in compile_block_attention(heads_per_kv, rows).items():
        assert f".entry {name}" in compiled.asm["ptx"] and compiled.asm["cubin"], name
        assert compiled.metadata.enable_fp_fusion and "fma.rn.f32" in compiled.asm["ptx"], name


def test_every_triton_launch_passes_the_options():
    # Each launch `kernel[grid](...)` of a @triton.jit function in the project's modules passes
    # **TRITON_OPTIONS (read from the source: launching needs a GPU).
    import ast
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launches = []  # (kernel, how many times that launch passes **TRITON_OPTIONS), one a launch
    for path in ("dflash_train/kernels.py", "dflash_train/flat_adamw.py"):
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read())
        kernels = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                   and any(ast.unparse(d) == "triton.jit" for d in f.decorator_list)}
        for call in ast.walk(tree):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id in kernels):
                launches.append((call.func.value.id, sum(k.arg is None and ast.unparse(k.value).endswith("TRITON_OPTIONS")
                                                         for k in call.keywords)))
    assert sorted(name for name, _ in launches) == ["_adamw_kernel", "_block_attention_bwd_block",
                                                    "_block_attention_bwd_context", "_block_attention_fwd",
                                                    "_ce_rows_kernel"]
    assert all(n == 1 for _, n in launches), launches
