"""Vocabulary-parallel embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.linear import apply_linear, default_weight_loader
from atom.model_loader.checkpoint_slice import materialize


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPInfo = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start : self.start + self.shard_size]
        if shard.shape[0] < self.shard_size:  # last rank of an uneven split: pad with zeros
            param.data.zero_()
            param.data[: shard.shape[0]].copy_(materialize(shard))
            return
        default_weight_loader(param, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # decode's rows take the skinny GEMM on CUDA: cuBLAS reads a vocabulary-wide weight at
        # ~80% of the copy bandwidth there
        logits = apply_linear(hidden_states, self.weight, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)
        return logits[..., : self.num_embeddings]
