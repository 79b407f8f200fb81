"""Tests of dflash_train/target_stage.py: the target stage's features equal the model's own forward of each
document alone, for every architecture it computes (whole and split in stages); the ones it
cannot compute refused by name."""
import copy
import json

import pytest
import torch

import train_dflash_pipeline as tp
from dflash_train import chat_data
from dflash_train import command_line as cli
from dflash_train import helpers
from dflash_train import target_model
from dflash_train import target_stage as ts
from dflash_train import throughput as thr
from conftest import run_main, tiny_gemma3, tiny_tokenizer, write_jsonl


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


def assert_stage_equals_forward(tmp_path, target, layers, attention, lengths, padding=0, low=0, distillation=None):
    """The target stage's hidden states of random documents of `lengths` packed in one row (and
    `padding` tokens after them) equal the transformers forward of each document alone, and so
    does its next-token distribution with a distillation (the top k of the forward's softmax of
    logits / temperature); returns the stage's embedding module."""
    target.save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    (rep,), embed, _ = ts.load_target_replicas(str(tmp_path / "t"), [torch.device("cpu")], layers, log=lambda *a: None,
                                               target_attention=attention, distillation=distillation)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(low, 100, (n,), generator=g) for n in lengths]
    pad = torch.zeros(padding, dtype=torch.long)
    batch = {"input_ids": torch.cat(docs + [pad])[None],
             "doc_ids": torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)] + [pad - 1])[None],
             "position_ids": torch.cat([torch.arange(len(d)) for d in docs] + [pad])[None]}
    outputs, at = rep.outputs(batch), 0
    for d in docs:
        forward = target(d[None], output_hidden_states=True)
        hs = forward.hidden_states
        torch.testing.assert_close(outputs["target_hidden"][0, at:at + len(d)],
                                   torch.cat([hs[i + 1] for i in layers], -1)[0], rtol=1e-4, atol=1e-4)
        if distillation:
            want = (forward.logits[0].float() / distillation["temperature"]).softmax(-1).topk(distillation["top_k"])
            assert torch.equal(outputs["target_top_ids"][0, at:at + len(d)].long(), want.indices)
            torch.testing.assert_close(outputs["target_top_probs"][0, at:at + len(d)], want.values,
                                       rtol=1e-4, atol=1e-6)
        at += len(d)
    return embed


@pytest.mark.parametrize("attention,lengths", [("dense", (20, 9)), ("flex", (20, 9)), ("flex", (150, 203, 60))])
def test_gemma_target_stage_equals_the_transformers_forward(tmp_path, attention, lengths):
    """Features of packed documents (target stage, document mask; sliding-window layers with
    their own) equal the hidden states of the transformers forward of each document alone. The
    flex path at 416 tokens: tiles of 128 that are fully visible, partly and not at all."""
    embed = assert_stage_equals_forward(tmp_path, tiny_gemma3(), [1, 3], attention, lengths, padding=3)
    assert embed(torch.tensor([3])).abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_the_distribution_the_drafter_learns_is_the_targets_own_softmax(tmp_path, arch):
    """--loss kl/mix: the target stage's top-k of packed documents are the transformers forward's
    probabilities at the distillation temperature (Gemma 3 with its final logit soft-capping)."""
    from conftest import tiny_target
    target = tiny_gemma3(final_logit_softcapping=3.0) if arch == "gemma3" else \
        tiny_target(vocab=128, dtype=torch.float32, init_std=0.15)
    assert_stage_equals_forward(tmp_path, target, [1, 3], "dense", (20, 9), padding=3,
                                distillation=dict(top_k=8, temperature=0.7, kl_weight=1.0))


