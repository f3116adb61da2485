"""`python trainer/run.py` end to end: a real CLI run whose checkpoint decodes, exact resume after an interruption,
a real 2-process torchrun (gloo) run, and clear errors on bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, greedy_dataset, make_drafter, make_target
from transformers import AutoModel, TrainerCallback, TrainingArguments

import modeling_carryover as mc
from trainer.carryover_trainer import TRAINING_SETTINGS_FILE, CarryoverArguments, CarryoverTrainer
from trainer.run import main as run_main


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny target folder and a dataset of its greedy responses on disk."""
    root = tmp_path_factory.mktemp("run")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    greedy_dataset(target, num_rows=24).save_to_disk(str(root / "data"))
    return root, target


def cli_args(root, output_dir, *extra):
    return [
        "--target", str(root / "target"), "--dataset", str(root / "data"), "--output_dir", str(output_dir),
        "--num_draft_layers", "2", "--block_size", "4", "--num_anchors", "16", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--report_to", "none", "--use_cpu", "--seed", "0", "--logging_steps", "2",
        "--disable_tqdm", "true", *extra,
    ]


def test_cli_trains_a_checkpoint_that_decodes(tiny_setup, tmp_path):
    root, target = tiny_setup
    out = tmp_path / "baseline"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "trainer/run.py", *cli_args(root, out, "--num_train_epochs", "2", "--save_strategy", "no", "--threads", "2")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pin_memory" not in result.stderr  # set only where an accelerator can use it
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_carryover.py", "custom_generate", TRAINING_SETTINGS_FILE} <= files
    record = json.loads((out / TRAINING_SETTINGS_FILE).read_text())
    assert record["torch_threads"] == 2  # --threads, over OMP_NUM_THREADS
    from datasets import load_from_disk

    assert record["inputs"] == {  # what the run read, for the model card (and a resumed run's check)
        "dataset": [str(root / "data")], "dataset_shards": None, "num_rows": len(load_from_disk(str(root / "data"))),
        "features": None, "drafter_checkpoint": None,
    }
    drafter = mc.CarryoverDrafterModel.from_pretrained(out)
    assert drafter.config.carryover is False  # a baseline checkpoint decodes without carryover by default
    prompt = torch.randint(0, 96, (1, 6))
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out_ids = target.generate(prompt, assistant_model=drafter, custom_generate=str(out), trust_remote_code=True, max_new_tokens=20)
    assert torch.equal(out_ids, expected)


def test_a_resumed_run_refuses_other_training_rows(tiny_setup, tmp_path):
    """The Trainer skips a resumed run's seen batches by position: other rows (a regeneration grown in between, other
    shard counts) would repeat some and skip others, so the run stops before training; the same rows resume."""
    root, _ = tiny_setup
    out = tmp_path / "run"
    run_main(cli_args(root, out, "--max_steps", "2", "--save_steps", "2"))
    grown = cli_args(root, out, "--max_steps", "4", "--save_steps", "2", "--resume_from_checkpoint", "latest")
    grown[grown.index("--dataset") + 1 : grown.index("--dataset") + 2] = [str(root / "data"), str(root / "data")]
    with pytest.raises(SystemExit, match="checkpoint-2 was trained on other inputs .dataset: .* num_rows: "):
        run_main(grown)
    resumed = run_main(cli_args(root, out, "--max_steps", "4", "--save_steps", "2", "--resume_from_checkpoint", "latest"))
    assert resumed.state.global_step == 4


