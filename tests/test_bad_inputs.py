"""Bad inputs get a clear error before any work, and nothing a user made is lost: the output rule
(carryover_common.outputs), argument checks (__post_init__), data checks and checkpoint checks. The whole catalogue of
bad inputs through every CLI is `python tests/bad_input_catalogue.py` (minutes); these are its fast unit checks."""

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from conftest import make_drafter, make_target
from datasets import Dataset
from transformers import TrainingArguments

from carryover_common.benchmarks import read_subset
from carryover_common.checkpoints import check_drafter_folder, check_model_folder
from carryover_common.cli import check_exists
from carryover_common.outputs import check_output_dir, move_into, staged_folder
from evaluation.run import EvalArguments, check_num_assistant_tokens
from hub.convert import ConvertArguments
from trainer.build import DrafterArguments, check_token_ids, prepare_rows
from trainer.data import MANIFEST, load_rows
from trainer.features import FeatureArguments
from trainer.regenerate import RegenerationArguments, check_data_dir
from trainer.run import DataArguments, check_training_arguments


def fingerprint(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad") / "drafter"
    make_drafter(make_target(), draft_vocab_size=32).save_pretrained(folder)
    return folder


def rows(**change):
    row = {"input_ids": list(range(5, 25)), "loss_mask": [0] * 5 + [1] * 15}
    return Dataset.from_list([row, {**row, **change}])


# ------------------------------------------------------------------------------------------------------------------
# Outputs: never overwrite a user's files; results moved into place only when complete
# ------------------------------------------------------------------------------------------------------------------


def test_a_non_empty_output_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("the user's")
    with pytest.raises(ValueError, match=r"already holds files .*model.safetensors.*pass --overwrite_output_dir true"):
        check_output_dir(tmp_path / "out")
    check_output_dir(tmp_path / "out", resumable=True)
    check_output_dir(tmp_path / "out", overwrite=True)
    check_output_dir(tmp_path / "new")  # a new folder, or an empty one
    check_output_dir(tmp_path / "out", files={"recall.json"})  # a shared folder: only the files it writes count
    with pytest.raises(ValueError, match="choose a new --data_dir"):
        check_output_dir(tmp_path / "out", flag=None, name="--data_dir")


def test_an_output_inside_or_equal_to_an_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is the input"):
        check_output_dir(tmp_path / "in", inputs=[tmp_path / "in"], overwrite=True)
    with pytest.raises(ValueError, match="lies inside the input"):
        check_output_dir(tmp_path / "in" / "out", inputs=[None, tmp_path / "in"], overwrite=True)


def test_a_failed_run_leaves_the_previous_results_whole(tmp_path):
    out = tmp_path / "out"
    (out / "b" / "T1").mkdir(parents=True)
    (out / "report.json").write_text("old")
    (out / "b" / "T1" / "acceptance.csv").write_text("T1")
    with pytest.raises(RuntimeError):
        with staged_folder(out) as staging:
            (staging / "report.json").write_text("half")
            raise RuntimeError("interrupted")
    assert (out / "report.json").read_text() == "old" and len(list(tmp_path.iterdir())) == 1  # no staging left
    with staged_folder(out) as staging:
        (staging / "b" / "T0").mkdir(parents=True)
        (staging / "b" / "T0" / "acceptance.csv").write_text("T0")
        (staging / "report.json").write_text("new")
    assert (out / "report.json").read_text() == "new"
    assert (out / "b" / "T1" / "acceptance.csv").read_text() == "T1"  # merged, not replaced
    with staged_folder(out, replace=True) as staging:
        (staging / "README.md").write_text("card")
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]


