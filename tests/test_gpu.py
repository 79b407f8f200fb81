"""GPU-only checks of the compiled, CUDA-graphed drafter step (skipped without CUDA)."""
import copy
import threading
import types

import pytest
import torch

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import chat_data
from dflash_train import command_line as cli
from dflash_train import decoding
from dflash_train import evaluation
from dflash_train import flat_adamw as fa
from dflash_train import helpers
from dflash_train import kernels as kn
from dflash_train import target_stage as ts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, LENGTH = 2, 512


def small_target_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128)


def make_worker(compile, seed=0, device="cuda:0", rank=0, averager=None, attention="triton", token_budget=ROWS * LENGTH,
                extra=()):
    args = cli.Settings.of_flags(["--max-length", str(LENGTH), "--token-budget", str(token_budget),
                                 "--num-anchors", "64", "--num-draft-layers", "2", "--lr", "3e-4", *extra]
                                + (["--compile"] if compile else []),
                                target_layer_ids=dm.default_target_layer_ids(8, 2), drafter_attention=attention)
    tc = small_target_config()
    torch.manual_seed(seed)
    cfg = dm.make_drafter_config(tc, mask_token_id=31999, num_draft_layers=2, block_size=16)
    drafter = dm.DFlashDraftModel(cfg).to(device).train()
    g = torch.Generator().manual_seed(99)
    embed = torch.nn.Embedding.from_pretrained((torch.randn(32000, 1024, generator=g) * 0.02).to(device, torch.bfloat16))
    drafter.set_target_parts(embed, (torch.randn(32000, 1024, generator=g) * 0.02).to(device, torch.bfloat16))
    run = types.SimpleNamespace(lr_for_step=lambda step: 3e-4 * min(1.0, step / 5), target_hidden_size=2 * 1024,
                                log=print)
    w = tp.DrafterWorker(rank, torch.device(device), drafter, args, averager or tp.GradAverager(1), run)
    return w


