"""Tests of dflash_train/memory_plan.py: what each GPU holds, counted by hand for a 70B target; layouts and
evaluations that cannot fit refused before anything loads."""


import pytest
import torch

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import chat_data
from dflash_train import command_line as cli
from dflash_train import memory_plan as mp
from dflash_train import target_stage as ts
from conftest import write_jsonl


def llama_70b_config(path):
    """Llama-3.3-70B's shapes (the config alone: nothing downloaded, no weights)."""
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False)
    config.save_pretrained(path)
    return config


def test_the_memory_plan_of_a_70b_target_on_a_laptop(tmp_path, capsys):
    """--plan --gpu-memory plans an 8-GPU host from the config alone: the weights are counted by
    hand here (Llama layers, the DFlash drafter's), bf16 for the target, 16 bytes a drafter
    parameter (fp32 master, bf16 copy and gradient, two fp32 moments)."""
    config = llama_70b_config(tmp_path / "l70")
    argv = ["--target-model", str(tmp_path / "l70"), "--target-gpus", "0,1,2,3,4,5", "--drafter-gpus", "6,7",
            "--gpu-memory", "80", "--plan"]
    assert tp.main(argv) == 1  # the asked layout does not fit: said, and the exit code says so
    out = capsys.readouterr().out
    H, I, V, kv = 8192, 28672, 128256, 8 * 128
    layer = 2 * H * H + 2 * H * kv + 3 * H * I + 2 * H  # q, o; k, v; the MLP; two norms
    layers = dm.default_target_layer_ids(80, 5)
    target_gb = 2 * ((max(layers) + 1) * layer + V * H + H) / 2**30  # + embedding, final norm (the LM head: host)
    draft_layer = layer + 2 * 128  # + q_norm, k_norm
    # + fc over 5 target layers, two norms; the AdamW moments split over the two drafter workers
    # (the plan does not fit with the whole state on each): 8 + 8 / 2 bytes a parameter
    drafter_gb = 12 * (5 * draft_layer + 5 * H * H + 2 * H) / 2**30
    assert f"    target weights: {target_gb:.2f} GB" in out, out
    assert f"    drafter weights, gradient and AdamW state: {drafter_gb:.2f} GB" in out, out
    assert "--shard-optimizer on" in out
    assert out.count("DOES NOT FIT") == 8 and "cuda:7:" in out
    # one verdict line, the nearest layout that fits as flags to paste; pasted, they fit
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("plan: does NOT fit cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7; the "
                              "nearest layout that fits: --target-stages 2 --token-budget 3072"), verdict
    assert tp.main(argv + verdict.split("fits: ")[1].split()) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("plan: fits every GPU (fullest: cuda:6")
    assert tp.main(argv + ["--no-shard-optimizer"]) == 1  # each worker the whole state: 16 bytes a parameter
    out = capsys.readouterr().out
    assert f"AdamW state: {drafter_gb * 16 / 12:.2f} GB" in out and out.strip().endswith("--shard-optimizer"), out
    assert config.num_hidden_layers == 80  # nothing loaded, nothing changed
    # split in three stages: two replicas, each over three GPUs, its layers cut as stage_bounds says
    assert tp.main(argv[:-1] + ["--target-stages", "3", "--plan"]) == 1  # the drafter GPUs' budget still too large
    out = capsys.readouterr().out
    bounds = ts.stage_bounds(max(layers) + 1, 3)
    stage_gb = [2 * ((b - a) * layer + H + (V * H if k == 0 else 0)) / 2**30
                for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    for gpu in range(6):
        block = out.split(f"cuda:{gpu}:")[1].split("cuda:")[0]
        assert f"    target weights: {stage_gb[gpu % 3]:.2f} GB" in block and "DOES NOT FIT" not in block, block


def test_an_evaluation_whose_target_fits_no_device_is_refused_before_training(tmp_path):
    """A 70B target's evaluation needs the whole target (141 GB in bf16) on one device: no 80 GB
    GPU holds it, nor this host in fp32, so the run is refused up front, naming the way out; on
    imaginary 400 GB GPUs, or without evaluation, it goes ahead."""
    llama_70b_config(tmp_path / "l70")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a question"}])
    settings = cli.Settings.of_flags(["--target-model", str(tmp_path / "l70"), "--gpu-memory", "80", "--eval-data",
                                     prompts, "--target-stages", "3"],
                                    target_config=cli.target_config(str(tmp_path / "l70")),
                                    target_devices=[torch.device("cuda", i) for i in range(6)],
                                    drafter_devices=[torch.device("cuda", 6), torch.device("cuda", 7)],
                                    target_layer_ids=dm.default_target_layer_ids(80, 5), target_attention="flex",
                                    shard_optimizer=True)
    H, I, V, kv = 8192, 28672, 128256, 8 * 128
    params = 80 * (2 * H * H + 2 * H * kv + 3 * H * I + 2 * H) + 2 * V * H + H  # layers, embedding, head, norm
    with pytest.raises(chat_data.UsageError, match=rf"whole target on one device, and it \({2 * params / 2**30:.0f} GB "
                       "in bf16.*--eval-prompts 0 and --eval-interval 0.*scripts/eval_acceptance.py"):
        mp.check_evaluation_fits(settings)
    mp.check_evaluation_fits(settings.replace(gpu_memory=400.0))
    mp.check_evaluation_fits(settings.replace(eval_prompts=0))


def test_a_layout_whose_weights_cannot_fit_is_refused_before_loading(tmp_path):
    llama_70b_config(tmp_path / "l70")
    settings = cli.Settings.of_flags(["--target-model", str(tmp_path / "l70"), "--gpu-memory", "80"],
                                    target_config=cli.target_config(str(tmp_path / "l70")),
                                    target_devices=[torch.device("cuda", 0)], drafter_devices=[torch.device("cuda", 1)],
                                    target_layer_ids=dm.default_target_layer_ids(80, 5), target_attention="flex")
    with pytest.raises(chat_data.UsageError, match="does not fit cuda:0.*target's weights do not fit: a replica split "
                       "over more GPUs \\(--target-stages 3 "):
        mp.check_memory_plan(settings)
    small = settings.replace(gpu_memory=400.0)  # an imaginary 400 GB card holds either stage
    assert set(mp.check_memory_plan(small)) == {torch.device("cuda", 0), torch.device("cuda", 1)}
