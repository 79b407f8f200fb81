"""Tests of dflash_train/command_line.py: the flags checked, the Settings resolved once (layout, attention
paths, demo defaults) and frozen."""
import json
import os
import types

import pytest
import torch

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import chat_data
from dflash_train import command_line as cli
from dflash_train import demo_assets
from dflash_train import helpers
from dflash_train import kernels as kn
from dflash_train import regeneration
from conftest import chat_rows, run_cli, run_main, write_jsonl


@pytest.mark.parametrize("extra,msg", [
    (["--token-budget", "64"], "smaller than --max-length"),
    (["--block-size", "200"], "--block-size 200 does not fit"),
    (["--target-gpus", "0", "--drafter-gpus", "7"], "does not exist"),
    (["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--compile"], "--compile captures CUDA graphs"),
    (["--loss", "mix", "--kl-weight", "1"], "--kl-weight 1.0 must be in (0, 1)"),
    (["--loss", "kl", "--distill-top-k", "129"], "larger than the target's vocabulary (128)"),
])
def test_impossible_settings_refused(tmp_path, tiny_model_dir, extra, msg):
    r = run_cli(tmp_path, tiny_model_dir, "unused.jsonl", *extra)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_encoder_decoder_target_refused(tmp_path):
    from transformers import T5Config
    T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=32, vocab_size=50).save_pretrained(tmp_path / "t5")
    r = run_cli(tmp_path, str(tmp_path / "t5"), "unused.jsonl")
    assert r.returncode == 2 and "not a decoder-only causal LM" in r.stderr


def test_typed_flags_win_over_the_demo_values():
    argv = ["--num-draft-layers", "5", "--lr", "6e-4"]  # equal to the defaults, typed all the same
    args = cli.parse_flags(argv)
    assert args.num_draft_layers == 5 and args.lr == 6e-4
    assert args.max_length == cli.DEMO_DEFAULTS["max_length"]  # not typed: the demo's


