"""A synthetic target family whose rejected draft branches re-converge by design: the positive control for carryover.

    python -m evaluation.synthetic_target --output_dir runs/synthetic --rhos 0 0.25 0.5 0.75 1

Writes an ordinary transformers folder (a small Llama causal LM trained here on CPU, its tokenizer and chat template)
that every CLI of the project takes as `--target`, plus prompts to regenerate on and a held-out benchmark:

  <output_dir>/target/            config.json, model.safetensors, tokenizer files, generation_config.json
  <output_dir>/train_prompts.jsonl  `prompt` records for `trainer.regenerate` (every rho alike)
  <output_dir>/benchmark/rho_<rho>.jsonl  held-out prompts, one subset per rho (never in train_prompts)
  <output_dir>/synthetic.json     the rules, the target's training log and its rule accuracy per rho

The language. An answer counts along a "spine" 0..N-1 in one of two lanes, a and b: after a17 comes a18 (the start
is below N minus an answer's length, so an answer never repeats a token). Each spine position has a fixed random
class (one of M). The prompt lists event classes with their action, one word each, then the start token, e.g.
`k3:d5 k7:j k12:d0 a14`:
  - `kX:dY`, a detour: after a token of class X comes the decoration dY, then the count goes on in the same lane, as
    if nothing happened;
  - `kX:j`, a divergence: after a token of class X the count goes on in the other lane (a17 -> b18), for good.
Classes not listed are no events. The events change from prompt to prompt, so they cannot be memorised: to write
the k-th next token, a model must look up the class of each token before it in the prompt. The target does that one
token at a time; a block drafter guesses all k in one parallel pass, so it errs where events pile up in a block.
rho is the share of a prompt's events that are detours (`round(rho * events)` of them). Where the drafter errs on a
detour (a missed, extra or wrong decoration: an insertion, deletion or substitution), the continuation rejoins the
rejected branch, and the target's states along that branch predict the committed continuation one position off,
which is what the paper's re-convergence count R counts; a missed or invented lane switch puts the branch in the
wrong lane for good (none of its tokens is ever committed). So rho = 1 makes every drafting error re-converge and
rho = 0 none, at the same difficulty.

The rules are deterministic, so the trained target's greedy text follows them wherever it learned them
(`synthetic.json` reports how often it does, per rho).
"""

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from carryover_common.benchmarks import encode_prompt
from carryover_common.cli import check_at_least, check_between, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir, staged_folder

USER, ASSISTANT, END, PAD, UNK = "<user>", "<assistant>", "<end>", "<pad>", "<unk>"
# One user turn, then the answer; whitespace-separated words are the tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user> {{ message['content'] }} "
    "{% else %}<assistant> {{ message['content'] }} <end> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass
class SyntheticArguments:
    output_dir: str = field(metadata={"help": "Where the target folder, prompts and benchmark go."})
    rhos: list[float] = field(
        default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0],
        metadata={"help": "Re-convergence knob values: the share of events that are detours. One benchmark subset each."},
    )
    num_spine: int = field(default=208, metadata={"help": "Spine positions N (starts below N - response_tokens)."})
    num_classes: int = field(default=16, metadata={"help": "Classes M of the spine positions."})
    num_events: int = field(default=6, metadata={"help": "Event classes listed in each prompt."})
    num_decorations: int = field(default=8, metadata={"help": "Decoration tokens."})
    response_tokens: int = field(default=160, metadata={"help": "Tokens per training answer (it never ends early)."})
    num_train_prompts: int = field(default=2000, metadata={"help": "Prompts written for regeneration (all rhos)."})
    num_eval_prompts: int = field(default=40, metadata={"help": "Held-out prompts per rho."})
    hidden_size: int = field(default=256)
    num_layers: int = field(default=4)
    num_heads: int = field(default=4)
    train_steps: int = field(default=600, metadata={"help": "Target training steps."})
    batch_size: int = field(default=32)
    learning_rate: float = field(default=2e-3)
    seed: int = field(default=0, metadata={"help": "Fixes the classes, the prompts and the target's initialisation."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})

    def __post_init__(self):
        if not self.rhos or any(not 0 <= rho <= 1 for rho in self.rhos):
            raise ValueError(f"--rhos must be values in [0, 1], got {self.rhos}.")
        for name in ("num_spine", "num_classes", "num_events", "num_decorations", "response_tokens",
                     "num_train_prompts", "num_eval_prompts", "hidden_size", "num_layers", "num_heads", "train_steps",
                     "batch_size"):
            check_at_least(f"--{name}", getattr(self, name), 1)
        check_between("--num_events", self.num_events, 1, self.num_classes)
        if self.num_spine <= self.response_tokens:
            raise ValueError(f"--num_spine {self.num_spine} must exceed --response_tokens {self.response_tokens}: an "
                             "answer must not run off the spine.")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden_size {self.hidden_size} must be a multiple of --num_heads {self.num_heads}.")


