import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open

import decoding
import evaluation
import target_model
import dflash_model as dm
from conftest import run_interpreted, tiny_target



@pytest.fixture(autouse=True)
def float64_default():
    """Exact comparisons in this file: tiny models and inputs in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make_drafter(target, layers=2, block_size=4, seed=1):
    torch.manual_seed(seed)
    cfg = dm.make_drafter_config(target.config, mask_token_id=target.config.vocab_size - 1,
                                 num_draft_layers=layers, block_size=block_size)
    return dm.DFlashDraftModel(cfg).to(torch.float64).attach_target(target).eval()


def target_features(target, ids, layer_ids):
    with target_model.collect_layer_outputs(target, layer_ids) as hidden:
        target(ids[None])
    return torch.cat(hidden, -1)[0]


def packed_row(target, drafter, doc_lens, pad, seed=0):
    """One packed row of several documents: ids, doc ids, positions and target features, each
    document's features computed on its own (what the pipeline's target stage must produce)."""
    g = torch.Generator().manual_seed(seed)
    ids, docs, pos, hidden = [], [], [], []
    for d, n in enumerate(doc_lens):
        t = torch.randint(0, target.config.vocab_size - 1, (n,), generator=g)
        ids.append(t); docs.append(torch.full((n,), d)); pos.append(torch.arange(n))
        hidden.append(target_features(target, t, drafter.target_layer_ids))
    ids.append(torch.zeros(pad, dtype=torch.long)); docs.append(torch.full((pad,), -1))
    pos.append(torch.zeros(pad, dtype=torch.long)); hidden.append(torch.zeros(pad, hidden[0].shape[1]))
    return torch.cat(ids)[None], torch.cat(docs)[None], torch.cat(pos)[None], torch.cat(hidden)[None]


def test_default_target_layer_ids():
    assert dm.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dm.default_target_layer_ids(36, 1) == [18]


def test_attention_rule_matches_brute_force():
    torch.manual_seed(0)
    L, bs, A = 40, 4, 9
    doc = torch.tensor([0] * 13 + [1] * 17 + [2] * 6 + [-1] * 4)[None].repeat(2, 1)
    doc[1] = torch.tensor([0] * 30 + [1] * 10)
    # random anchors with repeats-free overlap, including ones whose blocks run past the end
    anchors = torch.stack([torch.sort(torch.randperm(L)[:A]).values for _ in range(2)])
    anchors[:, -1] = L - 2
    mask = dm.dense_block_mask(anchors, doc, bs)[:, 0]
    for b in range(2):
        for i in range(A):
            a = int(anchors[b, i])
            for s in range(bs):
                q = i * bs + s
                for j in range(L + A * bs):
                    if j < L:
                        want = j < a and int(doc[b, j]) == int(doc[b, a])
                    else:
                        want = (j - L) // bs == i
                    assert bool(mask[b, q, j]) == want, (b, i, s, j)


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("B,L,A,bs,tile", [(2, 3072, 512, 16, 128), (1, 1000, 100, 16, 128), (2, 128, 16, 4, 128),
                                           (2, 700, 37, 10, 128), (1, 300, 20, 7, 128), (2, 3072, 512, 16, (128, 64)),
                                           (2, 700, 37, 10, (64, 128))])
def test_flex_block_mask_equals_create_block_mask(B, L, A, bs, tile):
    # Shapes where query/key lengths are and are not multiples of the tile, blocks that do not
    # divide it, several documents and padding (-1), full and partial tiles; square tiles and not.
    from torch.nn.attention.flex_attention import create_block_mask
    g = torch.Generator().manual_seed(L)
    doc = torch.zeros(B, L, dtype=torch.long)
    for r in range(B):
        cuts = sorted(torch.randint(1, L, (3,), generator=g).tolist())
        for i, (s, e) in enumerate(zip([0] + cuts, cuts + [L])):
            doc[r, s:e] = i
        doc[r, -3:] = -1
    anchors = torch.sort(torch.rand(B, L, generator=g).topk(A, dim=1).indices, dim=1).values
    starts = dm.context_starts(anchors, doc)
    mask_mod = dm.block_mask_mod(starts, anchors, L, bs)
    want = create_block_mask(mask_mod, B, None, A * bs, L + A * bs, device="cpu", BLOCK_SIZE=tile)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as in the training step: counts must stay exact
        got = dm.flex_block_mask(starts, anchors, L, bs, mask_mod, tile)
    assert (got.seq_lengths, got.BLOCK_SIZE) == (want.seq_lengths, want.BLOCK_SIZE)
    for f in BLOCK_MASK_FIELDS:  # values, and the layout flex's Triton kernels assume (contiguous)
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert getattr(got, f).stride() == getattr(want, f).stride(), f
    assert got.mask_mod is mask_mod
    if B == 2 and L == 128:  # traced as in the compiled step (fullgraph): the same tensors
        build = torch.compile(lambda a, d: [getattr(dm.flex_block_mask(dm.context_starts(a, d), a, L, bs, mask_mod), f)
                                            for f in BLOCK_MASK_FIELDS], fullgraph=True, dynamic=False)
        for f, t in zip(BLOCK_MASK_FIELDS, build(anchors, doc)):
            assert torch.equal(t, getattr(want, f)) and t.stride() == getattr(want, f).stride(), f


def test_block_mask_trace_does_not_grow_with_rows():
    # Traced into the compiled step, the mask must be the same graph at 2 rows and at 32: a
    # per-row Python loop unrolled there made the compile time grow with the rows.
    node_counts = []

    def count_nodes(gm, example_inputs):
        node_counts.append(len(gm.graph.nodes))
        return gm.forward
    for B in (2, 32):
        anchors = torch.sort(torch.rand(B, 300).topk(20, dim=1).indices, dim=1).values
        doc = torch.zeros(B, 300, dtype=torch.long)
        torch.compile(lambda a, d: dm.flex_block_mask(dm.context_starts(a, d), a, 300, 4, None).kv_indices, backend=count_nodes,
                      fullgraph=True, dynamic=False)(anchors, doc)
    assert node_counts[0] == node_counts[1], node_counts


def test_flex_backward_options_only_where_measured(monkeypatch):
    # Hopper at head_dim 64 and 128 (measured faster, bitwise the same: tests/test_gpu.py); else
    # inductor's defaults (an untested config could fail to compile or run slower).
    cuda, capability = torch.device("cuda", 0), {"value": (9, 0)}
    monkeypatch.setattr(dm, "cuda_capability", lambda device: capability["value"])
    assert dm.flex_kernel_options(cuda, 64) == dm.flex_kernel_options(cuda, 128) == dm.SM90_FLEX_BACKWARD
    assert dm.flex_kernel_options(cuda, 96) is None
    assert dm.flex_kernel_options(torch.device("cpu"), 64) is None
    capability["value"] = (8, 0)
    assert dm.flex_kernel_options(cuda, 64) is None and dm.flex_kernel_options(cuda, 128) is None


def test_target_stage_flex_forward_options_only_where_measured(monkeypatch):
    # The target stage's attention passes its forward tiles for the card (Hopper at head_dim 128,
    # measured faster with the same output: docs/benchmarks.md); the decoder's keeps inductor's.
    assert target_model.register_flex_attention(target_stage=True) == "dflash_flex_target"
    assert target_model.register_flex_attention() == "dflash_flex"
    seen = []
    monkeypatch.setattr(target_model, "flex_attention_for_transformers", lambda *a, kernel_options=None, **kw: seen.append(kernel_options))
    monkeypatch.setattr(target_model, "hopper", lambda device: True)
    for head_dim in (128, 64):
        q = torch.zeros(1, 2, 4, head_dim)
        target_model.target_flex_attention(None, q, q, q, None, scaling=1.0)
    monkeypatch.setattr(target_model, "hopper", lambda device: False)
    target_model.target_flex_attention(None, q.new_zeros(1, 2, 4, 128), q, q, None)
    assert seen == [target_model.SM90_FLEX_TARGET, None, None]


def test_flex_attention_path_equals_dense_path():
    # The GPU training path (flex_attention over flex_block_mask) against the CPU one (SDPA with
    # the dense mask), forward only: flex_attention has no backward on CPU. Lengths off the
    # 128 tile, full and partial tiles, three documents, blocks running past the row's end.
    torch.manual_seed(0)
    B, L, A, bs, H, KV, D = 2, 600, 64, 4, 4, 2, 32
    doc = torch.zeros(B, L, dtype=torch.long)  # row 0: one document (it has full tiles)
    doc[1, 400:] = 1
    doc[1, 550:] = 2
    anchors = torch.stack([torch.sort(torch.randperm(L - 1)[:A]).values for _ in range(B)])
    anchors[:, -1] = L - 2
    assert dm.flex_block_mask(dm.context_starts(anchors, doc), anchors, L, bs, None).full_kv_num_blocks.sum() > 0
    f32 = torch.float32  # flex_attention on CPU takes no float64
    q = torch.randn(B, A * bs, H, D, dtype=f32).transpose(1, 2)  # the layout DraftAttention hands over
    k, v = torch.randn(2, B, KV, L + A * bs, D, dtype=f32)
    flex = dm.flex_attend(anchors, doc, bs)(q, k, v)
    dense = dm.sdpa_attend(dm.dense_block_mask(anchors, doc, bs))(q, k, v)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_training_forward_matches_inference(arch):
    """The logits the training forward gives a block at anchor a equal those the inference path
    gives when drafting at a after the target processed tokens < a (catches context leaks)."""
    target = tiny_target(arch)
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    starts = {0: 0, 1: 11, 2: 28}
    anchors = torch.tensor([[3, 10, 12, 20, 27, 29, 35]])  # several docs; blocks cross doc ends
    train_logits = drafter.block_hidden(hidden, ids, doc, pos, anchors) @ drafter.lm_head_weight.t()
    for i, a in enumerate(anchors[0].tolist()):
        d = int(doc[0, a]); p = a - starts[d]
        prefix = ids[0, starts[d]:a]
        f = target_features(target, prefix, drafter.target_layer_ids)[None]
        ctx_kv = drafter.context_kv(f, torch.arange(p)[None])
        infer = drafter.draft_logits(ctx_kv, ids[0, a], p)
        torch.testing.assert_close(train_logits[0, i], infer[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layers", [1, 3])
def test_block_hidden_equals_every_slot_through_every_layer(layers):
    """draft_hidden's first layer projects each distinct row once (the anchors' rows, one mask row
    for all blocks) and its last carries only slots 1.. past the attention: the same hidden
    states and parameter gradients as every slot of every block run through every layer."""
    target = tiny_target()
    drafter = make_drafter(target, layers=layers)
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    anchors = torch.tensor([[3, 10, 12, 20, 27, 29, 35]])
    B, A, bs = 1, anchors.shape[1], drafter.block_size
    block_ids = torch.full((B, A, bs), drafter.mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    block_pos = (pos.gather(1, anchors)[:, :, None] + torch.arange(bs)).view(B, A * bs)
    attend = dm.sdpa_attend(dm.dense_block_mask(anchors, doc, bs))
    x = drafter.embed_tokens(block_ids.view(B, A * bs))
    cos, sin = drafter.rotary_emb(x, block_pos)
    for layer, (k, v) in zip(drafter.layers, drafter.context_kv(hidden, pos)):
        x = layer(x, cos, sin, k, v, attend)
    want = drafter.norm(x).view(B, A, bs, -1)[:, :, 1:]
    got = drafter.block_hidden(hidden, ids, doc, pos, anchors)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    params = list(drafter.parameters())
    torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), params),
                               torch.autograd.grad((want * weights).sum(), params), rtol=1e-10, atol=1e-12)


def fp32_drafter_and_row():
    """An fp32 drafter and the forward's inputs for one packed row of three documents."""
    torch.set_default_dtype(torch.float32)
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float()
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    return drafter, (hidden, ids, torch.ones_like(ids, dtype=torch.float32), doc, pos,
                     torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)))


