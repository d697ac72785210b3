"""What `logitless bench lmhead` hands each worker process (`bench.lmhead_steps`): the implementations' names, the
losses, and the `Shape` of the inputs, as JSON."""

from __future__ import annotations

from dataclasses import dataclass

IMPLEMENTATIONS = ("materialized", "materialized_minimal", "gemm", "torch_chunked", "liger", "trl", "logitless")
LOSSES = {"grpo": "GRPO loss", "kl": "KL(p || q)"}


@dataclass
class Shape:
    """The inputs of one row: their sizes, dtype and device, the padded end of each completion, and the loss."""

    block_tokens: int | None = None  # logitless's tokens per row chunk (BlockSizes.tokens); None: its default
    batch: int = 2
    seq: int = 512
    hidden: int = 512
    vocab: int = 151936
    dtype: str = "float32"
    device: str = "cpu"
    masked_fraction: float = 0.0  # the end of each completion that is padding
    loss: str = "grpo"  # a key of LOSSES

    @property
    def tokens(self) -> int:
        return self.batch * (self.seq - int(self.seq * self.masked_fraction))

    @property
    def head_matmuls(self) -> int:
        """Matmuls of N x H x V in a step: the logits of each head read, grad hidden, grad weight."""
        return 4 if self.loss == "kl" else 3
