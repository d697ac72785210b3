"""`logitless bench jax` on tiny shapes: the report's fields, the plot, compile-only, bad options."""

import json

import pytest

from logitless.cli import main

pytestmark = pytest.mark.jax_alone  # `make test` runs this file's tests in its JAX-only environment


@pytest.mark.slow
@pytest.mark.torch  # the plot: matplotlib comes with PyTorch's extra, not with the JAX one
def test_bench_jax_runs_every_implementation_and_they_agree(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "jax", "--loss", "grpo", "-B", "2", "-T", "8", "-H", "8", "-V", "1009",
                 "--vocab-block", "128", "--seq-chunks", "4", "--compile-shape", "1,16,8,257,bfloat16",
                 "--repeats", "2", "--tokamax", "off", "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["shapes"] == {"compile": {"batch": 1, "seq": 16, "hidden": 8, "vocab": 257, "dtype": "bfloat16",
                                            "vocab_block": 128, "seq_chunks": 4},
                                "run": {"batch": 2, "seq": 8, "hidden": 8, "vocab": 1009, "dtype": "float32",
                                        "vocab_block": 128, "seq_chunks": 4}}
    assert report["backend"] == "cpu" and not report["compile_only"] and report["losses"] == ["grpo"]
    assert "time_s" not in report["results"]["compile"]["grpo"]["plain"]
    for loss, results in report["results"]["run"].items():
        assert set(results) == {"plain", "seq_chunked", "logitless"}
        for result in results.values():
            assert result["temp_size_in_bytes"] > 0 and result["argument_size_in_bytes"] > 0
            assert len(result["times_s"]) == 2 and result["time_s"] > 0
            assert result["loss"] == pytest.approx(results["plain"]["loss"], rel=1e-6, abs=1e-6), loss
            assert result["max_abs_grad_diff"] < 1e-6, loss
        logitless = results["logitless"]
        assert logitless["temp_ratio"] == pytest.approx(logitless["temp_size_in_bytes"]
                                                        / results["plain"]["temp_size_in_bytes"])
    assert out_png.stat().st_size > 5000
    assert "seq_chunked" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_jax_compile_only_allocates_nothing(tmp_path, monkeypatch):
    import logitless.bench.jax as bench

    def no_inputs(loss, shape):
        raise AssertionError("--compile-only made the inputs")

    monkeypatch.setattr(bench, "make_inputs", no_inputs)
    out_json = tmp_path / "c.json"
    assert main(["bench", "jax", "--compile-only", "--loss", "ce", "kl", "-T", "512", "-H", "16", "-V", "32003",
                 "--dtype", "bfloat16", "--compile-shape", "none", "--tokamax", "off", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["compile_only"] and report["repeats"] == 0 and set(report["shapes"]) == {"run"}
    for loss, results in report["results"]["run"].items():
        assert "time_s" not in results["logitless"]
        assert results["logitless"]["temp_size_in_bytes"] < results["seq_chunked"]["temp_size_in_bytes"] \
            < results["plain"]["temp_size_in_bytes"], loss


@pytest.mark.parametrize("argv, match", [
    (["--dtype", "float16"], "--dtype: expected one of float32, bfloat16"),
    (["--loss", "ce", "dpo"], "--loss: expected some of ce, kl, grpo, got 'dpo'"),
    (["-T", "0"], "--seq: must be >= 1"),
    (["--vocab-block", "0"], "--vocab-block: must be >= 1"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--seq-chunks", "3"], "--seq-chunks: 3 does not divide the 512 tokens"),
    (["--compile-shape", "1,8192,4096"], "--compile-shape: expected B,T,H,V,DTYPE"),
])
def test_bench_jax_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "jax", *argv])


@pytest.mark.slow
def test_peak_worker_runs_one_step_in_a_fresh_process():
    """The worker behind the GPU/TPU peak_bytes_in_use column; on CPU the device keeps no such counter."""
    import subprocess
    import sys

    shape = json.dumps({"batch": 1, "seq": 4, "hidden": 8, "vocab": 257, "dtype": "float32", "vocab_block": 64,
                        "seq_chunks": 2})
    done = subprocess.run([sys.executable, "-m", "logitless.bench.jax", "--peak-worker", "ce", "logitless",
                           "--shape", shape], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"peak_bytes_in_use_before_step": None,
                                                                "peak_bytes_in_use": None}


# The Tokamax rows. Tokamax needs Python >= 3.12, which this suite's interpreter may not be: the rows are checked here
# on a stand-in `tokamax` package (plain JAX, with chunked_xla's zero-padded vocabulary), run in this interpreter and
# in a stand-in peer interpreter; the real Tokamax runs in the benchmark (docs/BENCHMARKS.md).

STUB_TOKAMAX = '''"""A stand-in for Tokamax's linear_softmax_cross_entropy_loss, in plain JAX."""
import jax
import jax.numpy as jnp

__version__ = "0.0.0+stub"


def linear_softmax_cross_entropy_loss(x, labels, weights, *, reduction="sum", implementation=None):
    if implementation == "chunked_xla":  # zero columns up to a multiple of the block, as chunked_xla pads
        weights = jnp.pad(weights, ((0, 0), (0, -weights.shape[1] % 128)))
    logits = (x @ weights).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - picked
    return {"none": losses, "sum": losses.sum(), "mean": losses.mean()}[reduction]
'''


def _stub_tokamax(folder):
    """A `tokamax` package under ``folder`` with the stand-in loss and both implementations named."""
    api = folder / "tokamax" / "_src" / "ops" / "linear_softmax_cross_entropy_loss"
    api.mkdir(parents=True)
    (folder / "tokamax" / "__init__.py").write_text(STUB_TOKAMAX)
    for package in (folder / "tokamax" / "_src", folder / "tokamax" / "_src" / "ops", api):
        (package / "__init__.py").touch()
    (api / "api.py").write_text('IMPLEMENTATIONS = {"xla": None, "chunked_xla": None}\n')
    return folder


def _padded_error(comparison, pad):
    """The loss's relative error when ``pad`` zero logits enter every token's log-sum-exp, in float64."""
    import numpy as np

    from logitless.bench.tokamax import make_inputs

    inputs = make_inputs(comparison, "float32")
    hidden, weight = np.asarray(inputs["hidden"], np.float64), np.asarray(inputs["weight"], np.float64)
    logits = hidden @ weight.T
    lse = np.log(np.exp(logits).sum(axis=1))
    loss = (lse - logits[np.arange(len(logits)), np.asarray(inputs["targets"])]).sum()
    return np.log1p(pad * np.exp(-lse)).sum() / loss


def _check_rows(section, comparison):
    from logitless.bench.tokamax import IMPLEMENTATIONS, REDUCTIONS

    assert section["tokamax"] == "0.0.0+stub" and section["comparison"]["tokens"] == comparison.tokens
    expected = _padded_error(comparison, -comparison.vocab % 128)
    for reduction in REDUCTIONS:
        rows = section["results"]["float32"][reduction]
        assert list(rows) == list(IMPLEMENTATIONS)
        for impl, row in rows.items():
            assert row["temp_size_in_bytes"] > 0 and row["time_s"] > 0 and len(row["times_s"]) == 1, impl
            assert row["loss_only_s"] > 0 and row["gemms"] == pytest.approx(row["time_s"] / row["gemm_s"]), impl
        for impl in ("plain", "tokamax_xla", "logitless"):
            assert max(rows[impl][name] for name in ("loss_rel_err", "dhidden_rel_err", "dweight_rel_err")) < 1e-5
        padded = rows["tokamax_chunked_xla"]
        assert padded["loss_rel_err"] == pytest.approx(expected, rel=1e-3), reduction
        assert padded["dhidden_rel_err"] > 1e-3 and padded["dweight_rel_err"] > 1e-3
        fastest = rows["logitless"]["fastest_tokamax"]
        assert rows[fastest]["time_x_tokamax"] == 1.0 and rows[fastest]["temp_x_tokamax"] == 1.0
        assert rows["logitless"]["time_x_tokamax"] == pytest.approx(rows["logitless"]["time_s"]
                                                                    / rows[fastest]["time_s"])
    mean, total = section["results"]["float32"]["mean"]["plain"], section["results"]["float32"]["per_token"]["plain"]
    assert mean["loss"] == pytest.approx(total["loss"] / comparison.tokens, rel=1e-6)


TINY = ["-B", "2", "-T", "8", "-H", "8", "-V", "300", "--repeats", "1", "--tokamax-dtypes", "float32"]


@pytest.mark.slow
def test_the_tokamax_rows_run_in_a_peer_interpreter_and_merge_into_the_report(tmp_path, monkeypatch, capsys):
    import os
    import stat
    import sys

    import logitless.bench.tokamax as bench_tokamax

    monkeypatch.setattr(bench_tokamax, "tokamax_unavailable", lambda: "tokamax is not installed for this Python")
    stub = _stub_tokamax(tmp_path / "stub")
    peer = tmp_path / "peer-python"  # this interpreter with the stand-in on its path, as a separate program
    peer.write_text(f'#!/bin/sh\nPYTHONPATH="{stub}{os.pathsep}$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    peer.chmod(peer.stat().st_mode | stat.S_IEXEC)
    out_json = tmp_path / "t.json"
    assert main(["bench", "jax", "--tokamax", "only", *TINY, "--peer-python", str(peer), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert f"tokamax is not installed for this Python; the Tokamax comparison (logitless's and plain JAX's rows " \
           f"with it) runs in {peer}\n" in out
    assert "tokamax_chunked_xla" in out and "x tkmx" in out
    report = json.loads(out_json.read_text())
    assert report["losses"] == [] and report["results"] == {"run": {}}
    _check_rows(report["tokamax"], bench_tokamax.Comparison(16, 8, 300, ["float32"], 1))


@pytest.mark.slow
def test_the_tokamax_rows_run_in_this_interpreter_when_it_has_tokamax(tmp_path, monkeypatch, capsys):
    import sys

    import logitless.bench.tokamax as bench_tokamax

    monkeypatch.syspath_prepend(str(_stub_tokamax(tmp_path / "stub")))
    for name in [name for name in sys.modules if name == "tokamax" or name.startswith("tokamax.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        assert bench_tokamax.tokamax_unavailable() is None
        section = bench_tokamax.tokamax_section(bench_tokamax.Comparison(16, 8, 300, ["float32"], 1),
                                                peer_python=str(tmp_path / "none"), progress=False)
    finally:
        for name in [name for name in sys.modules if name == "tokamax" or name.startswith("tokamax.")]:
            del sys.modules[name]  # the stand-in stays out of the other tests
    assert capsys.readouterr().out == ""
    assert section["ran_in"] == sys.executable
    _check_rows(section, bench_tokamax.Comparison(16, 8, 300, ["float32"], 1))


def test_without_tokamax_or_a_peer_one_line_says_how_to_get_it_and_the_other_rows_run(tmp_path, monkeypatch,
                                                                                       capsys):
    import logitless.bench.tokamax as bench_tokamax

    monkeypatch.setattr(bench_tokamax, "tokamax_unavailable", lambda: "tokamax is not installed for this Python")
    out_json, missing = tmp_path / "m.json", tmp_path / "no-venv" / "bin" / "python"
    assert main(["bench", "jax", "--compile-only", "--loss", "ce", "--compile-shape", "none", "-T", "16", "-H", "8",
                 "-V", "257", "--seq-chunks", "2", "--peer-python", str(missing), "--json", str(out_json)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "Tokamax" in line]
    assert lines == [f"bench jax: no Tokamax rows: tokamax is not installed for this Python, and there is no peer "
                     f"interpreter at {missing} (`make tokamax-env` makes one; or --peer-python PATH)"]
    report = json.loads(out_json.read_text())
    assert report["tokamax"] == {"skipped": lines[0]}
    assert set(report["results"]["run"]["ce"]) == {"plain", "seq_chunked", "logitless"}


def test_a_failing_peer_is_one_line_and_the_exit_status(tmp_path, monkeypatch, capsys):
    import stat

    import logitless.bench.tokamax as bench_tokamax

    monkeypatch.setattr(bench_tokamax, "tokamax_unavailable", lambda: "tokamax is not installed for this Python")
    peer = tmp_path / "python"
    peer.write_text("#!/bin/sh\necho 'no module named tokamax' >&2\nexit 3\n")
    peer.chmod(peer.stat().st_mode | stat.S_IEXEC)
    out_json = tmp_path / "f.json"
    assert main(["bench", "jax", "--tokamax", "only", "--compile-only", *TINY, "--peer-python", str(peer),
                 "--json", str(out_json)]) == 1
    failed = f"bench jax: the Tokamax rows failed in {peer}: {peer} exited with status 3; its error is above"
    assert failed in capsys.readouterr().out.splitlines()
    assert json.loads(out_json.read_text())["tokamax"] == {"failed": failed}


def test_the_float64_reference_and_the_error_metric_catch_a_padded_log_sum_exp():
    """chunked_xla's error: its zero-padded vocabulary columns enter the log-sum-exp, which is then too high by
    log1p(pad * exp(-lse)). The metric must see it, and must see fp32 rounding as rounding."""
    import numpy as np

    from logitless.bench.tokamax import float64_cross_entropy, relative_errors

    rng = np.random.default_rng(1)
    n, h, v, pad = 6, 8, 300, 84
    hidden, weight = rng.standard_normal((n, h)), rng.standard_normal((v, h)) * 0.3
    targets = rng.integers(0, v, n)
    reference = float64_cross_entropy(hidden, weight, targets, chunk=4)  # a ragged last chunk
    logits = hidden @ weight.T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    rows = np.arange(n), targets
    assert reference[0] == pytest.approx(-np.log(probs[rows]).sum(), rel=1e-12)
    probs[rows] -= 1
    assert np.allclose(reference[1], probs @ weight, rtol=1e-12) and np.allclose(reference[2], probs.T @ hidden,
                                                                                 rtol=1e-12)
    assert relative_errors(*reference, reference) == {"loss_rel_err": 0.0, "dhidden_rel_err": 0.0,
                                                      "dweight_rel_err": 0.0}
    rounded = float64_cross_entropy(hidden.astype(np.float32), weight.astype(np.float32), targets)
    rounded = (np.float32(rounded[0]), rounded[1].astype(np.float32), rounded[2].astype(np.float32))
    assert max(relative_errors(*rounded, reference).values()) < 1e-6

    padded_logits = np.concatenate([logits, np.zeros((n, pad))], axis=1)  # the padding columns' logits are 0
    lse = np.log(np.exp(logits).sum(axis=1))
    padded_lse = np.log(np.exp(padded_logits).sum(axis=1))
    assert np.allclose(padded_lse - lse, np.log1p(pad * np.exp(-lse)))
    padded_probs = np.exp(logits - padded_lse[:, None])
    padded_probs[rows] -= 1
    padded = ((padded_lse - logits[rows]).sum(), padded_probs @ weight, padded_probs.T @ hidden)
    errors = relative_errors(*padded, reference)
    assert errors["loss_rel_err"] == pytest.approx(np.log1p(pad * np.exp(-lse)).sum() / reference[0], rel=1e-9)
    assert min(errors.values()) > 1e-3


def test_bench_jax_help_documents_the_tokamax_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "jax", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--tokamax {auto,off,only}" in text and "(default: auto)" in text
    assert "--tokamax-dtypes {float32,bfloat16} [{float32,bfloat16} ...]" in text
    assert "(default: float32 bfloat16)" in text
    assert "--peer-python PATH" in text and "(default: .venv-tokamax/bin/python)" in text