def test_bf16_matmul_weights_give_the_fp32_drafters_step_under_autocast():
    """The CUDA training step passes bf16 copies of the matmul weights (train_dflash_pipeline's
    FlatAdamW keeps them) and autocast does the rest: loss and gradients must be the fp32
    drafter's under autocast, bit for bit (the residual stream's dtype is autocast's in both, not
    read off a weight)."""
    drafter, inputs = fp32_drafter_and_row()
    params = dict(drafter.named_parameters())
    linear = {f"{name}.weight" for name, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)}
    copies = {k: (p.to(torch.bfloat16) if k in linear else p) for k, p in params.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = drafter(*inputs, num_anchors=7)
        got, _ = torch.func.functional_call(drafter, copies, inputs, dict(num_anchors=7))
    assert torch.equal(got, want), (got, want)
    grads = torch.autograd.grad(got, [copies[k] for k in params])
    for (k, p), g, w in zip(params.items(), grads, torch.autograd.grad(want, list(params.values()))):
        assert torch.equal(g.float(), w), k


def test_the_residual_stream_takes_autocasts_dtype():
    """Train = serve: under autocast (the GPU step) the residual stream, into and out of every
    layer, is bf16, as a server runs the drafter; without autocast (CPU training) it is fp32."""
    drafter, inputs = fp32_drafter_and_row()
    seen = []
    for layer in drafter.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    drafter(*inputs, num_anchors=7)
    assert seen and set(seen) == {(torch.float32, torch.float32)}
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafter(*inputs, num_anchors=7)
    assert len(seen) == len(drafter.layers) and set(seen) == {(torch.bfloat16, torch.bfloat16)}


def test_context_leak_would_be_caught():
    """Sanity of the test above: letting a block see its anchor's own hidden state changes logits."""
    target = tiny_target()
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [20], pad=0)
    a = 10
    f_ok = target_features(target, ids[0, :a], drafter.target_layer_ids)[None]
    f_leak = target_features(target, ids[0, :a + 1], drafter.target_layer_ids)[None]
    ok = drafter.draft_logits(drafter.context_kv(f_ok, torch.arange(a)[None]), ids[0, a], a)
    leak = drafter.draft_logits(drafter.context_kv(f_leak, torch.arange(a + 1)[None]), ids[0, a], a)
    assert not torch.allclose(ok, leak)


