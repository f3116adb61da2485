"""Regenerate the drafter's training responses with the target itself (on-policy data).

    python -m trainer.regenerate --output-dir data/smollm2-magpie --prompts magpie --num-prompts 2000 --dtype bfloat16
    python -m trainer.regenerate --output-dir data/qwen3-ultrachat --target Qwen/Qwen3-4B \\
        --prompts HuggingFaceH4/ultrachat_200k --split train_sft --num-prompts 50000 --max-new-tokens 2048

`--prompts` is a JSONL/Parquet/CSV file, a `save_to_disk` folder, a Hub dataset id, or `magpie` (prompts sampled
from the target, kept in the output folder). Running the same command again resumes an interrupted run.
"""

import argparse
import json
from pathlib import Path

import torch

from trainer.data import load_prompts, regenerate, synthesize_prompts, write_atomic
from trainer.targets import EMBEDDED_TARGET, load_target


def magpie_prompts(target, tokenizer, args) -> list:
    """Synthesised once and kept next to the data: sampling is costly, and a resumed run must see the same list."""
    path = Path(args.output_dir) / f"magpie-n{args.num_prompts}-seed{args.seed}.jsonl"
    if not path.exists():
        prompts = synthesize_prompts(
            target,
            tokenizer,
            args.num_prompts,
            batch_size=args.batch_size,
            max_new_tokens=args.magpie_max_new_tokens,
            seed=args.seed,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda p: p.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts)))
    return load_prompts(path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--target", default=None, help="local folder or Hub id (default: the embedded SmolLM2)")
    parser.add_argument("--adapter", default=None, help="a PEFT adapter merged into the target")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--prompts", required=True, help="file, save_to_disk folder, Hub dataset id, or 'magpie'")
    parser.add_argument("--split", default="train")
    parser.add_argument("--column", default=None, help="prompt or chat-messages column (default: auto)")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts (magpie: how many to make)")
    parser.add_argument("--magpie-max-new-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=None, help="cap on prompt + response tokens")
    parser.add_argument("--do-sample", action="store_true", help="sample the responses (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template-kwargs", type=json.loads, default={}, help='e.g. {"enable_thinking": false}')
    args = parser.parse_args(argv)
    if args.prompts == "magpie" and not args.num_prompts:
        parser.error("--prompts magpie needs --num-prompts")
    return args


def main(argv=None):
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, adapter=args.adapter, dtype=dtype, device=args.device)
    if args.prompts == "magpie":
        prompts = magpie_prompts(target, tokenizer, args)
    else:
        prompts = load_prompts(args.prompts, split=args.split, column=args.column, limit=args.num_prompts)
    data = regenerate(
        target,
        tokenizer,
        prompts,
        args.output_dir,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        chat_template_kwargs=args.chat_template_kwargs,
        target_name=args.target or EMBEDDED_TARGET,
    )
    response_tokens = sum(sum(mask) for mask in data["loss_mask"])
    print(
        f"{len(data)} responses ({sum(data['finished'])} ended their turn), {response_tokens} response tokens "
        f"-> {args.output_dir}"
    )


if __name__ == "__main__":
    main()
