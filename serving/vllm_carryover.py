"""Carryover inside vLLM 0.32's DFlash speculative decoding: the drafter model and the proposer that `vllm_plugin`
installs. Private vLLM methods are overridden here, so the vLLM version is pinned (pyproject's `vllm` extra).

How carryover maps onto vLLM's DFlash (padded drafter batch, the only mode vLLM runs DFlash in). After each
verification, a request's context rows are its whole verified window `[anchor, draft_1 .. draft_K]` (the target's
features at their true positions); its last `num_rejected` rows are the rejected drafts. Stock DFlash writes all of
them into the drafter's KV cache, each at the slot of its position, counts only the committed ones in `seq_lens`, and
writes the new block `[bonus, MASK x K]` right after them, over the rejected rows' slots. With carryover:
  1. the rejected rows get E_carry before the fusion layer `fc` (`CarryoverDFlashProposer.propose`);
  2. they stay in their slots and count in `seq_lens`; the block's keys/values go to the slots after the whole window
     (its RoPE positions are unchanged), so each block attends to [committed rows ; carried rows ; itself], exactly the
     keys `generate` gives it (`CarryoverDFlashProposer.set_inputs_first_pass`);
  3. the next window is written from the next anchor's position on, over the carried rows' slots, and `seq_lens`
     stops before whatever is left of them: they are context for one proposal only. No per-request state is kept
     outside vLLM's own, so requests join, leave and end mid-round as in stock vLLM.
The block's last slot is the one stock DFlash uses when every draft is accepted (position + num_rejected is always
the window's end + 1 + offset), so carryover needs no extra KV-cache slots.
"""

import json
import os

import torch
from torch import nn
from typing_extensions import override
from vllm import _custom_ops as ops
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.v1.spec_decode.dflash import DFlashProposer

from modeling_carryover import CarryoverDrafterConfig

# Every proposal's drafts, one JSON line per request and round, when this names a file (tests and analyses).
RECORD_ENV = "CARRYOVER_VLLM_RECORD"


class CarryoverDFlashModel(DFlashQwen3Model):
    def _normalize_context_k(self, all_k):
        """Each layer's context keys normed with that layer's own k_norm weight. vLLM 0.32 norms all layers at once
        with the stacked [L, head_dim] weights, but its CPU `rms_norm` applies the first row to every layer, which
        changes the proposals of any drafter with more than one layer. all_k [L, rows, K, D] -> [L, rows, K, D]"""
        normed = torch.empty_like(all_k)
        for layer, weight in enumerate(self._k_norm_weights):
            ops.rms_norm(normed[layer], all_k[layer], weight, self._rms_norm_eps)
        return normed


class CarryoverDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's Qwen3 DFlash drafter plus E_carry (`carry_embedding`, the width of the concatenated target features),
    with the context keys normed per layer (`CarryoverDFlashModel`) and, for a draft vocabulary, the target LM head's
    rows of the draft tokens as its head (`load_draft_head`)."""

    model_cls = CarryoverDFlashModel

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.carry_embedding = nn.Parameter(
            torch.zeros(self.model.fc.input_size, dtype=vllm_config.model_config.dtype), requires_grad=False
        )

    def load_weights(self, weights):
        # The DFlash loader would prefix `model.` and find no such parameter: E_carry is read here
        rest = []
        for name, tensor in weights:
            if name == "carry_embedding":
                self.carry_embedding.data.copy_(tensor)
            else:
                rest.append((name, tensor))
        return super().load_weights(rest)

    def load_draft_head(self, target_lm_head: nn.Module) -> None:
        """The head of a drafter with a draft vocabulary (`draft_vocab_size` N and the map `d2t`, loaded by vLLM's
        DFlash as `draft_id_to_target_id`): the target LM head's rows of the N draft tokens, gathered once, as
        `generate`'s `draft_logits` scores them. vLLM's `compute_logits` then scores these rows only and places them at
        their target ids, -inf elsewhere (its EAGLE-3 mechanism), so the greedy draft is the argmax over the draft
        vocabulary mapped to its target id. One rank: the target's head must not be split over a tensor-parallel group.
        target_lm_head.weight [vocab (padded), d] -> self.lm_head.weight [N (padded), d]"""
        rows = torch.arange(len(self.draft_id_to_target_id), device=self.draft_id_to_target_id.device)
        rows = rows + self.draft_id_to_target_id  # [N] target ids, increasing
        self.lm_head.weight_loader(self.lm_head.weight, target_lm_head.weight[rows])
        self.lm_head.quant_method.process_weights_after_loading(self.lm_head)  # vLLM CPU packs the weight for its GEMM


def check_pair(draft_hf_config, target_hf_config, num_speculative_tokens: int) -> None:
    """Refuse a carryover drafter served with a target or a block it was not trained for (`ValueError`)."""
    drafter = CarryoverDrafterConfig(
        vocab_size=draft_hf_config.vocab_size,
        hidden_size=draft_hf_config.hidden_size,
        num_attention_heads=draft_hf_config.num_attention_heads,
        num_hidden_layers=draft_hf_config.num_hidden_layers,
        num_target_layers=draft_hf_config.num_target_layers,
        target_layer_ids=draft_hf_config.dflash_config["target_layer_ids"],
        block_size=draft_hf_config.block_size,
    )
    drafter.check_target(target_hf_config)  # sizes and layers: one definition with `generate`
    wanted, model_type = draft_hf_config.dflash_config.get("target_model_type"), target_hf_config.get_text_config().model_type
    if wanted is not None and wanted != model_type:
        raise ValueError(f"This carryover drafter was trained for a {wanted!r} target, not {model_type!r}.")
    if num_speculative_tokens != drafter.block_size - 1:
        raise ValueError(
            f"This carryover drafter proposes block_size - 1 = {drafter.block_size - 1} tokens, as in training and "
            f"`generate`; serve it with num_speculative_tokens={drafter.block_size - 1}, not {num_speculative_tokens}."
        )


class CarryoverDFlashProposer(DFlashProposer):
    """vLLM's DFlash proposer with carryover for drafters that have E_carry (`CarryoverDFlashForCausalLM`). Carryover
    is on by default where the export says so (`dflash_config.carryover`); a request turns it off or on with
    `SamplingParams(extra_args={"carryover": bool})`. A drafter without E_carry runs exactly as stock DFlash."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # its requests' sampling params say where carryover is on

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        draft_config = self.draft_model_config.hf_config
        self.carry_embedding = getattr(self.model, "carry_embedding", None)  # None: a plain DFlash drafter
        self.carryover_default = bool(draft_config.dflash_config.get("carryover", False))
        if self.carry_embedding is not None:
            check_pair(draft_config, self.vllm_config.model_config.hf_config, self.num_speculative_tokens)
        self.carried = None  # [batch] rows each request carries into the proposal being made
        self.record_path = os.environ.get(RECORD_ENV)
        self.num_proposals = 0

    @override
    def _maybe_share_lm_head(self, target_language_model: nn.Module) -> None:
        """vLLM gives a drafter without an LM head of its own the target's whole head; a carryover drafter with a
        draft vocabulary gets that head's rows of its draft tokens instead."""
        if isinstance(self.model, CarryoverDFlashForCausalLM) and self.model.draft_id_to_target_id is not None:
            if self.vllm_config.parallel_config.tensor_parallel_size > 1:
                raise ValueError("A carryover drafter with a draft vocabulary is served with tensor_parallel_size=1.")
            self.model.load_draft_head(target_language_model.lm_head)
        else:
            super()._maybe_share_lm_head(target_language_model)

    def carried_rows(self, batch_size: int, num_rejected_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Rows each request of the batch carries: its rejected drafts where carryover is on for it. -> [batch]"""
        if self.carry_embedding is None or num_rejected_tokens is None:
            return None
        requests = self.runner.requests
        carry = [
            (requests[req_id].sampling_params.extra_args or {}).get("carryover", self.carryover_default)
            for req_id in self.runner.input_batch.req_ids[:batch_size]
        ]
        if not any(carry):
            return None
        return num_rejected_tokens * torch.tensor(carry, dtype=num_rejected_tokens.dtype, device=self.device)

    def mark_carried(self, target_hidden_states, query_start_loc, carried):
        """E_carry on the carried rows (the last `carried[i]` rows of request i's window), before `fc`.
        target_hidden_states [rows, F], query_start_loc [batch + 1], carried [batch] -> [rows, F]"""
        rows = torch.arange(target_hidden_states.shape[0], device=self.device)
        window_end = query_start_loc[1:]
        request = torch.searchsorted(window_end, rows, right=True)  # request of each row
        is_carried = rows >= (window_end - carried)[request]
        marked = target_hidden_states + self.carry_embedding.to(target_hidden_states.dtype)
        return torch.where(is_carried[:, None], marked, target_hidden_states)

    @override
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):  # fmt: skip
        batch_size = common_attn_metadata.batch_size()
        self.carried = self.carried_rows(batch_size, num_rejected_tokens_gpu)
        if self.carried is not None:
            target_hidden_states = self.mark_carried(
                target_hidden_states, common_attn_metadata.query_start_loc, self.carried
            )
        drafts = super().propose(
            num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings,
        )  # fmt: skip
        if self.record_path:
            self.record(batch_size, drafts)
        return drafts

    @override
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):  # fmt: skip
        num_query_total, token_indices_to_sample, new_cad = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample, cad,
            num_rejected_tokens_gpu,
        )  # fmt: skip
        if self.carried is not None:
            num_query_per_req = 1 + self.num_speculative_tokens
            new_cad.seq_lens = new_cad.seq_lens + self.carried  # the carried rows stay visible
            # the block's keys/values go after the carried rows; its positions (RoPE) stay where they are
            slot_positions = self.positions[:num_query_total] + self.carried.repeat_interleave(num_query_per_req)
            new_cad.slot_mapping.copy_(self.slots(cad.block_table_tensor, slot_positions, num_query_per_req))
        return num_query_total, token_indices_to_sample, new_cad

    def slots(self, block_table, positions, num_query_per_req: int) -> torch.Tensor:
        """KV-cache slots of the block's tokens at logical `positions`, as vLLM's DFlash input kernel computes them.
        block_table [batch, max blocks], positions [batch * num_query_per_req] -> [batch * num_query_per_req]"""
        batch_size = positions.shape[0] // num_query_per_req
        request = torch.arange(batch_size, device=self.device).repeat_interleave(num_query_per_req)
        block_number = (positions // self.block_size).clamp(max=block_table.shape[1] - 1)
        return block_table[request, block_number].long() * self.block_size + positions % self.block_size

    def record(self, batch_size: int, drafts: torch.Tensor) -> None:
        """Append this proposal's drafts per request (JSON lines: proposal index, request id, anchor position,
        carried rows, drafts)."""
        num_query_per_req = 1 + self.num_speculative_tokens
        anchors = self.positions[: batch_size * num_query_per_req : num_query_per_req].tolist()
        carried = [0] * batch_size if self.carried is None else self.carried.tolist()
        with open(self.record_path, "a") as f:
            for i, req_id in enumerate(self.runner.input_batch.req_ids[:batch_size]):
                round_ = {"proposal": self.num_proposals, "request_id": req_id, "anchor_position": anchors[i],
                          "carried": carried[i], "drafts": drafts[i].tolist()}  # fmt: skip
                f.write(json.dumps(round_) + "\n")
        self.num_proposals += 1
