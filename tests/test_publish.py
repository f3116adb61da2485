"""Publishing (hub/publish.py, hub/model_card.py): the repo folder, its model card, a fresh-process load and decode,
the card's usage snippet, and the upload against a real HTTP fake of the Hub on 127.0.0.1."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from conftest import REPO_ROOT, make_drafter, make_target
from fake_hub import FakeHub
from hub.model_card import render_model_card
from hub.publish import BLOCK_PROJECT_IMPORTS, check_in_fresh_process
from modeling_carryover import CarryoverDrafterModel

REPO_ID, BASE_MODEL = "me/tiny-carryover", "HuggingFaceTB/SmolLM2-135M-Instruct"
TRAINING = {"target": BASE_MODEL, "learning_rate": 0.0006, "block_size": 4, "carryover": True, "datasets": ["a|b"]}


def result(drafter, subset, temperature, acceptance_length, speedup=None, tokens_per_second=None):
    return dict(drafter=drafter, subset=subset, temperature=temperature, acceptance_length=acceptance_length,
                speedup=speedup, tokens_per_second=tokens_per_second)


REPORT = {
    "results": [
        result("dflash", "humaneval", 0.0, 3.1, speedup=2.0, tokens_per_second=50.0),
        result("carryover", "humaneval", 0.0, 3.4, speedup=2.2, tokens_per_second=55.0),
        result("dflash", "math_reasoning", 0.0, 2.9),
        result("carryover", "humaneval", 1.0, 2.5),
        {"drafter": "plain", "subset": "humaneval", "temperature": 0.0, "speedup": 1.0},  # the reference: no tau
    ],
    "provenance": {"git_commit": "abc123", "max_new_tokens": 1024},
}
EXPECTED_FILES = {
    "README.md",
    "config.json",
    "model.safetensors",
    "configuration_carryover.py",
    "modeling_carryover.py",
    "generation_carryover.py",
    "custom_generate/generate.py",
    "carryover_training.json",
    "eval_report.json",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("publish")


@pytest.fixture(scope="module")
def target_dir(workdir):
    """A tiny Llama target saved with a word-level tokenizer and a chat template: what the usage snippet needs."""
    folder = workdir / "target"
    target = make_target("llama")
    target.save_pretrained(folder)
    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, target.config.vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", chat_template=chat_template)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint_dir(workdir):
    """A trainer-style checkpoint: the drafter (with a Markov head) and its carryover_training.json."""
    folder = workdir / "checkpoint"
    make_drafter(make_target("llama"), markov_rank=4).save_pretrained(folder)
    (folder / "carryover_training.json").write_text(json.dumps(TRAINING))
    (workdir / "report.json").write_text(json.dumps(REPORT))
    return folder


def clean_env(hf_home: Path, **extra) -> dict:
    """No real token, endpoint or cached login leaks in from the machine running the tests; no telemetry requests."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    defaults = {"OMP_NUM_THREADS": "1", "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return env | defaults | extra


def run_publish(workdir, output_dir, *args, **env):
    command = [
        sys.executable, "hub/publish.py",
        "--checkpoint", str(workdir / "checkpoint"),
        "--repo_id", REPO_ID,
        "--base_model", BASE_MODEL,
        "--eval_report", str(workdir / "report.json"),
        "--output_dir", str(output_dir),
        *args,
    ]
    env = clean_env(workdir / "hf_home", **env)
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


