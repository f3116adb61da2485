"""Publish a drafter checkpoint to the Hugging Face Hub.

    python hub/publish.py --checkpoint runs/carryover --repo_id me/qwen3-8b-carryover --base_model Qwen/Qwen3-8B \
        --eval_report runs/eval/report.json --target Qwen/Qwen3-8B --dry_run

Builds the repo folder (safetensors weights, config.json with auto_map, the model code, custom_generate/, a model card
README.md, the training arguments and the evaluation report), validates it (config and weights load, the card parses,
and with --target: the folder loads with trust_remote_code in a fresh process where this project cannot be imported
and decodes losslessly), then, unless --dry_run, creates the repo (and branch) and uploads the folder as one commit.
The token comes from --token, else HF_TOKEN, else the cached `hf auth login`.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import HfApi, ModelCard, get_token

from carryover_common.checkpoints import check_any_drafter_folder
from carryover_common.cli import check_exists, parse_arguments
from carryover_common.outputs import check_output_dir, staged_folder
from carryover_common.targets import resolve_target_path
from hub.convert import import_drafter
from hub.model_card import render_model_card
from modeling_carryover import CarryoverDrafterModel
from trainer.carryover_trainer import TRAINING_SETTINGS_FILE as TRAINING_ARGUMENTS_FILE

EVAL_REPORT_FILE = "eval_report.json"
CHECK_TOKENS = 8

# Prepended to code that must run as a user without this project would: importing it raises.
BLOCK_PROJECT_IMPORTS = '''
import importlib.abc
import sys


class BlockProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"modeling_carryover", "trainer", "hub", "evaluation"}:
            raise ImportError(f"{name} is not importable here: the drafter folder must work without this project")
        return None


sys.meta_path.insert(0, BlockProject())
'''

# argv: folder, target, number of tokens. Prints one JSON line.
FRESH_PROCESS_CHECK = BLOCK_PROJECT_IMPORTS + '''
import json

import torch
from transformers import AutoModel, AutoModelForCausalLM

folder, target_path, num_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
drafter = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
input_ids = torch.arange(1, 9)[None] % target.config.vocab_size
inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
expected = target.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
decoded = target.generate(
    **inputs, assistant_model=drafter, custom_generate=folder, trust_remote_code=True, max_new_tokens=num_tokens,
    do_sample=False,
)
print(json.dumps({"lossless": torch.equal(expected, decoded), "drafter_module": type(drafter).__module__,
                  "new_tokens": decoded.shape[1] - input_ids.shape[1], "rounds": drafter.generation_stats.num_rounds}))
'''


class PublishError(RuntimeError):
    pass


@dataclass
class PublishArguments:
    checkpoint: str = field(metadata={"help": "Drafter checkpoint folder (ours, or any format hub/convert.py reads)."})
    repo_id: str = field(metadata={"help": "Hub repo to publish to, e.g. me/qwen3-8b-carryover."})
    base_model: str = field(metadata={"help": "Hub id of the target model (card metadata and usage snippet)."})
    output_dir: str | None = field(default=None, metadata={"help": "Repo folder to build; None means <checkpoint>-hub."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})
    target: str | None = field(
        default=None, metadata={"help": "Target to load (path or Hub id) to check a fresh-process lossless decode."}
    )
    eval_report: str | None = field(default=None, metadata={"help": "Evaluation report.json to tabulate in the card."})
    license: str = field(default="apache-2.0", metadata={"help": "License id for the card metadata."})
    dtype: str | None = field(
        default=None,
        metadata={"help": "Save the weights in this dtype (bfloat16: half a float32 checkpoint) [as stored].",
                  "choices": ["float32", "bfloat16", "float16"]},
    )
    revision: str | None = field(default=None, metadata={"help": "Branch to commit to, created if needed."})
    private: bool = field(default=False, metadata={"help": "Create the repo as private."})
    token: str | None = field(default=None, metadata={"help": "Hub token; None means HF_TOKEN, else the cached login."})
    commit_message: str | None = field(default=None, metadata={"help": "Commit message."})
    dry_run: bool = field(default=False, metadata={"help": "Build and validate the folder, upload nothing."})

    def __post_init__(self):
        check_exists("checkpoint", self.checkpoint)
        check_any_drafter_folder(self.checkpoint)
        check_exists("eval_report", self.eval_report)
        check_exists("target", self.target, hub=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from error


def build_repo_folder(args: PublishArguments) -> Path:
    """The repo folder: the drafter re-saved (weights, config with auto_map, code, custom_generate/), its training
    arguments and evaluation report when given, and the model card."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise ValueError(f"--checkpoint {checkpoint} is not a folder.")
    folder = Path(args.output_dir) if args.output_dir else checkpoint.with_name(checkpoint.name + "-hub")
    check_output_dir(folder, inputs=[checkpoint, args.eval_report], overwrite=args.overwrite_output_dir)

    # Everything that can fail on bad inputs happens before the folder is touched.
    drafter = import_drafter(str(checkpoint))
    training_file = checkpoint / TRAINING_ARGUMENTS_FILE
    training_arguments = read_json(training_file) if training_file.is_file() else None
    report = read_json(Path(args.eval_report)) if args.eval_report else None
    card = render_model_card(
        args.repo_id, args.base_model, drafter.config.to_dict(), training_arguments, report, args.license, args.revision
    )

    if args.dtype:
        drafter = drafter.to(getattr(torch, args.dtype))  # floating weights only: the draft token map stays int64
    with staged_folder(folder, replace=True) as staging:  # the repo folder is exactly this build, once it is complete
        drafter.save_pretrained(staging)
        card.save(staging / "README.md")
        if training_arguments is not None:
            shutil.copyfile(training_file, staging / TRAINING_ARGUMENTS_FILE)
        if report is not None:
            shutil.copyfile(args.eval_report, staging / EVAL_REPORT_FILE)
    return folder


