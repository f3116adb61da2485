"""The model card (README.md) of a published drafter: Hub metadata, a usage snippet that runs as written, the drafter
fields from config.json, the training arguments (carryover_training.json) and the evaluation tables (report.json)."""

import json

import transformers
from huggingface_hub import ModelCard, ModelCardData

# config.json fields shown in the card, in this order.
ARCHITECTURE_FIELDS = (
    "block_size",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "carryover",
    "carryover_interface",
    "carry_gate",
    "markov_rank",
    "target_model_type",
)
REPORT_FIELDS = ("drafter", "subset", "temperature")


def usage_snippet(repo_id: str, base_model: str, revision: str | None = None) -> str:
    """Python that loads the target and this drafter from the Hub and decodes with carryover (needs only torch and
    transformers: the drafter's model and decoding code come with the repo)."""
    if revision:  # custom_generate= takes no revision: point both loads at the branch's snapshot
        drafter_line = (
            "from huggingface_hub import snapshot_download\n\n"
            f'drafter_id = snapshot_download("{repo_id}", revision="{revision}")'
        )
    else:
        drafter_line = f'drafter_id = "{repo_id}"'
    return f"""from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target_id = "{base_model}"
{drafter_line}
tokenizer = AutoTokenizer.from_pretrained(target_id)
target = AutoModelForCausalLM.from_pretrained(target_id, dtype="auto")
drafter = AutoModel.from_pretrained(drafter_id, trust_remote_code=True, dtype="auto")

messages = [{{"role": "user", "content": "Write a haiku about speculative decoding."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = target.generate(
    **inputs,
    assistant_model=drafter,
    custom_generate=drafter_id,
    trust_remote_code=True,
    max_new_tokens=128,
    do_sample=False,
)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("tokens per round:", drafter.generation_stats.acceptance_length)"""


def key_value_table(rows: dict) -> str:
    lines = ["| field | value |", "| --- | --- |"]
    for key, value in rows.items():
        value = json.dumps(value).replace("|", "\\|")  # a bare | would end the cell
        lines.append(f"| `{key}` | `{value}` |")
    return "\n".join(lines)


def evaluation_tables(report: dict) -> str:
    """One Markdown table per temperature: subsets as rows, drafters as columns; each cell is the acceptance length
    tau (tokens per verification round, bonus token included) and, when measured, the speedup over plain decoding.
    Results without an acceptance length (plain decoding, the speedup reference) are not drafters: left out."""
    results = report.get("results")
    if not isinstance(results, list) or not results:
        raise ValueError('The evaluation report has no "results" list.')
    cells = {}  # (temperature, subset, drafter) -> text
    for index, result in enumerate(results):
        missing = [key for key in REPORT_FIELDS if key not in result]
        if missing:
            raise ValueError(f"Evaluation result {index} lacks {missing}.")
        if result.get("acceptance_length") is None:
            continue
        key = (float(result["temperature"]), result["subset"], result["drafter"])
        if key in cells:
            temperature, subset, drafter = key
            raise ValueError(f"Evaluation report has two results for {drafter!r} on {subset!r} at T={temperature:g}.")
        speedup = result.get("speedup")
        cells[key] = f"{result['acceptance_length']:.2f}" + (f" ({speedup:.2f}x)" if speedup is not None else "")
    subsets = list(dict.fromkeys(subset for _, subset, _ in cells))  # first-seen order
    drafters = list(dict.fromkeys(drafter for _, _, drafter in cells))
    sections = []
    for temperature in sorted({t for t, _, _ in cells}):
        header = f"| subset | {' | '.join(drafters)} |\n| --- |" + " --- |" * len(drafters)
        lines = [f"### T = {temperature:g}", "", header]
        for subset in subsets:
            row = [cells.get((temperature, subset, drafter), "-") for drafter in drafters]
            lines.append(f"| {subset} | " + " | ".join(row) + " |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def render_model_card(
    repo_id: str,
    base_model: str,
    drafter_config: dict,
    training_arguments: dict | None = None,
    report: dict | None = None,
    license: str = "apache-2.0",
    revision: str | None = None,
) -> ModelCard:
    """The drafter's model card. `drafter_config`: its config.json; `training_arguments`: carryover_training.json;
    `report`: an evaluation report.json."""
    markov = drafter_config.get("markov_rank", 0) > 0
    tags = ["speculative-decoding", "dflash", "carryover", "block-diffusion", "custom_generate"]
    tags += ["dspark"] if markov else []
    metadata = ModelCardData(base_model=base_model, library_name="transformers", license=license, tags=tags)
    head = " with a DSpark-style Markov head" if markov else ""
    reads = (
        "and, with carryover, also the target's hidden states of the previous round's rejected drafts"
        if drafter_config.get("carryover")
        else "(carryover, which also reads the previous round's rejected drafts, is off in its config)"
    )
    sections = [
        f"# Carryover drafter for {base_model}",
        f"A block-diffusion speculative-decoding drafter (DFlash-style{head}, Carryover Drafting format) for "
        f"[`{base_model}`](https://huggingface.co/{base_model}). Each round it proposes up to "
        f"{drafter_config['block_size'] - 1} tokens from the target's hidden states {reads}. The target verifies "
        "every proposal, so the output is the target's own: token for token when greedy, the same distribution when "
        "sampling.",
        "## Usage",
        f"Needs `torch` and `transformers` (this card was written with {transformers.__version__}); the drafter's "
        "model and decoding code come with this repo (`trust_remote_code`, `custom_generate/`). Batch size 1.",
        f"```python\n{usage_snippet(repo_id, base_model, revision)}\n```",
        "`generate` also takes `carryover=True` or `False` to switch the recycling of rejected rows for one call.",
        "## Drafter",
        key_value_table({key: drafter_config[key] for key in ARCHITECTURE_FIELDS if key in drafter_config}),
        "## Training",
        key_value_table(training_arguments)
        if training_arguments
        else "No training record (`carryover_training.json`) came with the checkpoint.",
    ]
    if report:
        sections += [
            "## Evaluation",
            "Acceptance length tau (tokens per verification round, bonus token included); speedup over plain decoding "
            "in parentheses where measured.",
            evaluation_tables(report),
        ]
        if report.get("provenance"):
            provenance = json.dumps(report["provenance"], indent=2)
            sections.append(f"<details><summary>Provenance</summary>\n\n```json\n{provenance}\n```\n\n</details>")
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")
