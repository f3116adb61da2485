"""A saved drafter is self-contained: in a fresh process with HF_HUB_OFFLINE=1 where this project cannot be
imported, `AutoModel.from_pretrained(folder, trust_remote_code=True)` and `target.generate(..., custom_generate=folder)`
give the same proposals and the same output as the in-process drafter."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from conftest import trained_drafter

import modeling_carryover as mc
from hub.publish import BLOCK_PROJECT_IMPORTS

def run_fresh(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(cwd / "modules"))
    return subprocess.run([sys.executable, "-c", BLOCK_PROJECT_IMPORTS + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_round_trip_in_a_fresh_process(tmp_path):
    target, drafter, dataset = trained_drafter("llama", 4, 8)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    assert (tmp_path / "drafter" / "custom_generate" / "generate.py").exists()
    prompts = [row["input_ids"][:6] for row in dataset.select(range(3))]
    expected = []
    for prompt in prompts:
        out = mc.generate(target, torch.tensor([prompt]), assistant_model=drafter, max_new_tokens=30, do_sample=False)
        expected.append({"output": out[0].tolist(), "drafts": [r.drafts for r in drafter.generation_stats.rounds]})

    code = textwrap.dedent(
        f"""
        import json, torch
        from transformers import AutoModel, AutoModelForCausalLM
        try:
            import modeling_carryover
            raise SystemExit("the project is importable")
        except ImportError:
            pass
        target = AutoModelForCausalLM.from_pretrained("target")
        drafter = AutoModel.from_pretrained("drafter", trust_remote_code=True)
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        results = []
        for prompt in {prompts!r}:
            out = target.generate(torch.tensor([prompt]), assistant_model=drafter, custom_generate="drafter",
                                  trust_remote_code=True, max_new_tokens=30, do_sample=False)
            results.append({{"output": out[0].tolist(), "drafts": [r.drafts for r in drafter.generation_stats.rounds]}})
        print(json.dumps(results))
        """
    )
    result = run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected
    # and the speculative output is the target's own greedy output
    for prompt, record in zip(prompts, expected):
        assert record["output"] == target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0].tolist()


def test_loading_without_trust_remote_code_says_so(tmp_path):
    target, drafter, _ = trained_drafter("llama", 4, 0)
    drafter.save_pretrained(tmp_path / "drafter")
    code = textwrap.dedent(
        """
        import sys
        from transformers import AutoModel
        sys.stdin.close()
        try:
            AutoModel.from_pretrained("drafter")
        except ValueError as error:
            print("ERROR:", error)
        """
    )
    result = run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trust_remote_code" in result.stdout