@dataclass
class Prompt:
    """One prompt: its rho, its events {class: decoration index, or None for a lane switch} and its start position
    (in lane a)."""

    rho: float
    events: dict
    start: int

    def text(self) -> str:
        actions = [f"k{c}:j" if d is None else f"k{c}:d{d}" for c, d in self.events.items()]
        return " ".join([*actions, f"a{self.start}"])


class Rules:
    """The fixed random part of the language: the class of each spine position; and the answer to a prompt."""

    def __init__(self, args: SyntheticArguments):
        rng = random.Random(args.seed)
        self.token_class = [rng.randrange(args.num_classes) for _ in range(args.num_spine)]

    def response(self, prompt: Prompt, length: int) -> list[str]:
        """The answer to `prompt`: `length` words."""
        words, position, lane = [], prompt.start, "a"
        while len(words) < length:
            event = self.token_class[position]
            if event in prompt.events:
                if prompt.events[event] is None:
                    lane = "b" if lane == "a" else "a"
                else:
                    words.append(f"d{prompt.events[event]}")
            position += 1
            words.append(f"{lane}{position}")
        return words[:length]


def vocabulary(args: SyntheticArguments) -> list[str]:
    actions = [f"k{c}:j" for c in range(args.num_classes)]
    actions += [f"k{c}:d{d}" for c in range(args.num_classes) for d in range(args.num_decorations)]
    return [
        PAD, UNK, USER, ASSISTANT, END, *actions,
        *(f"{lane}{i}" for lane in "ab" for i in range(args.num_spine + 1)),
        *(f"d{i}" for i in range(args.num_decorations)),
    ]


def build_tokenizer(args: SyntheticArguments) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(vocabulary(args))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, pad_token=PAD, eos_token=END, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_prompt(rng: random.Random, rho: float, args: SyntheticArguments) -> Prompt:
    """`num_events` random classes in random order, round(rho * num_events) of them detours, and a random start."""
    classes = rng.sample(range(args.num_classes), args.num_events)
    detours = round(rho * args.num_events)
    events = {c: (rng.randrange(args.num_decorations) if i < detours else None) for i, c in enumerate(classes)}
    order = list(events)
    rng.shuffle(order)
    return Prompt(rho, {c: events[c] for c in order}, rng.randrange(args.num_spine - args.response_tokens))


def make_prompts(args: SyntheticArguments) -> tuple[list, dict]:
    """Training prompts (every rho alike, shuffled) and held-out prompts per rho, disjoint from them."""
    rng = random.Random(args.seed + 1)
    train, seen = [], set()
    while len(train) < args.num_train_prompts:
        prompt = make_prompt(rng, args.rhos[len(train) % len(args.rhos)], args)
        if prompt.text() not in seen:
            seen.add(prompt.text())
            train.append(prompt)
    rng.shuffle(train)
    held_out = {}
    for rho in args.rhos:
        prompts = []
        while len(prompts) < args.num_eval_prompts:
            prompt = make_prompt(rng, rho, args)
            if prompt.text() not in seen:
                seen.add(prompt.text())
                prompts.append(prompt)
        held_out[rho] = prompts
    return train, held_out