def files_in(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


# ----------------------------------------------------------------------------------------------------------------
# The model card
# ----------------------------------------------------------------------------------------------------------------


def test_model_card_metadata_and_tables():
    drafter_config = make_drafter(make_target("llama"), markov_rank=4).config.to_dict()
    card = ModelCard(str(render_model_card(REPO_ID, BASE_MODEL, drafter_config, TRAINING, REPORT)))
    metadata = card.data.to_dict()
    assert metadata["base_model"] == BASE_MODEL and metadata["library_name"] == "transformers"
    assert metadata["license"] == "apache-2.0"
    assert {"speculative-decoding", "dflash", "carryover", "dspark"} <= set(metadata["tags"])
    text = card.text
    # one table per temperature: subsets as rows, drafters as columns, "-" where a pair was not measured
    assert (
        "### T = 0\n\n| subset | dflash | carryover |\n| --- | --- | --- |\n"
        "| humaneval | 3.10 (2.00x) | 3.40 (2.20x) |\n| math_reasoning | 2.90 | - |"
    ) in text
    assert (
        "### T = 1\n\n| subset | dflash | carryover |\n| --- | --- | --- |\n"
        "| humaneval | - | 2.50 |\n| math_reasoning | - | - |"
    ) in text
    assert '<summary>Provenance</summary>\n\n```json\n{\n  "git_commit": "abc123",' in text
    assert "| `learning_rate` | `0.0006` |" in text and '| `datasets` | `["a\\|b"]` |' in text
    assert "| `block_size` | `4` |" in text and "| `markov_rank` | `4` |" in text
    assert f'drafter_id = "{REPO_ID}"' in text and "custom_generate=drafter_id," in text


def test_model_card_without_training_record_and_with_a_branch():
    config = {"block_size": 16, "markov_rank": 0}
    text = render_model_card(REPO_ID, BASE_MODEL, config, revision="v2").text
    assert "No training record (`carryover_training.json`)" in text and "## Evaluation" not in text
    assert f'drafter_id = snapshot_download("{REPO_ID}", revision="v2")' in text  # custom_generate= takes no revision


@pytest.mark.parametrize(
    "report, message",
    [
        ({"results": []}, 'no "results" list'),
        ({"results": [{"drafter": "a", "subset": "s", "acceptance_length": 2.0}]}, r"result 0 lacks \['temperature'\]"),
        ({"results": [REPORT["results"][0], REPORT["results"][0]]}, "two results for 'dflash' on 'humaneval' at T=0"),
    ],
)
def test_malformed_reports_are_named(report, message):
    with pytest.raises(ValueError, match=message):
        render_model_card(REPO_ID, BASE_MODEL, {"block_size": 4}, report=report)


# ----------------------------------------------------------------------------------------------------------------
# Dry run: the folder, validated in a fresh process; the usage snippet as written
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(workdir, checkpoint_dir, target_dir):
    done = run_publish(workdir, workdir / "dry", "--dry_run", "--target", str(target_dir))
    assert done.returncode == 0, done.stderr
    return workdir / "dry", done.stdout


def test_dry_run_builds_and_validates_the_folder(dry_run):
    folder, stdout = dry_run
    assert set(files_in(folder)) == EXPECTED_FILES
    assert "ok: fresh process without this project: loaded as transformers_modules." in stdout
    assert "identical to the target's greedy output" in stdout and "nothing was uploaded" in stdout
    assert json.loads((folder / "carryover_training.json").read_text()) == TRAINING
    assert json.loads((folder / "eval_report.json").read_text()) == REPORT
    assert ModelCard.load(folder / "README.md").data.base_model == BASE_MODEL
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_carryover.CarryoverDrafterModel"


def test_dry_run_saves_bf16_weights_that_decode_losslessly(workdir, checkpoint_dir, target_dir):
    """--dtype bfloat16 (the shipped drafters): half the float32 weights, and the fresh-process lossless check passes."""
    done = run_publish(workdir, workdir / "dry-bf16", "--dry_run", "--dtype", "bfloat16", "--target", str(target_dir))
    assert done.returncode == 0, done.stderr
    assert "identical to the target's greedy output" in done.stdout
    with safe_open(workdir / "dry-bf16" / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"BF16"}


def test_project_imports_are_blocked_in_the_fresh_process():
    code = BLOCK_PROJECT_IMPORTS + "import modeling_carryover"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ImportError: modeling_carryover is not importable here" in done.stderr


def test_fresh_process_check_catches_a_folder_that_needs_the_project(dry_run, target_dir, tmp_path):
    """Without generation_carryover.py the model file only imports where this project is installed."""
    broken = shutil.copytree(dry_run[0], tmp_path / "broken")
    (broken / "generation_carryover.py").unlink()
    with pytest.raises(ValueError, match="failed to load or decode in a fresh process"):
        check_in_fresh_process(broken, str(target_dir))


def test_usage_snippet_runs_as_written(dry_run, target_dir, workdir):
    """The card's snippet, with the local folder and the local target in place of the two repo ids, in a process
    where this project cannot be imported."""
    folder, _ = dry_run
    snippet = ModelCard.load(folder / "README.md").text.split("```python\n")[1].split("\n```")[0]
    assert f'"{REPO_ID}"' in snippet and f'"{BASE_MODEL}"' in snippet
    snippet = snippet.replace(f'"{REPO_ID}"', json.dumps(str(folder)))
    snippet = snippet.replace(f'"{BASE_MODEL}"', json.dumps(str(target_dir)))
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_PROJECT_IMPORTS + snippet],
        cwd=workdir,
        env=clean_env(workdir / "hf_home"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "tokens per round: " in done.stdout


# ----------------------------------------------------------------------------------------------------------------
# Upload to a fake Hub on 127.0.0.1
# ----------------------------------------------------------------------------------------------------------------


def test_upload_creates_repo_and_branch_and_commits_the_folder_once(workdir, checkpoint_dir):
    with FakeHub() as hub:
        done = run_publish(
            workdir, workdir / "upload", "--revision", "dev", "--private", "--commit_message", "Add the tiny drafter",
            HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_fake_token", HF_HUB_OFFLINE="0",
        )
    assert done.returncode == 0, done.stderr
    assert hub.repos[REPO_ID]["private"] is True and set(hub.repos[REPO_ID]["branches"]) == {"main", "dev"}
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    assert (commit.repo_id, commit.revision, commit.summary) == (REPO_ID, "dev", "Add the tiny drafter")
    assert commit.files == files_in(workdir / "upload") and set(commit.files) == EXPECTED_FILES
    assert [path.split("/")[-2] if "/models/" in path else path for _, path, _ in hub.requests] == [
        "/api/repos/create", "branch", "/api/validate-yaml", "preupload", "commit"
    ]
    assert all(authorization == "Bearer hf_fake_token" for _, _, authorization in hub.requests)
    assert f"Uploaded {workdir / 'upload'} to {REPO_ID} (dev)" in done.stdout


def closed_port_endpoint() -> str:
    with socket.socket() as sock:  # bind, then close: nothing listens there afterwards
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "failure, cause",
    [
        ({"create_repo": 500}, "500 Internal Server Error"),
        ({"commit": 403}, "403 Forbidden"),  # not 500 here: huggingface_hub retries a 5xx commit for ~23 s
        (None, "ConnectError: [Errno 111] Connection refused"),  # nothing listens on the port
    ],
)
def test_failed_upload_keeps_the_folder_and_exits_nonzero(workdir, checkpoint_dir, failure, cause):
    output_dir = workdir / f"failed-{next(iter(failure)) if failure else 'refused'}"
    with FakeHub(fail=failure) as hub:
        endpoint = hub.endpoint if failure else closed_port_endpoint()
        done = run_publish(workdir, output_dir, HF_ENDPOINT=endpoint, HF_TOKEN="hf_fake_token", HF_HUB_OFFLINE="0")
    assert done.returncode == 1
    assert f"publish: Uploading {output_dir} to {REPO_ID} failed:" in done.stderr and cause in done.stderr
    assert f"The local folder {output_dir} is intact" in done.stderr
    assert hub.commits == []
    assert set(files_in(output_dir)) == EXPECTED_FILES
    CarryoverDrafterModel.from_pretrained(output_dir)  # still loads


