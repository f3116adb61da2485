"""Serving with carryover in vLLM (serving/vllm_plugin.py, serving/vllm_carryover.py), with vLLM's CPU build really running:
greedy outputs equal vLLM's own decoding without speculation (concurrency 1 and 4), every proposal equals the one
`generate`'s CandidateGenerator makes at the same anchor (carryover on and off), requests that end mid-round, and
batches whose requests carry different numbers of rejected rows; all of it for a drafter on the target's whole
vocabulary and for the same drafter on a draft vocabulary (token map); and stock vLLM DFlash serving the draft
vocabulary with the head `hub/convert.py --to dflash --verifier` exports. One vLLM engine per drafter serves all tests
(an engine start takes about half a minute here); a plain engine runs first for the reference outputs. Runs in the
serving venv (serving/vllm_env.sh); skipped where vLLM is not installed."""

import gc
import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from conftest import greedy_dataset, make_drafter, make_target, train_drafter  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

import modeling_carryover as mc  # noqa: E402
from hub.convert import export_dflash, import_drafter  # noqa: E402
from serving.vllm_carryover import RECORD_ENV, check_pair  # noqa: E402
from serving.vllm_plugin import export_vllm  # noqa: E402
from trainer.build import draft_vocab_from_rows  # noqa: E402