def batches(n, device="cuda:0", seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        doc = torch.zeros(ROWS, LENGTH, dtype=torch.long)
        doc[:, LENGTH // 3:] = 1
        doc[:, -20:] = -1
        pos = torch.cat([torch.arange(LENGTH // 3), torch.arange(LENGTH - LENGTH // 3)]).repeat(ROWS, 1)
        out.append({"target_hidden": torch.randn(ROWS, LENGTH, 2048, generator=g).to(device, torch.bfloat16),
                    "input_ids": torch.randint(0, 32000, (ROWS, LENGTH), generator=g).to(device),
                    "loss_mask": (torch.rand(ROWS, LENGTH, generator=g) > 0.3).float().to(device),
                    "doc_ids": doc.to(device), "position_ids": pos.to(device)})
    return out


def captured_worker(**kw):
    w = make_worker(compile=True, **kw)
    w.capture(ROWS, 2048)
    return w


def run_steps(worker, data, first_step=1):
    losses = []
    with torch.cuda.stream(worker.stream):
        for step, b in enumerate(data, first_step):
            loss, stats = worker.train_step(step, b)
            losses.append(loss)
        torch.cuda.synchronize(worker.device)
    return torch.stack(losses).float().cpu()


def test_gpu_attention_training_gradients_match_dense_sdpa():
    # The GPU attention paths (dm.block_attend's Triton kernels, and flex_attention over
    # flex_block_mask; eager, and inside the compiled step) against SDPA with the dense mask: loss
    # and the whole flat gradient of one step, in bf16 autocast as in training. Catches a mask whose
    # forward is right but whose backward reads the wrong blocks.
    b = batches(1)[0]
    results = {}
    for label, compile, attention in (("sdpa", False, "sdpa"), ("flex", False, "flex"), ("flex compiled", True, "flex"),
                                      ("triton", False, "triton"), ("triton compiled", True, "triton")):
        w = make_worker(compile=compile, attention=attention)
        inputs = [b[k] for k in tp.BATCH_KEYS] + [w.anchor_noise(1, torch.empty(ROWS, LENGTH, device="cuda"))]
        loss, _ = w.forward_backward(inputs)
        results[label] = (loss.float(), w.flat_grad.float().clone())
    want_loss, want_grad = results.pop("sdpa")
    for label, (loss, grad) in results.items():
        grad_err = ((grad - want_grad).norm() / want_grad.norm()).item()
        print(f"{label}: loss {loss.item():.5f} vs sdpa {want_loss.item():.5f}, relative gradient error {grad_err:.2e}")
        assert abs(loss - want_loss) / want_loss < 1e-2, label
        assert grad_err < 2e-2, (label, grad_err)


def test_distillation_step_compiled_and_graphed_is_the_eager_step():
    # --loss mix: the step with the target's top-k distribution (the distillation chunk eager, then
    # under inductor, then replayed as a CUDA graph) gives the eager step's loss and gradient.
    g = torch.Generator().manual_seed(3)
    b = batches(1)[0]
    k = 32
    b["target_top_ids"] = ((torch.randint(0, 32000, (ROWS, LENGTH, 1), generator=g) + 997 * torch.arange(k)) % 32000
                           ).int().cuda()  # k distinct ids a position
    b["target_top_probs"] = (torch.randn(ROWS, LENGTH, k, generator=g).softmax(-1) * 0.8).cuda()
    extra = ("--loss", "mix", "--kl-weight", "0.7", "--distill-top-k", str(k))
    results = {}
    for label, compile in (("eager", False), ("compiled", True)):
        w = make_worker(compile=compile, extra=extra)
        noise = w.anchor_noise(1, torch.empty(ROWS, LENGTH, device="cuda"))
        loss, _ = w.forward_backward([noise if key == "anchor_noise" else b[key] for key in w.input_keys])
        results[label] = (loss.float(), w.flat_grad.float().clone())
    w = make_worker(compile=True, extra=extra)
    w.capture(ROWS, 2048)
    with torch.cuda.stream(w.stream):  # the gradient stays in the flat buffer after the update
        loss, _ = w.train_step(1, b)
        torch.cuda.synchronize()
    results["graphed"] = (loss.float(), w.flat_grad.float().clone())
    want_loss, want_grad = results.pop("eager")
    for label, (loss, grad) in results.items():
        grad_err = ((grad - want_grad).norm() / want_grad.norm()).item()
        print(f"{label}: loss {loss.item():.5f} vs eager {want_loss.item():.5f}, relative gradient error {grad_err:.2e}")
        assert abs(loss - want_loss) / want_loss < 1e-2, label
        assert grad_err < 2e-2, (label, grad_err)


def suggested_budget(error):
    """The budget a start-up out-of-memory error names."""
    import re
    print(error)
    return int(re.search(r"largest that fits is about --token-budget (\d+)", str(error)).group(1))


@pytest.mark.parametrize("compile", [False, True])
def test_token_budget_that_does_not_fit_names_one_that_does(compile):
    # 4096 rows of 512 (about 170 GB of activations at these shapes) cannot fit one GPU: the
    # start-up warm-up must say so with a budget that fits, and that budget must then warm up.
    w = make_worker(compile=compile, token_budget=4096 * LENGTH)
    with torch.cuda.stream(w.stream), pytest.raises(RuntimeError, match="does not fit the drafter step") as e:
        w.warm_up()
    fits = suggested_budget(e.value)
    assert LENGTH <= fits < 4096 * LENGTH
    del w, e
    torch.cuda.empty_cache()
    print(f"after the failed start-up: {torch.cuda.memory_allocated() / 2**30:.2f} GB still allocated")
    w = make_worker(compile=compile, token_budget=fits)
    with torch.cuda.stream(w.stream):
        w.warm_up()
    assert (w.graphs is not None) == compile
    print(f"warm-up at --token-budget {fits}: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GB "
          f"of {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}")


@pytest.mark.parametrize("compile", [False, True])
def test_target_token_budget_that_does_not_fit_names_one_that_does(compile):
    # The target stage's start-up forward (or capture) at 100,000 rows of 512: the features alone
    # would take 210 GB. The error names a budget, and that budget then warms up. (With --compile
    # the one-row estimate alone, 4,098,560, did not fit on an H200: the named budget is now tried.)
    from transformers import AutoModelForCausalLM
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(small_target_config(), dtype=torch.bfloat16, attn_implementation="sdpa")
    replica = ts.TargetReplica(model.eval().requires_grad_(False), dm.default_target_layer_ids(8, 2), torch.device("cuda:0"))
    args = types.SimpleNamespace(token_budget=100_000 * LENGTH, max_length=LENGTH, compile=compile)
    with pytest.raises(chat_data.UsageError, match="does not fit the target stage") as e:
        ts.warm_up_target([replica], args, print)
    fits = suggested_budget(e.value)
    assert LENGTH <= fits < args.token_budget
    del e
    ts.warm_up_target([replica], types.SimpleNamespace(**{**vars(args), "token_budget": fits}), print)
    assert (replica.graphs is not None) == compile


def test_graph_replay_equals_compiled_step():
    data = batches(20)
    compiled = make_worker(compile=True)
    graphed = captured_worker()
    a, b = run_steps(compiled, data), run_steps(graphed, data)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), (a, b)
    for p, q in zip(compiled.drafter.parameters(), graphed.drafter.parameters()):
        assert torch.equal(p, q)


def test_eager_and_compiled_agree_over_50_steps():
    data = batches(50)
    eager = make_worker(compile=False)
    graphed = captured_worker()
    a, b = run_steps(eager, data), run_steps(graphed, data)
    rel = ((a - b).abs() / a.abs()).max()
    assert rel < 2e-2, (rel, a, b)
    assert a[-10:].mean() < a[:10].mean()


def test_resumed_optimizer_follows_the_schedule():
    # 3 steps, then a fresh worker loaded with that state does 3 more: the same as 6 in one go.
    # (load_state_dict used to replace the lr tensor the captured update reads: lr frozen.)
    data = batches(6)
    whole = captured_worker()
    run_steps(whole, data)
    first = captured_worker()
    run_steps(first, data[:3])
    resumed = make_worker(compile=True)
    resumed.drafter.load_state_dict(first.drafter.state_dict())
    resumed.load_optimizer_state(first.optimizer.state_dict())
    resumed.capture(ROWS, 2048)
    run_steps(resumed, data[3:], first_step=4)
    assert resumed.optimizer.param_groups[0]["lr"] is resumed.lr
    for p, q in zip(whole.drafter.parameters(), resumed.drafter.parameters()):
        assert torch.equal(p, q)


def test_clipping_in_the_flat_adamw_equals_clipping_the_gradient():
    # On CUDA the clip reaches the update as a factor FlatAdamW's kernel applies as it reads the
    # gradient (no pass of its own): the update must be torch's for-loop AdamW's on the clipped
    # gradient. eps 1 and lr 1 make the update about the gradient itself, so an unclipped one differs.
    w = make_worker(compile=False)
    w.settings = w.settings.replace(grad_clip=0.01)
    w.optimizer.param_groups[0]["eps"] = 1.0
    w.lr.fill_(1.0)
    params = list(w.drafter.parameters())
    b = batches(1)[0]
    w.forward_backward([b[k] for k in tp.BATCH_KEYS] + [w.anchor_noise(1, torch.empty(ROWS, LENGTH, device="cuda"))])
    grad = w.flat_grad.float()  # bf16: what the matmuls write
    norm = grad.norm().item()
    assert norm > 10 * w.settings.grad_clip  # the clip is active
    expected = {}
    for name, coef in (("clipped", w.settings.grad_clip / (norm + 1e-6)), ("unclipped", 1.0)):
        ps, at = [p.detach().clone().requires_grad_(True) for p in params], 0
        for p in ps:
            p.grad, at = grad[at:at + p.numel()].view_as(p) * coef, at + p.numel()
        torch.optim.AdamW(ps, lr=1.0, weight_decay=w.settings.weight_decay, eps=1.0, foreach=False).step()
        expected[name] = ps
    w.clip_and_update()
    # The worker's norm and the kernel's arithmetic round in another order than grad.norm() and
    # torch's AdamW (on some GPUs), so a weight may land an fp32 step away: 1e-6 allows a few
    # steps at the weights' size, far below what the unclipped update moves them.
    diff = {name: max((p - q).abs().max().item() for p, q in zip(params, ps)) for name, ps in expected.items()}
    assert diff["clipped"] < 1e-6 and diff["unclipped"] > 1e-4, diff


def test_the_gpu_step_reads_the_bf16_weights_the_optimizer_keeps():
    # On CUDA the step's matmuls read FlatAdamW's bf16 copy of the weights instead of autocast's
    # cast of the fp32 ones: loss and gradients must be the plain drafter's under autocast, and
    # after every update (eager, then captured) the copy must be the new weights cast to bf16.
    w = make_worker(compile=False)
    opt, a = w.optimizer, w.settings
    assert isinstance(opt, fa.FlatAdamW) and sum(bf16 is not None for *_, bf16 in w.grad_into) == 15
    b = batches(1)[0]
    inputs = [b[k] for k in tp.BATCH_KEYS] + [w.anchor_noise(1, torch.empty(ROWS, LENGTH, device="cuda"))]
    params = list(w.drafter.parameters())
    with w.autocast():
        loss, _ = w.drafter(*inputs, num_anchors=a.num_anchors, gamma=a.loss_decay_gamma,
                            ce_chunk_size=a.ce_chunk_size, attention=a.drafter_attention)
    want = torch.autograd.grad(loss, params)
    got, _ = w.forward_backward(inputs)
    torch.testing.assert_close(got, loss.detach())
    assert w.flat_grad.dtype == torch.bfloat16
    for (name, p, into, bf16), g in zip(w.grad_into, want):
        got_grad = into.float()
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # used twice (context and block): autocast cast the weight per use and summed the two
            # gradients in fp32; one bf16 copy sums them in bf16 first (one more bf16 rounding)
            err = ((got_grad - g).norm() / g.norm()).item()
            assert err < 1e-2, (name, err)
        elif bf16 is None:  # no matmul weight: a norm's, an fp32 reduction rounded to the buffer's bf16
            torch.testing.assert_close(got_grad, g, msg=name, rtol=2 ** -8, atol=1e-6)
        else:  # the matmuls' own bf16 gradients (autocast upcast them), exactly
            torch.testing.assert_close(got_grad, g, msg=name, rtol=0, atol=0)
    for step in (1, 2):
        w.set_lr(step)
        w.clip_and_update()
        assert torch.equal(opt.weight_bf16, opt.flat_param.to(torch.bfloat16))
    assert [p.data_ptr() for p in params] == [v.data_ptr() for v in fa.flat_views(opt.flat_param, params)]
    c = captured_worker()
    run_steps(c, batches(3))
    assert torch.equal(c.optimizer.weight_bf16, c.optimizer.flat_param.to(torch.bfloat16))
    assert torch.all(c.optimizer.steps == 3)  # the captured update counted its steps


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_workers_average_gradients_and_stay_identical():
    averager = tp.GradAverager(2)
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    averager.buffers = [g.to(f"cuda:{i}") for i, g in enumerate(grads)]
    averager._average()
    for b in averager.buffers:
        torch.testing.assert_close(b.cpu(), (grads[0] + grads[1]) / 2)

    workers = [captured_worker(device=f"cuda:{i}", rank=i, averager=averager) for i in range(2)]
    data = [batches(10, device=f"cuda:{i}", seed=5 + i) for i in range(2)]
    losses = [None, None]

    def train(i):
        losses[i] = run_steps(workers[i], data[i])
    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(l is not None for l in losses)
    assert not torch.equal(losses[0], losses[1])  # different batches, one averaged gradient:
    for p, q in zip(workers[0].drafter.parameters(), workers[1].drafter.parameters()):
        assert torch.equal(p.cpu(), q.cpu())  # the replicas stay identical


def test_peak_memory_flat_over_500_steps():
    w = captured_worker()
    data = batches(4)
    run_steps(w, data * 5)
    torch.cuda.reset_peak_memory_stats()
    run_steps(w, data * 5)
    after_warmup = torch.cuda.max_memory_allocated()
    run_steps(w, data * 120)
    assert torch.cuda.max_memory_allocated() <= after_warmup * 1.001


@pytest.mark.parametrize("layout", ["shared", "one_target_two_drafters", "one_plus_one", "target_in_two_stages"])
def test_pipeline_compiled_end_to_end(tmp_path, tiny_model_dir, layout):
    import json
    import os
    from conftest import chat_rows, pipeline_args
    from conftest import write_jsonl
    n = torch.cuda.device_count()
    t, d = {"shared": ("0", "0"), "one_target_two_drafters": ("0", "0,0" if n < 2 else "1,1"),
            "one_plus_one": ("0", "1"), "target_in_two_stages": ("0,0", "0")}[layout]
    stages = ["--target-stages", "2"] if layout == "target_in_two_stages" else []
    if layout == "one_plus_one" and n < 2:
        pytest.skip("needs 2 GPUs")
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(80))
    rc = tp.main(pipeline_args(tmp_path / "o", tiny_model_dir, data, "--token-budget", "512", "--max-steps", "20",
                               "--log-interval", "5", "--target-gpus", t, "--drafter-gpus", d, "--compile",
                               "--eval-interval", "10", "--val-fraction", "0.2", "--val-rows", "2", *stages))
    assert rc == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        m = [json.loads(l) for l in f]
    train, val = [x for x in m if "loss" in x], [x for x in m if "val_loss" in x]
    assert train[-1]["loss"] < train[0]["loss"]
    # the held-out rows scored eagerly beside the captured step, which goes on unharmed
    assert [x["step"] for x in val] == [10, 20] and val[1]["val_loss"] < val[0]["val_loss"]
    assert all(1.0 <= x["val_acceptance_length"] <= 16 for x in val)  # replayed in chunks of the step's shape
    assert os.path.exists(tmp_path / "o" / "final" / "model.safetensors")


def test_sharded_flat_adamw_trains_exactly_like_the_whole_one_graphed(tmp_path, tiny_model_dir):
    """Two drafter workers (on one GPU, or two), the step compiled and graphed, each updating its
    share of the flat buffers (--shard-optimizer) against each updating all of them: the same
    losses and the same drafter."""
    import json
    from safetensors.torch import load_file
    from conftest import chat_rows, pipeline_args
    from conftest import write_jsonl
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(80))
    d = "0,0" if torch.cuda.device_count() < 2 else "0,1"
    for run, flag in (("whole", "--no-shard-optimizer"), ("shard", "--shard-optimizer")):
        assert tp.main(pipeline_args(tmp_path / run, tiny_model_dir, data, "--token-budget", "512", "--max-steps", "8",
                                     "--log-interval", "1", "--target-gpus", "0", "--drafter-gpus", d, "--compile",
                                     flag)) == 0
    losses = [[r["loss"] for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "loss" in r]
              for run in ("whole", "shard")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    assert "AdamW state sharded over 2 workers" in (tmp_path / "shard" / "train.log").read_text()
    whole, shard = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("whole", "shard"))
    assert all(torch.equal(whole[k], shard[k]) for k in whole)


def drafter_mask_case(H, KV, D, bs=16, dtype=torch.bfloat16):
    """A drafter-shaped attention case on the GPU: sorted anchors over two documents per row
    (and padding), the block rule, q/k/v in dtype (query and key lengths off the 128 tile; the
    same values, rounded, in every dtype)."""
    B, L, A = 2, 1000, 100
    g = torch.Generator().manual_seed(0)
    doc = torch.zeros(B, L, dtype=torch.long)
    doc[0, 600:], doc[1, 300:], doc[1, -5:] = 1, 1, -1
    anchors = torch.sort(torch.rand(B, L, generator=g).topk(A, dim=1).indices, dim=1).values.cuda()
    doc = doc.cuda()
    starts = dm.context_starts(anchors, doc)
    q = torch.randn(B, H, A * bs, D, generator=g).cuda().to(dtype)
    k, v = torch.randn(2, B, KV, L + A * bs, D, generator=g).cuda().to(dtype)
    return types.SimpleNamespace(B=B, L=L, A=A, bs=bs, anchors=anchors, starts=starts, doc=doc,
                                 mask_mod=dm.block_mask_mod(starts, anchors, L, bs), q=q, k=k, v=v)


def output_and_grads(attend, case):
    """[output, q.grad, k.grad, v.grad] of attend(q, k, v) under a squared-sum loss."""
    q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = attend(q, k, v)
    out.float().square().sum().backward()
    return [out, q.grad, k.grad, v.grad]


def test_flex_block_mask_on_gpu_equals_create_block_mask_forward_and_backward():
    # The per-block BlockMask on the GPU, built eagerly and compiled (Triton), against
    # create_block_mask's; then flex_attention's output and q/k/v gradients through each.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from test_dflash_model import BLOCK_MASK_FIELDS
    c = drafter_mask_case(H=4, KV=2, D=128)
    want = create_block_mask(c.mask_mod, c.B, None, c.A * c.bs, c.L + c.A * c.bs, device="cuda")
    eager = dm.flex_block_mask(c.starts, c.anchors, c.L, c.bs, c.mask_mod)
    compiled = torch.compile(lambda: [getattr(dm.flex_block_mask(c.starts, c.anchors, c.L, c.bs, c.mask_mod), f)
                                      for f in BLOCK_MASK_FIELDS], fullgraph=True)()
    for f, cf in zip(BLOCK_MASK_FIELDS, compiled):  # values, and the (contiguous) layout flex's kernels assume
        assert torch.equal(getattr(eager, f), getattr(want, f)) and torch.equal(cf, getattr(want, f)), f
        assert getattr(eager, f).stride() == cf.stride() == getattr(want, f).stride(), f

    attend = torch.compile(flex_attention, dynamic=False)
    results = [output_and_grads(lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=True), c)
               for mask in (want, eager)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("block_size,D", [(16, 128), (10, 64)])
def test_triton_block_attention_as_close_to_fp32_as_flex(block_size, D, rows, monkeypatch):
    # dm.block_attend's kernels in bf16 against the rule in fp32 (SDPA, dense mask) on the same
    # values unrounded, forward and the three gradients, as close as flex_attention in bf16 is:
    # Qwen3-8B's heads (32 query, 8 KV: 4 x 16 rows a block), documents and padding; one block a
    # program in every kernel, then two (three of 4 x 10 rows).
    for kernel in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(kn.BLOCK_ATTENTION_CONFIG, f"{kernel}_rows", rows)
    exact, case = (drafter_mask_case(H=32, KV=8, D=D, bs=block_size, dtype=dtype)
                   for dtype in (torch.float32, torch.bfloat16))
    want = output_and_grads(helpers.sdpa_attend(dm.dense_block_mask(exact.anchors, exact.doc, block_size)), exact)
    flex = output_and_grads(dm.flex_attend(case.anchors, case.doc, block_size), case)
    ours = output_and_grads(dm.block_attend(case.anchors, case.doc, block_size), case)
    for name, w, f, o in zip(("out", "dq", "dk", "dv"), want, flex, ours):
        w, f, o = w.float(), f.float(), o.float()
        err_flex, err = ((f - w).norm() / w.norm()).item(), ((o - w).norm() / w.norm()).item()
        print(f"{name}: relative error against fp32, flex {err_flex:.2e}, triton {err:.2e}")
        assert err < 1.5 * err_flex + 1e-4 and err < 1e-2, name


@pytest.mark.parametrize("D", [64, 128])
def test_flex_backward_options_give_bitwise_the_same_gradients(D):
    # The backward block config flex_kernel_options picks on Hopper is a speed choice only:
    # output and q/k/v gradients equal inductor's default config's, bit for bit, over the
    # drafter's block mask (grouped heads as SmolLM2's, lengths off the 128 tile).
    from torch.nn.attention.flex_attention import flex_attention
    options = dm.flex_kernel_options(torch.device("cuda"), D)
    if options is None:
        pytest.skip("no backward options on this GPU")
    c = drafter_mask_case(H=9, KV=3, D=D)
    mask = dm.flex_block_mask(c.starts, c.anchors, c.L, c.bs, c.mask_mod)
    results = []
    for kernel_options in (None, options):
        attend = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                                                              kernel_options=kernel_options), dynamic=False)
        results.append(output_and_grads(attend, c))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(kn.triton is None, reason="needs triton")
