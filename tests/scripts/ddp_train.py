"""Run trainer/run.py's main under torchrun and write the drafter weights before (initial.pt) and after training, to
compare ranks and runs.

DDP: every rank writes its own weights (rank<r>.pt). FSDP (`--fsdp ...`): the full state dict is gathered and rank 0
writes it. accelerate maps multi-process CPU runs to DDP even when FSDP is asked for (its FSDP switch lists
accelerator device types only), so with CARRYOVER_TEST_CPU_FSDP=1 this script makes accelerate take its FSDP branch
on CPU: the sharding itself is torch's real FSDP2 over gloo. On GPUs no such switch is needed.
"""

import os
import sys

import torch


def allow_fsdp_on_cpu():
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # later AcceleratorState()s copy it

    AcceleratorState.__init__ = init


def save_initial_weights(weights_dir):
    """Rank 0 writes the drafter's weights as training starts (initial.pt): the test checks that they moved."""
    from trainer.carryover_trainer import CarryoverTrainer

    train = CarryoverTrainer.train

    def recorded_train(self, *args, **kwargs):
        if int(os.environ.get("RANK", 0)) == 0:
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            torch.save(state, os.path.join(weights_dir, "initial.pt"))
        return train(self, *args, **kwargs)

    CarryoverTrainer.train = recorded_train


if __name__ == "__main__":
    if os.environ.get("CARRYOVER_TEST_CPU_FSDP") == "1":
        allow_fsdp_on_cpu()
    from torch.distributed.tensor import DTensor

    from trainer.run import end_distributed, main

    weights_dir, argv = sys.argv[1], sys.argv[2:]
    save_initial_weights(weights_dir)
    trainer = main(argv)
    rank = int(os.environ.get("RANK", 0))
    sharded = isinstance(trainer.accelerator.unwrap_model(trainer.model).fc.weight, DTensor)
    state = trainer.accelerator.get_state_dict(trainer.model)  # FSDP: gathered on rank 0 (a collective)
    if state and (not sharded or rank == 0):
        torch.save({k: v.detach().cpu() for k, v in state.items()}, os.path.join(weights_dir, f"rank{rank}.pt"))
    print(f"rank {rank} world {trainer.accelerator.num_processes} steps {trainer.state.global_step} "
          f"type {trainer.accelerator.distributed_type} sharded {sharded}")
    end_distributed()
    # Leave without finalizing the interpreter. A gloo worker thread that still holds a Python-backed tensor (FSDP2
    # over gloo on CPU, the test-only path above) can reach for the GIL while the interpreter finalizes; Python ends
    # such a thread with pthread_exit, which C++ reports as "terminate called without an active exception" (SIGABRT,
    # seen once in CI after every weight was written). Everything this script makes is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
