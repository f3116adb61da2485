"""Training data: prompt loading, Magpie synthesis, resumable regeneration and chat-template loss masks.

The tokenizer is a byte-level BPE without merges (one token per byte, plus ChatML special tokens), so every expected
token sequence can be written down by hand. The target is a tiny Llama taught four short ChatML conversations in the
test (about 2 s), so that it closes its turns like an instruct model does.
"""

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import make_target
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.build import FEATURE_INDEX, load_training_rows
from trainer.data import (
    MANIFEST,
    deduplicate,
    load_prompts,
    load_regenerated,
    python_code_names,
    python_code_prompts,
    regenerate,
    synthesize_prompts,
    template_turn,
    tokenize_conversations,
)
from trainer.features import extract_features, rows_with_features

SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
# SmolLM2-style ChatML: a default system prompt when the conversation has none.
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '" + SYSTEM.replace("\n", "\\n") + "' }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same rendering with generation markers around what the assistant writes (content and <|im_end|>).
CHATML_MARKED = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '" + SYSTEM.replace("\n", "\\n") + "' }}"
    "{% endif %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3-style: the last assistant turn (only) gets an empty think block, so a conversation rendered through an
# earlier assistant turn is NOT a prefix of the whole conversation; the generation prompt still is.
QWEN3_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Assistant turns rendered under another header than the generation prompt: no token-prefix property.
NO_PREFIX = CHATML.replace("'<|im_start|>' + m['role']", "'<|im_start|>' + m['role'][:3]")

TAUGHT = [("hello", "hi there"), ("name a color", "blue"), ("count to three", "one two three"), ("say nothing", "")]


def make_tokenizer(chat_template=CHATML):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # ids 0..255, one per byte
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",  # 256
        pad_token="<|endoftext|>",  # 257
        additional_special_tokens=["<|im_start|>"],  # 258
        chat_template=chat_template,
    )


TOK = make_tokenizer()
IM_END, PAD, IM_START = 256, 257, 258


def ids(*pieces):
    """Token ids by hand: "<|im_start|>" and "<|im_end|>" are single tokens, any other text one token per byte."""
    special = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
    tokens = []
    for piece in pieces:
        if piece in special:
            tokens.append(special[piece])
        else:
            text_ids = TOK(piece, add_special_tokens=False)["input_ids"]
            assert len(text_ids) == len(piece.encode())
            tokens += text_ids
    return tokens


SYSTEM_IDS = ids("<|im_start|>", "system\nBe brief.", "<|im_end|>", "\n")
ASSISTANT_HEADER_IDS = ids("<|im_start|>", "assistant\n")


def chat(user, assistant=None):
    messages = [{"role": "user", "content": user}]
    return messages if assistant is None else messages + [{"role": "assistant", "content": assistant}]


