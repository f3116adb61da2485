"""A randomly initialised target with a real model's shape, for speed/memory benchmarks on a machine without its
weights (e.g. a GPU box without network). Not for acceptance numbers: random weights draft nothing useful.

    python tests/scripts/random_target.py --like qwen3-4b --tokenizer <folder with tokenizer files> --out /tmp/qwen3-4b-random
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

SHAPES = {  # the published configs' sizes
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--like", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--tokenizer", required=True, help="folder whose tokenizer files are copied next to the weights")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPES[args.like]), dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    for file in Path(args.tokenizer).iterdir():
        if file.name.startswith("tokenizer") or file.name.endswith(".jinja"):
            shutil.copy(file, args.out)
    print(f"{args.like}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {args.out}")