def test_triton_lm_head_ce_matches_inductor_chunks(monkeypatch):
    # The CUDA default's reductions (kn.ce_rows) against inductor's compiled chunk, through the
    # custom op and its backward: two chunks, the second partial, a vocabulary off the block.
    torch.manual_seed(0)
    N, D, V, chunk = 3000, 512, 50257, 2048
    w = (torch.randn(V, D, device="cuda") * 0.05).to(torch.bfloat16)
    h = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    lab = torch.randint(0, V, (N,), device="cuda")
    lab[:1000] = (h @ w.t()).argmax(-1)[:1000]  # right guesses, some in each chunk
    g = torch.randn(N, device="cuda")
    results = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setattr(dm, "HEAD_CE_KERNEL", kernel)
        x = h.clone().requires_grad_(True)
        ce, correct, _ = dm._lm_head_ce(x, w, lab, chunk, True, True)  # as inside a compiled step
        (ce * g).sum().backward()
        ce_eval, correct_eval = dm.lm_head_ce(h, w, lab, chunk, with_grad=False)
        results[kernel] = ce, correct, x.grad, ce_eval, correct_eval
    want, got = results["torch"], results["triton"]
    # Inductor's matmul may take another cuBLAS algorithm: a logit can round one bf16 step apart
    torch.testing.assert_close(got[0], want[0], rtol=4e-3, atol=1e-4)
    assert (got[0] - want[0]).abs().gt(1e-4).float().mean() < 1e-2
    assert torch.equal(got[1], want[1]) and int(got[1].sum()) >= 1000
    # bf16 rounding of softmax - onehot flips where lse differs in its last fp32 bit
    assert (got[2].float() - want[2].float()).abs().max() <= 1e-2 * want[2].float().abs().max()
    torch.testing.assert_close(got[3], got[0], rtol=0, atol=0)
    assert torch.equal(got[4], got[1])