@pytest.fixture(scope="module")
def taught_target():
    """A tiny Llama that has memorised the TAUGHT conversations (it answers "say nothing" with an empty turn)."""
    target = make_target("llama", num_hidden_layers=2, vocab_size=len(TOK)).train()
    sequences = [TOK.apply_chat_template(chat(u, a))["input_ids"] for u, a in TAUGHT]
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in sequences])
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for _ in range(150):
        loss = target(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return target.requires_grad_(False).eval()


def greedy_response(target, prompt, max_new_tokens):
    prompt_ids = TOK.apply_chat_template(chat(prompt), add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = target.generate(
        prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=IM_END, pad_token_id=PAD
    )
    return out[0, prompt_ids.shape[1] :].tolist()


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def test_load_prompts_from_every_local_format(tmp_path):
    rows = {"instruction": ["Write a haiku.", "  ", "Sum 2 and 3."], "id": [1, 2, 3]}
    Dataset.from_dict(rows).to_json(tmp_path / "p.jsonl")
    Dataset.from_dict(rows).to_parquet(tmp_path / "p.parquet")
    Dataset.from_dict(rows).to_csv(tmp_path / "p.csv", index=False)
    Dataset.from_dict(rows).save_to_disk(tmp_path / "single")
    DatasetDict({"train": Dataset.from_dict({"instruction": ["other"]}), "test": Dataset.from_dict(rows)}).save_to_disk(
        tmp_path / "dict"
    )
    expected = ["Write a haiku.", "Sum 2 and 3."]  # the blank prompt is skipped
    for source in ("p.jsonl", "p.parquet", "p.csv", "single"):
        assert load_prompts(tmp_path / source) == expected, source
    assert load_prompts(tmp_path / "dict", split="test") == expected
    assert load_prompts(tmp_path / "p.jsonl", limit=1) == ["Write a haiku."]
    with pytest.raises(ValueError, match=r"no split 'validation'; splits: \['train', 'test'\]"):
        load_prompts(tmp_path / "dict", split="validation")


def test_load_prompts_from_chat_messages_takes_the_first_user_turn(tmp_path):
    system = {"role": "system", "content": "Be kind."}
    conversations = [[system, *chat("Hi?", "Hello."), *chat("And then?")], chat("Only one.")]
    Dataset.from_dict({"messages": conversations}).to_json(tmp_path / "chats.jsonl")
    assert load_prompts(tmp_path / "chats.jsonl") == ["Hi?", "Only one."]


def test_load_prompts_bad_inputs(tmp_path):
    Dataset.from_dict({"text": ["a"], "label": [0]}).to_parquet(tmp_path / "no_prompt.parquet")
    with pytest.raises(ValueError, match=r"no column any of .*'prompt'.*columns \['text', 'label'\]"):
        load_prompts(tmp_path / "no_prompt.parquet")
    with pytest.raises(ValueError, match=r"no column 'query'; the dataset has columns \['text', 'label'\]"):
        load_prompts(tmp_path / "no_prompt.parquet", column="query")
    (tmp_path / "empty.csv").write_text("prompt,id\n")
    (tmp_path / "empty.jsonl").write_text("")
    for empty in ("empty.csv", "empty.jsonl"):
        with pytest.raises(ValueError, match="no rows could be read"):
            load_prompts(tmp_path / empty)
    with pytest.raises(ValueError, match="the dataset is empty"):
        load_prompts(Dataset.from_dict({"prompt": ["a"]}).select([]))
    Dataset.from_dict({"prompt": [" ", ""]}).to_parquet(tmp_path / "blank.parquet")
    with pytest.raises(ValueError, match="no non-blank prompt"):
        load_prompts(tmp_path / "blank.parquet")
    Dataset.from_dict({"messages": [[{"from": "human", "value": "hi"}]]}).to_json(tmp_path / "sharegpt.jsonl")
    with pytest.raises(ValueError, match="must hold chat messages"):
        load_prompts(tmp_path / "sharegpt.jsonl")
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"unsupported file type \(use \['\.csv'"):
        load_prompts(tmp_path / "p.txt")


def test_deduplicate_exact_and_up_to_case_and_whitespace():
    prompts = ["Hello world", "hello   world", "Hello world", " ", "HELLO WORLD\n", "Other", "other "]
    assert deduplicate(prompts) == ["Hello world", "Other"]


def test_pre_query_prefix_is_the_template_text_before_the_user_content():
    turn = template_turn(TOK, "user")
    assert turn.prefix_ids == SYSTEM_IDS + ids("<|im_start|>", "user\n")  # the default system prompt included
    assert turn.end_of_turn_id == IM_END
    assistant = template_turn(make_tokenizer(QWEN3_LIKE), "assistant", history=chat("Hi"))
    user_turn = ids("<|im_start|>", "user\nHi", "<|im_end|>", "\n")
    assert assistant.prefix_ids == user_turn + ids("<|im_start|>", "assistant\n<think>\n\n</think>\n\n")
    assert assistant.end_of_turn_id == IM_END


def test_synthesize_prompts_keeps_closed_distinct_turns_and_is_seeded(taught_target):
    prompts = synthesize_prompts(taught_target, TOK, 3, batch_size=8, max_new_tokens=24, seed=0, progress=False)
    taught = {user for user, _ in TAUGHT}
    assert len(prompts) == 3 and set(prompts) <= taught  # 8 samples of 4 memorised prompts: deduplicated
    assert synthesize_prompts(taught_target, TOK, 3, batch_size=8, max_new_tokens=24, seed=0, progress=False) == prompts
    # With a cap shorter than any taught prompt no sample closes its turn.
    with pytest.raises(ValueError, match="None of 16 samples closed a user turn within max_new_tokens=3"):
        synthesize_prompts(taught_target, TOK, 4, batch_size=8, max_new_tokens=3, max_samples=16, progress=False)


def test_python_code_prompts_are_distinct_documented_functions_and_seeded():
    prompts = python_code_prompts(50, seed=0)
    assert len(prompts) == 50 == len(set(prompts))
    assert prompts == python_code_prompts(50, seed=0) != python_code_prompts(50, seed=1)
    names = [p.split("`")[1].split("(")[0] for p in prompts]
    assert len(set(names)) == 50 and not any(n.startswith("_") for n in names)  # one task per public name
    assert not any("(self" in p or "(cls" in p for p in prompts)  # methods read as free functions
    assert all("Python" in p and p.count("`") >= 2 for p in prompts)


def test_python_stubs_pose_the_same_functions_as_source_files_to_complete():
    tasks, stubs = python_code_prompts(50, seed=0), python_code_prompts(50, seed=0, stubs=True)
    assert python_code_names(stubs) >= python_code_names(tasks)  # the same draw (docstrings may name more)
    for stub in stubs:
        function = ast.parse(stub).body[0]  # valid Python: a signature and a docstring, no body
        assert isinstance(function, ast.FunctionDef) and len(function.body) == 1 and ast.get_docstring(function)
        assert stub.startswith(f"def {function.name}(") and stub.endswith('\n    """\n')
        assert not any(line != line.rstrip() for line in stub.splitlines())
        docstring = ast.get_docstring(function)
        assert len(docstring) <= 600 or "\n\n" not in docstring  # whole paragraphs up to the cap (the first always)


def test_excluded_functions_leave_the_rest_of_the_draw_in_order(tmp_path):
    """`--exclude_prompts <held-out benchmark>`: its functions are never drawn, and the draw's other prompts keep their
    order, so a regeneration grown with the exclusion starts with the prompts it already has."""
    from trainer.regenerate import RegenerationArguments, mixed_prompts

    draw = python_code_prompts(62, seed=0, stubs=True)
    held_out = [draw[52], draw[57]]  # a benchmark of two functions the first 50 prompts do not name
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out))
    args = RegenerationArguments(prompts=["python-stub"], num_prompts=[60], exclude_prompts=[str(tmp_path / "heldout.jsonl")])
    grown = mixed_prompts(None, None, args)
    assert grown == [p for p in draw if p not in held_out]  # the first 50 as before, then the draw without the two
    assert python_code_prompts(50, seed=0, stubs=True) == grown[:50]


