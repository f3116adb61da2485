"""Checks of a checkpoint folder before it is loaded, so that a corrupt or truncated weights file, a folder that is not
a drafter, or a config that disagrees with its weights gets one message that names the file and what to do, instead
of safetensors' or torch's own error (which names neither)."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel

CONFIG_FIELD = {"draft_token_ids": "'s draft_vocab_size"}  # the config field a weight's size comes from, where one does


def weight_shapes(folder) -> dict:
    """{tensor name: shape} of every *.safetensors file of `folder`, read from the headers (no weights loaded)."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as weights:
                shapes.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
        except Exception as error:  # safetensors raises its own error type, which names no file
            raise ValueError(
                f"{file} is not a readable safetensors file (truncated or corrupt: {error}). Copy or download it "
                "again, or save the checkpoint again from where it was made."
            ) from None
    return shapes


def read_config(folder) -> dict:
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} has no config.json: it is not a checkpoint folder (give the folder that holds it).")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}): restore it from where it was made.") from None


def check_model_folder(path) -> None:
    """A local model folder (a target): config.json readable and every weights file readable. Hub ids pass."""
    if path is None or not Path(path).is_dir():
        return
    read_config(path)
    weight_shapes(path)


def check_any_drafter_folder(path) -> None:
    """A local drafter folder in any format hub/convert.py reads: readable config.json and weights, and a Carryover
    drafter's config agreeing with its weights. Hub ids pass."""
    if path is None or not Path(path).is_dir():
        return
    if read_config(path).get("model_type") == CarryoverDrafterConfig.model_type:
        check_drafter_folder(path)
    else:
        weight_shapes(path)


def check_drafter_folder(path) -> None:
    """A local drafter folder: a Carryover drafter's config.json, readable weights whose shapes are the ones its config
    makes (the token map's size, say). Hub ids pass (the loader reports those)."""
    if path is None or not Path(path).is_dir():
        return
    config = read_config(path)
    if config.get("model_type") != CarryoverDrafterConfig.model_type:
        raise ValueError(
            f"{path} is not a Carryover drafter (its config.json has model_type {config.get('model_type')!r}). Give "
            "a folder made by trainer/run.py; a DFlash, DSpark or speculators drafter: import it first with "
            "`python hub/convert.py --source <it> --output_dir <new folder>`."
        )
    shapes = weight_shapes(path)
    if not shapes:
        raise ValueError(f"{path} has no *.safetensors weights: it is not a saved drafter (or its weights were moved).")
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            expected = CarryoverDrafterModel(CarryoverDrafterConfig.from_dict(config)).state_dict()
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}/config.json is not a valid drafter config ({error}).") from None
    mismatched = [f"{name} {shapes[name]} (config{CONFIG_FIELD.get(name, '')}: {tuple(t.shape)})"
                  for name, t in expected.items() if name in shapes and shapes[name] != tuple(t.shape)]
    if mismatched:
        raise ValueError(
            f"{path}: config.json disagrees with the weights in its *.safetensors: {'; '.join(mismatched[:3])}. "
            "One of them was edited or replaced: restore the folder as it was saved."
        )