def test_batched_decoding_graphed_equals_eager_and_is_lossless():
    """The generation engine on CUDA: each decode step replayed as a CUDA graph gives the eager
    step's tokens (greedy) and its speculation gives the greedy outputs, with a drafter and with
    prompt lookup, for rows of mixed lengths over several batches."""
    from conftest import tiny_target
    target = tiny_target(vocab=128, dtype=torch.bfloat16, init_std=0.15).to("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 9, 70, 2, 33, 17)]
    eager = decoding.generate(target, prompts, 40, [1], batch_size=4, graph=False)
    graphed = decoding.generate(target, prompts, 40, [1], batch_size=4, graph=True)
    assert graphed == eager
    cfg = dm.make_drafter_config(target.config, mask_token_id=127, num_draft_layers=1, block_size=8)
    torch.manual_seed(0)
    drafter = dm.DFlashDraftModel(cfg).to("cuda", torch.bfloat16).attach_target(target).eval()
    for d in (drafter, None):
        spec = decoding.speculative_generate(target, prompts, 40, [1], drafter=d, block_size=8, batch_size=4, graph=True)
        assert spec == decoding.speculative_generate(target, prompts, 40, [1], drafter=d, block_size=8, batch_size=4,
                                               graph=False)
        # bf16: a block's verification rounds differently from one-token steps; outputs may part
        # only where the target's two choices are within rounding of each other
        for p, (s, _), (t, _) in zip(prompts, spec, eager):
            if s != t:
                first = next(n for n, (a, b) in enumerate(zip(s, t)) if a != b)
                assert evaluation.near_tie(target, p, t, s, first)[0], (first, s, t)


def test_flex_decoding_graphed_equals_eager_and_grouped_up_to_ties():
    """The decoder's flex steps on CUDA (one decoder for every prompt, refilled across lengths,
    finished rows reading nothing), replayed as a CUDA graph, give the eager flex steps' tokens;
    against the grouped SDPA path (bf16) outputs part only at near ties of the target."""
    from conftest import tiny_target
    target = tiny_target(vocab=128, dtype=torch.bfloat16, init_std=0.15).to("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 9, 70, 2, 33, 17, 700, 140)]
    eager = decoding.generate(target, prompts, 40, [1], batch_size=4, graph=False, decode_attention="flex")
    graphed = decoding.generate(target, prompts, 40, [1], batch_size=4, graph=True, decode_attention="flex")
    assert graphed == eager
    grouped = decoding.generate(target, prompts, 40, [1], batch_size=4, graph=True)
    for p, (f, _), (t, _) in zip(prompts, graphed, grouped):
        if f != t:
            first = next(n for n, (a, b) in enumerate(zip(f, t)) if a != b)
            assert evaluation.near_tie(target, p, t, f, first)[0], (first, f, t)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_flex_target_stage_equals_dense_graphed_and_eager(head_dim):
    """The target stage's flex path (document BlockMask) on CUDA, eager and replayed as a CUDA
    graph with new documents in the static buffers, gives the dense path's features (bf16); at
    head_dim 128 on Hopper in the stage's own kernel tiles and BlockMask tiles of 64."""
    from conftest import tiny_target
    model = tiny_target(arch="llama", dtype=torch.bfloat16, init_std=0.15, layers=4,
                        head_dim=head_dim).to("cuda").requires_grad_(False)
    dense = ts.TargetReplica(model, [1, 2], torch.device("cuda:0"), "dense")
    flex = ts.TargetReplica(model, [1, 2], torch.device("cuda:0"), "flex")
    assert flex.mask_tile == (64 if head_dim == 128 and helpers.hopper(torch.device("cuda:0")) else 128)
    g = torch.Generator().manual_seed(0)

    def batch(seed):
        g.manual_seed(seed)
        doc = torch.zeros(2, 640, dtype=torch.long)
        pos = torch.zeros(2, 640, dtype=torch.long)
        for r in range(2):
            cuts = sorted(torch.randint(1, 640, (3,), generator=g).tolist())
            for i, (s, e) in enumerate(zip([0] + cuts, cuts + [640])):
                doc[r, s:e], pos[r, s:e] = i, torch.arange(e - s)
        return {"input_ids": torch.randint(0, 290, (2, 640), generator=g).cuda(), "doc_ids": doc.cuda(),
                "position_ids": pos.cuda()}

    # bf16 rounding alone moves the dense path's features by about 2% (0.56 at most, features up
    # to 14; measured on the H200): each path is held to the same fp32 reference, within 10% of
    # the dense path's own rounding error, not to the dense path element by element
    exact = ts.TargetReplica(copy.deepcopy(model).float(), [1, 2], torch.device("cuda:0"), "dense")

    def check(replica, b):
        ref = exact.target_hidden(b).float()
        err = lambda x: ((x.float() - ref).norm() / ref.norm()).item()  # noqa: E731
        got, base = err(replica.target_hidden(b).clone()), err(dense.target_hidden(b))
        assert got <= 1.1 * base + 1e-3, (got, base)

    first, second = batch(1), batch(2)
    check(flex, first)
    flex.capture(2, 640)
    for b in (first, second):
        check(flex, b)
    # the decoder layers compiled (--compile-target), then captured
    fused = ts.TargetReplica(copy.deepcopy(model), [1, 2], torch.device("cuda:0"), "flex", compile_layers=True)
    fused.capture(2, 640)
    for b in (first, second):
        check(fused, b)


@pytest.mark.parametrize("distill", [False, True])
def test_a_split_target_on_one_gpu_equals_the_whole_one_graphed(distill):
    """Two stages on the same GPU, flex attention, the layers compiled and each stage captured as
    its own CUDA graph, replayed with new documents: the whole replica's features (and with a
    distillation its top-k distribution); the same kernels run, so within bf16 rounding at most."""
    from conftest import tiny_target
    model = tiny_target(arch="llama", dtype=torch.bfloat16, init_std=0.15, layers=4,
                        head_dim=128).to("cuda").requires_grad_(False)
    distillation = dict(top_k=8, temperature=1.0) if distill else None
    whole = ts.TargetReplica(model, [0, 2], torch.device("cuda:0"), "flex", compile_layers=True,
                             distillation=distillation)
    split = ts.TargetReplica(model, [0, 2], [torch.device("cuda:0")] * 2, "flex", stack_mlps=False,
                             distillation=distillation)
    assert [(s.first, s.end) for s in split.stages] == [(0, 2), (2, 4)]
    whole.capture(2, 640)
    split.capture(2, 640)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        doc = (torch.arange(640) >= torch.randint(1, 639, (1,), generator=g)).long().repeat(2, 1)
        pos = torch.cat([torch.arange(int((doc[0] == 0).sum())), torch.arange(int((doc[0] == 1).sum()))])
        b = {"input_ids": torch.randint(0, 290, (2, 640), generator=g), "doc_ids": doc,
             "position_ids": torch.stack([pos, pos])}
        want = {k: v.clone() for k, v in whole.outputs(b).items()}
        got = split.outputs(b)
        assert set(got) == set(want)
        for k in want:
            print(k, "largest difference", (got[k].float() - want[k].float()).abs().max().item())
            torch.testing.assert_close(got[k], want[k])
        assert torch.isfinite(want["target_hidden"]).all()


@pytest.mark.parametrize("attention", ["triton", "flex"])
def test_validation_gains_batched_gpu_attention_equal_dense_sdpa_per_row(attention):
    # The validation's teacher-forced gains on the GPU paths: rows batched as the validation batches
    # them, at the training step's anchor count, against SDPA's dense mask one row at a time. The
    # attention path is what differs, so the block hidden states are compared (a random drafter's
    # gains are mostly 1), then the gains.
    b = batches(1)[0]
    w = make_worker(compile=False, attention=attention)
    hidden, ids, loss_mask, doc_ids, pos = [b[k] for k in tp.BATCH_KEYS]
    anchors = torch.arange(0, LENGTH, LENGTH // 64, device="cuda").repeat(ROWS, 1)
    with torch.no_grad(), w.autocast():
        batched = w.drafter.block_hidden(hidden, ids, doc_ids, pos, anchors, attention).float()
        dense = torch.cat([w.drafter.block_hidden(hidden[r:r + 1], ids[r:r + 1], doc_ids[r:r + 1], pos[r:r + 1],
                                                  anchors[r:r + 1], "sdpa") for r in range(ROWS)]).float()
    err = ((batched - dense).norm() / dense.norm()).item()
    print(f"block hidden states, batched {attention} against per-row sdpa: relative error {err:.2e}")
    assert err < 1e-2
    gains = w.accepted_lengths(hidden, ids, loss_mask, doc_ids, pos)
    w.settings = w.settings.replace(drafter_attention="sdpa")
    alone = torch.cat([w.accepted_lengths(*[x[r:r + 1] for x in (hidden, ids, loss_mask, doc_ids, pos)])
                       for r in range(ROWS)])
    assert gains.shape == (ROWS, LENGTH) and (gains == alone).float().mean() > 0.99  # a near tie may round either way