def test_code_packages_draw_from_installed_packages_instead_of_the_standard_library():
    """`--code_packages packaging`: stubs of the functions documented in that package's own files (found without
    importing it); an unknown name is refused before anything is drawn."""
    import packaging

    from trainer.regenerate import RegenerationArguments, mixed_prompts

    sources = "".join(path.read_text() for path in Path(packaging.__file__).parent.rglob("*.py"))
    args = RegenerationArguments(prompts=["python-stub"], num_prompts=[20], code_packages=["packaging"])
    stubs = mixed_prompts(None, None, args)
    assert len(stubs) == 20 == len(set(stubs))
    names = {ast.parse(stub).body[0].name for stub in stubs}
    assert all(f"def {name}(" in sources for name in names)  # each one defined in the package's own files
    with pytest.raises(ValueError, match="'no_such_package' is not an installed package"):
        python_code_prompts(5, packages=["no_such_package"])


def test_mixed_prompt_sources_need_one_count_each_and_are_shuffled_together(tmp_path):
    from trainer.regenerate import RegenerationArguments, mixed_prompts

    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    args = RegenerationArguments(prompts=[str(tmp_path / "mine.jsonl"), "python-code"], num_prompts=[4, 5])
    mixed = mixed_prompts(None, None, args)  # no target needed: neither source samples it
    assert sorted(mixed) == sorted([f"question {i}" for i in range(4)] + python_code_prompts(5))
    assert mixed[:4] != [f"question {i}" for i in range(4)] and mixed == mixed_prompts(None, None, args)
    with pytest.raises(ValueError, match="gives 1 counts for 2 --prompts sources"):
        mixed_prompts(None, None, RegenerationArguments(prompts=args.prompts, num_prompts=[4]))
    with pytest.raises(ValueError, match="--prompts python-code needs its --num_prompts"):
        mixed_prompts(None, None, RegenerationArguments(prompts=["python-code"]))
    stubs = RegenerationArguments(prompts=["python-stub"], num_prompts=[3])
    assert sorted(mixed_prompts(None, None, stubs)) == sorted(python_code_prompts(3, stubs=True))