def test_move_into_replaces_files_of_the_same_name(tmp_path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "config.json").write_text("new")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("old")
    move_into(tmp_path / "stage", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == "new" and not (tmp_path / "stage").exists()


def test_regenerate_refuses_a_folder_of_other_files_and_resumes_its_own(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--data_dir .*mine already holds files"):
        check_data_dir(RegenerationArguments(prompts=["magpie"], num_prompts=[4], data_dir=str(tmp_path / "mine")))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MANIFEST).write_text("{}")
    check_data_dir(RegenerationArguments(prompts=["magpie"], num_prompts=[4], data_dir=str(tmp_path / "run")))


def test_convert_refuses_to_write_into_its_source(drafter_dir, tmp_path):
    before = fingerprint(drafter_dir)
    with pytest.raises(ValueError, match="is the input"):
        ConvertArguments(source=str(drafter_dir), output_dir=str(drafter_dir), to="dflash")
    with pytest.raises(ValueError, match="overwrite_output_dir"):
        ConvertArguments(source=str(drafter_dir), output_dir=str(drafter_dir.parent), to="dflash")
    assert fingerprint(drafter_dir) == before


def test_evaluation_refuses_an_earlier_run_folder_without_resume(drafter_dir, tmp_path, monkeypatch):
    from evaluation import run

    (tmp_path / "eval").mkdir()
    with gzip.open(tmp_path / "eval" / "records.jsonl.gz", "wt") as file:
        file.write('{"target": "t"}\n')
    before = fingerprint(tmp_path / "eval")
    monkeypatch.setattr(run, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "bench").mkdir()
    argv = ["--drafters", f"b={drafter_dir}", "--output_dir", str(tmp_path / "eval"), "--benchmark", str(tmp_path / "bench")]
    with pytest.raises(ValueError, match=r"--resume true .* or --overwrite_output_dir true"):
        run.main(argv)
    assert fingerprint(tmp_path / "eval") == before


# ------------------------------------------------------------------------------------------------------------------
# Arguments: checked in __post_init__, before any model is loaded
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: EvalArguments(drafters=[f"b={d}"], temperatures=[-1.0]), "--temperatures must be at least 0"),
        (lambda d: EvalArguments(drafters=[f"b={d}"], num_assistant_tokens=0), "--num_assistant_tokens must be at least 1"),
        (lambda d: EvalArguments(drafters=[f"b={d}"], draft_confidence_threshold=1.5), "between 0.0 and 1.0"),
        (lambda d: EvalArguments(drafters=[f"b={d}/missing"]), "no such file or folder"),
        (lambda d: EvalArguments(drafters=[f"b={d}"], resume=True, overwrite_output_dir=True), "give one"),
        (lambda d: RegenerationArguments(prompts=["magpie"], num_prompts=[0]), "--num_prompts must be at least 1"),
        (lambda d: RegenerationArguments(prompts=["magpie"], do_sample=True, temperature=0), "--temperature must be above 0"),
        (lambda d: RegenerationArguments(prompts=["magpie"], chat_template_kwargs="{bad"), "--chat_template_kwargs must be a JSON"),
        (lambda d: RegenerationArguments(prompts=[f"{d}/prompts.jsonl"]), "no such file"),
        (lambda d: DataArguments(dataset=["./no_such_rows"]), "--dataset ./no_such_rows: no such file or folder"),
        (lambda d: DataArguments(dataset=[str(d)], max_seq_length=0), "--max_seq_length must be at least 2"),
        (lambda d: DrafterArguments(block_size=1), "--block_size must be at least 2"),
        (lambda d: DrafterArguments(drafter_checkpoint="./no_such_checkpoint"), "no such file or folder"),
        (lambda d: FeatureArguments(dataset=[str(d)], output_dir="x", shard_size=0), "--shard_size must be at least 1"),
        (lambda d: ConvertArguments(source=str(d), output_dir="x", to="speculators"), "needs --verifier"),
    ],
)
def test_bad_arguments_are_refused_when_parsed(drafter_dir, make, message):
    with pytest.raises(ValueError, match=message):
        make(drafter_dir)


def test_a_hub_id_shaped_value_is_left_to_the_loader_but_a_missing_path_is_not():
    check_exists("target", "Qwen/Qwen3-8B", hub=True)
    for missing in ("./nope", "/nope/x", "a/b/c", "nope.jsonl"):
        with pytest.raises(ValueError, match="no such file or folder"):
            check_exists("target", missing, hub=True)


