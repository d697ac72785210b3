"""The Triton kernels of `ops/triton.py` against their PyTorch twins in `ops/chunks.py`.

Triton reads TRITON_INTERPRET when a kernel is defined, and other tests may have imported it
already, so without a GPU the kernel checks run in a child pytest on this file with
TRITON_INTERPRET=1 (the CPU interpreter); here `test_kernels_in_interpreter` launches it.
"""

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from logitless.ops import chunks  # noqa: E402
from logitless.ops import triton as triton_ops  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# (n, V): odd row counts; a prime V in one block of columns, and one spread over nine (the last partial).
SHAPES = [(3, 1009), (5, 32771), (2, 7), (1, 1)]


def test_imports_without_triton():
    script = ("import sys; sys.modules['triton'] = None\n"
              "from logitless.ops import triton\n"
              "assert triton.available() is False")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr


if INTERPRETED or torch.cuda.is_available():

    def _chunk(num_rows, vocab_size, offset=0.0):
        """(n, V) fp32 logits with the row max of the last row in its last column, and (n,) targets."""
        logits = torch.randn(num_rows, vocab_size) * 4 + offset
        logits[-1, -1] = logits[-1].max() + 3  # the running max of pass 1 grows in the last block
        targets = torch.randint(0, vocab_size, (num_rows,))
        targets[0], targets[-1] = vocab_size - 1, 0  # first and last column
        return logits.to(DEVICE), targets.to(DEVICE)

    def _assert_close(got, want, name):
        torch.testing.assert_close(got.cpu(), want.cpu(), **TOLERANCE, msg=lambda m: f"{name}: {m}")

    def test_available():
        assert triton_ops.available()

    @pytest.mark.parametrize("offset", [0.0, 100.0])
    @pytest.mark.parametrize("num_rows,vocab_size", SHAPES)
    def test_chunk_stats(num_rows, vocab_size, offset):
        logits, targets = _chunk(num_rows, vocab_size, offset)
        original = logits.clone()
        got = triton_ops.chunk_stats(logits, targets)
        want = chunks.chunk_stats(logits.clone(), targets)
        assert torch.equal(logits, original)  # the caller reuses the logits for the gradient
        for name, got_stat, want_stat in zip(chunks.ChunkStats._fields, got, want):
            _assert_close(got_stat, want_stat, name)

    @pytest.mark.parametrize("has_grads", list(itertools.product((True, False), repeat=3)),
                             ids=lambda flags: "".join("LEM"[i] if f else "-" for i, f in enumerate(flags)))
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    @pytest.mark.parametrize("num_rows,vocab_size", SHAPES)
    def test_logits_grad(num_rows, vocab_size, temperature, has_grads):
        logits, targets = _chunk(num_rows, vocab_size)
        grad_log_probs = torch.randn(num_rows, device=DEVICE)
        grad_entropy = torch.randn(num_rows, device=DEVICE)
        grad_mean_log_prob = torch.full((1,), -0.3, device=DEVICE).expand(num_rows)  # stride 0, as autograd gives
        grads = [g if has else None for g, has in zip((grad_log_probs, grad_entropy, grad_mean_log_prob), has_grads)]

        want_stats = chunks.chunk_stats(logits.clone(), targets)
        want = chunks.logits_grad(logits.clone(), want_stats, targets, temperature, *grads)
        stats = triton_ops.chunk_stats(logits, targets)
        got = triton_ops.logits_grad(logits, stats, targets, temperature, *grads)
        assert got.data_ptr() == stats.probs.data_ptr()
        _assert_close(got, want, "logits grad")

    def test_empty_chunk():
        logits, targets = torch.empty(0, 11, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE)
        stats = triton_ops.chunk_stats(logits, targets)
        assert [tuple(s.shape) for s in stats] == [(0, 11)] + [(0,)] * 4
        assert triton_ops.logits_grad(logits, stats, targets, 1.0, stats.lse).shape == (0, 11)

    def test_fused_ops_end_to_end_on_triton(monkeypatch):
        """fused_linear_logprobs and fused_grpo_loss with the Triton backend forced, against the oracles."""
        from logitless import fused_grpo_loss, fused_linear_logprobs
        from logitless.ops import backend, reference

        monkeypatch.setenv("LOGITLESS_TRITON", "1")
        assert backend.chunk_kernels(torch.device(DEVICE), torch.float32) is triton_ops
        hidden = (torch.randn(2, 9, 8) * 0.5).to(DEVICE).requires_grad_()
        weight = (torch.randn(1009, 8) * 0.5).to(DEVICE).requires_grad_()
        ids = torch.randint(0, 1009, (2, 9)).to(DEVICE)
        mask = torch.ones(2, 9, device=DEVICE)
        mask[1, 5:] = 0
        log_probs, entropy = fused_linear_logprobs(hidden, weight, ids, temperature=0.7, return_entropy=True,
                                                   chunk_size=4, mask=mask)
        ref_log_probs, ref_entropy = reference.linear_logprobs(hidden, weight, ids, temperature=0.7,
                                                               return_entropy=True)
        got = [log_probs, entropy, *torch.autograd.grad((log_probs + entropy).sum(), (hidden, weight))]
        want = [ref_log_probs * mask, ref_entropy * mask,
                *torch.autograd.grad(((ref_log_probs + ref_entropy) * mask).sum(), (hidden, weight))]
        for name, g, w in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, want):
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

        advantages, old = torch.randn(2, device=DEVICE), (ref_log_probs.detach() + 0.2)
        args = (hidden, weight, ids, mask, advantages)
        kwargs = dict(old_logprobs=old, ref_logprobs=old - 0.1, beta=0.04, temperature=0.7, softcap=1.5)
        loss, _ = fused_grpo_loss(*args, **kwargs, chunk_size=4)
        ref_loss, _ = reference.grpo_loss(*args, **kwargs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, w in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(ref_loss, (hidden, weight))):
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-6)

else:

    def test_kernels_in_interpreter():
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
        report = child.stdout[-4000:] + child.stderr[-4000:]
        assert child.returncode == 0, report
        assert re.search(r"\b\d+ passed", child.stdout) and "skipped" not in child.stdout, report