# ---------------------------------------------------------------------------------------------------------------
# Regeneration


def test_regenerated_rows_are_the_targets_own_responses(taught_target, tmp_path):
    prompts = ["hello", "count to three", "say nothing", "Hello ", "name a color"]  # "Hello " repeats "hello"
    data = regenerate(taught_target, TOK, prompts, tmp_path, shard_size=2, batch_size=2, max_new_tokens=20)
    # "say nothing" (prompt 2) is answered with an empty turn and dropped; "Hello " is a duplicate.
    assert data["prompt_index"] == [0, 1, 3]
    assert data["prompt"] == ["hello", "count to three", "name a color"]
    row = data[0]
    prompt_ids = SYSTEM_IDS + ids("<|im_start|>", "user\nhello", "<|im_end|>", "\n") + ASSISTANT_HEADER_IDS
    response = ids("hi there", "<|im_end|>")
    assert row["input_ids"] == prompt_ids + response
    assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response)
    assert row["num_prompt_tokens"] == len(prompt_ids) and row["finished"]
    for row in data:  # batched, left-padded generation = the target's own greedy answer to the prompt alone
        assert row["input_ids"][row["num_prompt_tokens"] :] == greedy_response(taught_target, row["prompt"], 20)


def test_length_caps(taught_target, tmp_path):
    data = regenerate(taught_target, TOK, ["count to three"], tmp_path / "new", max_new_tokens=5, progress=False)
    prompt_len = data[0]["num_prompt_tokens"]
    assert data[0]["input_ids"][prompt_len:] == ids("one t") and not data[0]["finished"]
    prompts = ["count to three", "hello" * 20]
    data = regenerate(taught_target, TOK, prompts, tmp_path / "total", max_length=prompt_len + 3, progress=False)
    assert data["prompt_index"] == [0]  # the long prompt has no room left: skipped
    assert data[0]["input_ids"][prompt_len:] == ids("one") and len(data[0]["input_ids"]) == prompt_len + 3


def test_interrupted_regeneration_resumes_to_the_uninterrupted_rows(taught_target, tmp_path):
    prompts = ["hello", "name a color", "count to three", "say hi", "count to two", "name a colour", "hello there"]
    settings = dict(shard_size=2, batch_size=2, max_new_tokens=12, do_sample=True, seed=3, progress=False)
    reference = regenerate(taught_target, TOK, prompts, tmp_path / "reference", **settings)

    generate, calls = taught_target.generate, []

    def interrupted_generate(*args, **kwargs):  # the run is killed during its third batch (= third shard)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    taught_target.generate = interrupted_generate
    torch.manual_seed(1234)  # the caller's RNG state must not matter: sampling is seeded per shard
    try:
        with pytest.raises(KeyboardInterrupt):
            regenerate(taught_target, TOK, prompts, tmp_path / "resumed", **settings)
        out = tmp_path / "resumed"
        assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "shard-00000.parquet", "shard-00001.parquet"]
        with pytest.raises(ValueError, match="2 of 4 shards are missing"):
            load_regenerated(out)
        # the finished shards can be trained on meanwhile: the first rows of the uninterrupted run
        first_two = load_regenerated(out, num_shards=2)
        assert first_two.to_dict() == reference.select(range(len(first_two))).to_dict() and len(first_two) == 4
        with pytest.raises(ValueError, match="1 of 3 shards are missing"):
            load_regenerated(out, num_shards=3)
        with pytest.raises(ValueError, match="has 4 shards; cannot load the first 5"):
            load_regenerated(out, num_shards=5)
        # ... beside other data, with a shard count per dataset (0: all of it), as run.py's --dataset_shards 2 0
        from trainer.build import load_training_rows

        mix = load_training_rows([out, tmp_path / "reference"], [2, 0])
        assert list(mix["input_ids"]) == list(first_two["input_ids"]) + list(reference["input_ids"])
        # and beside plain rows (JSONL: int64 tokens, where a regenerated folder stores int32/int8)
        reference.select_columns(["input_ids", "loss_mask"]).to_json(tmp_path / "rows.jsonl")
        mix = load_training_rows([out, tmp_path / "rows.jsonl"], [2, 0])
        assert list(mix["loss_mask"]) == list(first_two["loss_mask"]) + list(reference["loss_mask"])
        with pytest.raises(ValueError, match="2 of 4 shards are missing"):
            load_training_rows([out, tmp_path / "reference"], [0, 0])
        calls.clear()
        resumed = regenerate(taught_target, TOK, prompts, out, **settings)
        assert len(calls) == 2  # only shards 2 and 3 were generated: finished shards are never redone
    finally:
        del taught_target.generate
    assert resumed.to_dict() == reference.to_dict()
    assert len(set(resumed["prompt_index"])) == len(resumed)
    assert regenerate(taught_target, TOK, prompts, out, **settings).to_dict() == reference.to_dict()  # nothing to do
    reseeded = regenerate(taught_target, TOK, prompts, tmp_path / "reseeded", **{**settings, "seed": 4})
    assert reseeded["input_ids"] != reference["input_ids"]  # the untaught prompts get other samples