def test_training_steps_that_the_trainer_would_take_without_a_word():
    with pytest.raises(ValueError, match="--max_steps must be at least 1"):
        check_training_arguments(TrainingArguments(output_dir="x", max_steps=0))
    with pytest.raises(ValueError, match="--num_train_epochs must be above 0"):
        check_training_arguments(TrainingArguments(output_dir="x", num_train_epochs=0))
    check_training_arguments(TrainingArguments(output_dir="x", max_steps=3))


def test_num_assistant_tokens_beyond_the_block_is_refused_not_capped():
    drafter = make_drafter(make_target(), block_size=4)
    with pytest.raises(ValueError, match="proposes at most 3 drafts a round"):
        check_num_assistant_tokens(100, {"b": (drafter, False)})
    check_num_assistant_tokens(3, {"b": (drafter, False)})


# ------------------------------------------------------------------------------------------------------------------
# Data: checked when it is read
# ------------------------------------------------------------------------------------------------------------------


def test_a_loss_mask_of_other_values_than_0_and_1_is_refused():
    with pytest.raises(ValueError, match=r"loss_mask holds \[-1, 5\]"):
        prepare_rows(rows(loss_mask=[5, -1] + [0] * 3 + [1] * 15), max_seq_length=64)


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"token id 500, outside the target's vocabulary \[0, 96\)"):
        check_token_ids(rows(input_ids=list(range(5, 24)) + [500]), vocab_size=96)
    check_token_ids(rows(), vocab_size=96)


def test_a_malformed_jsonl_line_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": b}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl: line 3 is not valid JSON"):
        load_rows(path)
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"rows.jsonl: line 1 is not UTF-8 text"):
        load_rows(path)


def test_a_malformed_benchmark_line_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "alpha.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": b}\n')
    with pytest.raises(ValueError, match=r"alpha.jsonl, line 3: not valid JSON"):
        read_subset(path)
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"alpha.jsonl is not UTF-8 text"):
        read_subset(path)


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints: one message that names the file and what to do
# ------------------------------------------------------------------------------------------------------------------


def copy_of(folder: Path, destination: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, destination))


def test_a_truncated_weights_file_is_named(drafter_dir, tmp_path):
    folder = copy_of(drafter_dir, tmp_path / "cut")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cut/model.safetensors is not a readable safetensors file .*Copy"):
        check_drafter_folder(folder)
    with pytest.raises(ValueError, match=r"cut/model.safetensors is not a readable safetensors file"):
        check_model_folder(folder)


def test_a_folder_that_is_not_a_drafter_is_named(tmp_path):
    make_target().save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match=r"is not a Carryover drafter \(its config.json has model_type 'llama'\)"):
        check_drafter_folder(tmp_path / "target")
    with pytest.raises(ValueError, match="has no config.json"):
        check_drafter_folder(tmp_path)


def test_a_config_that_disagrees_with_its_weights_is_named(drafter_dir, tmp_path):
    folder = copy_of(drafter_dir, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 40}))
    with pytest.raises(ValueError, match=r"config.json disagrees with the weights .*draft_token_ids \(32,\) \(config.s draft_vocab_size: \(40,\)\)"):
        check_drafter_folder(folder)
    check_drafter_folder(drafter_dir)


def test_an_interrupted_final_save_leaves_the_previous_drafter_whole(drafter_dir, tmp_path):
    """trainer/run.py saves the final drafter beside the old one and moves it into place once complete."""
    from trainer.run import save_final_model

    class Trainer:  # what save_final_model calls of the CarryoverTrainer
        def __init__(self, fail):
            self.fail = fail

        def save_model(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model.safetensors").write_text("new weights")
            if self.fail:
                raise KeyboardInterrupt  # stopped half-way through the save

        def is_world_process_zero(self):
            return True

    out = copy_of(drafter_dir, tmp_path / "out")
    before = fingerprint(out)
    with pytest.raises(KeyboardInterrupt):
        save_final_model(Trainer(fail=True), str(out))
    assert {k: v for k, v in fingerprint(out).items() if not k.startswith(".final.partial")} == before
    save_final_model(Trainer(fail=False), str(out))
    assert (out / "model.safetensors").read_text() == "new weights" and not (out / ".final.partial").exists()
    assert (out / "config.json").is_file()