# argv: repo id, target folder, number of tokens. The README's two calls with a Hub repo id; prints one JSON line.
FROM_THE_HUB = BLOCK_PROJECT_IMPORTS + '''
import json

import torch
from transformers import AutoModel, AutoModelForCausalLM

repo_id, target_path, num_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
drafter = AutoModel.from_pretrained(repo_id, trust_remote_code=True)
input_ids = torch.arange(1, 9)[None] % target.config.vocab_size
inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
expected = target.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
out = target.generate(**inputs, assistant_model=drafter, custom_generate=repo_id, trust_remote_code=True,
                      max_new_tokens=num_tokens, do_sample=False)
print(json.dumps({"lossless": torch.equal(expected, out), "new_tokens": out.shape[1] - input_ids.shape[1],
                  "drafter_module": type(drafter).__module__, "rounds": drafter.generation_stats.num_rounds}))
'''


def test_published_repo_loads_and_decodes_from_the_hub(workdir, checkpoint_dir, target_dir, tmp_path):
    """After `publish`, a fresh process with an empty cache, where this project cannot be imported, downloads the
    drafter and its custom_generate/ from the (fake) Hub and decodes exactly the target's greedy tokens."""
    with FakeHub(max_requests=100) as hub:
        done = run_publish(
            workdir, workdir / "published", HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_fake_token", HF_HUB_OFFLINE="0"
        )
        assert done.returncode == 0, done.stderr
        uploads = len(hub.requests)
        env = clean_env(
            tmp_path / "hf_home", HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(tmp_path / "hub"),
            HF_MODULES_CACHE=str(tmp_path / "modules"),
        )
        loaded = subprocess.run(
            [sys.executable, "-c", FROM_THE_HUB, REPO_ID, str(target_dir), "12"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result["lossless"] and result["new_tokens"] == 12 and result["rounds"] > 0
    assert result["drafter_module"].startswith("transformers_modules.me.tiny_hyphen_carryover.")
    # the fresh process only read, pinned to the commit just made, and got the committed bytes (its cache was empty)
    assert {method for method, _, _ in hub.requests[uploads:]} <= {"HEAD", "GET"}
    head = hub.repos[REPO_ID]["branches"]["main"]
    assert f"/{REPO_ID}/resolve/{head}/model.safetensors" in {path for _, path, _ in hub.requests[uploads:]}
    snapshot = tmp_path / "hub" / "models--me--tiny-carryover" / "snapshots" / head
    downloaded = files_in(snapshot)
    assert {"config.json", "model.safetensors", "modeling_carryover.py", "custom_generate/generate.py"} <= set(
        downloaded
    )
    assert downloaded.items() <= hub.commits[0].files.items()


SAVE_AND_PUSH = """
import sys
from modeling_carryover import CarryoverDrafterModel
drafter = CarryoverDrafterModel.from_pretrained(sys.argv[1])
drafter.save_pretrained(sys.argv[2], push_to_hub=True, repo_id="me/pushed", commit_message="push from save")
"""


def test_save_pretrained_with_push_to_hub_uploads_the_custom_generate_folder(workdir, checkpoint_dir, tmp_path):
    """`drafter.save_pretrained(folder, push_to_hub=True)` uploads the folder as saved, custom_generate/ included
    (transformers' own upload happens before the drafter's save_pretrained writes it)."""
    with FakeHub(max_requests=50) as hub:
        env = clean_env(tmp_path / "hf_home", HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_fake_token", HF_HUB_OFFLINE="0")
        done = subprocess.run(
            [sys.executable, "-c", SAVE_AND_PUSH, str(checkpoint_dir), str(tmp_path / "saved")],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (commit,) = hub.commits
    assert (commit.repo_id, commit.summary) == ("me/pushed", "push from save")
    saved = files_in(tmp_path / "saved")
    assert "custom_generate/generate.py" in saved and saved.items() <= commit.files.items()