def test_a_shard_interrupted_while_being_written_is_not_kept(taught_target, tmp_path, monkeypatch):
    prompts = ["hello", "name a color", "count to three"]
    reference = regenerate(taught_target, TOK, prompts, tmp_path / "reference", shard_size=2, progress=False)
    to_parquet = Dataset.to_parquet

    def killed_while_writing(self, path):  # half a file, then the process dies
        Path(path).write_bytes(b"PAR1 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Dataset, "to_parquet", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        regenerate(taught_target, TOK, prompts, tmp_path / "out", shard_size=2, progress=False)
    assert not (tmp_path / "out" / "shard-00000.parquet").exists()
    monkeypatch.setattr(Dataset, "to_parquet", to_parquet)
    resumed = regenerate(taught_target, TOK, prompts, tmp_path / "out", shard_size=2, progress=False)
    assert resumed.to_dict() == reference.to_dict()


def test_a_finished_run_grows_with_more_prompts_in_whole_shards(taught_target, tmp_path):
    prompts = ["hello", "name a color", "count to three", "say hi", "count to two", "name a colour", "hello there"]
    settings = dict(shard_size=2, batch_size=2, max_new_tokens=12, do_sample=True, seed=3, progress=False)
    reference = regenerate(taught_target, TOK, prompts, tmp_path / "reference", **settings)
    out = tmp_path / "grown"
    regenerate(taught_target, TOK, prompts[:4], out, **settings)
    shard_0 = (out / "shard-00000.parquet").stat().st_mtime_ns
    generate, calls = taught_target.generate, []
    taught_target.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    try:
        grown = regenerate(taught_target, TOK, prompts, out, **settings)
    finally:
        del taught_target.generate
    assert len(calls) == 2 and (out / "shard-00000.parquet").stat().st_mtime_ns == shard_0  # only the new shards
    assert grown.to_dict() == reference.to_dict()
    assert json.loads((out / MANIFEST).read_text()) == json.loads((tmp_path / "reference" / MANIFEST).read_text())
    # no growth where the recorded run's last shard is partial, its prompts differ, or its settings do
    partial = tmp_path / "partial"
    regenerate(taught_target, TOK, prompts[:3], partial, **settings)
    with pytest.raises(ValueError, match="different num_prompts, prompts_fingerprint"):
        regenerate(taught_target, TOK, prompts, partial, **settings)
    with pytest.raises(ValueError, match="different num_prompts, prompts_fingerprint"):
        regenerate(taught_target, TOK, ["goodbye", *prompts], out, **settings)
    with pytest.raises(ValueError, match="different num_prompts, prompts_fingerprint, settings.seed"):
        regenerate(taught_target, TOK, [*prompts, "goodbye"], out, **{**settings, "seed": 4})


def test_a_grown_regeneration_grows_its_features_and_its_first_shards_train_beside_another_dataset(
    taught_target, tmp_path
):
    """Across sessions: a regeneration grows, its features folder grows with it (the new rows only), and its first
    shards train beside another dataset with one features folder each, every row reading its own stored layers."""
    prompts = ["hello", "name a color", "count to three", "say hi", "count to two", "name a colour"]
    settings = dict(shard_size=2, batch_size=2, max_new_tokens=12, progress=False)

    def extract(data, out):
        rows = load_training_rows(data)
        return extract_features(taught_target, rows, out, [0, 1], dtype=torch.float32, shard_size=2, progress=False)

    data, other = tmp_path / "data", tmp_path / "other"
    regenerate(taught_target, TOK, prompts[:4], data, **settings)
    first_rows = len(extract(data, tmp_path / "features"))
    regenerate(taught_target, TOK, prompts, data, **settings)
    grown, straight = extract(data, tmp_path / "features"), extract(data, tmp_path / "straight")
    assert first_rows < len(grown) == len(straight) and grown.manifest == straight.manifest
    regenerate(taught_target, TOK, ["hello there", "count to four"], other, **settings)
    other_features = extract(other, tmp_path / "other-features")

    rows, features = rows_with_features(
        [str(data), str(other)], [1, 0], [str(tmp_path / "features"), str(tmp_path / "other-features")], 64
    )
    first_shard = len(load_training_rows(data, 1))
    assert rows[FEATURE_INDEX] == [*range(first_shard), *range(len(grown), len(grown) + len(other_features))]
    expected = [straight.row(i) for i in range(first_shard)] + [other_features.row(i) for i in range(len(other_features))]
    assert all(torch.equal(features.row(index), stored) for index, stored in zip(rows[FEATURE_INDEX], expected))


def test_metadata_is_recorded_and_a_mismatched_resume_raises(taught_target, tmp_path):
    out, prompts = tmp_path / "out", ["hello", "name a color"]
    settings = dict(shard_size=1, max_new_tokens=8, target_name="tiny-taught", progress=False)
    data = regenerate(taught_target, TOK, prompts, out, **settings)
    manifest = json.loads((out / MANIFEST).read_text())
    assert json.loads(data.info.description) == manifest
    assert manifest["num_prompts"] == 2 and manifest["num_shards"] == 2
    recorded = manifest["settings"]
    assert recorded["target"] == "tiny-taught" and recorded["dtype"] == "torch.float32"
    assert recorded["generation"] == {"do_sample": False, "eos_token_id": [IM_END], "pad_token_id": PAD}
    assert recorded["max_new_tokens"] == 8 and recorded["seed"] == 0 and len(recorded["chat_template_sha256"]) == 64
    assert manifest["versions"]["transformers"] and manifest["versions"]["torch"]

    with pytest.raises(ValueError, match="different prompts_fingerprint: resuming would mix"):
        regenerate(taught_target, TOK, ["hello", "say hi"], out, **settings)
    with pytest.raises(ValueError, match="different settings.max_new_tokens"):
        regenerate(taught_target, TOK, prompts, out, **{**settings, "max_new_tokens": 9})
    with pytest.raises(ValueError, match="different settings.chat_template_sha256"):
        regenerate(taught_target, make_tokenizer(QWEN3_LIKE), prompts, out, **settings)
    with pytest.raises(ValueError, match="different settings.generation, settings.seed"):
        regenerate(taught_target, TOK, prompts, out, **settings, do_sample=True, seed=1)
    assert regenerate(taught_target, TOK, prompts, out, **{**settings, "progress": True}).to_dict() == data.to_dict()
    # the tokenizer counts by its vocabulary, not its path: a copy elsewhere (another machine's cache) resumes
    TOK.save_pretrained(tmp_path / "elsewhere")
    moved = PreTrainedTokenizerFast.from_pretrained(tmp_path / "elsewhere")
    assert moved.name_or_path != TOK.name_or_path and len(recorded["tokenizer_vocab_sha256"]) == 64
    assert regenerate(taught_target, moved, prompts, out, **settings).to_dict() == data.to_dict()


def test_regenerate_bad_inputs_write_nothing(taught_target, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="No prompts to regenerate"):
        regenerate(taught_target, TOK, [" ", ""], out)
    with pytest.raises(ValueError, match="All 1 responses for prompts 0..0 are empty"):
        regenerate(taught_target, TOK, ["say nothing"], out, progress=False)
    assert not out.exists()
    (tmp_path / "other").mkdir()
    Dataset.from_dict({"x": [1]}).to_parquet(tmp_path / "other" / "shard-00000.parquet")
    with pytest.raises(ValueError, match="holds shards but no regeneration.json: not a folder of this kind"):
        regenerate(taught_target, TOK, ["hello"], tmp_path / "other", progress=False)
    with pytest.raises(ValueError, match="not a regeneration output"):
        load_regenerated(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Existing conversations

CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "ok?"},
    {"role": "assistant", "content": "ok"},
]