def test_the_gpu_demo_trains_on_regenerated_data_unless_data_is_typed(monkeypatch, tmp_path):
    """On a GPU the demo trains on the target's own answers; `--data builtin:sharegpt` typed (the
    default's value) still means the human replies. The regenerated set needs the built-in
    target on a GPU: elsewhere a clear error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.parse_flags([]).data == [demo_assets.BUILTIN_REGENERATED]
    assert cli.parse_flags(["--data", demo_assets.BUILTIN_DATA]).data == [demo_assets.BUILTIN_DATA]
    args = cli.parse_flags([])
    assert args.decay_ratio == 0.2 and args.max_steps == 6000  # the peak held, decayed over the last 1,200
    assert args.loss_decay_gamma == 3.0
    argv = ["--decay-ratio", "1.0", "--loss-decay-gamma", "7"]  # typed: the cosine over every step, the published gamma
    typed = cli.parse_flags(argv)
    assert typed.decay_ratio == 1.0 and typed.loss_decay_gamma == 7.0
    monkeypatch.undo()
    assert tp.main(["--data", demo_assets.BUILTIN_REGENERATED, "--output-dir", str(tmp_path / "o")]) == 2


def test_the_gpu_demo_regenerates_regen_batch_size_rows_at_a_time(monkeypatch, tmp_path):
    seen = []

    class Backend:  # stands in for the target (the GPU path), recording what it was asked to batch
        def __init__(self, target_name, devices, tokenizer, args, progress=None):
            seen.append((args.batch_size, args.max_new_tokens, args.max_context_tokens))

    def regenerate(input_path, output, make_backend, settings, log, desc):
        make_backend(None)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        open(output, "w").close()
        return {"text": "regenerated"}
    monkeypatch.setattr(demo_assets, "CACHE", str(tmp_path))
    monkeypatch.setattr(demo_assets, "builtin_prompts_file", lambda: str(tmp_path / "prompts.jsonl"))
    monkeypatch.setattr(regeneration, "load_tokenizer", lambda name: None)
    monkeypatch.setattr(regeneration, "EmbeddedBackend", Backend)
    monkeypatch.setattr(regeneration, "regenerate", regenerate)
    args = cli.Settings.of_flags(["--regen-batch-size", "96", "--regen-max-new-tokens", "64"])
    out = regeneration.regenerated_builtin_data(args, print)
    assert seen == [(96, 64, args.max_length)] and os.path.exists(out + ".done")
    assert regeneration.regenerated_builtin_data(args, print) == out and len(seen) == 1  # cached: not again
    with pytest.raises(chat_data.UsageError, match="--regen-batch-size 0 must be positive"):
        cli.check_flags(cli.build_parser().parse_args(["--regen-batch-size", "0"]))


def test_a_grad_clip_of_zero_is_refused():
    # It would scale every update to nothing (the clip divides by norm / clip on CUDA).
    with pytest.raises(chat_data.UsageError, match="--grad-clip 0.0 must be positive"):
        cli.check_flags(cli.build_parser().parse_args(["--grad-clip", "0"]))


def test_target_stage_defaults_to_flex_compiled_on_gpus_and_typed_flags_win():
    parser = cli.build_parser()
    gpu, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    opts = lambda argv, devices: cli.resolve_target_stage(parser.parse_args(argv), devices)  # noqa: E731
    assert opts([], cpu) == ("dense", False) and opts(["--compile"], cpu) == ("dense", False)
    assert opts([], gpu) == ("flex", False) and opts(["--compile"], gpu) == ("flex", True)
    assert opts(["--compile", "--target-attention", "dense", "--no-compile-target"], gpu) == ("dense", False)
    assert opts(["--target-attention", "flex", "--compile-target"], cpu) == ("flex", True)


def test_drafter_attention_auto_is_sdpa_on_cpu_and_triton_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = cli.resolve_settings(cli.build_parser().parse_args(["--target-model", tiny_model_dir]))
    assert settings.drafter_attention == "sdpa"
    settings = cli.resolve_settings(cli.build_parser().parse_args(["--target-model", tiny_model_dir,
                                                                  "--drafter-attention", "flex"]))
    assert settings.drafter_attention == "flex"
    with pytest.raises(chat_data.UsageError, match="--drafter-attention triton needs CUDA"):
        cli.resolve_settings(cli.build_parser().parse_args(["--target-model", tiny_model_dir, "--drafter-attention", "triton"]))


def test_drafter_attention_auto_is_triton_on_hopper_gpus_where_its_shapes_fit(monkeypatch):
    monkeypatch.setattr(kn, "triton", object())  # installed or not here: the choice is what is tested
    capability = {"cuda:0": (9, 0), "cuda:1": (9, 0)}
    monkeypatch.setattr(helpers, "cuda_capability", lambda device: capability[device])
    parser = cli.build_parser()
    gpu, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    qwen3_8b = types.SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
    def choose(argv, devices, tc=qwen3_8b):
        args = parser.parse_args(argv)
        return cli.resolve_drafter_attention(args.drafter_attention, devices, tc, args.block_size)
    assert choose([], gpu) == "triton" and choose([], cpu) == "sdpa"
    assert choose(["--drafter-attention", "flex"], gpu) == "flex"
    # past what the kernels were measured on: 256-wide heads (Gemma 3), 4 query heads x 64 slots
    # (256 rows) per KV head, a head_dim not a power of two; auto takes flex there, triton is refused
    wide = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=2048)
    no_head_dim = types.SimpleNamespace(num_attention_heads=12, num_key_value_heads=4, hidden_size=1152)  # 96
    for argv, tc in (([], wide), (["--block-size", "64"], qwen3_8b), ([], no_head_dim)):
        assert choose(argv, gpu, tc) == "flex"
        with pytest.raises(chat_data.UsageError, match="--drafter-attention triton needs"):
            choose(argv + ["--drafter-attention", "triton"], gpu, tc)
    assert choose(["--block-size", "32"], gpu) == "triton"  # 4 x 32: 128 rows
    # its settings were chosen on an H200: on other GPUs (or any drafter GPU not Hopper) auto
    # takes flex, and triton is still there when asked for
    two = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert choose([], two) == "triton"
    capability["cuda:1"] = (8, 0)
    assert choose([], two) == "flex" and choose(["--drafter-attention", "triton"], two) == "triton"
    monkeypatch.setattr(kn, "triton", None)
    assert choose([], gpu) == "flex"


def test_settings_are_resolved_once_and_frozen(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = cli.build_parser().parse_args(["--target-model", tiny_model_dir, "--max-length", "100",
                                          "--token-budget", "250", "--num-anchors", "8", "--num-draft-layers", "2"])
    before = dict(vars(flags))
    settings = cli.resolve_settings(flags)
    assert vars(flags) == before  # the flags are read, never changed
    assert settings.token_budget == 200 and settings.rows_per_batch == 2
    layers = json.load(open(os.path.join(tiny_model_dir, "config.json")))["num_hidden_layers"]
    assert settings.target_layer_ids == dm.default_target_layer_ids(layers, 2) and settings.drafter_attention == "sdpa"
    assert settings.target_devices == [torch.device("cpu")] and settings.chat_template_kwargs == {}
    assert settings.loss_decay_gamma == dm.default_loss_gamma(16)
    with pytest.raises(AttributeError, match="frozen"):
        settings.lr = 1.0
    changed = settings.replace(lr=1.0)
    assert changed.lr == 1.0 and settings.lr == 6e-4
    # a setting that cannot be read is a sentence naming the flag, not a traceback
    with pytest.raises(chat_data.UsageError, match="--target-layer-ids a,b"):
        cli.resolve_settings(cli.build_parser().parse_args(["--target-model", tiny_model_dir, "--target-layer-ids", "a,b"]))


def test_last_target_layer_refused(tmp_path, tiny_model_dir):
    from conftest import run_cli
    r = run_cli(tmp_path, tiny_model_dir, "unused.jsonl", "--target-layer-ids", "1,5")
    assert r.returncode == 2 and "[5] are outside [0, 5)" in r.stderr and "final-normed" in r.stderr


@pytest.mark.parametrize("flags,said", [
    (["--max-steps", "0"], "--max-steps 0 must be at least 1"),
    (["--max-steps", "-5"], "--max-steps -5 must be at least 1"),
    (["--warmup-ratio", "2"], "--warmup-ratio 2.0 must be in [0, 1)"),
    (["--val-fraction", "1.5"], "--val-fraction 1.5 must be in [0, 1)"),
    (["--target-layer-ids", "2,2"], "each layer once"),
    (["--weight-decay=-5"], "--weight-decay -5.0 must be 0 or more"),
    (["--target-layer-ids", "a,b"], "--target-layer-ids a,b"),
    (["--resume", "auto", "--overwrite"], "give one of them"),
    (["--resume", "/nonexistent/step_5"], "--resume /nonexistent/step_5: not a checkpoint directory (no "
                                          "training_state.pt or model.safetensors)"),
    (["--init-drafter", "/tmp"], "--init-drafter /tmp: not a drafter directory (no config.json or model.safetensors)"),
    (["--eval-data", "/nonexistent/prompts.jsonl"], "--eval-data /nonexistent/prompts.jsonl: no such file"),
])
def test_flags_out_of_range_are_refused_before_anything_loads(tmp_path, tiny_model_dir, capsys, flags, said):
    assert run_main(tmp_path, tiny_model_dir, "o", *flags) == 2
    assert said in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")


def test_a_target_that_does_not_exist_is_a_sentence(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    assert tp.main(["--target-model", str(tmp_path / "nowhere"), "--data", data, "--output-dir", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
