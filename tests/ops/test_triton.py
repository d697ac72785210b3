"""The Triton kernels of `ops/triton.py` against their PyTorch twins in `ops/softmax.py`, `ops/kl.py` and `ops/jsd.py`.

Triton reads TRITON_INTERPRET when a kernel is defined, and other tests may have imported it
already, so without a GPU the kernel checks run in a child pytest on this file with
TRITON_INTERPRET=1 (the CPU interpreter); here `test_kernels_in_interpreter` launches it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from fused_cases import (OPS, TRAINED, case_inputs, on, output_names, outputs_and_grads, relative_error,  # noqa: E402
                         run_case)
from logitless.ops import BlockSizes  # noqa: E402
from logitless.ops import jsd as jsd_math  # noqa: E402
from logitless.ops import kl as kl_math  # noqa: E402
from logitless.ops import reference  # noqa: E402
from logitless.ops import softmax as softmax_math  # noqa: E402
from logitless.ops import triton as triton_ops  # noqa: E402
from logitless.ops.head import LinearHead  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# (n, c): row counts that are not a multiple of the row tile, a prime width spanning several column tiles
SHAPES = [(3, 1009), (17, 300), (1, 1)]
DTYPES = ("float32", "bfloat16", "float16")


def precision_contract() -> dict[str, tuple[float, float]]:
    """docs/fused_ops.md's precision table: {inputs' dtype: (bound on the outputs, bound on the gradients)}."""
    section = (Path(__file__).parents[2] / "docs" / "fused_ops.md").read_text().split("\n## Precision\n")[1]
    rows = re.findall(r"^\| `(\w+)` \| ([0-9.e-]+) \| ([0-9.e-]+) \|$", section.split("\n## ")[0], re.MULTILINE)
    return {dtype: (float(outputs), float(grads)) for dtype, outputs, grads in rows}


def test_the_precision_contract_bounds_each_dtype_by_its_own_rounding():
    """The published bounds: fp32 outputs in every dtype; gradients within two roundings to the inputs' dtype."""
    contract = precision_contract()
    assert list(contract) == list(DTYPES)
    for dtype, (outputs, grads) in contract.items():
        assert outputs == 1e-5
        assert grads == (1e-5 if dtype == "float32" else pytest.approx(torch.finfo(getattr(torch, dtype)).eps, 0.01))


def test_imports_without_triton():
    script = ("import sys; sys.modules['triton'] = None\n"
              "from logitless.ops import triton\n"
              "assert triton.available() is False")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr


if INTERPRETED or torch.cuda.is_available():

    def _blocks(num_rows, width, count, neg_inf):
        """``count`` consecutive (n, c) fp32 blocks of one vocabulary, and (n,) targets spread over it."""
        blocks = [torch.randn(num_rows, width) * 4 + 3 * index for index in range(count)]  # the max moves later
        if neg_inf:
            for block in blocks:
                block[:, 1::3] = float("-inf")  # never a whole row: that has no softmax
        targets = torch.randint(0, width * count, (num_rows,))
        targets[0] = width * count - 1
        return [b.to(DEVICE) for b in blocks], targets.to(DEVICE)

    def _assert_close(got, want, name):
        torch.testing.assert_close(got.cpu(), want.cpu(), **TOLERANCE, msg=lambda m: f"{name}: {m}")

    def test_available():
        assert triton_ops.available()

    @pytest.mark.parametrize("neg_inf", [False, True])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_update_stats(num_rows, width, neg_inf):
        blocks, targets = _blocks(num_rows, width, 3, neg_inf)
        states = [softmax_math.OnlineSoftmax(num_rows, torch.float32, torch.device(DEVICE), True, True, True, True)
                  for _ in range(2)]
        for index, block in enumerate(blocks):
            softmax_math.update_stats(states[0], block.clone(), index * width, targets, neg_inf)
            triton_ops.update_stats(states[1], block.clone(), index * width, targets, neg_inf)
        for name in ("max", "shift", "total", "weighted", "logit_sum", "square_total", "max_before_target",
                     "target_logit"):
            _assert_close(getattr(states[1], name), getattr(states[0], name), name)

    def test_token_extras_on_triton_match_the_pytorch_blocks():
        """linear_token_stats(extras=...) with impl="triton" against impl="chunked" and the materialized oracle:
        integer logits full of ties (the first argmax is the top 1), -inf on padded rows, a soft cap, a logit
        scale, rows not a multiple of the chunk and a prime vocabulary."""
        from logitless.ops import BlockSizes, reference
        from logitless.ops.fused import linear_token_stats

        generator = torch.Generator().manual_seed(5)
        vocab, extras = 1009, ("log_sum_sq_probs", "mean_logits", "is_top1")
        hidden = torch.randint(-1, 2, (23, 2), generator=generator).float()
        weight = torch.randint(-1, 2, (vocab, 2), generator=generator).float()
        bias = torch.zeros(vocab)
        bias[5::11] = float("-inf")
        maxima = [(row == row.max()).nonzero().squeeze(1) for row in hidden @ weight.T + bias]
        targets = torch.stack([m[0] if index % 3 == 0 else m[-1] for index, m in enumerate(maxima)])
        targets[2::3] = torch.randint(0, vocab, (len(targets[2::3]),), generator=generator)
        targets[targets % 11 == 5] += 1
        hidden, weight, bias, targets = (t.to(DEVICE) for t in (hidden, weight, bias, targets))
        for softcap in (None, 2.0):
            head = LinearHead(weight, bias=bias, temperature=0.7, softcap=softcap, logit_scale=1.3)
            got, want = (linear_token_stats(hidden, targets=targets, head=head,
                                            extras=extras, block_sizes=BlockSizes(4, 300),
                                            impl=impl) for impl in ("triton", "chunked"))
            for name, g, w in zip(("log_probs", "entropy"), got, want):
                _assert_close(g, w, name)
            for name in extras:
                _assert_close(got[3][name], want[3][name], name)
            oracle = reference.token_extras(head.logits(hidden), targets)["is_top1"]
            assert torch.equal(got[3]["is_top1"].cpu(), oracle.cpu())
            assert 0 < int(oracle.sum()) < len(oracle)

    @pytest.mark.parametrize("present", [(True, True, True, True), (True, True, False, False),
                                         (False, False, True, False), (False, True, False, True)],
                             ids=lambda flags: "".join("OPCU"[i] if f else "-" for i, f in enumerate(flags)))
    @pytest.mark.parametrize("softcap", [None, 3.0])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_block_logits_grad(num_rows, width, softcap, present):
        (block,), targets = _blocks(num_rows, width, 1, neg_inf=softcap is None)
        if softcap is not None:
            block = softcap * torch.tanh(block / softcap) / 0.7  # logits of a capped head at temperature 0.7
        head = LinearHead(torch.zeros(width, 2, device=DEVICE), temperature=0.7, softcap=softcap)
        lse = torch.logsumexp(block, dim=1)
        expected = (torch.softmax(block, 1) * block.nan_to_num(neginf=0.0)).sum(1)
        coefs = softmax_math.StatGrads(*(torch.randn(num_rows, device=DEVICE) if has else None for has in present))
        want = softmax_math.block_logits_grad(head, block.clone(), 0, targets, lse, expected, coefs, softcap is None)
        got = triton_ops.block_logits_grad(head, block.clone(), 0, targets, lse, expected, coefs, softcap is None)
        assert torch.isfinite(want).all()
        _assert_close(got, want, "block gradient")

    @pytest.mark.parametrize("need_gap, need_entropy", [(True, (False, False)), (True, (True, False)),
                                                        (False, (False, True))])
    @pytest.mark.parametrize("neg_inf", [False, True])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_kl_update_stats(num_rows, width, neg_inf, need_gap, need_entropy):
        blocks_p, _ = _blocks(num_rows, width, 3, neg_inf)
        blocks_q = [block * 0.5 - 1.0 + torch.randn_like(block) for block in blocks_p]  # -inf where p's are
        sums = [kl_math.KLSums(num_rows, torch.float32, torch.device(DEVICE), need_gap=need_gap,
                                 need_entropy=need_entropy) for _ in range(2)]
        for block_p, block_q in zip(blocks_p, blocks_q):
            kl_math.kl_update_stats(sums[0], block_p.clone(), block_q.clone(), neg_inf)
            triton_ops.kl_update_stats(sums[1], block_p.clone(), block_q.clone(), neg_inf)
        distributions = [torch.distributions.Categorical(logits=torch.cat(b, 1)) for b in (blocks_p, blocks_q)]
        for side, has_entropy, distribution in zip(("p", "q"), need_entropy, distributions):
            for name in ("max", "shift", "total") + (("weighted",) if has_entropy else ()):
                _assert_close(getattr(getattr(sums[1], side), name), getattr(getattr(sums[0], side), name),
                              f"{side}.{name}")
            if has_entropy:
                _assert_close(getattr(sums[1], side).entropy(), distribution.entropy(), f"{side} entropy")
            else:
                assert getattr(sums[1], side).weighted is None
        if need_gap:
            _assert_close(sums[1].gap, sums[0].gap, "gap")
            _assert_close(kl_math.kl_stats(sums[1]).kl, torch.distributions.kl_divergence(*distributions), "kl")
        else:
            assert sums[1].gap is None

    @pytest.mark.parametrize("beta", [0.3, 0.5])
    @pytest.mark.parametrize("neg_inf", [False, True])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_jsd_update_stats(num_rows, width, neg_inf, beta):
        blocks_s, _ = _blocks(num_rows, width, 3, neg_inf)
        blocks_t = [block * 0.5 - 1.0 + torch.randn_like(block) for block in blocks_s]  # -inf where the student's are
        if neg_inf:
            blocks_t[1][:, ::5] = float("-inf")  # and where the student's are not
        lse_s, lse_t = (torch.logsumexp(torch.cat(b, 1), 1) for b in (blocks_s, blocks_t))
        sums = [jsd_math.MixtureSums(num_rows, torch.float32, torch.device(DEVICE)) for _ in range(2)]
        for block_s, block_t in zip(blocks_s, blocks_t):
            jsd_math.jsd_update_stats(sums[0], block_s.clone(), block_t.clone(), lse_s, lse_t, beta, neg_inf)
            triton_ops.jsd_update_stats(sums[1], block_s.clone(), block_t.clone(), lse_s, lse_t, beta, neg_inf)
        _assert_close(sums[1].student_kl, sums[0].student_kl, "KL(p_s || m)")
        _assert_close(sums[1].teacher_kl, sums[0].teacher_kl, "KL(p_t || m)")
        log_p_s, log_p_t = (torch.log_softmax(torch.cat(b, 1), 1) for b in (blocks_s, blocks_t))
        normalizers = jsd_math.JSDStats(lse_s, lse_t, None, None, None)
        _assert_close(jsd_math.jsd_stats(normalizers, sums[1], beta).divergence,
                      reference.generalized_jsd(log_p_s, log_p_t, beta), "divergence")

    @pytest.mark.parametrize("beta", [0.0, 0.3])
    @pytest.mark.parametrize("softcap", [None, 3.0])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_jsd_block_logits_grad(num_rows, width, softcap, beta):
        (block_s,), _ = _blocks(num_rows, width, 1, neg_inf=softcap is None)
        block_t = block_s * 0.5 + torch.randn_like(block_s)
        if softcap is not None:
            block_s = softcap * torch.tanh(block_s / softcap) / 0.7  # logits of a capped head at temperature 0.7
        head = LinearHead(torch.zeros(width, 2, device=DEVICE), temperature=0.7, softcap=softcap, logit_scale=1.5)
        log_p_s, log_p_t = torch.log_softmax(block_s, 1), torch.log_softmax(block_t, 1)
        student_kl = torch.randn(num_rows, device=DEVICE)  # any per-row centering term
        stats = jsd_math.JSDStats(torch.logsumexp(block_s, 1), torch.logsumexp(block_t, 1), None, None, student_kl)
        grad_divergence = torch.randn(num_rows, device=DEVICE)
        want, got = (kernels.jsd_block_logits_grad(head, block_s.clone(), block_t.clone(), stats, grad_divergence,
                                                   beta, softcap is None) for kernels in (jsd_math, triton_ops))
        assert torch.isfinite(want).all() and (width == 1 or want.abs().max() > 0)
        _assert_close(got, want, "JSD block gradient")
        if beta == 0.0 and softcap is None:  # the forward KL's gradient: p_s - p_t, times the row's factor
            _assert_close(want, (log_p_s.exp() - log_p_t.exp()) * (grad_divergence * 1.5 / 0.7)[:, None], "p_s - p_t")

    @pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
    def test_fused_jsd_on_triton_matches_the_pytorch_blocks(beta):
        """fused_linear_jsd with impl="triton" (both sweeps and the gradient on the kernels) against
        impl="chunked" and the materialized JSD: odd shapes, -inf on padded rows, different hidden sizes, a mask,
        a soft cap, the student's entropy."""
        from logitless.ops import BlockSizes, fused_linear_jsd

        generator = torch.Generator().manual_seed(7)
        vocab = 1009
        hidden_s = (torch.randn(3, 7, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        weight_s = (torch.randn(vocab, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        bias_s = torch.randn(vocab, generator=generator).to(DEVICE)
        bias_s[::11] = float("-inf")
        bias_s.requires_grad_()
        hidden_t = (torch.randn(3, 7, 5, generator=generator) * 0.6).to(DEVICE)
        weight_t = (torch.randn(vocab, 5, generator=generator) * 0.6).to(DEVICE)
        bias_t = torch.randn(vocab, generator=generator).to(DEVICE)
        bias_t[::11] = float("-inf")
        mask = (torch.rand(3, 7, generator=generator) > 0.25).to(DEVICE)
        inputs = (hidden_s, weight_s, bias_s)

        def jsd_and_grads(**options):
            divergence, entropy = fused_linear_jsd(hidden_s, weight_s, hidden_t, weight_t, bias_s=bias_s,
                                                   bias_t=bias_t, beta=beta, temperature=0.8, softcap=2.0,
                                                   logit_scale=1.3, mask=mask, return_token_entropy=True, **options)
            weights = torch.linspace(0.5, 1.5, divergence.numel(), device=DEVICE).reshape(divergence.shape)
            return [divergence, entropy, *torch.autograd.grad((divergence * weights).sum(), inputs)]

        got = jsd_and_grads(impl="triton", block_sizes=BlockSizes(4, 300))
        for want in (jsd_and_grads(impl="chunked", block_sizes=BlockSizes(4, 300)), jsd_and_grads(impl="reference")):
            for name, g, w in zip(("divergence", "entropy", "grad hidden", "grad weight", "grad bias"), got, want):
                assert torch.isfinite(w).all(), name
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    @pytest.mark.parametrize("softcap", [None, 3.0])
    @pytest.mark.parametrize("num_rows,width", SHAPES)
    def test_kl_block_logits_grad(num_rows, width, softcap):
        (block_p,), _ = _blocks(num_rows, width, 1, neg_inf=softcap is None)
        block_q = block_p * 0.5 + torch.randn_like(block_p)
        if softcap is not None:
            block_p = softcap * torch.tanh(block_p / softcap) / 0.7  # logits of a capped head at temperature 0.7
        head = LinearHead(torch.zeros(width, 2, device=DEVICE), temperature=0.7, softcap=softcap, logit_scale=1.5)
        lse_p, lse_q = torch.logsumexp(block_p, 1), torch.logsumexp(block_q, 1)
        log_p, log_q = block_p - lse_p[:, None], block_q - lse_q[:, None]
        kl = (log_p.exp() * (log_p - log_q).nan_to_num(nan=0.0)).sum(1)
        stats = kl_math.KLStats(lse_p, lse_q, kl)
        grad_kl = torch.randn(num_rows, device=DEVICE)
        want = kl_math.kl_block_logits_grad(head, block_p.clone(), block_q.clone(), stats, grad_kl)
        got = triton_ops.kl_block_logits_grad(head, block_p.clone(), block_q.clone(), stats, grad_kl)
        assert torch.isfinite(want).all() and (width == 1 or want.abs().max() > 0)  # one column: p = q = 1
        _assert_close(got, want, "KL block gradient")

    @pytest.mark.parametrize("target", list(triton_ops.STATS_TILES))
    def test_each_gpu_targets_tiles_give_the_pytorch_blocks_results(target, monkeypatch):
        """Every kernel at the tiles a GPU target runs (the interpreter runs larger ones: fewer programs), on rows
        that are not a multiple of the row tile and a prime width of several column tiles, every option on."""
        monkeypatch.setattr(triton_ops, "device_tiles",
                            lambda device: (triton_ops.STATS_TILES[target], triton_ops.GRAD_TILES[target]))
        num_rows, width = 3, 1009
        test_update_stats(num_rows, width, neg_inf=True)
        for softcap in (None, 3.0):
            test_block_logits_grad(num_rows, width, softcap, present=(True, True, True, True))
            test_kl_block_logits_grad(num_rows, width, softcap)
            test_jsd_block_logits_grad(num_rows, width, softcap, beta=0.3)
        test_kl_update_stats(num_rows, width, True, need_gap=True, need_entropy=(True, True))
        test_jsd_update_stats(num_rows, width, True, beta=0.3)
        test_jsd_block_logits_grad(num_rows, width, None, beta=0.0)

    @pytest.mark.parametrize("softcap", [None, 2.0])
    def test_fused_kl_on_triton_matches_the_pytorch_blocks(softcap):
        """fused_linear_kl with impl="triton" (both passes on the kernels) against impl="chunked" and the
        materialized KL: odd shapes (rows not a multiple of the chunk, a prime vocabulary), a -inf bias,
        different hidden sizes, a mask, a soft cap."""
        from logitless.ops import BlockSizes, fused_linear_kl

        generator = torch.Generator().manual_seed(7)
        vocab = 1009
        hidden_p = (torch.randn(3, 7, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        weight_p = (torch.randn(vocab, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        bias_p = torch.randn(vocab, generator=generator).to(DEVICE).requires_grad_()
        hidden_q = (torch.randn(3, 7, 5, generator=generator) * 0.6).to(DEVICE)
        weight_q = (torch.randn(vocab, 5, generator=generator) * 0.6).to(DEVICE)
        bias_q = torch.randn(vocab, generator=generator).to(DEVICE)
        bias_q[::11] = float("-inf")  # q's padded rows; p never puts mass there only if its bias does too
        with torch.no_grad():
            bias_p[::11] = float("-inf")
        mask = torch.rand(3, 7, generator=generator) > 0.25
        inputs = (hidden_p, weight_p, bias_p)

        def kl_and_grads(**options):
            kl = fused_linear_kl(hidden_p, weight_p, hidden_q, weight_q, bias_p=bias_p, bias_q=bias_q,
                                 temperature=0.8, softcap=softcap, logit_scale=1.3, mask=mask.to(DEVICE), **options)
            weights = torch.linspace(0.5, 1.5, kl.numel(), device=DEVICE).reshape(kl.shape)
            return [kl, *torch.autograd.grad((kl * weights).sum(), inputs)]

        got = kl_and_grads(impl="triton", block_sizes=BlockSizes(4, 300))
        for want in (kl_and_grads(impl="chunked", block_sizes=BlockSizes(4, 300)), kl_and_grads(impl="reference")):
            for name, g, w in zip(("kl", "grad hidden", "grad weight", "grad bias"), got, want):
                assert torch.isfinite(w).all(), name
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    # 18 tokens, hidden 16, a prime vocabulary of 3 blocks
    PRECISION_SHAPE, PRECISION_BLOCKS = (2, 9, 16, 601), dict(block_sizes=BlockSizes(16, 256))

    @pytest.mark.parametrize("impl", ["triton", "chunked"])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("op", list(OPS))
    def test_every_op_meets_the_precision_contract(op, dtype, impl):
        """Each op's outputs and gradients in fp32, bf16 and fp16 inputs against the fp64 oracle on the same input
        values, within docs/fused_ops.md's bounds; the gradients come back in the inputs' dtype."""
        outputs_bound, grads_bound = precision_contract()[dtype]
        dtype = getattr(torch, dtype)
        exact = run_case(OPS[op], PRECISION_SHAPE, torch.float64, "cpu", values=dtype, impl="reference")
        x = on(case_inputs(*PRECISION_SHAPE), DEVICE, dtype)
        got = outputs_and_grads(OPS[op], x, impl=impl, **PRECISION_BLOCKS)
        assert [g.dtype for g in got[-len(TRAINED):]] == [dtype] * len(TRAINED)
        for index, (name, g, want) in enumerate(zip(output_names(exact), got, exact)):
            bound = outputs_bound if index < len(exact) - len(TRAINED) else grads_bound
            error = relative_error(g.detach().double().cpu(), want)
            assert error <= bound, (name, error, bound)

    def test_fused_ops_end_to_end_on_triton(monkeypatch):
        """The fused ops with the Triton kernels forced, several blocks and chunks, against the oracles. The losses
        known at forward time take the two-pass schedule, whose blocks the kernels compute, as on a GPU."""
        from logitless import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
        from logitless.ops import BlockSizes, reference
        from logitless.ops import plan as schedule
        from logitless.ops.api import implementations

        monkeypatch.setenv("LOGITLESS_TRITON", "1")
        monkeypatch.setattr(schedule, "SINGLE_PASS_DEVICES", ())
        grad_kernel_calls, kernel = [], triton_ops.block_logits_grad
        monkeypatch.setattr(triton_ops, "block_logits_grad",
                            lambda *args, **kwargs: grad_kernel_calls.append(1) or kernel(*args, **kwargs))
        chosen = implementations("auto", torch.device(DEVICE), torch.float32)[0]
        assert chosen.triton and chosen.kernels(None)._triton is triton_ops
        hidden = (torch.randn(2, 9, 8) * 0.5).to(DEVICE).requires_grad_()
        weight = (torch.randn(1009, 8) * 0.5).to(DEVICE).requires_grad_()
        bias = torch.randn(1009, device=DEVICE)
        bias[::7] = float("-inf")  # padded vocabulary rows
        ids = torch.randint(0, 1009, (2, 9)).to(DEVICE)
        ids[ids % 7 == 0] += 1
        mask = torch.ones(2, 9, device=DEVICE)
        mask[1, 5:] = 0
        blocks = dict(block_sizes=BlockSizes(4, 300))
        log_probs, entropy = fused_linear_logprobs(hidden, weight, ids, bias=bias, temperature=0.7,
                                                   return_token_entropy=True, mask=mask, **blocks)
        ref_log_probs, ref_entropy = reference.linear_logprobs(hidden, weight, ids, bias=bias, temperature=0.7,
                                                               return_token_entropy=True)
        got = [log_probs, entropy, *torch.autograd.grad((log_probs + entropy).sum(), (hidden, weight))]
        want = [ref_log_probs * mask, ref_entropy * mask,
                *torch.autograd.grad(((ref_log_probs + ref_entropy) * mask).sum(), (hidden, weight))]
        for name, g, w in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, want):
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

        calls_before_cross_entropy = len(grad_kernel_calls)
        cross = fused_linear_cross_entropy(hidden, weight, ids, label_smoothing=0.1, softcap=2.0, **blocks)
        ref_cross = reference.cross_entropy(reference.linear_logits(hidden, weight, softcap=2.0), ids,
                                            label_smoothing=0.1)
        for g, w in zip((cross, *torch.autograd.grad(cross, (hidden, weight))),
                        (ref_cross, *torch.autograd.grad(ref_cross, (hidden, weight)))):
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-6)
        calls_before_grpo = len(grad_kernel_calls)
        assert calls_before_grpo > calls_before_cross_entropy

        advantages, old = torch.randn(2, device=DEVICE), (ref_log_probs.detach() + 0.2)
        args = (hidden, weight, ids, mask, advantages)
        kwargs = dict(old_log_probs=old, ref_log_probs=old - 0.1, beta=0.04, temperature=0.7, softcap=1.5)
        loss, _ = fused_grpo_loss(*args, **kwargs, **blocks)
        ref_loss, _ = reference.grpo_loss(*args, **kwargs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, w in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(ref_loss, (hidden, weight))):
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-6)
        assert len(grad_kernel_calls) > calls_before_grpo

    def test_a_kernel_that_cannot_run_here_gives_way_to_the_pytorch_blocks_once(monkeypatch, caplog):
        """A statistics kernel whose launch fails as on a GPU without the shared memory its tile needs: "auto" runs
        the PyTorch twin for that call and every later one on the device, with one warning naming the kernel, the
        device and the compiler's message, and the same numbers; impl="triton" raises the kernel's error."""
        from triton.runtime.errors import OutOfResources

        from logitless import fused_linear_logprobs
        from logitless.ops import fallback
        from logitless.ops import plan as schedule
        from logitless.ops.api import implementations

        class Refused:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(grid)
                    raise OutOfResources(232448, 101376, "shared memory")
                return launch

        launches = []
        monkeypatch.setenv("LOGITLESS_TRITON", "1")
        monkeypatch.setattr(schedule, "SINGLE_PASS_DEVICES", ())
        monkeypatch.setattr(fallback, "_FAILED", {})
        monkeypatch.setattr(triton_ops, "_update_stats_kernel", Refused())
        hidden = (torch.randn(7, 8) * 0.5).to(DEVICE)
        weight = (torch.randn(301, 8) * 0.5).to(DEVICE)
        ids = torch.randint(0, 301, (7,)).to(DEVICE)
        want, _ = reference.linear_logprobs(hidden, weight, ids)
        with caplog.at_level("WARNING", logger="logitless.ops.fallback"):
            for _ in range(2):
                torch.testing.assert_close(fused_linear_logprobs(hidden, weight, ids), want, rtol=1e-5, atol=1e-5)
        [warning] = [record.getMessage() for record in caplog.records]
        assert "the Triton kernel of update_stats failed on cpu: OutOfResources: out of resource: shared memory, " \
            "Required: 232448, Hardware limit: 101376" in warning and "impl='triton' would raise" in warning
        assert len(launches) == 1  # the second call went straight to the PyTorch blocks
        assert not implementations("auto", torch.device(DEVICE), torch.float32)[0].triton
        with pytest.raises(OutOfResources):
            fused_linear_logprobs(hidden, weight, ids, impl="triton")

    def test_impl_triton_matches_the_reference():
        """impl="triton" runs the kernels in both passes (never the one-pass PyTorch schedule), whatever
        LOGITLESS_TRITON says, and agrees with impl="reference"; it refuses fp64."""
        from logitless import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
        from logitless.ops import BlockSizes

        generator = torch.Generator().manual_seed(0)
        hidden = (torch.randn(2, 7, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        weight = (torch.randn(301, 8, generator=generator) * 0.6).to(DEVICE).requires_grad_()
        ids = torch.randint(0, 301, (2, 7), generator=generator).to(DEVICE)
        mask = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
        mask[1, 4:] = False
        advantages, old = torch.tensor([1.0, -0.5], device=DEVICE), torch.full((2, 7), -5.0, device=DEVICE)
        ops = [
            lambda **o: sum(fused_linear_logprobs(hidden, weight, ids, mask=mask,
                                                  return_token_entropy=True, softcap=3.0,
                                                  **o)).sum(),
            lambda **o: fused_linear_cross_entropy(hidden, weight, ids.masked_fill(~mask, -100), label_smoothing=0.1,
                                                   **o),
            lambda **o: fused_grpo_loss(hidden, weight, ids, mask, advantages, old_log_probs=old,
                                        ref_log_probs=old + 0.1, beta=0.04, temperature=0.8, **o)[0],
        ]
        for op in ops:
            want = op(impl="reference")
            got = op(impl="triton", block_sizes=BlockSizes(5, 64))
            for g, w in zip((got, *torch.autograd.grad(got, (hidden, weight))),
                            (want, *torch.autograd.grad(want, (hidden, weight)))):
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="impl: 'triton' runs fp32 block logits"):
            fused_linear_logprobs(hidden.double(), weight.double(), ids, impl="triton")

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(num_rows=st.integers(0, 20), vocab=st.integers(2, 700), block=st.integers(16, 300), neg_inf=st.booleans(),
           softcap=st.one_of(st.none(), st.floats(0.5, 20.0)), temperature=st.floats(0.3, 2.0),
           seed=st.integers(0, 2**16))
    def test_random_shapes_through_the_kernels(num_rows, vocab, block, neg_inf, softcap, temperature, seed):
        """Log-probs, entropy, cross-entropy and the GRPO loss with the kernels forced (the two-pass schedule,
        as on GPUs), each op's values and gradients against its oracle on its own."""
        import os as _os

        from logitless import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
        from logitless.ops import BlockSizes, reference
        from logitless.ops import plan as blocks

        _os.environ["LOGITLESS_TRITON"] = "1"
        single_pass_devices, blocks.SINGLE_PASS_DEVICES = blocks.SINGLE_PASS_DEVICES, ()
        try:
            generator = torch.Generator().manual_seed(seed)
            hidden = (torch.randn(1, num_rows, 6, generator=generator) * 0.7).requires_grad_()
            weight = (torch.randn(vocab, 6, generator=generator) * 0.7).requires_grad_()
            bias = torch.randn(vocab, generator=generator)
            if neg_inf:
                bias[1::4] = float("-inf")
            ids = torch.randint(0, vocab, (1, num_rows), generator=generator)
            ids = ids - ids % 4 if neg_inf else ids  # never a -inf row
            mask = torch.rand(1, num_rows, generator=generator) > 0.2
            advantages = torch.randn(1, generator=generator)
            head = dict(bias=bias, temperature=temperature, softcap=softcap)
            sizes = BlockSizes(vocab=block)
            log_probs, entropy = fused_linear_logprobs(hidden, weight, ids, return_token_entropy=True, mask=mask,
                                                       block_sizes=sizes, **head)
            ref_log_probs, ref_entropy = reference.linear_logprobs(hidden, weight, ids, return_token_entropy=True,
                                                                   **head)
            ignored = ids.masked_fill(~mask, -100)
            checks = {
                "log_probs": (log_probs, ref_log_probs * mask),
                "entropy": (entropy, ref_entropy * mask),
                "cross_entropy": (fused_linear_cross_entropy(hidden, weight, ignored, reduction="sum",
                                                             block_sizes=sizes, **head),
                                  reference.cross_entropy(reference.linear_logits(hidden, weight, **head), ignored,
                                                          reduction="sum")),
                "grpo": (fused_grpo_loss(hidden, weight, ids, mask, advantages, block_sizes=sizes, **head)[0],
                         reference.grpo_loss(hidden, weight, ids, mask, advantages, **head)[0]),
            }
            for name, (got, want) in checks.items():
                weights = torch.linspace(0.5, 1.5, want.numel()).reshape(want.shape)  # any upstream gradient
                for what, g, w in zip(("value", "grad hidden", "grad weight"),
                                      (got, *_grads_or_zeros((got * weights).sum(), (hidden, weight))),
                                      (want, *_grads_or_zeros((want * weights).sum(), (hidden, weight)))):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4,
                                               msg=lambda m, n=f"{name} {what}": f"{n}: {m}")
        finally:
            blocks.SINGLE_PASS_DEVICES = single_pass_devices
            _os.environ.pop("LOGITLESS_TRITON")

    def _grads_or_zeros(output, inputs):
        """The gradients of ``output`` (zeros when no token reaches it), keeping the graph (log-probs and entropy
        share one)."""
        if not output.requires_grad:
            return [torch.zeros_like(t) for t in inputs]
        return torch.autograd.grad(output, inputs, allow_unused=True, materialize_grads=True, retain_graph=True)

else:

    @pytest.mark.interpreter
    def test_kernels_in_interpreter():
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
        report = child.stdout[-4000:] + child.stderr[-4000:]
        assert child.returncode == 0, report
        assert re.search(r"\b\d+ passed", child.stdout) and "skipped" not in child.stdout, report
