"""Checkpoint conversion (hub/convert.py): z-lab DFlash, DeepSpec DSpark, speculators and transformers' built-in
DFlash in, z-lab, speculators and transformers' built-in DFlash out.

Imported drafters are judged against an independent plain-torch forward written here from z-lab's dflash/model.py
and speculators' models/dflash/attention.py (not from this project's model), on a real tiny Qwen3 target; the
transformers export decodes through transformers' own DFlash path.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import REPO_ROOT, make_drafter, make_target, trained_drafter
from transformers import AutoModel, DynamicCache
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from hub.convert import export_dflash, export_speculators, export_transformers, import_drafter
import modeling_carryover as mc
from modeling_carryover import CarryoverDrafterModel

# z-lab-format drafter for the tiny Qwen3 target (4 layers, hidden 64, vocab 96). Layer ids [0, 2] are asymmetric
# and skip the last layer, so an off-by-one in the feature index changes the result.
HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 4, 2, 16, 128, 2
TARGET_LAYER_IDS, BLOCK_SIZE, MASK_TOKEN_ID, ROPE_THETA = [0, 2], 4, 95, 5000.0


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


def zlab_config(target) -> dict:
    """The config.json layout of z-lab/Qwen3-8B-DFlash-b16 (legacy rope_theta, as published), at tiny size."""
    text = target.config
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": BLOCK_SIZE,
        "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS},
        "num_target_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "max_position_embeddings": 512,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "layer_types": ["full_attention"] * LAYERS,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }


def zlab_weights(hidden_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random z-lab weights; norm weights are random too, so a swapped or skipped norm shows."""
    generator = torch.Generator().manual_seed(seed)

    def linear(rows, cols):
        return 0.1 * torch.randn(rows, cols, generator=generator)

    def norm(size):
        return 1 + 0.2 * torch.randn(size, generator=generator)

    d, q, kv = hidden_size, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights = {"fc.weight": linear(d, len(TARGET_LAYER_IDS) * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": linear(q, d),
            p + "self_attn.k_proj.weight": linear(kv, d),
            p + "self_attn.v_proj.weight": linear(kv, d),
            p + "self_attn.o_proj.weight": linear(d, q),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM),
            p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": linear(INTERMEDIATE, d),
            p + "mlp.up_proj.weight": linear(INTERMEDIATE, d),
            p + "mlp.down_proj.weight": linear(d, INTERMEDIATE),
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
        }
    return weights


def write_checkpoint(folder, config, weights):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("zlab")
    return write_checkpoint(folder, zlab_config(target), zlab_weights(target.config.hidden_size))