@pytest.mark.parametrize("template", [CHATML, CHATML_MARKED], ids=["token-prefixes", "generation-markers"])
def test_multi_turn_loss_mask(template):
    data = tokenize_conversations(Dataset.from_dict({"messages": [CONVERSATION]}), make_tokenizer(template))
    pieces = [  # (tokens, trained?) by hand: each assistant content and its <|im_end|>, not the "\n" after it
        (SYSTEM_IDS + ids("<|im_start|>", "user\nhi", "<|im_end|>", "\n") + ASSISTANT_HEADER_IDS, 0),
        (ids("yo", "<|im_end|>"), 1),
        (ids("\n", "<|im_start|>", "user\nok?", "<|im_end|>", "\n") + ASSISTANT_HEADER_IDS, 0),
        (ids("ok", "<|im_end|>"), 1),
        (ids("\n"), 0),
    ]
    assert data[0]["input_ids"] == [t for tokens, _ in pieces for t in tokens]
    assert data[0]["loss_mask"] == [m for tokens, m in pieces for _ in tokens]


def test_token_prefix_mask_with_a_qwen3_style_think_block():
    data = tokenize_conversations(Dataset.from_dict({"messages": [CONVERSATION]}), make_tokenizer(QWEN3_LIKE))
    input_ids, mask = data[0]["input_ids"], data[0]["loss_mask"]
    trained = [t for t, m in zip(input_ids, mask) if m]
    # the earlier turn is rendered without a think block; the last one with it, which the target writes itself
    assert trained == ids("yo", "<|im_end|>", "<think>\n\n</think>\n\nok", "<|im_end|>")
    assert input_ids[-1:] == ids("\n") and mask[-1] == 0