def test_loss_weights_and_normalisation_by_hand():
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    ids, doc, pos, hidden = packed_row(target, drafter, [8, 6], pad=2)
    L = ids.shape[1]
    loss_mask = torch.ones(1, L); loss_mask[0, :3] = 0; loss_mask[0, 12] = 0; loss_mask[0, 14:] = 0
    noise = torch.zeros(1, L); noise[0, 5] = 0.9; noise[0, 10] = 0.8; noise[0, 6] = 0.7
    gamma = 2.0
    loss, stats = drafter(hidden, ids, loss_mask, doc, pos, noise, num_anchors=3, gamma=gamma, ce_chunk_size=5)
    anchors = torch.tensor([[5, 6, 10]])
    logits = (drafter.block_hidden(hidden, ids, doc, pos, anchors) @ drafter.lm_head_weight.t())[0]  # [3, slots 1..3, V]
    num = den = 0.0
    for i, a in enumerate([5, 6, 10]):
        for k in range(1, 4):
            t = a + k
            # same row, same document, loss mask set
            if t >= L or doc[0, t] != doc[0, a] or loss_mask[0, t] == 0:
                continue
            w = math.exp(-(k - 1) / gamma)
            ce = -torch.log_softmax(logits[i, k - 1], -1)[ids[0, t]]
            num += w * ce.item(); den += w
    assert den > 0
    assert abs(loss.item() - num / den) < 1e-9
    # anchor 10 (doc 1: 8..13) sees labels 11 (ok), 12 (masked), 13 (ok); anchor 5: 6, 7 then doc ends
    assert float(stats[2]) == 3  # three valid blocks


def test_too_few_valid_positions_get_zero_weight():
    target = tiny_target()
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [6], pad=10)
    mask = (doc >= 0).double()
    loss, stats = drafter(hidden, ids, mask, doc, pos, torch.rand(1, 16), num_anchors=12)
    assert torch.isfinite(loss)
    assert float(stats[2]) == 5  # positions 0..4 are the only valid anchors


def test_chunked_head_matches_full_and_grads():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16)
    lab = torch.randint(0, 50, (37,))
    ce, correct = dm.lm_head_ce(h, w, lab, 8)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), lab, reduction="none")
    torch.testing.assert_close(ce, ref)
    assert torch.equal(correct, (h @ w.t()).argmax(-1) == lab)
    g = torch.randn(37)
    (gh,) = torch.autograd.grad((ce * g).sum(), h)
    (gref,) = torch.autograd.grad((ref * g).sum(), h)
    torch.testing.assert_close(gh, gref)
    # Without a gradient (evaluation) the same values come out, and no gradient is computed.
    ce_eval, correct_eval = dm.lm_head_ce(h.detach(), w, lab, 8, False)
    torch.testing.assert_close(ce_eval, ref)
    assert torch.equal(correct_eval, correct)


def test_head_reads_hidden_in_the_weight_dtype(monkeypatch):
    # The op gets the final norm's output (fp32 in a step) already in the head's bf16, as its
    # matmul reads it: the same ce as casting it inside, and the gradient back in the input's dtype.
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16).to(torch.bfloat16)
    lab = torch.randint(0, 50, (37,))
    seen, op = [], dm._lm_head_ce
    monkeypatch.setattr(dm, "_lm_head_ce", lambda hidden, *rest: seen.append(hidden.dtype) or op(hidden, *rest))
    ce, _ = dm.lm_head_ce(h, w, lab, 8)
    assert seen == [torch.bfloat16]
    ref = torch.nn.functional.cross_entropy((h.to(torch.bfloat16) @ w.t()).float(), lab, reduction="none")
    torch.testing.assert_close(ce, ref)
    (gh,) = torch.autograd.grad(ce.sum(), h)
    (gref,) = torch.autograd.grad(ref.sum(), h)
    assert gh.dtype == h.dtype
    torch.testing.assert_close(gh, gref, rtol=2e-2, atol=2e-2)  # a bf16 matmul's rounding


def test_compiled_head_chunk_matches_eager_and_writes_no_fp32_vocabulary_buffer():
    # Compiled (--compile's LM-head chunk), the softmax gradient is fused into the reductions'
    # kernel and written once in bf16; a scatter there made it an fp32 N x V buffer plus a cast.
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    N, D, V = 64, 32, 1000
    h = torch.randn(N, D, dtype=torch.bfloat16)
    w = (torch.randn(V, D) * 0.2).to(torch.bfloat16)
    lab = torch.randint(0, V, (N,))
    want = dm._head_ce_chunk(h, w, lab, True)
    got, code = run_and_get_code(torch.compile(dm._head_ce_chunk, dynamic=False), h, w, lab, True)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    vocab_buffers = re.findall(rf"\(\({N}, {V}\), \({V}, 1\), torch\.(\w+)\)", "\n".join(code))
    assert vocab_buffers and "float32" not in vocab_buffers, vocab_buffers


# --- distillation: KL from the target's top-k distribution ----------------------------------