# ----------------------------------------------------------------------------------------------------------------
# Independent reference: z-lab's DFlashDraftModel.forward (dflash/model.py), in plain torch, with speculators'
# sliding-window rule (models/dflash/attention.py, create_anchor_block_mask_mod)
# ----------------------------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta):
    """Qwen3 RoPE (rotate_half) of x [heads, T, D] at absolute positions [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@torch.no_grad()
def zlab_reference_logits(weights, config, target, context_hidden_states, anchor_id, sliding=None):
    """z-lab drafting of the block [anchor, MASK x (B-1)] right after the context (fresh cache), then the target's
    lm_head on slots 1..B-1. context_hidden_states: the target's output_hidden_states for positions 0..T-1.
    sliding: (layer_types, window, non_causal): speculators' rule in its sliding_attention layers, where the block
    at anchor a sees the context rows at positions >= a - window (and < a) and, unless non_causal, itself causally."""
    W, B = weights, config["block_size"]
    ids, mask_id = config["dflash_config"]["target_layer_ids"], config["dflash_config"]["mask_token_id"]
    ctx = torch.cat([context_hidden_states[i + 1][0] for i in ids], dim=-1)  # extract_context_feature: offset 1
    ctx = rms_norm(ctx @ W["fc.weight"].T, W["hidden_norm.weight"])  # [T, d], one tensor for every layer
    T = ctx.shape[0]
    positions = torch.arange(T + B)  # context rows at their positions, the block at T .. T+B-1
    h = target.get_input_embeddings()(torch.tensor([anchor_id] + [mask_id] * (B - 1)))  # [B, d]
    visible = {"full_attention": torch.ones(B, T + B, dtype=torch.bool)}  # non-causal: the block sees everything
    if sliding is not None:
        layer_types, window, non_causal = sliding
        in_block = torch.ones(B, B, dtype=torch.bool) if non_causal else torch.ones(B, B, dtype=torch.bool).tril()
        visible["sliding_attention"] = torch.cat([(positions[:T] >= T - window).expand(B, T), in_block], dim=1)
    layer_types = sliding[0] if sliding is not None else ["full_attention"] * config["num_hidden_layers"]
    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}."
        x = rms_norm(h, W[p + "input_layernorm.weight"])
        q = (x @ W[p + "self_attn.q_proj.weight"].T).view(B, HEADS, HEAD_DIM)
        q = rms_norm(q, W[p + "self_attn.q_norm.weight"])
        rows = torch.cat([ctx, x])  # keys/values from [context ; block]
        k = (rows @ W[p + "self_attn.k_proj.weight"].T).view(T + B, KV_HEADS, HEAD_DIM)
        k = rms_norm(k, W[p + "self_attn.k_norm.weight"])
        v = (rows @ W[p + "self_attn.v_proj.weight"].T).view(T + B, KV_HEADS, HEAD_DIM)
        q = rotate(q.transpose(0, 1), positions[-B:], ROPE_THETA)  # queries: the trailing slice of the tables
        k = rotate(k.transpose(0, 1), positions, ROPE_THETA).repeat_interleave(HEADS // KV_HEADS, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        scores = (q @ k.transpose(1, 2) * HEAD_DIM**-0.5).masked_fill(~visible[layer_types[layer]], float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ v
        h = h + attn.transpose(0, 1).reshape(B, HEADS * HEAD_DIM) @ W[p + "self_attn.o_proj.weight"].T
        y = rms_norm(h, W[p + "post_attention_layernorm.weight"])
        mlp = F.silu(y @ W[p + "mlp.gate_proj.weight"].T) * (y @ W[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ W[p + "mlp.down_proj.weight"].T
    return target.lm_head(rms_norm(h, W["norm.weight"])[1:])  # [B-1, V]


@torch.no_grad()
def drafter_logits(drafter, target, context_hidden_states, anchor_id):
    """The same block through this project's drafter (no cache): [B-1, V]."""
    T = context_hidden_states[0].shape[1]
    block_ids, block_positions = drafter.block_inputs(torch.tensor([anchor_id]), torch.tensor([T]))
    out = drafter(
        target.get_input_embeddings()(block_ids)[None],
        block_positions[None],
        context_features=drafter.target_features(context_hidden_states),
        context_position_ids=torch.arange(T)[None],
    )
    return target.lm_head(out.last_hidden_state[0, 0, 1:])


def prefix_hidden_states(target, sequence, length):
    with torch.no_grad():
        return target(sequence[:, :length], output_hidden_states=True).hidden_states


def generate_with(drafter, target, prompt, max_new_tokens=16):
    return mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False, carryover=False)


PROMPT = torch.tensor([[3, 17, 42, 8, 61, 5, 29]])


# ----------------------------------------------------------------------------------------------------------------
# z-lab DFlash import
# ----------------------------------------------------------------------------------------------------------------


def test_zlab_import_matches_reference_forward(zlab_dir, target):
    drafter = import_drafter(str(zlab_dir))
    config = drafter.config
    assert (config.target_layer_ids, config.block_size) == (TARGET_LAYER_IDS, BLOCK_SIZE)
    assert config.mask_token_id == MASK_TOKEN_ID
    assert config.rope_parameters["rope_theta"] == ROPE_THETA and config.carryover is False
    assert not drafter.carry_embedding.any()  # E_carry zero: a plain baseline until carryover training
    weights, zconfig = load_file(zlab_dir / "model.safetensors"), zlab_config(target)
    for length in (3, PROMPT.shape[1]):
        hidden_states = prefix_hidden_states(target, PROMPT, length)
        anchor = int(PROMPT[0, length - 1])
        torch.testing.assert_close(
            drafter_logits(drafter, target, hidden_states, anchor),
            zlab_reference_logits(weights, zconfig, target, hidden_states, anchor),
            atol=1e-5,
            rtol=1e-4,
        )


def test_zlab_import_proposes_what_the_reference_proposes_in_generate(zlab_dir, target):
    """Every round's drafts inside `generate` equal the reference's argmax on the committed prefix."""
    drafter = import_drafter(str(zlab_dir))
    weights, zconfig = load_file(zlab_dir / "model.safetensors"), zlab_config(target)
    output = generate_with(drafter, target, PROMPT)
    assert torch.equal(output, target.generate(PROMPT, max_new_tokens=16, do_sample=False))
    rounds = drafter.generation_stats.rounds
    assert len(rounds) > 5
    for draft_round in rounds:
        anchor_position = draft_round.anchor_position  # context: every committed position before the anchor
        hidden_states = prefix_hidden_states(target, output, anchor_position)
        logits = zlab_reference_logits(weights, zconfig, target, hidden_states, int(output[0, anchor_position]))
        assert draft_round.drafts == logits[: draft_round.proposed].argmax(-1).tolist()