def test_continue_a_baseline_with_carryover_and_the_control(tiny_setup, tmp_path):
    """The paper's recipe: carryover continues the baseline checkpoint (its weights, a fresh optimizer and schedule),
    and the fair control continues it for the same steps without carryover."""
    root, target = tiny_setup
    baseline = tmp_path / "baseline"
    run_main(cli_args(root, baseline, "--max_steps", "3", "--save_strategy", "no"))
    start = mc.CarryoverDrafterModel.from_pretrained(baseline).state_dict()

    # learning rate 0: what the continued run starts from is exactly the checkpoint
    frozen = run_main(cli_args(root, tmp_path / "lr0", "--drafter_checkpoint", str(baseline), "--carryover",
                               "--learning_rate", "0", "--carry_embedding_lr", "0", "--max_steps", "1", "--save_strategy", "no"))
    for name, weight in frozen.model.state_dict().items():
        torch.testing.assert_close(weight, start[name], atol=0, rtol=0, msg=name)

    continued = {}
    for name, extra in (("carryover", ["--carryover"]), ("control", [])):
        trainer = run_main(cli_args(root, tmp_path / name, "--drafter_checkpoint", str(baseline), "--max_steps", "2",
                                    "--save_strategy", "no", "--lr_scheduler_type", "constant", *extra))
        assert trainer.state.global_step == 2  # a new run, not the baseline's step count continued
        assert trainer.optimizer.state_dict()["state"][0]["step"].item() == 2  # a fresh optimizer: 2 steps of Adam
        saved = mc.CarryoverDrafterModel.from_pretrained(tmp_path / name)
        assert saved.config.carryover is (name == "carryover")  # each decodes the way it was trained
        assert json.loads((tmp_path / name / TRAINING_SETTINGS_FILE).read_text())["inputs"]["drafter_checkpoint"] == str(baseline)
        continued[name] = saved.state_dict()
    assert not torch.equal(continued["carryover"]["fc.weight"], continued["control"]["fc.weight"])
    assert torch.equal(continued["control"]["carry_embedding"], start["carry_embedding"])  # untouched without carryover
    assert not torch.equal(continued["carryover"]["carry_embedding"], start["carry_embedding"])


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt  # an interruption right after the checkpoint of this step was written


@pytest.mark.parametrize("carryover", [False, True])
def test_resume_gives_the_same_weights(tiny_setup, tmp_path, carryover):
    root, target = tiny_setup
    from datasets import load_from_disk

    dataset = load_from_disk(str(root / "data"))

    def run(output_dir, stop_at=None, resume=None):
        torch.manual_seed(0)
        drafter = make_drafter(target, block_size=4)
        args = TrainingArguments(
            output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=8, save_steps=3, learning_rate=3e-3,
            report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=100,
        )
        trainer = CarryoverTrainer(
            model=drafter, args=args, train_dataset=dataset, target_model=target,
            carryover_args=CarryoverArguments(num_anchors=8, carryover=carryover),
            callbacks=[StopAt(stop_at)] if stop_at else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return drafter

    straight = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "interrupted", stop_at=5)
    assert (tmp_path / "interrupted" / "checkpoint-3").exists()
    resumed = run(tmp_path / "interrupted", resume=str(tmp_path / "interrupted" / "checkpoint-3"))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    # the interrupted run's checkpoints are complete drafter folders
    assert (tmp_path / "interrupted" / "checkpoint-3" / "custom_generate" / "generate.py").exists()