def distribution_case(N=9, D=8, V=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    target = (torch.randn(N, V, generator=g) * 2).softmax(-1)
    return h, w, torch.randint(0, V, (N,), generator=g), target


@pytest.mark.parametrize("kl_weight", [1.0, 0.3])
def test_kl_with_the_whole_vocabulary_is_the_exact_kl_and_its_gradient(kl_weight):
    h, w, lab, p = distribution_case()
    ids = p.argsort(-1, descending=True)  # top-k = the vocabulary: no rest bucket
    h = h.requires_grad_()
    loss, correct = dm.lm_head_ce(h, w, lab, 4, True, (ids, p.gather(1, ids)), kl_weight)
    log_q = (h @ w.t()).log_softmax(-1)
    ref = (1 - kl_weight) * -log_q.gather(1, lab[:, None])[:, 0] + kl_weight * (p * (p.log() - log_q)).sum(-1)
    torch.testing.assert_close(loss, ref)
    assert torch.equal(correct, log_q.argmax(-1) == lab)
    g = torch.randn(len(lab))
    torch.testing.assert_close(torch.autograd.grad((loss * g).sum(), h)[0], torch.autograd.grad((ref * g).sum(), h)[0])


def test_kl_of_a_top_k_is_over_the_k_tokens_and_one_bucket_for_the_rest():
    h, w, lab, p = distribution_case()
    ids = p.topk(5, -1).indices
    pk = p.gather(1, ids)
    h = h.requires_grad_()
    loss, _ = dm.lm_head_ce(h, w, lab, 4, True, (ids, pk), 1.0)
    q = (h @ w.t()).softmax(-1)
    qk, rest, q_rest = q.gather(1, ids), 1 - pk.sum(-1), 1 - q.gather(1, ids).sum(-1)
    ref = (pk * (pk / qk).log()).sum(-1) + rest * (rest / q_rest).log()  # written out by hand
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), h)[0], torch.autograd.grad(ref.sum(), h)[0])