def test_zlab_round_trip_is_lossless(zlab_dir, target, tmp_path):
    drafter = import_drafter(str(zlab_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a baseline loses nothing, so nothing to warn about
        exported = export_dflash(drafter, tmp_path / "zlab")
    original, again = load_file(zlab_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    source, written = zlab_config(target), json.loads((exported / "config.json").read_text())
    assert "auto_map" not in written  # it would name z-lab's dflash.py, which is not in the folder
    for key in source:
        if key not in ("rope_scaling", "auto_map"):  # rope_scaling: None in the source (default RoPE), not written
            assert written[key] == source[key], key
    reimported = import_drafter(str(exported))
    assert_same_weights(drafter, reimported)
    assert generate_with(reimported, target, PROMPT).tolist() == generate_with(drafter, target, PROMPT).tolist()
    assert rounds_of(reimported) == rounds_of(drafter)


def assert_same_weights(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if key not in skip:
            assert torch.equal(sa[key], sb[key]), key


def rounds_of(drafter):
    return [(r.anchor_position, r.drafts) for r in drafter.generation_stats.rounds]


# ----------------------------------------------------------------------------------------------------------------
# Export of this project's drafter: speculators (keeps the Markov head), z-lab (drops it)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def markov_drafter(target):
    """A carryover drafter with a Markov head; the zero-initialised parts get values so that a mix-up shows."""
    drafter = make_drafter(target, markov_rank=8, target_layer_ids=TARGET_LAYER_IDS)
    with torch.no_grad():
        drafter.markov_proj.weight.normal_(std=2.0)
        drafter.carry_embedding.normal_()
    return drafter


def test_exports_drop_the_carry_gate_with_a_warning(target, tmp_path):
    """No format has a place for the carry gates: an export names them with the rest of the carryover part it drops
    (it then drafts as the drafter does with carryover off, where the gates act on nothing)."""
    drafter = make_drafter(target, carry_gate=True, target_layer_ids=TARGET_LAYER_IDS)
    with torch.no_grad():
        drafter.carry_gate.normal_()
    with pytest.warns(UserWarning, match=r"carryover part \(carry_embedding, carry_gate\)"):
        exported = export_dflash(drafter, tmp_path / "zlab")
    assert not any(key.startswith("carry") for key in load_file(exported / "model.safetensors"))


def test_speculators_round_trip_keeps_markov_head_and_layer_ids(markov_drafter, target, tmp_path):
    with pytest.warns(UserWarning, match=r"speculators format has no place for the carryover part \(carry_embedding\)"):
        exported = export_speculators(markov_drafter, tmp_path / "spec", verifier="Qwen/Qwen3-0.6B")
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in TARGET_LAYER_IDS] == [1, 3]
    # vLLM's update_dflash maps the speculators ids back with - 1: z-lab's (and our) convention
    assert [i - 1 for i in config["aux_hidden_state_layer_ids"]] == TARGET_LAYER_IDS
    assert config["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy", "speculative_tokens": BLOCK_SIZE - 1, "verifier_accept_k": 1, "accept_tolerance": 0.0
    }
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "Qwen/Qwen3-0.6B", "architectures": ["Qwen3ForCausalLM"]}
    weights = load_file(exported / "model.safetensors")
    assert torch.equal(weights["markov_head.markov_w1.weight"], markov_drafter.markov_embed.weight)
    assert torch.equal(weights["markov_head.markov_w2.weight"], markov_drafter.markov_proj.weight)
    assert not any(key.startswith("carry") for key in weights)

    reimported = import_drafter(str(exported))
    assert reimported.config.target_layer_ids == TARGET_LAYER_IDS and reimported.config.markov_rank == 8
    assert_same_weights(markov_drafter, reimported, skip={"carry_embedding"})
    assert not reimported.carry_embedding.any()
    output = generate_with(reimported, target, PROMPT)
    assert output.tolist() == generate_with(markov_drafter, target, PROMPT).tolist()
    assert rounds_of(reimported) == rounds_of(markov_drafter)


def test_speculators_import_reads_the_target_depth_from_the_verifier(markov_drafter, target, tmp_path):
    """Checkpoints written by speculators itself do not record num_target_layers: the verifier's config has it."""
    target.config.save_pretrained(tmp_path / "verifier")
    with pytest.warns(UserWarning):
        folder = export_speculators(markov_drafter, tmp_path / "spec", verifier=str(tmp_path / "verifier"))
    config = json.loads((folder / "config.json").read_text())
    del config["num_target_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    assert import_drafter(str(folder)).config.num_target_layers == target.config.num_hidden_layers == 4


def test_dflash_export_drops_markov_and_carryover_with_a_warning(markov_drafter, tmp_path):
    dropped = r"carry_embedding.*Markov head \(markov_embed.weight, markov_proj.weight, confidence_head"
    with pytest.warns(UserWarning, match=dropped):
        exported = export_dflash(markov_drafter, tmp_path / "zlab")
    config = json.loads((exported / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS}
    reimported = import_drafter(str(exported))
    assert reimported.config.markov_rank == 0
    backbone = reimported.state_dict()
    for key, tensor in markov_drafter.state_dict().items():
        if key in backbone and key != "carry_embedding":
            assert torch.equal(backbone[key], tensor), key


def test_speculators_export_records_the_verifiers_architectures(zlab_dir, target, tmp_path):
    """An imported z-lab drafter records no target type: the architectures come from the verifier's config.json, as
    speculators writes them; a verifier whose config cannot be read is an error, not an empty list."""
    drafter = import_drafter(str(zlab_dir))
    target.save_pretrained(tmp_path / "verifier")  # as published: config.json with "architectures"
    folder = export_speculators(drafter, tmp_path / "spec", verifier=str(tmp_path / "verifier"))
    verifier = json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="Cannot tell the verifier's architectures"):
        export_speculators(drafter, tmp_path / "spec2", verifier="nobody/unreadable-offline")


def test_export_warns_when_vllm_cannot_capture_the_last_layer(target, tmp_path):
    drafter = make_drafter(target, target_layer_ids=[0, 3], carryover=False)
    with pytest.warns(UserWarning, match="target layer 3 is the target's last layer"):
        export_speculators(drafter, tmp_path / "spec", verifier="some/target")


# ----------------------------------------------------------------------------------------------------------------
# DeepSpec DSpark and speculators variants
# ----------------------------------------------------------------------------------------------------------------


def dspark_checkpoint(folder, target, confidence_head_with_markov=True, **overrides):
    """DeepSpec's Qwen3DSparkModel layout: a Qwen3Config plus its own fields; weights with the target copies and
    markov_head.markov_w1/w2, confidence_head.proj."""
    generator = torch.Generator().manual_seed(3)
    text, rank = target.config, 8
    config = {key: value for key, value in zlab_config(target).items() if key not in ("auto_map", "dflash_config")}
    config |= {
        "architectures": ["Qwen3DSparkModel"],
        "target_layer_ids": TARGET_LAYER_IDS,
        "mask_token_id": MASK_TOKEN_ID,
        "num_anchors": 512,
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": confidence_head_with_markov,
        **overrides,
    }
    width = text.hidden_size + (rank if confidence_head_with_markov else 0)
    weights = zlab_weights(text.hidden_size) | {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.lm_head.weight.detach().clone(),
        "markov_head.markov_w1.weight": torch.randn(text.vocab_size, rank, generator=generator),
        "markov_head.markov_w2.weight": torch.randn(text.vocab_size, rank, generator=generator),
        "confidence_head.proj.weight": torch.randn(1, width, generator=generator),
        "confidence_head.proj.bias": torch.randn(1, generator=generator),
    }
    return write_checkpoint(folder, config, weights), weights


def test_dspark_block_layout_is_refused_unless_init_only(target, tmp_path):
    folder, _ = dspark_checkpoint(tmp_path / "dspark", target)
    layout = r"anchor slot is the first prediction \(slot k predicts token\[a\+k\+1\]\).*init_only"
    with pytest.raises(ValueError, match=layout):
        import_drafter(str(folder))


@pytest.mark.parametrize("with_markov", [True, False])
def test_dspark_init_only_maps_markov_and_confidence_heads(target, tmp_path, with_markov):
    folder, weights = dspark_checkpoint(tmp_path / "dspark", target, confidence_head_with_markov=with_markov)
    with pytest.warns(UserWarning, match="initialisation only"):
        drafter = import_drafter(str(folder), init_only=True)
    assert drafter.config.block_size == BLOCK_SIZE and drafter.config.target_layer_ids == TARGET_LAYER_IDS
    assert torch.equal(drafter.markov_embed.weight, weights["markov_head.markov_w1.weight"])  # W1 [V, r]
    assert torch.equal(drafter.markov_proj.weight, weights["markov_head.markov_w2.weight"])  # W2 [V, r]
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, weights["layers.1.mlp.down_proj.weight"])
    # DSpark's corrected logits U_k + W2(W1[x]) and confidence sigmoid(proj([h ; W1[x]])) or sigmoid(proj(h))
    prev, hidden = torch.tensor([5, 17]), torch.randn(2, target.config.hidden_size)
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    torch.testing.assert_close(drafter.markov_correction(prev), w1[prev] @ w2.T)
    features = torch.cat([hidden, w1[prev]], -1) if with_markov else hidden
    expected = torch.sigmoid(features @ weights["confidence_head.proj.weight"].T + weights["confidence_head.proj.bias"])
    torch.testing.assert_close(drafter.confidence(hidden, prev), expected[:, 0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"markov_head_type": "gated"}, "'gated' Markov head: not supported"),
        ({"target_layer_ids": [-1, 2]}, r"use -1 \(the embedding output\)"),
        ({"architectures": ["Gemma4DSparkModel"]}, "Gemma4DSparkModel is not supported"),
    ],
)
def test_unsupported_dspark_variants_are_named(target, tmp_path, overrides, message):
    folder, _ = dspark_checkpoint(tmp_path / "dspark", target, **overrides)
    with pytest.raises(ValueError, match=message):
        import_drafter(str(folder), init_only=True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(sample_from_anchor=True), "anchor slot is the first prediction"),
        (lambda c: c.pop("sample_from_anchor"), "anchor slot is the first prediction"),  # dspark's default: True
        (lambda c: c.update(aux_hidden_state_layer_ids=[0, 3]), r"include 0 \(the embedding output\)"),
        (lambda c: c.update(draft_vocab_size=32), "lacks its d2t/t2d token maps"),
        (lambda c: c.update(speculators_model_type="eagle3"), "not a DFlash-family drafter"),
    ],
)
def test_unsupported_speculators_variants_are_named(markov_drafter, tmp_path, edit, message):
    with pytest.warns(UserWarning):
        folder = export_speculators(markov_drafter, tmp_path / "spec", verifier="some/target")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        import_drafter(str(folder))


