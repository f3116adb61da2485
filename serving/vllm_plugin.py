"""Serve a Carryover drafter WITH carryover in vLLM (0.32.0, pinned): a `vllm.general_plugins` plugin and its export.

    python -m serving.vllm_plugin --source checkpoints/carryover --output_dir out-vllm          # export (E_carry kept)
    python -m vllm.entrypoints.openai.api_server --model <target> \
        --speculative-config '{"method": "dflash", "model": "out-vllm", "num_speculative_tokens": 7}'

The export is `hub/convert.py --to dflash` (z-lab's DFlash format, which vLLM loads) plus what carryover needs:
E_carry as the tensor `carry_embedding`, `architectures: ["DFlashCarryoverDraftModel"]`, in `dflash_config`
`carryover` (on by default for requests; the checkpoint's own `carryover` unless `--carryover` says otherwise) and
`target_model_type`, and a draft vocabulary's `draft_vocab_size` with its token map `d2t` (and `t2d`). With the
plugin installed (`pip install -e ".[vllm]"`, see serving/vllm_env.sh), vLLM loads it as
`vllm_carryover.CarryoverDFlashForCausalLM`, whose head for a draft vocabulary is the target LM head's rows of the
draft tokens, and drafts with `vllm_carryover.CarryoverDFlashProposer`, which refuses a target or
`num_speculative_tokens` the drafter does not fit. Plain `--to dflash` exports (no E_carry) run exactly as
stock vLLM DFlash with the plugin installed too. A request turns carryover off (or on) with
`SamplingParams(extra_args={"carryover": False})`.
"""

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from safetensors.torch import load_file, save_file

from carryover_common.checkpoints import check_any_drafter_folder
from carryover_common.cli import check_exists, parse_arguments
from carryover_common.outputs import check_output_dir, staged_folder
from hub.convert import export_dflash, import_drafter
from modeling_carryover import CarryoverDrafterModel

ARCHITECTURE = "DFlashCarryoverDraftModel"  # vLLM keeps a DFlash draft's architecture that starts with "DFlash"


def register() -> None:
    """The `vllm.general_plugins` entry point, run in every vLLM process: our drafter class for ARCHITECTURE, and
    our proposer wherever vLLM's model runner builds its DFlash proposer."""
    from vllm import ModelRegistry
    from vllm.v1.worker import gpu_model_runner  # the CPU runner subclasses it

    from serving.vllm_carryover import CarryoverDFlashProposer

    ModelRegistry.register_model(ARCHITECTURE, "serving.vllm_carryover:CarryoverDFlashForCausalLM")
    gpu_model_runner.DFlashProposer = CarryoverDFlashProposer


def export_vllm(drafter: CarryoverDrafterModel, output_dir: str | Path, carryover: bool | None = None) -> Path:
    """Write the z-lab DFlash format with E_carry, for vLLM with this plugin. `carryover`: on for requests by default
    (None: the drafter config's `carryover`)."""
    config = drafter.config
    if config.carryover_interface != "embedding" or config.markov_rank or config.carry_gate:
        raise ValueError(
            f"The vLLM plugin serves DFlash drafters with the E_carry marker (carryover_interface='embedding', no Markov "
            f"head, no carry gate); this one has carryover_interface={config.carryover_interface!r}, markov_rank="
            f"{config.markov_rank}, carry_gate={config.carry_gate}. `hub/convert.py --to dflash` exports it without "
            "carryover."
        )
    with warnings.catch_warnings():  # export_dflash drops E_carry with a warning: it is added back below
        warnings.filterwarnings("ignore", message=".*has no place for the carryover part")
        folder = export_dflash(drafter, output_dir, keep_token_map=True)
    vllm_config = json.loads((folder / "config.json").read_text())
    vllm_config["architectures"] = [ARCHITECTURE]
    vllm_config["dflash_config"] |= {
        "carryover": config.carryover if carryover is None else carryover,
        "target_model_type": config.target_model_type,
    }
    (folder / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
    weights = load_file(folder / "model.safetensors")
    weights["carry_embedding"] = drafter.carry_embedding.detach().contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@dataclass
class ExportArguments:
    source: str = field(metadata={"help": "Carryover drafter checkpoint (local folder or Hub repo id)."})
    output_dir: str = field(metadata={"help": "Where to write the vLLM export."})
    carryover: Literal["checkpoint", "on", "off"] = field(
        default="checkpoint", metadata={"help": "Carryover for requests by default: the checkpoint's setting, on or off."}
    )
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Write into a non-empty --output_dir."})

    def __post_init__(self):
        check_exists("source", self.source, hub=True)
        check_any_drafter_folder(self.source)
        check_output_dir(self.output_dir, inputs=[self.source], overwrite=self.overwrite_output_dir)


ARGUMENT_CLASSES = (ExportArguments,)


def main(argv: list[str] | None = None) -> None:
    try:
        (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
        carryover = {"checkpoint": None, "on": True, "off": False}[args.carryover]
        drafter = import_drafter(args.source)
        with staged_folder(args.output_dir) as staging:  # a failed export leaves nothing, and earlier files stay whole
            export_vllm(drafter, staging, carryover=carryover)
    except (ValueError, OSError) as error:
        sys.exit(f"vllm_plugin: {error}")
    print(f"Wrote a vLLM carryover export to {args.output_dir}")


if __name__ == "__main__":
    main()