def tiny_windowed(arch, window=8):
    """A tiny target whose every layer attends through a plain sliding window (no layer types:
    Mistral, Phi-3), or Qwen2's use_sliding_window on its upper layers."""
    from transformers import AutoConfig, AutoModelForCausalLM
    extra = dict(use_sliding_window=True, max_window_layers=2) if arch == "qwen2" else {}
    cfg = AutoConfig.for_model(arch, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               sliding_window=window, pad_token_id=0, eos_token_id=1, bos_token_id=2, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()


@pytest.mark.parametrize("arch", ["mistral", "phi3", "qwen2"])
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_sliding_windows_of_every_kind_equal_the_transformers_forward(tmp_path, arch, attention):
    """Windows of 8 tokens, documents of 20 and 31: the packed features equal the forward of each
    document alone (the window in the stage's mask, where the model's own mask would have had
    it); the batched decoder, which does not apply windows, refuses such a target."""
    from dflash_train import decoding
    target = tiny_windowed(arch)
    assert_stage_equals_forward(tmp_path, target, [0, 2], attention, (20, 31), low=3)
    with pytest.raises(ValueError, match="sliding-window attention"):
        decoding.check_batchable(target.config)


def test_the_smoke_tests_layer_check_sees_a_stage_that_is_not_the_model(monkeypatch):
    """stage_against_transformers (the smoke test's check) on a packed row: equal to the forward
    of each document alone when the stage keeps the window; with the window dropped (a stage that
    ignores a plain sliding_window) the documents longer than it differ by far more than
    rounding."""
    target = tiny_windowed("mistral")
    g = torch.Generator().manual_seed(0)
    lengths = (20, 31)
    batch = {"input_ids": torch.randint(3, 100, (1, sum(lengths)), generator=g),
             "doc_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    right = ts.TargetReplica(target, [0, 2], torch.device("cpu"))
    assert max(ts.stage_against_transformers(right, batch).values()) < 1e-5
    monkeypatch.setattr(ts, "target_windows", lambda tc: (None, None))
    errors = ts.stage_against_transformers(ts.TargetReplica(target, [0, 2], torch.device("cpu")), batch)
    assert min(errors.values()) > 0.01, errors


def test_every_run_checks_its_target_and_logs_the_figure(tmp_path, tiny_model_dir):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "1") == 0
    line = next(l for l in (tmp_path / "o" / "train.log").read_text().splitlines() if "target check:" in l)
    errors = [float(x.split(": ")[1]) for x in line.split("per layer ")[1].split(" (limit")[0].split(", ")]
    assert len(errors) == 1 and errors[0] < 1e-5, line  # one draft layer: one target layer read


def test_a_target_that_leaks_across_packed_documents_is_refused_before_any_step(tmp_path, tiny_model_dir,
                                                                                  monkeypatch, capsys):
    """A family no named refusal lists: each decoder layer mixes in the previous token's output (a
    causal convolution), which in a packed row reaches across documents. The start-up check sees
    it against the model's own forward of each document alone, and the run stops before a step."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    real = Qwen3DecoderLayer.forward

    def leaky(self, hidden_states, *args, **kwargs):
        out = real(self, hidden_states, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        mixed = h + 0.5 * torch.nn.functional.pad(h[:, :-1], (0, 0, 1, 0))  # the previous token, 0 before the first
        return (mixed, *out[1:]) if isinstance(out, tuple) else mixed
    monkeypatch.setattr(Qwen3DecoderLayer, "forward", leaky)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2") == 2
    err = capsys.readouterr().err
    assert "differ from the model's own forward of each document alone by more than 0.0001" in err, err
    assert "at target layers {" in err and "it is refused" in err
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_a_target_the_batched_decoder_does_not_handle_is_evaluated_by_its_own_forward(tmp_path):
    """A plain sliding window (Mistral; windows of 8 tokens, answers longer than that): the run
    trains, and its evaluation decodes with the model's own forward (said in the log), lossless:
    every speculative output equals the target's greedy one, decoded by the same fallback."""
    target = tiny_windowed("mistral")
    target.save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "an answer"}]}])
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": "a longer prompt, and more"}])
    argv = ["--target-model", str(tmp_path / "t"), "--data", data, "--output-dir", str(tmp_path / "o"),
            "--eval-data", prompts, "--max-steps", "1", "--max-length", "64", "--token-budget", "64",
            "--num-anchors", "4", "--block-size", "4", "--num-draft-layers", "1", "--eval-max-new-tokens", "24"]
    assert tp.main(argv) == 0
    log = (tmp_path / "o" / "train.log").read_text()
    assert "sliding-window attention" in log and "the model's own forward decodes" in log
    report = json.loads((tmp_path / "o" / "final" / "eval_acceptance.json").read_text())
    assert report["lossless"] and report["answers"] == 2 and report["generated_tokens"] > 2 * 8