def test_kl_to_a_one_hot_distribution_is_the_cross_entropy():
    h, w, lab, _ = distribution_case()
    one_hot = (lab[:, None], torch.ones(len(lab), 1))
    for weight in (1.0, 0.5):
        got = dm._head_distill_chunk(h, w, lab, *one_hot, weight, True)
        want = dm._head_ce_chunk(h, w, lab, True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_compiled_distillation_chunk_matches_eager():
    torch._dynamo.reset()
    h, w, lab, p = distribution_case(N=32, V=200)
    top = p.topk(16, -1)
    args = (h.float(), w.float(), lab, top.indices, top.values.float(), 0.5, True)
    for a, b in zip(torch.compile(dm._head_distill_chunk, dynamic=False)(*args), dm._head_distill_chunk(*args)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_training_with_kl_lowers_the_kl_to_the_target():
    # A drafter trained on one batch's target distribution (the target stage's top-k at T=1) with
    # --loss kl: the KL to it falls well below where it starts.
    import train_dflash_pipeline as tp
    target = tiny_target(vocab=64, init_std=0.3)
    drafter = make_drafter(target).train()
    replica = tp.TargetReplica(target, drafter.target_layer_ids, torch.device("cpu"),
                               distillation=dict(top_k=16, temperature=1.0, kl_weight=1.0))
    g = torch.Generator().manual_seed(0)
    R, L = 2, 40
    ids = torch.randint(0, 63, (R, L), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(L).repeat(R, 1), "doc_ids": torch.zeros(R, L).long()}
    out = replica.outputs(batch)
    inputs = (out["target_hidden"], ids, torch.ones(R, L), batch["doc_ids"], batch["position_ids"],
              torch.rand(R, L, generator=g), out["target_top_ids"], out["target_top_probs"])
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss, _ = drafter(*inputs, num_anchors=8, kl_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


CE_ROWS_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import dflash_model as dm
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
ce, correct = dm.ce_rows(logits.clone(), torch.tensor([1, 2]), False, block=256, num_warps=4)
assert correct.tolist() == (logits.float().argmax(-1) == torch.tensor([1, 2])).tolist() == [True, False]
torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits.float(), torch.tensor([1, 2]), reduction="none"))
print("ok")
"""


def test_triton_ce_kernel_matches_torch_chunk_interpreted():
    # The CUDA path's LM-head reductions (dm.ce_rows), run by Triton's interpreter on the CPU
    # against the torch chunk; tests/test_gpu.py runs it compiled.
    run_interpreted(CE_ROWS_CHECK)


BLOCK_ATTENTION_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import dflash_model as dm
torch.manual_seed(0)
# (rows, query heads, KV heads, head_dim, context length, blocks, block size): heads x slots of
# 16, 30 (padded to 32 rows) and 16 a program; a 16-slot block beside a 16-key tile; a long
# document, whose blocks see whole key tiles. Key tiles of 16 and 32, so blocks span several.
# Rows a program: 16, one block; then 48 and 64, 3 and 4 blocks of 16 rows, 1 and 2 of 30 (the
# last program short of blocks, blocks of different documents in one program).
cases = [(2, 4, 2, 32, 40, 6, 8), (1, 6, 2, 16, 50, 5, 10), (1, 2, 2, 16, 33, 3, 16), (1, 2, 1, 16, 80, 8, 8)]
configs = [(keys, rows) for rows in ((16, 16, 16), (48, 64, 64)) for keys in ((16, 16, 16), (32, 16, 32))]
for (B, H, NKV, D, L, A, bs), (keys, rows) in zip(cases * 4, [c for c in configs for _ in cases]):
    dm.BLOCK_ATTENTION_CONFIG.update(zip(("fwd_keys", "dq_keys", "dkdv_keys"), keys))
    dm.BLOCK_ATTENTION_CONFIG.update(zip(("fwd_rows", "dq_rows", "dkdv_rows"), rows))
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
    for attend in (dm.sdpa_attend(dm.dense_block_mask(anchors, doc, bs)), dm.block_attend(anchors, doc, bs)):
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
    # unless its launch asks; dm.TRITON_OPTIONS asks, so the kernels stay as tuned.
    pytest.importorskip("triton")
    from scripts.tune_kernels import compile_block_attention
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    program = dm._program_rows(rows, heads_per_kv, 16, 128)
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
    for path in ("dflash_model.py", "flat_adamw.py"):
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


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rope_theta", "rms_norm_eps", "block_size", "num_target_layers", "layer_types"):
        assert key in cfg, key
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["dflash_config"] == {"mask_token_id": 299, "target_layer_ids": drafter.target_layer_ids}
    # vLLM builds before its layer-offset fix read only this field, as hidden_states indices
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.target_layer_ids]
    assert cfg["rope_theta"] == dm.rope_fields(target.config)[0]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or "lm_head" in n for n in names)
    expected = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert names == expected
    loaded = dm.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64).attach_target(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [12], pad=0)
    anchors = torch.tensor([[2, 7]])
    torch.testing.assert_close(loaded.block_hidden(hidden, ids, doc, pos, anchors),
                               drafter.block_hidden(hidden, ids, doc, pos, anchors))


def test_rope_scaling_written_top_level(tmp_path):
    target = tiny_target("llama")
    target.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    cfg = dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=1, block_size=4)
    d = dm.serving_config_dict(cfg)
    assert d["rope_theta"] == 5e5 and d["rope_scaling"]["rope_type"] == "linear"


class OracleDrafter:
    """Wraps a drafter's draft_logits so its first `right` slots are the target's true continuation
    (one row)."""

    def __init__(self, drafter, truth, prompt_len, right):
        self.drafter, self.truth, self.prompt_len, self.right = drafter, truth, prompt_len, right

    def __call__(self, ctx_kv, anchor_token, anchor_position, attend=dm.full_attend):
        logits = dm.DFlashDraftModel.draft_logits(self.drafter, ctx_kv, anchor_token, anchor_position, attend)
        for k in range(min(self.right, logits.shape[1])):
            i = int(torch.as_tensor(anchor_position).reshape(-1)[0]) + 1 + k - self.prompt_len
            if 0 <= i < len(self.truth):
                logits[0, k] = 0
                logits[0, k, self.truth[i]] = 1
        return logits


def hf_greedy(target, prompt, n, stop=None):
    out = target.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("right", [0, 2, 3, 100])
def test_speculative_decoding_is_lossless(right):
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(0, 299, (1, 7), generator=torch.Generator().manual_seed(3))
    truth = hf_greedy(target, prompt, 30)
    drafter.draft_logits = OracleDrafter(drafter, truth, prompt.shape[1], right)
    (out, acc), = decoding.speculative_generate(target, prompt.tolist(), 30, drafter=drafter, batch_size=1, graph=False)
    assert out == truth
    assert sum(acc) + 1 >= len(out)
    if right >= 3:  # every draft right: bs tokens per target forward
        assert acc[:-1] == [4] * (len(acc) - 1)
    elif right == 2:
        assert set(acc[:-1]) == {3}


def test_speculative_rows_that_finish_first_stay_inside_their_cache_slots():
    """A row that ends by length keeps its place while the other rows go on verifying blocks;
    with the longest prompt at a multiple of the slot granule (no padding to spare), its blocks
    must still fit the cache (this case ran out of bounds when a row held max_new + block slots)
    and every output is the target's greedy one. The counter target makes prompt lookup right
    along counting runs and wrong at their defects, so the rows gain at different rates."""
    import random
    from conftest import counter_target
    V, rnd = 128, random.Random(0)
    target = counter_target(V)
    prompts = []
    for r in range(3):
        p = [i % V for i in range(256 - 8 * r)]
        for _ in range(rnd.randint(1, 12)):
            p[rnd.randrange(len(p))] = rnd.randrange(V)
        prompts.append(p)
    prompts.append([rnd.randrange(V) for _ in range(200)])
    outs = decoding.speculative_generate(target, prompts, 48, (), block_size=16, batch_size=4, graph=False)
    assert [o for o, _ in outs] == [t for t, _ in decoding.generate(target, prompts, 48, (), 4, graph=False)]
    assert len({len(gains) for _, gains in outs}) > 1  # the rows took different numbers of steps


def test_speculative_decoding_stops_at_stop_token():
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(0, 299, (1, 5), generator=torch.Generator().manual_seed(4))
    truth = hf_greedy(target, prompt, 20)
    stop = truth[6]
    (out, _), = decoding.speculative_generate(target, prompt.tolist(), 20, [stop], drafter=drafter, batch_size=1, graph=False)
    assert out == hf_greedy(target, prompt, 20, stop)
    assert out[-1] == stop and len(out) <= 7


def test_batched_decoding_equals_transformers_generate_and_per_row_speculation():
    """Rows of mixed lengths in one batch (left-padded, refilled batch by batch) decode exactly as
    transformers' greedy generate decodes each alone; batched speculation with a drafter and with
    prompt lookup gives the same outputs, and a row's accepted lengths do not depend on its batch."""
    for arch in ("qwen3", "llama"):
        target = tiny_target(arch=arch, dtype=torch.float32, init_std=0.15, vocab=128)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
        greedy = decoding.generate(target, prompts, 20, [1], batch_size=3, graph=False)
        drafter = make_drafter(target, block_size=4)
        batched = decoding.speculative_generate(target, prompts, 20, [1], drafter=drafter, batch_size=3, graph=False)
        lookup = decoding.speculative_generate(target, prompts, 20, [1], block_size=4, batch_size=2, graph=False)
        for p, (tokens, reason), (spec, gains), (look, _) in zip(prompts, greedy, batched, lookup):
            assert tokens == hf_greedy(target, torch.tensor([p]), 20, 1) == spec == look
            assert reason == ("stop" if tokens[-1] == 1 else "length")
            (alone, alone_gains), = decoding.speculative_generate(target, [p], 20, [1], drafter=drafter, batch_size=1,
                                                            graph=False)
            assert alone == spec and alone_gains == gains


@pytest.mark.parametrize("attention", ["grouped", "flex"])
def test_finished_rows_are_refilled_and_decode_as_transformers_does(monkeypatch, attention):
    """Rows that stop early take the next prompts of their group while the others keep decoding
    (some rows refilled, all rows at once at the end): every output still equals transformers'
    greedy generate of that prompt alone. With flex attention every prompt shares one decoder,
    whatever its length."""
    target = tiny_target(arch="llama", dtype=torch.float32, init_std=0.15, vocab=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (11,), generator=g)]
    free = [hf_greedy(target, torch.tensor([p]), 40) for p in prompts]
    # the stop id: a token that ends some replies early and others late or never
    stop = max(range(128), key=lambda t: len({min(f.index(t), 40) if t in f else 40 for f in free}))
    refills = []
    real = decoding.BatchDecoder.prefill
    monkeypatch.setattr(decoding.BatchDecoder, "prefill",
                        lambda self, ps, rows=None: refills.append(rows) or real(self, ps, rows))
    decoders = []
    real_init = decoding.BatchDecoder.__init__
    monkeypatch.setattr(decoding.BatchDecoder, "__init__", lambda self, *a, **k: decoders.append(1) or real_init(self, *a, **k))
    out = decoding.generate(target, prompts, 40, [stop], batch_size=4, graph=False, decode_attention=attention)
    assert [t for t, _ in out] == [hf_greedy(target, torch.tensor([p]), 40, stop) for p in prompts]
    assert any(r is not None and len(r) < 4 for r in refills), refills  # a partial refill happened
    ends = {len(t) for t, _ in out}
    assert len(ends) > 2, ends
    assert attention != "flex" or len(decoders) == 1, decoders