# ----------------------------------------------------------------------------------------------------------------
# Unknown and corrupt checkpoints
# ----------------------------------------------------------------------------------------------------------------


def corrupt(folder, name):
    config, weights = json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")
    if name == "no config":
        (folder / "config.json").unlink()
    elif name == "bad json":
        (folder / "config.json").write_text("{not json")
    elif name == "llama model":
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    elif name == "no weights":
        (folder / "model.safetensors").unlink()
    elif name == "missing tensor":
        del weights["layers.1.mlp.down_proj.weight"]
        save_file(weights, folder / "model.safetensors")
    elif name == "wrong shape":
        config["intermediate_size"] = 64
        (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "name, message",
    [
        ("no config", "has no config.json; expected a drafter checkpoint in one of the formats: .*z-lab DFlash"),
        ("bad json", "is not valid JSON"),
        ("llama model", r"Unrecognised drafter checkpoint \(model_type='llama'.*expected one of the formats"),
        ("no weights", r"has no \*.safetensors weights"),
        ("missing tensor", r"missing \['layers.1.mlp.down_proj.weight'\]"),
        ("wrong shape", r"wrong shapes \['layers.0.mlp.down_proj.weight \(64, 128\) != \(64, 64\)"),
    ],
)
def test_unknown_or_corrupt_checkpoints_say_what_was_expected(target, tmp_path, name, message):
    folder = write_checkpoint(tmp_path / "zlab", zlab_config(target), zlab_weights(target.config.hidden_size))
    corrupt(folder, name)
    with pytest.raises(ValueError, match=message):
        import_drafter(str(folder))


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def run_convert(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "hub/convert.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_cli_imports_zlab_and_rejects_unknown_formats(zlab_dir, tmp_path):
    done = run_convert("--source", str(zlab_dir), "--output_dir", str(tmp_path / "ours"))
    assert done.returncode == 0, done.stderr
    assert_same_weights(CarryoverDrafterModel.from_pretrained(tmp_path / "ours"), import_drafter(str(zlab_dir)))
    assert (tmp_path / "ours" / "custom_generate" / "generate.py").is_file()
    done = run_convert("--source", str(zlab_dir), "--output_dir", str(tmp_path / "hf"), "--to", "transformers")
    assert done.returncode == 0, done.stderr
    assert_same_weights(import_drafter(str(tmp_path / "hf")), import_drafter(str(zlab_dir)))

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    failed = run_convert("--source", str(tmp_path / "llama"), "--output_dir", str(tmp_path / "out"), "--to", "dflash")
    assert failed.returncode == 1 and "convert: Unrecognised drafter checkpoint" in failed.stderr
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# transformers' built-in DFlash (MuseGlimmerAssistantModel, speculation_type="dflash")
# ----------------------------------------------------------------------------------------------------------------


def builtin_dflash_proposals(monkeypatch):
    """Record what transformers' own DFlashTokenCandidateGenerator proposes each round."""
    proposals, get_candidates = [], DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            proposals.append((input_ids.shape[1] - 1, candidates[0, input_ids.shape[1] :].tolist()))
        return candidates, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", recording)
    return proposals


def test_transformers_export_decodes_in_transformers_builtin_dflash(tmp_path, monkeypatch):
    """A carryover-trained drafter exported for transformers loads with AutoModel (no remote code) and, through
    `target.generate(..., speculation_type="dflash")`, proposes round for round what this project proposes with
    carryover off; both outputs are the target's greedy output. The export imports back to the same weights."""
    target, drafter, dataset = trained_drafter("qwen3", 4, 0)
    with pytest.warns(UserWarning, match="no place for the carryover part"):
        exported = export_transformers(drafter, tmp_path / "hf")
    assert sorted(path.name for path in exported.iterdir()) == ["config.json", "model.safetensors"]
    builtin = AutoModel.from_pretrained(exported)
    assert type(builtin).__name__ == "MuseGlimmerAssistantModel"
    proposals = builtin_dflash_proposals(monkeypatch)
    accepted = 0
    for row in dataset.select(range(3)):
        prompt, proposals[:] = torch.tensor([row["input_ids"][:6]]), []
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        theirs = target.generate(prompt, assistant_model=builtin, speculation_type="dflash", max_new_tokens=24, do_sample=False)
        ours = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, carryover=False)
        assert torch.equal(theirs, expected) and torch.equal(ours, expected)
        rounds = drafter.generation_stats.rounds
        assert len(proposals) == len(rounds)
        assert [(anchor, drafts[: r.proposed]) for (anchor, drafts), r in zip(proposals, rounds)] == rounds_of(drafter)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 10  # the rounds commit several rows, not only the bonus token
    reimported = import_drafter(str(exported))
    assert reimported.config.layer_types == ["full_attention"] * 2
    assert_same_weights(drafter, reimported, skip={"carry_embedding"})