def test_tokenize_conversations_bad_inputs():
    with pytest.raises(ValueError, match="not a token prefix"):
        tokenize_conversations(Dataset.from_dict({"messages": [CONVERSATION]}), make_tokenizer(NO_PREFIX))
    with pytest.raises(ValueError, match=r"no column 'messages'; the dataset has columns \['chat'\]"):
        tokenize_conversations(Dataset.from_dict({"chat": [CONVERSATION]}), TOK)
    with pytest.raises(ValueError, match="is empty"):
        tokenize_conversations(Dataset.from_dict({"messages": []}), TOK)
    with pytest.raises(ValueError, match="has an assistant token"):
        tokenize_conversations(Dataset.from_dict({"messages": [chat("hi")]}), TOK)
    # max_length cuts sequences; the second conversation is left without an assistant token and dropped
    full = tokenize_conversations(Dataset.from_dict({"messages": [CONVERSATION]}), TOK)[0]
    two = Dataset.from_dict({"messages": [CONVERSATION, chat("a" * 50, "b")]})
    cut = tokenize_conversations(two, TOK, max_length=45)
    assert cut["input_ids"] == [full["input_ids"][:45]] and cut["loss_mask"] == [full["loss_mask"][:45]]
    assert 0 < sum(cut["loss_mask"][0]) < sum(full["loss_mask"])


@pytest.mark.slow
def test_smollm2_template_prefixes():
    """The real SmolLM2 tokenizer (embedded target; converted once, ~30 s, then cached)."""
    from transformers import AutoTokenizer

    from carryover_common.targets import resolve_target_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(None))
    turn = template_turn(tokenizer, "user")
    header = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert tokenizer.decode(turn.prefix_ids) == header + "<|im_start|>user\n"
    assert turn.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    data = tokenize_conversations(Dataset.from_dict({"messages": [CONVERSATION]}), tokenizer)
    trained = [t for t, m in zip(data[0]["input_ids"], data[0]["loss_mask"]) if m]
    assert tokenizer.decode(trained) == "yo<|im_end|>ok<|im_end|>"