def validate_repo_folder(folder: Path, target: str | None = None) -> list[str]:
    """Raise a ValueError naming the first problem; return what was checked."""
    config = read_json(folder / "config.json")
    auto_map = config.get("auto_map", {})
    code_files = [f"{reference.split('.')[0]}.py" for reference in auto_map.values()] + ["custom_generate/generate.py"]
    missing = [name for name in code_files if not (folder / name).is_file()]
    if not {"AutoConfig", "AutoModel"} <= set(auto_map) or missing:
        raise ValueError(f"{folder} cannot load on its own: auto_map {auto_map}, missing files {missing}.")
    checked = [f"config.json with auto_map; code files {code_files}"]

    _, info = CarryoverDrafterModel.from_pretrained(folder, output_loading_info=True)
    problems = {key: info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(key)}
    if problems:
        raise ValueError(f"The weights in {folder} do not load cleanly: {problems}.")
    checked.append("weights load with no missing, unexpected or mismatched tensors")

    metadata = ModelCard.load(folder / "README.md").data.to_dict()
    if metadata.get("library_name") != "transformers" or not metadata.get("base_model"):
        raise ValueError(f"The model card metadata lacks library_name: transformers or base_model: {metadata}.")
    checked.append(f"model card parses (base_model {metadata['base_model']})")

    if target:
        result = check_in_fresh_process(folder, target)
        checked.append(
            f"fresh process without this project: loaded as {result['drafter_module']}, decoded {result['new_tokens']} "
            f"tokens in {result['rounds']} rounds, identical to the target's greedy output"
        )
    return checked


def check_in_fresh_process(folder: Path, target: str) -> dict:
    """Load the folder with trust_remote_code in a new interpreter where this project is unimportable, and decode
    `CHECK_TOKENS` tokens with the drafter against the target's own greedy decoding."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_CHECK, str(folder.resolve()), resolve_target_path(target), str(CHECK_TOKENS)],
        cwd=tempfile.gettempdir(),  # `python -c` puts the working directory first on sys.path: keep it neutral
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},  # the --threads setting
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise ValueError(f"{folder} failed to load or decode in a fresh process:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["drafter_module"].startswith("transformers_modules"):
        raise ValueError(f"The drafter loaded from {result['drafter_module']}, not from the folder's remote code.")
    if not result["lossless"]:
        raise ValueError(f"Decoding with {folder} in a fresh process differed from the target's greedy output.")
    return result


def upload_repo_folder(folder: Path, args: PublishArguments, token: str):
    """Create the repo (and branch) if needed, then upload the folder as one commit. Returns the CommitInfo."""
    api = HfApi(token=token)
    try:
        api.create_repo(args.repo_id, private=args.private or None, exist_ok=True)  # None: the namespace's default
        if args.revision and args.revision != "main":
            api.create_branch(args.repo_id, branch=args.revision, exist_ok=True)
        return api.upload_folder(
            repo_id=args.repo_id,
            folder_path=folder,
            revision=args.revision,
            commit_message=args.commit_message or f"Upload Carryover drafter for {args.base_model}",
        )
    except Exception as error:  # HTTP status, connection, file and Hub validation errors all end the upload alike
        raise PublishError(
            f"Uploading {folder} to {args.repo_id} failed: {type(error).__name__}: {error}\n"
            f"The local folder {folder} is intact; rerun with --overwrite_output_dir, or upload it with "
            f"`hf upload {args.repo_id} {folder}{f' --revision {args.revision}' if args.revision else ''}`."
        ) from error


def publish(args: PublishArguments) -> Path:
    token = None
    if not args.dry_run:
        token = args.token or get_token()
        if not token:
            raise PublishError("No Hugging Face token: pass --token, set HF_TOKEN, or log in with `hf auth login`.")
    folder = build_repo_folder(args)
    for line in validate_repo_folder(folder, args.target):
        print(f"ok: {line}")
    if args.dry_run:
        print(f"Dry run: {folder} is ready for {args.repo_id}; nothing was uploaded.")
        return folder
    commit = upload_repo_folder(folder, args, token)
    print(f"Uploaded {folder} to {args.repo_id} ({args.revision or 'main'}): {commit.commit_url}")
    return folder


ARGUMENT_CLASSES = (PublishArguments,)


def main(argv: list[str] | None = None) -> None:
    try:
        (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
        publish(args)
    except (PublishError, ValueError, OSError) as error:
        sys.exit(f"publish: {error}")


if __name__ == "__main__":
    main()