def partial_rope_drafter(target):
    return make_drafter(target, rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("export", ["dflash", "speculators", "transformers"])
def test_partial_rope_drafters_are_not_exported(target, tmp_path, export):
    """z-lab's, speculators' and transformers' DFlash layers rotate the whole head (their default RoPE ignores the
    factor): writing the drafter there would change its drafts, so the export refuses and writes nothing."""
    drafter = partial_rope_drafter(target)
    writers = {
        "dflash": lambda: export_dflash(drafter, tmp_path / "out"),
        "speculators": lambda: export_speculators(drafter, tmp_path / "out", verifier="some/target"),
        "transformers": lambda: export_transformers(drafter, tmp_path / "out"),
    }
    with pytest.raises(ValueError, match=r"has no partial RoPE: its layers rotate the whole head.*0\.5"):
        writers[export]()
    assert not (tmp_path / "out").exists()


def test_partial_rope_imports_as_the_reference_reads_it(target, tmp_path):
    """A z-lab config with partial_rotary_factor: z-lab's Qwen3 RoPE rotates whole heads, and so does the import
    (with a warning); with a non-default rope_type their tables do not fit the heads, so the import refuses."""
    config = zlab_config(target) | {"partial_rotary_factor": 0.5}
    folder = write_checkpoint(tmp_path / "partial", config, zlab_weights(target.config.hidden_size))
    with pytest.warns(UserWarning, match="partial_rotary_factor 0.5, which its Qwen3 layers ignore"):
        drafter = import_drafter(str(folder))
    assert "partial_rotary_factor" not in drafter.config.rope_parameters
    hidden_states = prefix_hidden_states(target, PROMPT, 5)
    torch.testing.assert_close(
        drafter_logits(drafter, target, hidden_states, int(PROMPT[0, 4])),
        zlab_reference_logits(load_file(folder / "model.safetensors"), config, target, hidden_states, int(PROMPT[0, 4])),
        atol=1e-5,
        rtol=1e-4,
    )
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    write_checkpoint(folder, config, zlab_weights(target.config.hidden_size))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 with rope_type 'linear'"):
        import_drafter(str(folder))


# ----------------------------------------------------------------------------------------------------------------
# Sliding-window drafter layers (speculators' training default)
# ----------------------------------------------------------------------------------------------------------------

SLIDING_TYPES, WINDOW = ["sliding_attention", "full_attention"], 3


def speculators_sliding_checkpoint(folder, target, non_causal=False):
    """A checkpoint as speculators' training CLI writes it with its defaults (sliding layers; here layer 1 passed to
    --full-attention-indices): the documented DFlashSpeculatorConfig fields, weights without the verifier's parts."""
    layers = {key: value for key, value in zlab_config(target).items() if key not in ("auto_map", "dflash_config", "architectures", "block_size", "num_target_layers")}
    layers |= {"layer_types": SLIDING_TYPES, "sliding_window": WINDOW, "use_sliding_window": True}
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layers,
        "draft_vocab_size": target.config.vocab_size,
        "block_size": BLOCK_SIZE,
        "aux_hidden_state_layer_ids": [i + 1 for i in TARGET_LAYER_IDS],
        "mask_token_id": MASK_TOKEN_ID,
        "sliding_window_non_causal": non_causal,
        "sample_from_anchor": False,
        "num_target_layers": target.config.num_hidden_layers,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK_SIZE - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "Qwen/Qwen3-0.6B", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    return write_checkpoint(folder, config, zlab_weights(target.config.hidden_size))


@pytest.mark.parametrize("non_causal", [False, True])
def test_speculators_sliding_window_import_matches_reference_and_decodes(target, tmp_path, non_causal):
    """Sliding-window layers imported from speculators draft as the reference rule says, in one forward and in every
    round of `generate` (whose cache holds rows the window hides), losslessly; they export back unchanged."""
    folder = speculators_sliding_checkpoint(tmp_path / "spec", target, non_causal)
    drafter = import_drafter(str(folder))
    config = drafter.config
    assert (config.layer_types, config.sliding_window, config.sliding_window_non_causal) == (SLIDING_TYPES, WINDOW, non_causal)
    weights, zconfig = load_file(folder / "model.safetensors"), zlab_config(target)
    sliding = (SLIDING_TYPES, WINDOW, non_causal)
    hidden_states = prefix_hidden_states(target, PROMPT, 6)
    reference = zlab_reference_logits(weights, zconfig, target, hidden_states, int(PROMPT[0, 5]), sliding)
    torch.testing.assert_close(drafter_logits(drafter, target, hidden_states, int(PROMPT[0, 5])), reference, atol=1e-5, rtol=1e-4)
    # the window matters here: the same weights with full-attention layers draft differently
    full = zlab_reference_logits(weights, zconfig, target, hidden_states, int(PROMPT[0, 5]))
    assert (full - reference).abs().max() > 1e-2

    output = generate_with(drafter, target, PROMPT, max_new_tokens=20)
    assert torch.equal(output, target.generate(PROMPT, max_new_tokens=20, do_sample=False))
    for draft_round in drafter.generation_stats.rounds:
        anchor_position = draft_round.anchor_position
        hidden_states = prefix_hidden_states(target, output, anchor_position)
        logits = zlab_reference_logits(weights, zconfig, target, hidden_states, int(output[0, anchor_position]), sliding)
        assert draft_round.drafts == logits[: draft_round.proposed].argmax(-1).tolist()

    target.save_pretrained(tmp_path / "verifier")
    exported = export_speculators(drafter, tmp_path / "again", verifier=str(tmp_path / "verifier"))
    written = json.loads((exported / "config.json").read_text())
    assert written["sliding_window_non_causal"] is non_causal
    layers = written["transformer_layer_config"]
    assert (layers["layer_types"], layers["sliding_window"], layers["use_sliding_window"]) == (SLIDING_TYPES, WINDOW, True)
    assert_same_weights(import_drafter(str(exported)), drafter)


def test_speculators_own_forward_matches_the_import(target, tmp_path):
    """Optional (needs `pip install speculators`): speculators' own DFlash mask and decoder layers, run on a packed
    sequence with many anchors as its trainer runs them, give the logits of the imported drafter's training forward."""
    pytest.importorskip("speculators")
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.models.dflash.model_definitions import Qwen3DFlashDecoderLayer
    from torch.nn.attention.flex_attention import create_mask
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from trainer.objectives import Batch, drafter_hidden

    folder = speculators_sliding_checkpoint(tmp_path / "spec", target)
    weights, drafter = load_file(folder / "model.safetensors"), import_drafter(str(folder))
    layer_config = Qwen3Config(**json.loads((folder / "config.json").read_text())["transformer_layer_config"])
    layer_config._attn_implementation = "eager"
    layers = torch.nn.ModuleList(Qwen3DFlashDecoderLayer(layer_config, i) for i in range(LAYERS))
    layers.load_state_dict({key[len("layers.") :]: w for key, w in weights.items() if key.startswith("layers.")})
    sequence = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    T, anchors = sequence.shape[1], torch.tensor([3, 8, 12, 17, 22, 26])
    masks = {}
    for layer_type, window in (("full_attention", None), ("sliding_attention", WINDOW)):
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(torch.zeros(T, dtype=torch.long), T, anchors, BLOCK_SIZE, window)
        visible = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")
        masks[layer_type] = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        hidden_states = target(sequence, output_hidden_states=True).hidden_states
        features = drafter.target_features(hidden_states)
        ids = torch.full((1, len(anchors) * BLOCK_SIZE), MASK_TOKEN_ID)
        ids[:, ::BLOCK_SIZE] = sequence[:, anchors]
        h, context = target.get_input_embeddings()(ids), rms_norm(features @ weights["fc.weight"].T, weights["hidden_norm.weight"])
        positions = torch.cat([torch.arange(T), (anchors[:, None] + torch.arange(BLOCK_SIZE)).flatten()])[None]
        rope = Qwen3RotaryEmbedding(layer_config)(h, positions)
        for layer, layer_type in zip(layers, SLIDING_TYPES):
            h = layer(target_hidden=context, hidden_states=h, attention_mask=masks[layer_type], position_embeddings=rope)
        theirs = target.lm_head(rms_norm(h, weights["norm.weight"])).view(len(anchors), BLOCK_SIZE, -1)[:, 1:]
        batch = Batch(sequence, torch.ones_like(sequence), torch.ones_like(sequence), features, None)
        hidden = drafter_hidden(drafter, target.get_input_embeddings(), batch, anchors[None])
    torch.testing.assert_close(target.lm_head(hidden)[0], theirs, atol=1e-5, rtol=1e-4)


def test_sliding_window_training_logits_equal_decoding_logits(target):
    """The training forward (all anchors at once, carried rows, dense and FlexAttention) gives a sliding-window
    drafter's blocks the logits the decoding layout gives (incremental cache holding rows outside the window)."""
    from trainer.objectives import Batch, drafter_hidden
    from trainer.verification import target_pass

    drafter = make_drafter(target, layer_types=SLIDING_TYPES, sliding_window=WINDOW)
    torch.manual_seed(0)
    sequence = torch.randint(0, target.config.vocab_size, (1, 16))
    recorded = target_pass(target, sequence, torch.ones_like(sequence), drafter.feature_hidden_state_indices)
    features = drafter.target_features(recorded.hidden_states)
    batch = Batch(sequence, torch.ones_like(sequence), torch.ones_like(sequence), features, None)
    anchors, R = torch.tensor([[4, 9, 13]]), 2
    carried = (torch.randn(1, 3, R, drafter.config.feature_size), anchors.unsqueeze(-1) + torch.arange(R), torch.ones(1, 3, R, dtype=torch.bool))
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        training = lm_head(drafter_hidden(drafter, embed, batch, anchors, carried))
        drafter.set_attn_implementation("flex_attention")
        flex = lm_head(drafter_hidden(drafter, embed, batch, anchors, carried))
        drafter.set_attn_implementation("eager")
        for n, a in enumerate(anchors[0].tolist()):
            cache, half = DynamicCache(), a // 2
            block_ids, block_positions = drafter.block_inputs(sequence[:, a], torch.tensor([a]))
            block = (embed(block_ids)[:, None], block_positions[:, None])
            drafter(*block, past_key_values=cache, context_features=features[:, :half], context_position_ids=torch.arange(half)[None])
            out = drafter(
                *block,
                past_key_values=cache,
                context_features=features[:, half:a],
                context_position_ids=torch.arange(half, a)[None],
                carried_features=carried[0][:, n : n + 1],
                carried_position_ids=carried[1][:, n : n + 1],
            )
            torch.testing.assert_close(training[0, n], lm_head(out.last_hidden_state[0, 0, 1:]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(flex, training, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("source", ["z-lab", "transformers"])
def test_foreign_sliding_window_rules_are_refused(target, tmp_path, source):
    """z-lab counts the window from each query slot, transformers' DFlash on both sides of it: neither is the
    anchor-based rule this drafter implements, so both imports and exports refuse sliding-window layers."""
    if source == "z-lab":
        config = zlab_config(target) | {"layer_types": SLIDING_TYPES, "sliding_window": WINDOW, "use_sliding_window": True}
        folder = write_checkpoint(tmp_path / "in", config, zlab_weights(target.config.hidden_size))
    else:
        folder = export_transformers(make_drafter(target, target_layer_ids=TARGET_LAYER_IDS), tmp_path / "in")
        config = json.loads((folder / "config.json").read_text())
        config["layer_types"] = SLIDING_TYPES
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window layers .* whose window rule differs"):
        import_drafter(str(folder))
    drafter = make_drafter(target, layer_types=SLIDING_TYPES, sliding_window=WINDOW)
    export = export_dflash if source == "z-lab" else export_transformers
    with pytest.raises(ValueError, match="counts a sliding window from each query slot"):
        export(drafter, tmp_path / "out")