def test_rows_without_an_anchor_are_dropped_with_a_warning(caplog):
    from datasets import Dataset

    from trainer.build import prepare_rows

    rows = Dataset.from_list([
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]},  # one response token: no block can anchor
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 0]},  # two one-token turns: none either
    ])
    with caplog.at_level("WARNING", logger="trainer.build"):
        kept = prepare_rows(rows, max_seq_length=16)
    assert kept["input_ids"] == [[1, 2, 3, 4, 5]] and kept["loss_mask"] == [[0, 0, 1, 1, 1]]
    assert "Dropped 2 of 3 rows" in caplog.text
    with pytest.raises(ValueError, match="None of the 3 rows"):
        prepare_rows(rows, max_seq_length=3)
    with pytest.raises(ValueError, match=r"1 rows have a loss_mask of another length than their input_ids \(first: row 1\)"):
        prepare_rows(Dataset.from_list([rows[0], {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1]}]), 16)
    # a batch of what is kept always anchors a block (a kept one-token-turn row stopped training midway)
    from trainer.carryover_trainer import pad_collator
    from trainer.objectives import sample_anchors

    _, anchor_valid = sample_anchors(pad_collator(list(kept))["loss_mask"], num_anchors=4)
    assert anchor_valid.any()


def test_heldout_prompts_avoid_every_training_prompt(taught_target, tmp_path):
    """evaluation/heldout.py on a real regenerated folder: python-code tasks on functions no training prompt names,
    and Magpie prompts sampled from the target that equal no training prompt, as a benchmark folder."""
    from carryover_common.benchmarks import load_benchmark
    from evaluation import heldout

    code = python_code_prompts(3, seed=0)
    data = regenerate(taught_target, TOK, ["hello", "count to three", *code], tmp_path / "data", max_new_tokens=4)
    training_names = python_code_names(data["prompt"])
    assert len(training_names) >= 1 and "hello" in data["prompt"]
    taught_target.save_pretrained(tmp_path / "target")
    TOK.save_pretrained(tmp_path / "target")
    subsets = heldout.main([
        "--data_dir", str(tmp_path / "data"), "--output_dir", str(tmp_path / "heldout"), "--num_prompts", "3",
        "--target", str(tmp_path / "target"), "--magpie_max_new_tokens", "24", "--magpie_batch_size", "8",
    ])
    assert load_benchmark(str(tmp_path / "heldout")) == subsets
    names = python_code_names(subsets["python_code"])
    assert len(names) == 3 and not names & training_names
    assert subsets["python_code"] == python_code_prompts(3, seed=1, skip_names=training_names)
    # the target has memorised four user turns; the two the training data used are never held out
    assert subsets["magpie"] and set(subsets["magpie"]) <= {"name a color", "say nothing"}
    with pytest.raises(ValueError, match="held-out subsets"):
        heldout.main(["--data_dir", str(tmp_path / "data"), "--subsets", "humaneval"])


def test_run_regenerates_then_trains_on_the_responses(taught_target, tmp_path):
    """`trainer/run.py --prompts <file>` (no --dataset): the target's greedy responses are regenerated into --data_dir,
    then the drafter trains on them, and the run records that folder as its data."""
    from trainer.run import main as run_main

    target_dir = tmp_path / "target"
    taught_target.generation_config.update(eos_token_id=IM_END, pad_token_id=PAD)
    taught_target.save_pretrained(target_dir)
    TOK.save_pretrained(target_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": user}) + "\n" for user, _ in TAUGHT[:3]))
    trainer = run_main([
        "--target", str(target_dir), "--prompts", str(prompts), "--data_dir", str(tmp_path / "data"),
        "--max_new_tokens", "16", "--shard_size", "2", "--output_dir", str(tmp_path / "out"), "--num_draft_layers", "1",
        "--block_size", "3", "--num_anchors", "4", "--per_device_train_batch_size", "2", "--max_steps", "2",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    rows = load_regenerated(tmp_path / "data")
    responses = [TOK.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]) for row in rows]
    assert responses == [f"{answer}<|im_end|>" for _, answer in TAUGHT[:3]]
    assert trainer.state.global_step == 2 and trainer.inputs_record["dataset"] == [str(tmp_path / "data")]
