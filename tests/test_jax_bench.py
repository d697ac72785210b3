"""`logitless bench jax` on tiny shapes: the report's fields, the plot, compile-only, bad options."""

import json

import pytest

from logitless.cli import main


@pytest.mark.slow
def test_bench_jax_runs_every_implementation_and_they_agree(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "jax", "--loss", "grpo", "-B", "2", "-T", "8", "-H", "8", "-V", "1009",
                 "--vocab-block", "128", "--seq-chunks", "4", "--compile-shape", "1,16,8,257,bfloat16",
                 "--repeats", "2", "--json", str(out_json), "--plot", str(out_png)]) == 0
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
                 "--dtype", "bfloat16", "--compile-shape", "none", "--json", str(out_json)]) == 0
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