def training_batch(rng: random.Random, rules: Rules, tokenizer, args: SyntheticArguments) -> dict:
    """A batch of whole conversations (fresh prompts every step), loss on the answers only."""
    rows, labels = [], []
    for _ in range(args.batch_size):
        prompt = make_prompt(rng, rng.choice(args.rhos), args)
        prefix = encode_prompt(tokenizer, prompt.text())["input_ids"][0].tolist()
        answer = tokenizer(" ".join(rules.response(prompt, args.response_tokens)), add_special_tokens=False)
        rows.append(prefix + answer["input_ids"])
        labels.append([-100] * len(prefix) + answer["input_ids"])
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([row + [pad] * (width - len(row)) for row in rows]),
        "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
        "labels": torch.tensor([label + [-100] * (width - len(label)) for label in labels]),
    }


def build_model(tokenizer, args: SyntheticArguments) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def train_target(model, rules: Rules, tokenizer, args: SyntheticArguments) -> list[dict]:
    """AdamW with a linear warmup and cosine decay on freshly sampled conversations; returns the loss log."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    warmup = max(1, args.train_steps // 20)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.train_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rng, log = random.Random(args.seed + 2), []
    model.train()
    for step in (progress := tqdm(range(args.train_steps), desc="target")):
        loss = model(**training_batch(rng, rules, tokenizer, args)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.train_steps - 1:
            log.append({"step": step, "loss": loss.item()})
            progress.set_postfix(loss=f"{loss.item():.4f}")
    model.eval()
    return log


@torch.no_grad()
def rule_accuracy(model, rules: Rules, tokenizer, held_out: dict, num_prompts: int = 8, length: int = 128) -> dict:
    """Per rho: the share of greedy answer tokens written before the first departure from the rules, averaged over
    prompts (1.0: the target writes the language exactly)."""
    accuracy = {}
    for rho, prompts in held_out.items():
        followed = []
        for prompt in prompts[:num_prompts]:
            inputs = encode_prompt(tokenizer, prompt.text())
            output = model.generate(**inputs, max_new_tokens=length, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            words = tokenizer.convert_ids_to_tokens(output[0, inputs["input_ids"].shape[1] :].tolist())
            expected = rules.response(prompt, length)
            first_departure = next((i for i, (a, b) in enumerate(zip(words, expected)) if a != b), min(len(words), length))
            followed.append(first_departure / length)
        accuracy[f"rho={rho:.2f}"] = sum(followed) / len(followed)
    return accuracy


def write_jsonl(path: Path, prompts) -> None:
    path.write_text("".join(json.dumps({"prompt": p.text(), "rho": p.rho}) + "\n" for p in prompts))


def build_synthetic_target(args: SyntheticArguments) -> dict:
    check_output_dir(args.output_dir, overwrite=args.overwrite_output_dir)
    started = time.perf_counter()
    rules, tokenizer = Rules(args), build_tokenizer(args)
    train_prompts, held_out = make_prompts(args)
    model = build_model(tokenizer, args)
    log = train_target(model, rules, tokenizer, args)
    accuracy = rule_accuracy(model, rules, tokenizer, held_out, length=min(128, args.response_tokens))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    summary = {
        "arguments": asdict(args),
        "token_class": rules.token_class,
        "target_parameters": sum(p.numel() for p in model.parameters()),
        "training_log": log,
        "rule_accuracy": accuracy,
        "seconds": time.perf_counter() - started,
        "torch_threads": torch.get_num_threads(),
    }
    with staged_folder(args.output_dir) as output_dir:
        model.save_pretrained(output_dir / "target")
        tokenizer.save_pretrained(output_dir / "target")
        write_jsonl(output_dir / "train_prompts.jsonl", train_prompts)
        (output_dir / "benchmark").mkdir()
        for rho, prompts in held_out.items():
            write_jsonl(output_dir / "benchmark" / f"rho_{rho:.2f}.jsonl", prompts)
        (output_dir / "synthetic.json").write_text(json.dumps(summary, indent=1))
    print(f"Target in {args.output_dir}/target ({summary['target_parameters']:,} parameters, "
          f"{summary['seconds']:.0f} s); greedy answers follow the rules for: "
          + ", ".join(f"{name} {value:.0%}" for name, value in accuracy.items()))
    return summary


ARGUMENT_CLASSES = (SyntheticArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    return build_synthetic_target(args)


if __name__ == "__main__":
    run_cli(main)
