"""GPU check (run on a CUDA machine; CI has none): the real Trainer trains a drafter on CUDA (fp32 and bf16 autocast,
baseline then carryover), carryover decoding on CUDA reproduces plain greedy decoding, and a training step through
FlexAttention gives the loss and gradients of the dense path (CPU FlexAttention has no backward: only here).

    python tests/cuda_check.py [cpu]      # prints one JSON line per dtype; exits 1 on an fp32 mismatch

bf16 is reported, not asserted: a multi-token verification forward and one-token plain decoding use different
kernels, so bf16 argmax ties can flip (true of any assisted generation in transformers).
"""

import json
import sys
import tempfile
import time

import torch
from conftest import greedy_dataset, make_drafter, make_target
from transformers import TrainingArguments

import modeling_carryover as mc
from trainer.carryover_trainer import CarryoverArguments, CarryoverTrainer, pad_collator
from trainer.objectives import LossSettings, training_step_loss


def train(target, drafter, dataset, carryover, bf16):
    args = TrainingArguments(
        use_cpu=target.device.type == "cpu",
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_train_epochs=6 if not carryover else 3,
        learning_rate=3e-3, lr_scheduler_type="constant", save_strategy="no", report_to=[], seed=0, bf16=bf16,
        disable_tqdm=True, logging_steps=1000,
    )
    trainer = CarryoverTrainer(
        model=drafter, args=args, train_dataset=dataset, target_model=target,
        carryover_args=CarryoverArguments(num_anchors=32, carryover=carryover),
    )
    trainer.train()
    return trainer.state.log_history[-1]["train_loss"]


def check(dtype, device):
    target = make_target("llama")
    dataset = greedy_dataset(target, num_rows=64)  # on CPU, float32: the training data
    target.to(device=device, dtype=dtype)
    drafter = make_drafter(target, block_size=8)
    started = time.perf_counter()
    losses = [train(target, drafter, dataset, carryover, dtype == torch.bfloat16) for carryover in (False, True)]
    drafter.to(device=device, dtype=dtype).eval()
    mismatches, runs, rounds = 0, 0, []
    for row in dataset.select(range(12)):
        prompt = torch.tensor([row["input_ids"][:6]], device=device)
        for max_new_tokens in (1, 17, 60):
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            for carryover in (True, False):
                out = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, carryover=carryover)
                mismatches += not torch.equal(out, expected)
                runs += 1
                rounds += drafter.generation_stats.rounds
        torch.manual_seed(0)
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=40, do_sample=True)  # sampling runs on CUDA
    return {
        "dtype": str(dtype),
        "train_loss_baseline": losses[0],
        "train_loss_carryover": losses[1],
        "train_and_decode_seconds": round(time.perf_counter() - started, 1),
        "greedy_runs": runs,
        "mismatches": mismatches,
        "tau": mc.GenerationStats(rounds).acceptance_length,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def flex_check(device):
    """One carryover training step (float32) with the dense and the FlexAttention path: loss and gradients agree."""
    target = make_target("llama")
    batch = pad_collator(list(greedy_dataset(target, num_rows=4)))
    target.to(device)
    drafter = make_drafter(target, block_size=8).to(device)
    results = {}
    for implementation in ("eager", "flex_attention"):
        for bf16 in (False, True):  # bf16: autocast, as the Trainer runs with --bf16
            drafter.set_attn_implementation(implementation)
            drafter.zero_grad()
            torch.manual_seed(0)  # the same anchors
            inputs = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = training_step_loss(drafter, target, inputs, 32, LossSettings(gamma=7.0), carryover=True)
            loss.backward()
            grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
            results[implementation, bf16] = (loss.item(), grads)
    (dense_loss, dense_grads), (flex_loss, flex_grads) = results["eager", False], results["flex_attention", False]
    grad_error = max((a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(dense_grads, flex_grads))
    bf16_losses = results["eager", True][0], results["flex_attention", True][0]
    return {"check": "flex_attention", "dense_loss": dense_loss, "flex_loss": flex_loss, "max_relative_grad_error": grad_error,
            "bf16_autocast_losses_dense_flex": bf16_losses,
            "ok": abs(dense_loss - flex_loss) < 1e-4 and grad_error < 1e-3 and abs(bf16_losses[0] - bf16_losses[1]) < 5e-2}


if __name__ == "__main__":
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")  # `cpu` to try the script without a GPU
    results = [check(torch.float32, device), check(torch.bfloat16, device)]
    flex = flex_check(device) if device.type == "cuda" else {"check": "flex_attention", "ok": None, "skipped": "cpu"}
    for result in [*results, flex]:
        print(json.dumps(result))
    sys.exit(1 if results[0]["mismatches"] or flex["ok"] is False else 0)
