"""Every fused op on every device this machine has (the CPU; a CUDA GPU where there is one, where "auto" runs the
compiled Triton block kernels and bf16 goes through cuBLAS), in fp32 and bf16, against the materialized oracle in
fp64 on the CPU from the same input values: the values and the gradients of hidden, weight and bias. The losses
known at forward time (cross-entropy, GRPO) run on both schedules, one pass and two (``LOGITLESS_ONE_PASS``).

fp32 must agree to 1e-5 of each tensor's scale. bf16 rounds the inputs' products differently on each device, so it
is judged against what a user would otherwise run on that device: the materialized path (``impl="reference"``) at
the same dtype, whose error the fused op may not exceed by more than half again.
"""

import pytest
import torch

from fused_cases import OPS, output_names, relative_error, run_case
from logitless.ops import BlockSizes

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
SHAPE = (2, 37, 64, 4001)  # batch, seq, hidden, vocab: 74 tokens, not a multiple of the chunk; 4 vocabulary blocks
BLOCKS = BlockSizes(16, 1024)


def _run(op, dtype: torch.dtype, device: str, impl: str, values: torch.dtype | None = None) -> list[torch.Tensor]:
    return run_case(op, SHAPE, dtype, device, values, impl=impl, block_sizes=BLOCKS)


# (op, LOGITLESS_ONE_PASS): the losses known at forward time once more on each schedule, whatever the default is
CASES = [(op, "auto") for op in OPS] + [(op, one_pass) for op in ("cross_entropy", "grpo") for one_pass in "01"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op,one_pass", CASES)
def test_fused_op_on_this_device_matches_the_fp64_oracle(op, one_pass, dtype, device, monkeypatch):
    monkeypatch.setenv("LOGITLESS_ONE_PASS", one_pass)
    exact = _run(OPS[op], torch.float64, "cpu", "reference", values=dtype)
    fused = _run(OPS[op], dtype, device, "auto")
    materialized = _run(OPS[op], dtype, device, "reference") if dtype == torch.bfloat16 else None
    for index, (name, got, want) in enumerate(zip(output_names(exact), fused, exact)):
        error = relative_error(got, want)
        if dtype == torch.float32:
            assert error <= 1e-5, (name, error)
        else:
            bound = relative_error(materialized[index], want)
            assert error <= 1.5 * bound + 1e-6, (name, error, bound)