def test_decode_block_mask_is_the_rule_tile_by_tile():
    """decode_block_mask against the dense rule (row b's query i sees slots pad..pad + verified + i,
    none of a finished row): skipped tiles hold no visible slot, full tiles only visible ones, and
    the rule inside partial tiles gives the rest; rows spanning several tiles, the last one cut."""
    from torch.nn.attention.flex_attention import BlockMask
    g = torch.Generator().manual_seed(0)
    B, q, S, tile = 12, 3, 45, 4
    pad = torch.randint(0, 10, (B,), generator=g)
    verified = torch.randint(0, S - q - 10, (B,), generator=g)
    live = torch.rand(B, generator=g) > 0.25
    live[0] = False
    mask = decoding.decode_block_mask(pad, verified, live, q, S, tile=tile)
    slot, i = torch.arange(S), torch.arange(q)
    rule = (slot[None, None] >= pad[:, None, None]) & (slot[None, None] <= (pad + verified)[:, None, None] + i[None, :, None])
    rule &= live[:, None, None]
    seen = torch.zeros(B, q, S, dtype=torch.bool)
    for b in range(B):
        for t in mask.full_kv_indices[b, 0, 0, :mask.full_kv_num_blocks[b, 0, 0]].tolist():
            seen[b, :, t * tile:(t + 1) * tile] = True
        for t in mask.kv_indices[b, 0, 0, :mask.kv_num_blocks[b, 0, 0]].tolist():
            kv = torch.arange(t * tile, min((t + 1) * tile, S))
            seen[b, :, kv] = mask.mask_mod(torch.tensor(b), 0, i[:, None], kv[None, :])
    assert torch.equal(seen, rule)
    assert mask.kv_num_blocks[0].sum() + mask.full_kv_num_blocks[0].sum() == 0  # a finished row reads nothing
    assert (mask.full_kv_num_blocks > 0).any() and (mask.kv_num_blocks > 1).any()
    assert isinstance(mask, BlockMask)


def test_grouped_decoding_attention_equals_the_models_own(monkeypatch):
    """The decoder's grouped-query attention (the KV cache read once per KV head) gives the
    logits of transformers' own attention, at one token and at a block, rows of mixed lengths."""
    target = tiny_target(dtype=torch.float64, init_std=0.15, vocab=128)  # 4 query heads share 2 KV heads
    calls = []
    real = decoding.grouped_attention
    monkeypatch.setattr(decoding, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    decoding._register_grouped_attention.cache_clear()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    outs = []
    for attention in ("grouped", "model"):
        d = decoding.BatchDecoder(target, 3, 32, decode_attention=attention)
        first, _ = d.prefill(prompts)
        one, _ = d.step(first.argmax(-1)[:, None])
        d.advance(torch.ones(3, dtype=torch.long))
        block, _ = d.step(torch.randint(3, 128, (3, 4), generator=torch.Generator().manual_seed(0)))
        outs.append((first, one, block))
    assert calls and target.config._attn_implementation == "sdpa"  # used while decoding, restored after
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    decoding._register_grouped_attention.cache_clear()


def test_flex_decoding_attention_equals_grouped():
    """The decoder's flex steps (only the slots each row uses, tile by tile) give the grouped
    attention's logits, at one token and at a block, for rows of mixed lengths spanning several
    128-slot tiles; a row that is not live reads nothing and leaves the others' logits as they were."""
    target = tiny_target(dtype=torch.float32, init_std=0.15, vocab=128)  # 4 query heads share 2 KV heads
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (300, 20, 140, 129)]
    block = torch.randint(3, 128, (4, 5), generator=g)
    outs = []
    for attention in ("grouped", "flex"):
        d = decoding.BatchDecoder(target, 4, 512, decode_attention=attention)
        with torch.no_grad():  # as generate runs it (flex_attention has no backward on the CPU)
            first, _ = d.prefill(prompts)
            one, _ = d.step(first.argmax(-1)[:, None])
            d.advance(torch.ones(4, dtype=torch.long))
            blk, _ = d.step(block)
            d.live[2] = False
            without, _ = d.step(block)
        outs.append((first, one, blk, without))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    keep = torch.tensor([0, 1, 3])
    torch.testing.assert_close(outs[1][3][keep], outs[0][3][keep], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(outs[1][3]).all()


def test_sampling_is_seeded_and_respects_top_p():
    target = tiny_target(dtype=torch.float32, init_std=0.15, vocab=128)
    prompts = [[5, 6, 7], [9, 10]]
    a = decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=3, graph=False)
    assert a == decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=3, graph=False)
    assert a != decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=4, graph=False)
    logits = torch.tensor([[0.0, 5.0, 4.9, -9.0]])
    picks = {int(decoding.pick_tokens(logits, 1.0, 0.5, torch.Generator().manual_seed(s))) for s in range(50)}
    assert picks == {1}  # token 1 alone holds over half the mass
    assert decoding.pick_tokens(logits).tolist() == [1]


def test_training_step_compiles_fullgraph_and_its_trace_does_not_grow_with_chunks():
    # The LM-head loss is one opaque op in the trace: unrolled, its chunk loop made the compile
    # time grow with the chunk count. Compiled, the step gives the eager loss and gradients.
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().train()
    ids, doc, pos, hidden = packed_row(target, drafter, [20, 12], pad=0)
    hidden, mask, noise = hidden.detach().float(), torch.ones(1, 32), torch.rand(1, 32)

    def loss_and_grads(step, chunk):
        drafter.zero_grad()
        loss, stats = step(hidden, ids, mask, doc, pos, noise, num_anchors=8, ce_chunk_size=chunk)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]

    node_counts = []

    def count_nodes(gm, example_inputs):  # subgraphs too: an autograd.Function is traced into one
        node_counts.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
        return gm.forward
    for chunk in (3, 1000):  # 19 chunks, 1 chunk
        torch._dynamo.reset()
        want_loss, want_grads = loss_and_grads(drafter, chunk)
        loss, grads = loss_and_grads(torch.compile(drafter, fullgraph=True, backend=count_nodes), chunk)
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(grads, want_grads)
    assert node_counts[0] == node_counts[1], node_counts


def test_compiled_step_computes_rope_cos_sin_once_per_position():
    # Fused into its consumers, RoPE's cos/sin were computed once per head in the forward and
    # again in the backward's kernels (12 calls of cos in this step's output code, 8 of them in
    # the backward). Through dm.computed_once: at most one per call site (context, block), in the
    # forward, and the loss and gradients stay eager's.
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().train()
    ids, doc, pos, hidden = packed_row(target, drafter, [20, 12], pad=0)
    hidden, mask, noise = hidden.detach().float(), torch.ones(1, 32), torch.rand(1, 32)

    def loss_and_grads(step):
        drafter.zero_grad()
        loss, _ = step(hidden, ids, mask, doc, pos, noise, num_anchors=8)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]
    want = loss_and_grads(drafter)
    got, code = run_and_get_code(loss_and_grads, torch.compile(drafter, fullgraph=True, dynamic=False))
    torch.testing.assert_close(got, want)
    cos_calls = [len(re.findall(r"\.cos\(\)|std::cos\(|math\.cos\(", c)) for c in code]
    assert "_forward']" in code[0] and cos_calls[0] <= 2 and sum(cos_calls[1:]) == 0, cos_calls  # then the backward's


