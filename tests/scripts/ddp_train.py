"""Run trainer/run.py's main under torchrun and write this rank's drafter weights, to compare ranks."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer.run import main  # noqa: E402

if __name__ == "__main__":
    weights_dir, argv = sys.argv[1], sys.argv[2:]
    trainer = main(argv)
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    rank = int(os.environ.get("RANK", 0))
    torch.save({k: v.detach().cpu() for k, v in drafter.state_dict().items()}, os.path.join(weights_dir, f"rank{rank}.pt"))
    print(f"rank {rank} world {trainer.accelerator.num_processes} steps {trainer.state.global_step}")