def torchrun(root, weights_dir, port, *extra, env=None):
    """trainer/run.py in 2 real processes (gloo); tests/scripts/ddp_train.py writes the trained weights."""
    weights_dir.mkdir(exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        "tests/scripts/ddp_train.py", str(weights_dir),
        *cli_args(root, weights_dir / "out", "--max_steps", "4", "--save_strategy", "no", "--carryover", *extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-3000:]
    assert "world 2" in result.stdout
    return result.stdout


def test_torchrun_refuses_to_regenerate_in_every_process(tiny_setup, tmp_path):
    """--prompts under torchrun would have every rank write the same shards: refused before anything is written."""
    root, _ = tiny_setup
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29525",
        "trainer/run.py", "--target", str(root / "target"), "--prompts", "magpie", "--num_prompts", "4",
        "--data_dir", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "--prompts regenerates in one process" in result.stderr
    assert not (tmp_path / "data").exists()


def assert_trained(initial_path, trained):
    """Every weight moved from where training started."""
    initial = torch.load(initial_path)
    assert initial.keys() == trained.keys()
    moved = {name for name in trained if not torch.equal(trained[name], initial[name])}
    assert moved == set(trained), set(trained) - moved


@pytest.mark.parametrize("markov_rank", [0, 8])  # the Markov head's loss runs outside the DDP-wrapped forward
def test_torchrun_two_processes_keep_identical_weights(tiny_setup, tmp_path, markov_rank):
    root, _ = tiny_setup
    torchrun(root, tmp_path, 29517 + markov_rank, "--markov_rank", str(markov_rank))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for name, weight in rank0.items():
        torch.testing.assert_close(weight, rank1[name], atol=0, rtol=0, msg=name)
    assert_trained(tmp_path / "initial.pt", rank0)


def test_fsdp_shards_the_drafter_and_trains_like_ddp(tiny_setup, tmp_path):
    """FSDP2 over 2 real processes shards every drafter weight, trains carryover with the Markov heads (applied
    outside the sharded forward) and a feature-scaled E_carry exactly like DDP, saves a full checkpoint that loads
    with its own remote code and decodes losslessly, and an interrupted run resumes to the same weights.
    (accelerate routes CPU runs to DDP; ddp_train.py lets its FSDP branch run on CPU.)"""
    root, target = tiny_setup
    extra = ("--markov_rank", "8", "--carry_embedding_init", "feature_rms", "--lr_scheduler_type", "constant")
    torchrun(root, tmp_path / "ddp", 29521, *extra)
    fsdp_config = tmp_path / "fsdp.json"
    fsdp_config.write_text('{"version": 2}')
    fsdp = (*extra, "--fsdp", "full_shard", "--fsdp_config", str(fsdp_config))
    env = {"CARRYOVER_TEST_CPU_FSDP": "1"}
    stdout = torchrun(root, tmp_path / "fsdp", 29522, *fsdp, env=env)
    assert "type DistributedType.FSDP sharded True" in stdout
    ddp, fsdp_weights = torch.load(tmp_path / "ddp" / "rank0.pt"), torch.load(tmp_path / "fsdp" / "rank0.pt")
    assert ddp.keys() == fsdp_weights.keys()
    assert_trained(tmp_path / "fsdp" / "initial.pt", fsdp_weights)
    assert not torch.equal(ddp["carry_embedding"], torch.zeros_like(ddp["carry_embedding"]))
    for name in ddp:
        torch.testing.assert_close(fsdp_weights[name], ddp[name], atol=1e-5, rtol=1e-4, msg=name)

    saved = tmp_path / "fsdp" / "out"
    assert sorted(p.name for p in saved.glob("*.py")) == ["configuration_carryover.py", "generation_carryover.py", "modeling_carryover.py"]
    drafter = AutoModel.from_pretrained(saved, trust_remote_code=True).eval()  # the folder's own code
    for name, weight in drafter.state_dict().items():
        torch.testing.assert_close(weight, fsdp_weights[name], msg=name)
    prompt = torch.tensor([[1, 5, 9, 2]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=24), expected)

    # interrupted after 2 of the 4 steps (sharded checkpoint), then resumed
    checkpoints = ("--save_strategy", "steps", "--save_steps", "2")
    torchrun(root, tmp_path / "resumed", 29523, *fsdp, *checkpoints, "--max_steps", "2", env=env)
    torchrun(root, tmp_path / "resumed", 29524, *fsdp, *checkpoints, "--resume_from_checkpoint", "latest", env=env)
    resumed = torch.load(tmp_path / "resumed" / "rank0.pt")
    for name in fsdp_weights:
        torch.testing.assert_close(resumed[name], fsdp_weights[name], atol=0, rtol=0, msg=name)


def test_bad_inputs_fail_before_writing_anything(tiny_setup, tmp_path):
    root, target = tiny_setup
    from datasets import Dataset

    def fails(match, *extra, dataset=None):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        args = cli_args(root, out, "--max_steps", "2", *extra)
        if dataset is not None:
            path = tmp_path / f"data{len(list(tmp_path.iterdir()))}"
            dataset.save_to_disk(str(path))
            args[args.index("--dataset") + 1] = str(path)
        with pytest.raises(ValueError, match=match):
            run_main(args)
        assert not out.exists()

    fails("lacks \\['loss_mask'\\]", dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    fails("two consecutive response tokens", dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 0, 1]]}))
    fails("not a regenerated folder: it has no shards", "--dataset_shards", "1")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out_empty"
    args = cli_args(root, out, "--max_steps", "2")
    args[args.index("--dataset") + 1] = str(empty)
    with pytest.raises(ValueError, match="no rows"):
        run_main(args)
    assert not out.exists()
    other = tmp_path / "other_drafter"
    make_drafter(make_target("llama", num_hidden_layers=2)).save_pretrained(other)
    fails("does not fit the target", "--drafter_checkpoint", str(other))
    fails("out of range", "--target_layer_ids", "0", "7")
    fails("needs a GPU", "--attn_implementation", "flex_attention")