def test_flex_training_forward_compiles_fullgraph_and_matches_sdpa():
    # The GPU step's attention path traced whole as in --compile (flex_block_mask and
    # flex_attention inside the model), forward only: flex_attention has no backward on CPU.
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().eval()
    ids, doc, pos, hidden = packed_row(target, drafter, [150, 90], pad=10)
    hidden, L = hidden.float(), ids.shape[1]
    mask, noise = (doc >= 0).float(), torch.rand(1, L, dtype=torch.float32)
    with torch.no_grad():
        want, _ = drafter(hidden, ids, mask, doc, pos, noise, num_anchors=40, attention="sdpa")
        step = torch.compile(drafter, fullgraph=True)
        got, _ = step(hidden, ids, mask, doc, pos, noise, num_anchors=40, attention="flex")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_length_batches_keep_the_cache_within_its_budget():
    prompts = [[0] * n for n in (5, 300, 9, 70, 2, 33)]
    slots_of = lambda n: decoding.slots_for(n, 64)
    wide = decoding.length_batches(prompts, 4, slots_of, 1, float("inf"))
    assert [b[0] for b in wide] == [[4, 0, 2, 5], [3, 1]]  # by length
    assert [(b[1], b[2]) for b in wide] == [(4, 320), (4, 576)]
    # a budget of 1000 slot-rows: 4 x 320 does not fit, 2 x 320 does; 576 slots only one row at a time
    tight = decoding.length_batches(prompts, 4, slots_of, 1, 1000)
    assert [b[0] for b in tight] == [[4, 0], [2, 5], [3], [1]]
    assert sorted(i for b in tight for i in b[0]) == list(range(6))


def test_near_tie_tells_rounding_from_a_wrong_token():
    from conftest import counter_target
    target = counter_target(16)
    # the counter target's next token after 3 is 4, by a wide margin over 9
    assert evaluation.near_tie(target, [1, 2, 3], [4], [9], 0)[0] is False
    with torch.no_grad():
        target.lm_head.weight[9] = target.lm_head.weight[4]  # tokens 4 and 9 now score the same
    assert evaluation.near_tie(target, [1, 2, 3], [4], [9], 0) == (True, 0.0)


def test_near_tie_is_rounding_at_the_scale_of_the_rows_logits():
    """bf16: two small logits 0.03 apart in a row whose largest logit is 20 are within rounding
    (the hidden state's rounding moves every logit by up to a few units at that scale); 1.0 apart
    they are not."""
    import types

    class Fixed(torch.nn.Module):
        def __init__(self, row):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.row = row

        def forward(self, ids, logits_to_keep=1):
            return types.SimpleNamespace(logits=self.row[None, None].expand(1, ids.shape[1], -1))

    row = torch.zeros(8, dtype=torch.bfloat16)
    row[0], row[1], row[2] = 20.0, 0.5, 0.53
    assert evaluation.near_tie(Fixed(row), [5], [1], [2], 0)[0] is True
    row[2] = 1.5
    assert evaluation.near_tie(Fixed(row), [5], [1], [2], 0)[0] is False