def test_the_fallback_decoder_equals_the_models_own_greedy_generation():
    """generate() through ModelDecoder (a windowed target, rows refilled as they finish) against
    transformers' own greedy loop, token for token."""
    from dflash_train import decoding
    target = tiny_windowed("mistral", window=4)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21]]
    got = decoding.generate(target, prompts, 12, batch_size=2)
    for prompt, (tokens, _) in zip(prompts, got):
        ids = torch.tensor([prompt])
        for _ in range(12):
            nxt = target(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        assert tokens == ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,named", [("gemma2", "soft-capping"), ("gpt_oss", "attention sinks"),
                                        ("qwen3_next", "linear-attention")])
def test_targets_whose_attention_the_stage_does_not_compute_are_refused_by_name(tmp_path, arch, named):
    from transformers import AutoConfig
    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path / "t")
    flags = cli.build_parser().parse_args(["--target-model", str(tmp_path / "t"), "--data", "x.jsonl"])
    with pytest.raises(chat_data.UsageError, match=named):
        cli.resolve_settings(flags)


SMALL_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)


# family: (its config's extra fields, what happens: "trains" (and evaluates), "trains, evaluated by
# the model's own forward: <what the batched decoder does not handle>", or "refused: <named>")
FAMILIES = {
    "qwen3": ({}, "trains"),
    "qwen2": ({}, "trains"),
    "llama": ({}, "trains"),
    "mistral": ({"sliding_window": None}, "trains"),
    "phi3": ({"sliding_window": None}, "trains"),
    "qwen3_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "trains"),
    "mistral+window": ({"sliding_window": 8}, "trains, evaluated by the model's own forward: sliding-window"),
    "qwen2+window": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
                     "trains, evaluated by the model's own forward: sliding-window"),
    "gemma3_text": ({"sliding_window": 8, "head_dim": 16}, "trains, evaluated by the model's own forward: sliding-window"),
    "deepseek_v3": ({"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
                    "trains, evaluated by the model's own forward: multi-head latent attention"),
    "gemma2": ({}, "refused: soft-capping"),
    "gpt_oss": ({}, "refused: attention sinks"),
    "qwen3_next": ({}, "refused: linear-attention"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_common_architecture_is_exact_or_refused_by_name(tmp_path, family, capsys):
    """What a new user meets with each family (a tiny random-weight config, packed chat data, the
    evaluator on): training and the evaluation run, with the target stage's features equal to the
    transformers forward of each packed document alone (whole, and split in two and three
    stages), and the evaluation lossless: by the batched decoder, or where it does not handle the
    target by the model's own forward, the log naming why; or the target is refused by name."""
    from transformers import AutoConfig, AutoModelForCausalLM
    extra, outcome = FAMILIES[family]
    config = AutoConfig.for_model(family.split("+")[0], **{**SMALL_CONFIG, **extra})
    torch.manual_seed(0)
    if outcome.startswith("refused"):
        config.save_pretrained(tmp_path / "t")
    else:
        AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    from conftest import chat_rows
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}])
    argv = ["--target-model", str(tmp_path / "t"), "--data", data, "--output-dir", str(tmp_path / "o"),
            "--cache-dir", str(tmp_path / "cache"), "--max-length", "128", "--token-budget", "256", "--num-anchors",
            "8", "--block-size", "4", "--num-draft-layers", "1", "--target-layer-ids", "0,2", "--max-steps", "2",
            "--eval-data", prompts, "--eval-prompts", "1", "--eval-max-new-tokens", "16"]
    capsys.readouterr()
    rc = tp.main(argv)
    err = capsys.readouterr().err
    if outcome.startswith("refused"):
        assert rc == 2 and outcome.split(": ")[1] in err, err
        return
    assert rc == 0, err
    assert json.loads((tmp_path / "o" / "final" / "eval_acceptance.json").read_text())["lossless"]
    log = (tmp_path / "o" / "train.log").read_text()
    assert ("the model's own forward decodes" in log) == ("own forward" in outcome), outcome
    assert "own forward" not in outcome or outcome.split(": ")[1] in log
    (replica,), _, _ = ts.load_target_replicas(str(tmp_path / "t"), [torch.device("cpu")], [0, 2], log=lambda *a: None)
    g = torch.Generator().manual_seed(1)
    lengths = (40, 23, 50)
    batch = {"input_ids": torch.randint(3, 100, (1, sum(lengths)), generator=g),
             "doc_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    errors = ts.stage_against_transformers(replica, batch)
    assert max(errors.values()) < 1e-4, errors
    # split over two and three stages (one layer each): the same features, and the smoke test's
    # check holds the split stages against the model's own forward too
    for stages in (2, 3):
        (split,), _, _ = ts.load_target_replicas(str(tmp_path / "t"), [torch.device("cpu")] * stages, [0, 2],
                                                 log=lambda *a: None, stages=stages)
        assert [(s.first, s.end) for s in split.stages] == list(zip(ts.stage_bounds(3, stages),
                                                                    ts.stage_bounds(3, stages)[1:]))
        torch.testing.assert_close(split.target_hidden(batch), replica.target_hidden(batch), rtol=1e-6, atol=1e-6)
        assert max(ts.stage_against_transformers(split, batch).values()) < 1e-4


def test_a_split_stage_starts_from_the_hidden_states_passed_on_even_where_the_model_scales_its_input(tmp_path):
    """Granite multiplies inputs_embeds inside its base model's forward: a later stage, which is
    handed the stage before's hidden states as inputs_embeds, must not scale them again. The split
    replica's features equal the plain transformers forward's layer outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("granite", **SMALL_CONFIG, embedding_multiplier=12.0, residual_multiplier=0.5)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    ids = torch.randint(3, 100, (1, 30))
    with target_model.collect_layer_outputs(target, [0, 2]) as want, torch.no_grad():
        target(input_ids=ids)
    split = ts.TargetReplica(target, [0, 2], [torch.device("cpu")] * 3, stack_mlps=False)
    got = split.outputs({"input_ids": ids, "position_ids": torch.arange(30)[None],
                         "doc_ids": torch.zeros(1, 30, dtype=torch.long)})["target_hidden"]
    torch.testing.assert_close(got, torch.cat(want, dim=-1), rtol=1e-5, atol=1e-5)


def test_each_stage_of_a_split_replica_is_timed_on_its_own_clock(tiny_model_dir):
    """The target stage's busy time (its tokens/s in the log, the split advice) is the slowest
    replica stage's: each stage's work is timed by its own clock, eagerly and as the pipeline
    feeds it."""
    (replica,), _, _ = ts.load_target_replicas(tiny_model_dir, [torch.device("cpu")] * 2, [1, 3],
                                               log=lambda *a: None, stages=2)
    clocks = [thr.StageClock(), thr.StageClock()]
    batch = {"input_ids": torch.randint(3, 100, (2, 64)), "position_ids": torch.arange(64).repeat(2, 1),
             "doc_ids": torch.zeros(2, 64, dtype=torch.long)}
    for _ in range(3):
        replica.outputs(batch, clocks)
    assert [c.total()[1] for c in clocks] == [3, 3] and all(c.total()[0] > 0 for c in clocks)


@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("window", [None, 200])
def test_document_block_mask_tiles_equal_the_rule_counted_pair_by_pair(window, tile):
    """The target's BlockMask classifies tiles from their first and last documents and positions;
    counted pair by pair (document_visible at every query and key) the full tiles are the same,
    and so are the partial ones without a window (with one, they may be more: the rule inside the
    kernel still decides)."""
    g = torch.Generator().manual_seed(0)
    L = 700
    rows = []
    for r in range(6):
        cuts = sorted(torch.randint(1, L, (r + 1,), generator=g).tolist())
        doc = torch.full((L,), -1, dtype=torch.long)
        for i, (s, e) in enumerate(zip([0] + cuts[:-1], cuts)):
            doc[s:e] = i
        if r % 2:  # no padding: the last document runs to the end
            doc[cuts[-1]:] = len(cuts)
        rows.append(doc)
    doc_ids = torch.stack(rows)
    bm = ts.document_block_mask(doc_ids, window, tile)
    n = -(-L // tile)
    pos = torch.arange(n * tile)
    docs = torch.nn.functional.pad(doc_ids, (0, n * tile - L), value=-1)
    seen = ts.document_visible(pos[:, None], pos[None, :], docs[:, :, None], docs[:, None, :], window)
    seen = seen & (pos[:, None] < L) & (pos[None, :] < L)
    pairs = seen.view(len(rows), n, tile, n, tile).sum((2, 4))
    full_ref, some_ref = pairs == tile * tile, pairs > 0

    def as_map(num, idx):
        m = torch.zeros(len(rows), n, n, dtype=torch.bool)
        for r in range(len(rows)):
            for q in range(n):
                m[r, q, idx[r, 0, q, :num[r, 0, q]].long()] = True
        return m

    full = as_map(bm.full_kv_num_blocks, bm.full_kv_indices)
    some = as_map(bm.kv_num_blocks, bm.kv_indices) | full
    assert torch.equal(full, full_ref)
    if window is None:
        assert torch.equal(some, some_ref)
    else:
        assert (some_ref <= some).all()


@pytest.mark.parametrize("attention,lengths,mask_tile", [("dense", (7, 12, 5), None), ("flex", (7, 12, 5), None),
                                                         ("flex", (140, 260, 3), None), ("flex", (140, 260, 3), 64)])
def test_packed_documents_do_not_see_each_other(tiny_model_dir, attention, lengths, mask_tile):
    """The target stage gives a document the same features packed with others as alone (flex:
    in the BlockMask's tiles for the CPU, 128, and in Hopper's, 64)."""
    replicas, _, _ = ts.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention=attention)
    rep = replicas[0]
    if mask_tile:
        rep.mask_tile = mask_tile
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs + [torch.zeros(4, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((4,), -1)])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.zeros(4, dtype=torch.long)])[None]
    packed = rep.target_hidden({"input_ids": ids, "doc_ids": doc_ids, "position_ids": pos})
    at = 0
    for d in docs:
        alone = rep.target_hidden({"input_ids": d[None], "doc_ids": torch.zeros(1, len(d), dtype=torch.long),
                              "position_ids": torch.arange(len(d))[None]})
        torch.testing.assert_close(packed[0, at:at + len(d)], alone[0], rtol=1e-4, atol=1e-4)
        at += len(d)
    assert torch.isfinite(packed).all()


def test_target_stage_block_mask_takes_the_flex_kernel_tiles_for_the_card(monkeypatch):
    """On Hopper at head_dim 128 the stage's flex kernel runs 64 x 64 tiles (target_model.SM90_FLEX_TARGET)
    and its document BlockMask comes in tiles of 64; elsewhere flex's default, 128."""
    from conftest import tiny_target
    doc_ids = torch.zeros(2, 300, dtype=torch.long)
    for hopper, hidden, tile in ((True, 512, 64), (True, 256, 128), (False, 512, 128)):
        monkeypatch.setattr(target_model, "hopper", lambda device, on=hopper: on)
        model = tiny_target(hidden=hidden, layers=2)  # qwen3: head_dim hidden / 4
        replica = ts.TargetReplica(model, [1], torch.device("cpu"), "flex")
        assert replica.mask_tile == tile and replica.mask(doc_ids).BLOCK_SIZE == (tile, tile), (hopper, hidden)
    assert helpers.flex_mask_tile(None) == helpers.flex_mask_tile({"USE_TMA": True}) == 128
    assert helpers.flex_mask_tile({"BLOCK_M": 128, "BLOCK_N": 64}) == 128 and helpers.flex_mask_tile(target_model.SM90_FLEX_TARGET) == 64


def test_compiled_target_layers_give_the_same_features(tiny_model_dir):
    """--compile-target: the target's decoder layers compiled by inductor (flex path) give the
    uncompiled layers' features on a packed batch."""
    (plain,), _, _ = ts.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention="flex")
    (fused,), _, _ = ts.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention="flex", compile_layers=True)
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0] * 90 + [1] * 150 + [2] * 60])
    pos = torch.cat([torch.arange(90), torch.arange(150), torch.arange(60)])[None]
    batch = {"input_ids": torch.randint(0, 100, (1, 300), generator=g), "doc_ids": doc, "position_ids": pos}
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in target_model.decoder_layers(fused.model))
    torch.testing.assert_close(fused.target_hidden(batch), plain.target_hidden(batch), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,config", [("qwen3", {}), ("llama", {"mlp_bias": True})])
def test_target_stage_stacks_gate_and_up_into_one_matmul_with_the_transformers_features(arch, config):
    """The target stage's MLPs (GateUpMLP): compiled, the gate and up projections are one matmul
    (two in the MLP, down included); eager, the MLP's own output to the bit; the features, eager
    and with the layers compiled, are the transformers forward's hidden states."""
    from conftest import tiny_target
    from torch._inductor.utils import run_and_get_code
    target = tiny_target(arch=arch, layers=4, dtype=torch.float32, init_std=0.15, **config)
    replica = ts.TargetReplica(copy.deepcopy(target), [1, 2], torch.device("cpu"), "flex")
    assert [type(layer.mlp) for layer in target_model.decoder_layers(replica.model)] == [ts.GateUpMLP] * 4
    assert (target_model.decoder_layers(replica.model)[0].mlp.bias is not None) == bool(config)
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "doc_ids": torch.zeros(1, 200, dtype=torch.long), "position_ids": torch.arange(200)[None]}
    hidden = target(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[2], hidden[3]], dim=-1)
    torch.testing.assert_close(replica.target_hidden(batch), expected, rtol=1e-5, atol=1e-5)

    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(1))
    mlp = target_model.decoder_layers(replica.model)[1].mlp
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code,) = run_and_get_code(torch.compile(mlp, dynamic=False), x)
    assert code.count("extern_kernels.mm(") + code.count("extern_kernels.addmm(") == 2
    with torch.no_grad():
        own = target.model.layers[1].mlp(x)
        torch.testing.assert_close(out, own, rtol=1e-5, atol=1e-5)
        assert torch.equal(mlp(x), own)

    torch._dynamo.reset()
    replica.set_compiled_layers(True)
    torch.testing.assert_close(replica.target_hidden(batch), expected, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_mlps_of_another_form_are_not_stacked():
    """stack_gate_up leaves alone an MLP whose forward is not down(act(gate(x)) * up(x)), or that
    has more than those four parts."""
    from conftest import tiny_target

    class UpGated(torch.nn.Module):  # the gate and up roles swapped
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    target = tiny_target(layers=3, dtype=torch.float32, init_std=0.15)
    layers = target_model.decoder_layers(target)
    layers[0].mlp = UpGated(layers[0].mlp)
    layers[1].mlp.dropout = torch.nn.Dropout(0.0)
    assert ts.stack_gate_up(target) == 1
    assert [type(layer.mlp).__name__ for layer in layers] == ["UpGated", "Qwen3MLP", "GateUpMLP"]


def test_compiled_target_layers_store_queries_token_major_and_save_the_attention_output_copy(tiny_model_dir,
                                                                                             monkeypatch):
    """flex's output follows its queries' order: with the queries token-major (target_model.token_major) a
    compiled layer has one kernel fewer than with inductor's own order, which needs a transposing
    copy before the output projection; the features are the same."""
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code
    batch = {"input_ids": torch.randint(0, 100, (2, 256), generator=torch.Generator().manual_seed(0)),
             "doc_ids": torch.tensor([[0] * 100 + [1] * 156, [0] * 256]), "position_ids": torch.arange(256).repeat(2, 1)}

    def features_and_kernels_a_layer():
        torch._dynamo.reset()
        metrics.reset()
        (replica,), _, _ = ts.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                                   target_attention="flex", compile_layers=True)
        # No FX graph cache, so each call compiles what it counts (config.patch: monkeypatch's undo
        # deletes a config entry); run_and_get_code returns one code a compiled graph.
        with torch._inductor.config.patch(fx_graph_cache=False):
            target_hidden, codes = run_and_get_code(replica.target_hidden, batch)
        return target_hidden, metrics.generated_kernel_count / len(codes)

    token_major = features_and_kernels_a_layer()
    monkeypatch.setattr(target_model, "token_major", lambda query: query)
    inductors_order = features_and_kernels_a_layer()
    torch._dynamo.reset()
    torch.testing.assert_close(token_major[0], inductors_order[0], rtol=1e-4, atol=1e-4)
    assert token_major[1] == inductors_order[1] - 1