BLOCK_SIZE = 4
DRAFT_VOCAB = 40  # of the tiny target's 96 tokens; vLLM pads the drafter's head to 64 rows
SHIPPED_DRAFTER = Path(__file__).parents[1] / "hub" / "embedded" / "smollm2-135m-instruct" / "dflash-baseline"
MAX_TOKENS = 32
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, enforce_eager=True, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target and a drafter trained on its greedy outputs (baseline, then carryover), and the same drafter on a
    draft vocabulary (the DRAFT_VOCAB most frequent response tokens), saved and exported."""
    folder = tmp_path_factory.mktemp("vllm")
    target = make_target("llama", num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: vLLM CPU's smallest
    dataset = greedy_dataset(target, num_rows=32, new_tokens=40)
    drafter = make_drafter(target, block_size=BLOCK_SIZE, target_layer_ids=[1, 2])  # vLLM cannot read the last layer
    train_drafter(target, drafter, dataset, carryover=False, epochs=15)
    train_drafter(target, drafter, dataset, carryover=True, epochs=4)
    draft_token_ids = draft_vocab_from_rows(dataset, DRAFT_VOCAB, target.config.vocab_size)
    drafters = {"full vocabulary": drafter, "draft vocabulary": with_draft_vocab(drafter, draft_token_ids)}
    target.save_pretrained(folder / "target")
    for name, each in drafters.items():
        export_vllm(each, folder / name)
    prompts = [row["input_ids"][:n] for row, n in zip(dataset.select(range(4)), (4, 6, 8, 10))]
    prompts += [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7)]
    return {"folder": folder, "target": target, "drafters": drafters, "prompts": prompts}


def with_draft_vocab(drafter, draft_token_ids):
    """`drafter` (its weights and settings, carryover among them), drafting on the target tokens `draft_token_ids`."""
    config = drafter.config.to_dict() | {"draft_vocab_size": len(draft_token_ids)}
    restricted = mc.CarryoverDrafterModel(mc.CarryoverDrafterConfig.from_dict(config)).eval()
    restricted.load_state_dict(drafter.state_dict() | {"draft_token_ids": draft_token_ids})
    return restricted


def engine_env():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the cores are shared
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB


def generate(llm, prompts, per_request=None):
    """Greedy outputs (token ids) and request ids, in prompt order; `per_request`: more sampling settings for each."""
    per_request = per_request or [{}] * len(prompts)
    params = [SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **p}) for p in per_request]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.request_id for o in outputs]


@pytest.fixture(scope="module")
def plain_outputs(models):
    """vLLM without speculation: the reference greedy output of every prompt (MAX_TOKENS tokens)."""
    engine_env()
    llm = LLM(model=str(models["folder"] / "target"), **ENGINE)
    outputs, _ = generate(llm, models["prompts"])
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return outputs


@contextmanager
def speculative_engine(models, export):
    """vLLM serving the export `models["folder"] / export` as its DFlash drafter; every proposal is recorded
    (RECORD_ENV, the plugin's proposer). -> (engine, record file)"""
    engine_env()
    record = models["folder"] / f"proposals-{export}.jsonl"
    os.environ[RECORD_ENV] = str(record)
    speculative = {"method": "dflash", "model": str(models["folder"] / export), "num_speculative_tokens": 3}
    llm = LLM(model=str(models["folder"] / "target"), speculative_config=speculative, **ENGINE)
    try:
        yield llm, record
    finally:
        llm.llm_engine.engine_core.shutdown()
        os.environ.pop(RECORD_ENV, None)
        del llm
        gc.collect()


@pytest.fixture(scope="module", params=["full vocabulary", "draft vocabulary"])
def engine(request, models, plain_outputs):
    """vLLM with the plugin's carryover DFlash proposer serving one of the drafters (the tests run once per drafter,
    one engine each)."""
    with speculative_engine(models, request.param) as (llm, record):
        yield {"llm": llm, "record": record, "drafter": models["drafters"][request.param]}


def proposals(record, request_id):
    """The plugin's recorded proposals of one request, by anchor position."""
    rounds = [json.loads(line) for line in record.read_text().splitlines()]
    return {r["anchor_position"]: r for r in rounds if r["request_id"].startswith(request_id + "-")}


def generate_rounds(models, engine, prompt, carryover):
    """`generate`'s rounds for `prompt` with the engine's drafter, run past MAX_TOKENS so that no round near its end is
    cut short."""
    drafter = engine["drafter"]
    mc.generate(models["target"], torch.tensor([prompt]), assistant_model=drafter, carryover=carryover,
                max_new_tokens=MAX_TOKENS + BLOCK_SIZE, do_sample=False)  # fmt: skip
    return drafter.generation_stats.rounds


def assert_same_proposals(models, engine, request_id, prompt, output, carryover):
    """Every proposal vLLM made before the request's last token is `generate`'s at the same anchor (same drafts, same
    number of carried rows), and vLLM made one at every anchor `generate` made one."""
    end = len(prompt) + len(output) - 1  # vLLM's proposal after the last verification is never verified
    served = {a: r for a, r in proposals(engine["record"], request_id).items() if a < end}
    rounds = [r for r in generate_rounds(models, engine, prompt, carryover) if r.anchor_position < end]
    assert sorted(served) == [r.anchor_position for r in rounds]
    for r in rounds:
        ours = served[r.anchor_position]
        assert (ours["drafts"], ours["carried"]) == (r.drafts, r.carried), (request_id, r, carryover)


def test_lossless_one_request_at_a_time(models, plain_outputs, engine):
    for prompt, expected in zip(models["prompts"], plain_outputs):
        outputs, _ = generate(engine["llm"], [prompt])
        assert outputs == [expected]


def test_lossless_and_proposals_equal_generate_at_concurrency_4(models, plain_outputs, engine):
    """Four requests at a time, carryover on for some and off for others (per request), each proposal as in
    `generate` with the same setting; carryover changes some proposals, so the check sees the carried rows."""
    prompts, expected = models["prompts"][:4], plain_outputs[:4]
    for carry in ([True, False, True, False], [False, True, False, True]):
        per_request = [{"extra_args": {"carryover": c}} for c in carry]
        outputs, request_ids = generate(engine["llm"], prompts, per_request=per_request)
        assert outputs == expected
        for prompt, output, request_id, c in zip(prompts, outputs, request_ids, carry):
            assert_same_proposals(models, engine, request_id, prompt, output, carryover=c)
    changed = [
        [a.drafts for a in generate_rounds(models, engine, p, True)]
        != [b.drafts for b in generate_rounds(models, engine, p, False)]
        for p in prompts
    ]
    assert any(changed)


def test_requests_ending_mid_round(models, plain_outputs, engine):
    """One request stops at a stop token and one at max_tokens, each at the first accepted draft of a round (so inside
    it), while the others go on: all outputs as plain decoding, cut where the request ended, and every proposal as in
    `generate`."""
    prompts = models["prompts"][:4]
    ends = []  # output lengths ending at the first accepted draft of a round, at a token not produced before
    for prompt, expected in zip(prompts[:2], plain_outputs[:2]):
        rounds = generate_rounds(models, engine, prompt, True)
        lengths = [r.anchor_position + 2 - len(prompt) for r in rounds if r.accepted]
        ends.append(next(n for n in lengths if 1 < n < len(expected) and expected[n - 1] not in expected[: n - 1]))
    stop_token = plain_outputs[0][ends[0] - 1]
    per_request = [{"stop_token_ids": [stop_token]}, {"max_tokens": ends[1]}, {}, {}]
    outputs, request_ids = generate(engine["llm"], prompts, per_request=per_request)
    assert outputs[0] == plain_outputs[0][: ends[0]]
    assert outputs[1] == plain_outputs[1][: ends[1]]
    assert outputs[2:] == plain_outputs[2:4]
    for prompt, output, request_id in zip(prompts, outputs, request_ids):
        assert_same_proposals(models, engine, request_id, prompt, output, carryover=True)


def test_batch_with_different_numbers_of_carried_rows(models, plain_outputs, engine):
    """Six requests at once: some proposal carries different numbers of rows for different requests (and none for
    some), and every request's proposals are still `generate`'s."""
    outputs, request_ids = generate(engine["llm"], models["prompts"])
    assert outputs == plain_outputs
    for prompt, output, request_id in zip(models["prompts"], outputs, request_ids):
        assert_same_proposals(models, engine, request_id, prompt, output, carryover=True)
    ours = [json.loads(line) for line in engine["record"].read_text().splitlines()]
    ours = [r for r in ours if any(r["request_id"].startswith(i + "-") for i in request_ids)]
    by_proposal = {}
    for r in ours:
        by_proposal.setdefault(r["proposal"], []).append(r["carried"])
    mixed = [carried for carried in by_proposal.values() if len({c for c in carried if c}) >= 2]
    assert mixed, by_proposal


def test_refuses_a_drafter_that_does_not_fit(models, tmp_path):
    """The checks the proposer runs on load: another target (depth, model type) or another block size."""
    drafter_config = AutoConfig.from_pretrained(models["folder"] / "full vocabulary")
    target_config = models["target"].config
    check_pair(drafter_config, target_config, num_speculative_tokens=BLOCK_SIZE - 1)
    with pytest.raises(ValueError, match="num_speculative_tokens=3, not 5"):
        check_pair(drafter_config, target_config, num_speculative_tokens=5)
    deeper = make_target("llama", num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1).config
    with pytest.raises(ValueError, match="built for a 4-layer target, this one has 6"):
        check_pair(drafter_config, deeper, num_speculative_tokens=BLOCK_SIZE - 1)
    qwen3 = make_target("qwen3", num_attention_heads=2, num_key_value_heads=1).config
    with pytest.raises(ValueError, match="trained for a 'llama' target"):
        check_pair(drafter_config, qwen3, num_speculative_tokens=BLOCK_SIZE - 1)


def test_export_refuses_what_the_plugin_cannot_serve(models, tmp_path):
    target = models["target"]
    for overrides in ({"carryover_interface": "projector"}, {"markov_rank": 4}, {"carry_gate": True}):
        with pytest.raises(ValueError, match="E_carry marker"):
            export_vllm(make_drafter(target, **overrides), tmp_path / "out")


def test_export_keeps_the_draft_vocabulary(models, tmp_path):
    """The export writes a draft vocabulary as vLLM's DFlash reads it (`draft_vocab_size`, speculators' `d2t`/`t2d`);
    the shipped SmolLM2 drafter (8192 of 49152 tokens) exports too."""
    folder = models["folder"] / "draft vocabulary"
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    ids = models["drafters"]["draft vocabulary"].draft_token_ids
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert torch.equal(weights["d2t"] + torch.arange(DRAFT_VOCAB), ids)  # target id = index + d2t[index]
    assert torch.equal(weights["t2d"].nonzero()[:, 0], ids)
    shipped = export_vllm(import_drafter(str(SHIPPED_DRAFTER)), tmp_path / "shipped")
    config = json.loads((shipped / "config.json").read_text())
    assert (config["draft_vocab_size"], config["vocab_size"]) == (8192, 49152)
    assert load_file(shipped / "model.safetensors")["d2t"].shape == (8192,)


def with_first_k_norm(drafter):
    """A copy of `drafter` whose layers all norm their keys with the first layer's k_norm weight: vLLM 0.32's own
    DFlash on CPU applies that weight to every layer's context keys (the bug in the README; the plugin's drafter norms
    each layer with its own), so stock vLLM serves this copy as it was trained."""
    copy = with_draft_vocab(drafter, drafter.draft_token_ids)
    for layer in copy.layers[1:]:
        layer.self_attn.k_norm.weight.data.copy_(copy.layers[0].self_attn.k_norm.weight)
    return copy


def test_stock_vllm_serves_a_draft_vocabulary_with_the_exported_head(models, plain_outputs):
    """`hub/convert.py --to dflash --verifier`'s export of the draft-vocabulary drafter (its own head: the target LM
    head's rows of the draft tokens, and `d2t`) served as vLLM's own DFlash: its drafter class, weight loading and head
    (the plugin's proposer runs a drafter without E_carry as stock DFlash and only records the proposals). vLLM keeps
    the exported head instead of sharing the target's and maps its argmax through `d2t`: lossless at concurrency 4,
    and every proposal is `generate`'s with carryover off (`with_first_k_norm` keeps vLLM's CPU k_norm bug out)."""
    drafter = with_first_k_norm(models["drafters"]["draft vocabulary"])
    with warnings.catch_warnings():  # E_carry has no place in the format: dropped, as it should be
        warnings.filterwarnings("ignore", message=".*has no place for the carryover part")
        folder = export_dflash(drafter, models["folder"] / "stock", target_lm_head=models["target"].lm_head.weight)
    head = load_file(folder / "model.safetensors")["lm_head.weight"]
    assert torch.equal(head, models["target"].lm_head.weight[drafter.draft_token_ids])  # [DRAFT_VOCAB, d]
    prompts = models["prompts"][:4]
    with speculative_engine(models, "stock") as (llm, record):
        outputs, request_ids = generate(llm, prompts)
    assert outputs == plain_outputs[:4]
    engine = {"record": record, "drafter": drafter}
    for prompt, output, request_id in zip(prompts, outputs, request_ids):
        assert_same_proposals(models, engine, request_id, prompt, output, carryover=False)