def counter_drafter():
    """The counter target and a drafter trained briefly on it, so that its gains vary (1 to the
    block size, 6)."""
    from conftest import counter_target
    torch.manual_seed(0)
    V = 64
    target = counter_target(V)
    cfg = dm.make_drafter_config(target.config, mask_token_id=V - 1, num_draft_layers=1, block_size=6)
    drafter = dm.DFlashDraftModel(cfg).float().attach_target(target)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        ids = (torch.randint(0, V, (4, 1), generator=g) + torch.arange(32)) % V
        with torch.no_grad(), target_model.collect_layer_outputs(target, drafter.target_layer_ids) as hidden:
            target(ids)
        loss, _ = drafter(torch.cat(hidden, -1), ids, torch.ones(4, 32), torch.zeros_like(ids),
                          torch.arange(32).expand(4, 32), torch.rand(4, 32, generator=g), num_anchors=8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, drafter.eval()


def test_decoding_replayed_over_teacher_forced_taus_gives_the_measured_gains():
    """Train = serve for the drafter: the taus its training path computes on the target's greedy
    output, replayed as greedy decoding would visit them, give the gains that real speculative
    decoding (the inference path: KV cache, draft_logits) measured, block for block, but for the
    last block of each answer (its drafts past the end are unknown to the replay)."""
    target, drafter = counter_drafter()
    prompts = [[5, 6, 7], [20, 21], [40, 41, 42, 43]]
    measured = decoding.speculative_generate(target, prompts, 30, (), drafter=drafter, batch_size=2, graph=False)
    seen = set()
    for p, (out, gains) in zip(prompts, measured):
        _, replayed = evaluation.teacher_forced_gains(target, drafter, torch.tensor([p]), out)
        assert replayed[:-1] == gains[:-1] and replayed[-1] <= gains[-1], (replayed, gains)
        seen |= set(gains)
    assert len(seen) >= 3 and max(seen) == 6, seen  # gains of several sizes, some whole blocks


def test_validation_replay_over_a_packed_row_equals_the_evaluations_replay_per_answer():
    """The held-out 'decoding replayed' figure: on a packed row (four documents, prompts and a
    second user turn untrained, padding) the gains equal those the evaluation path replays for
    each answer alone, given everything before it in its document as the prompt (the test above
    ties that path to real decoding). num_anchors 7 leaves a part-filled last chunk."""
    target, drafter = counter_drafter()
    V = target.config.vocab_size
    greedy = lambda last, n: [(last + 1 + k) % V for k in range(n)]  # noqa: E731  (the counter's answers)
    # One counting sequence throughout, user turns and document starts included, so that a draft
    # running on past an answer's end (into the next turn or document) would be counted right
    # unless the loss mask and the document boundaries stop it.
    docs, last = [], 2  # (tokens, trained flags)
    # the last document starts inside an answer (the second piece of one split to fit a row)
    for turns in ([(4, 20)], [(2, 11), (3, 17)], [(5, 9)], [(0, 8)]):
        ids, trained = [], []
        for user, answer in turns:
            ids += greedy(last, user) + greedy(last + user, answer)
            trained += [0] * user + [1] * answer
            last = ids[-1]
        docs.append((ids, trained))
    L = sum(len(d) for d, _ in docs) + 5

    def packed_row(docs):
        row = {k: [] for k in ("input_ids", "loss_mask", "doc_ids", "position_ids")}
        for n, (ids, trained) in enumerate(docs):
            row["input_ids"] += ids; row["loss_mask"] += trained; row["doc_ids"] += [n] * len(ids)
            row["position_ids"] += list(range(len(ids)))
        pad = L - len(row["input_ids"])
        row["input_ids"] += [0] * pad; row["loss_mask"] += [0] * pad; row["doc_ids"] += [len(docs)] * pad
        row["position_ids"] += list(range(pad))
        return row

    def everywhere(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        with torch.no_grad(), target_model.collect_layer_outputs(target, drafter.target_layer_ids) as hidden:
            target(ids)  # the counter target's layer outputs do not depend on the context: packing is exact
        packing = tuple(torch.tensor([r[k] for r in rows]) for k in ("loss_mask", "doc_ids", "position_ids"))
        packing = (packing[0].float(),) + packing[1:]
        return ids, torch.cat(hidden, -1), packing, evaluation.accepted_lengths_everywhere(drafter, torch.cat(hidden, -1), ids, *packing, 7)

    row, other = packed_row(docs), packed_row(docs[::-1])
    ids, hidden, packing, taus = everywhere([row])
    taus = taus[0]
    # rows batched together (as the validation batches them) each get what they get alone
    both = everywhere([row, other])[3]
    assert both[0].tolist() == taus.tolist() and both[1].tolist() == everywhere([other])[3][0].tolist()
    # slot by slot as accepted_lengths takes them = the training step's figures (every slot's logits)
    every = torch.arange(L)[None]
    _, correct, ok = drafter.block_predictions(hidden, ids, *packing, every, torch.ones_like(every).bool())
    assert taus.tolist() == (1 + (correct & ok).long().cumprod(-1).sum(-1))[0].tolist()
    # sampled: a target sure of the data's next token expects greedy's gains; one that gives it
    # probability 1/2 expects 1 + 1/2 + ... + (1/2)^(gain - 1) = 2 - (1/2)^(gain - 1)
    data_next = torch.cat([ids[:, 1:], ids[:, -1:]], 1)[..., None]
    for p, want in ((1.0, taus.double()), (0.5, 2 - 0.5 ** (taus.double() - 1))):
        expected = evaluation.accepted_lengths_everywhere(drafter, hidden, ids, *packing, 7,
                                                          distribution=(data_next, torch.full(data_next.shape, p)))
        torch.testing.assert_close(expected[0].double(), want)
    answers = evaluation.replayed_over_answers(lambda p, end: taus[p].item(), row["loss_mask"], row["doc_ids"])
    assert [first for _, first in answers] == [True, True, False, True, True]  # doc 1 has two answers
    packed = [g for gains, _ in answers for g in gains]
    alone = []
    for ids_doc, trained in docs:
        s = 0
        while s < len(ids_doc):
            if not trained[s]:
                s += 1
                continue
            e = s
            while e < len(ids_doc) and trained[e]:
                e += 1
            alone += evaluation.teacher_forced_gains(target, drafter, torch.tensor([ids_doc[:s]], dtype=torch.long), ids_doc[s:e])[1]
            s = e
    assert packed == alone, (packed, alone)
    answers = (20, 11, 17, 9, 8)  # each replay covers its answer: it stops at n - 1 or n tokens
    assert sum(n - 1 for n in answers) <= sum(packed) <= sum(answers) and len(set(packed)) >= 3, packed
    # two answers side by side in two documents are two replays, each with its first token given
    assert evaluation.replayed_over_answers(lambda p, end: 1, [1] * 6, [0, 0, 0, 1, 1, 1]) == [([1, 1], True), ([1, 1], True)]


def chi_square(a, b):
    """Pearson's statistic of homogeneity of two samples' counts (categories with fewer than 10
    draws in both pooled into one), and its degrees of freedom."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    rare = [k for k in set(ca) | set(cb) if ca[k] + cb[k] < 10]
    rows = [(ca[k], cb[k]) for k in set(ca) | set(cb) if k not in rare] + [(sum(ca[k] for k in rare),
                                                                            sum(cb[k] for k in rare))]
    rows = [r for r in rows if sum(r)]
    na, nb = len(a), len(b)
    stat = sum((x - na * (x + y) / (na + nb)) ** 2 / (na * (x + y) / (na + nb)) +
               (y - nb * (x + y) / (na + nb)) ** 2 / (nb * (x + y) / (na + nb)) for x, y in rows)
    return stat, len(rows) - 1


# Upper 0.1% points of the chi-square distribution (a false alarm once in a thousand runs).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


@torch.no_grad()
def test_speculative_sampling_is_distributed_as_the_target_samples(monkeypatch):
    """At a temperature the tokens speculative decoding keeps are the target's own samples: the
    marginal distribution of each generated position over many seeded rows equals plain sampling's
    (chi-square test of homogeneity at 0.1%), for the drafter and for prompt lookup. An
    acceptance rule that keeps every draft fails the same test."""
    torch.manual_seed(0)
    target = tiny_target(vocab=8, layers=4, hidden=32, dtype=torch.float32, init_std=0.6)
    drafter = make_drafter(target, block_size=4).float()
    prompt, n, new = [1, 2, 3, 1], 3000, 4
    plain = decoding.generate(target, [prompt] * n, new, batch_size=n, temperature=1.0, seed=1, graph=False)

    def sampled(**kw):
        return decoding.speculative_generate(target, [prompt] * n, new, batch_size=n, graph=False, temperature=1.0,
                                             seed=2, **kw)

    def worst(runs):
        stats = [chi_square([t[k] for t, _ in plain], [t[k] for t, _ in runs]) for k in range(1, new)]
        return max(stat / CHI2_999[df] for stat, df in stats)
    spec, lookup = sampled(drafter=drafter), sampled(drafter=None, block_size=4)
    assert worst(spec) < 1 and worst(lookup) < 1
    assert sum(len(g) for _, g in spec) < n * (new - 1)  # drafts were accepted: fewer steps than tokens
    real = decoding.verify_block

    def keep_every_draft(logits, draft, proposed, temperature=0.0, top_p=1.0, generator=None):
        m, _ = real(logits, draft, proposed, 0.0)
        return proposed, decoding.pick_tokens(logits[torch.arange(len(m)), proposed], temperature, top_p, generator)
    monkeypatch.setattr(decoding, "verify_block", keep_every_draft)
    assert worst(sampled(drafter=drafter)) > 1