def test_yaml_config_and_a_peft_adapter_on_the_target(tiny_setup, tmp_path):
    """run.py from a YAML file, drafting for a fine-tuned target given as base + PEFT adapter (merged on load)."""
    import yaml
    from peft import LoraConfig, get_peft_model

    root, target = tiny_setup
    base = make_target("llama")
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload()
    config = {
        "target": str(root / "target"), "target_adapter": str(tmp_path / "adapter"), "dataset": str(root / "data"),
        "output_dir": str(tmp_path / "out"), "num_draft_layers": 2, "block_size": 4, "num_anchors": 16,
        "per_device_train_batch_size": 4, "max_steps": 2, "save_strategy": "no", "report_to": "none", "use_cpu": True,
        "disable_tqdm": True,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    trainer = run_main([str(tmp_path / "run.yaml")])
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "model.safetensors").exists()
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        used, expected, plain = (m(ids).logits for m in (trainer.target_model, merged, target))
    torch.testing.assert_close(used, expected)  # the trainer's target is base + adapter...
    assert not torch.allclose(used, plain)  # ...not the base model


@pytest.mark.parametrize(
    "module, argv",
    [("trainer.run", []), ("trainer.regenerate", []), ("trainer.features", []), ("trainer.bench_training", []),
     ("evaluation.run", []), ("evaluation.analyze", ["recall"]), ("evaluation.bench_decoding", []),
     ("evaluation.heldout", []), ("hub.publish", []), ("serving.vllm_plugin", [])],
)
def test_every_cli_takes_a_thread_setting(module, argv, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0 and "--threads" in capsys.readouterr().out


def test_thread_setting_is_applied_and_checked():
    from carryover_common.cli import parse_arguments
    from trainer.run import ARGUMENT_CLASSES

    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="--threads must be at least 1, got 0"):
            parse_arguments(ARGUMENT_CLASSES, ["--output_dir", "x", "--threads", "0"])
        assert torch.get_num_threads() == before
        parsed = parse_arguments(ARGUMENT_CLASSES, ["--output_dir", "x", "--threads", "1"])
        assert len(parsed) == len(ARGUMENT_CLASSES) and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_recipe_file_with_overriding_flags(tmp_path):
    """A YAML recipe then flags: the flags win, lists and booleans parse, null keeps the default, unknown keys fail."""
    import yaml

    from carryover_common.cli import parse_arguments
    from trainer.run import ARGUMENT_CLASSES

    recipe = {"output_dir": "from-recipe", "target_layer_ids": [1, 8, 15], "block_size": 4, "carryover": True,
              "learning_rate": 3e-4, "draft_vocab_size": None, "chat_template_kwargs": '{"enable_thinking": false}',
              "carry_rows": False}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    before = torch.get_num_threads()
    try:
        _, drafter, _, regeneration, carryover, ablation, training = parse_arguments(
            ARGUMENT_CLASSES, [str(tmp_path / "recipe.yaml"), "--block_size", "8", "--output_dir", "from-flag"]
        )
    finally:
        torch.set_num_threads(before)
    assert drafter.target_layer_ids == [1, 8, 15] and drafter.block_size == 8 and drafter.draft_vocab_size is None
    assert carryover.carryover is True and training.learning_rate == 3e-4 and training.output_dir == "from-flag"
    assert ablation.carry_rows is False  # an ablation flag parses into its own group
    assert json.loads(regeneration.chat_template_kwargs) == {"enable_thinking": False}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"output_dir": "x", "blok_size": 4}))
    with pytest.raises(ValueError, match="blok_size"):
        parse_arguments(ARGUMENT_CLASSES, [str(tmp_path / "bad.yaml")])
