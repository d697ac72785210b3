import json

import pytest

from logitless.cli import main


@pytest.mark.slow
def test_bench_lmhead_small_shape(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "lmhead", "-B", "2", "-T", "16", "-H", "8", "-V", "1009", "--repeats", "1",
                 "--masked-fraction", "0.25", "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["shape"] == {"batch": 2, "seq": 16, "hidden": 8, "vocab": 1009, "dtype": "float32", "device": "cpu",
                               "masked_fraction": 0.25, "loss": "grpo", "block_tokens": None}
    assert report["tokens"] == 24 and report["flops"] == 6 * 24 * 8 * 1009
    assert set(report["results"]) == {"materialized", "materialized_minimal", "gemm", "torch_chunked", "liger", "trl",
                                      "logitless"}
    for name, result in report["results"].items():
        assert result["time_s"] > 0 and result["tokens_per_s"] > 0 and result["bound_fraction"] > 0
        if name != "gemm":  # every loss equals the materialized one, with the same gradients
            assert result["loss_diff"] < 1e-5 and result["max_abs_grad_diff"] < 1e-5, name
    assert report["results"]["materialized"]["max_abs_grad_diff"] == 0.0
    assert report["results"]["materialized_minimal"]["time_ratio_minimal"] == 1.0
    assert out_png.stat().st_size > 5000
    assert "logitless" in capsys.readouterr().out


@pytest.fixture
def lmhead_in_process(monkeypatch):
    """bench lmhead's implementations run in this process, one after another: the results but the peaks are the same
    as in fresh processes, which test_bench_lmhead_small_shape spawns."""
    from logitless.bench import lmhead, lmhead_steps

    monkeypatch.setattr(lmhead, "_spawn", lambda implementation, shape, repeats, grads_path, profile:
                        lmhead_steps.run_worker(implementation, shape, repeats, grads_path, profile))


@pytest.mark.slow
def test_bench_lmhead_kl(tmp_path, capsys, lmhead_in_process):
    out_json = tmp_path / "kl.json"
    assert main(["bench", "lmhead", "--loss", "kl", "-B", "2", "-T", "16", "-H", "8", "-V", "1009", "--repeats", "1",
                 "--masked-fraction", "0.25", "--block-tokens", "5", "--profile", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["flops"] == 8 * 24 * 8 * 1009  # two heads' logits, grad hidden, grad weight
    assert set(report["results"]) == {"materialized", "materialized_minimal", "gemm", "trl", "logitless@5"}
    assert report["results"]["logitless@5"]["chunk_tokens"] == 5
    for name in ("materialized_minimal", "trl", "logitless@5"):  # the same KL and gradients as F.kl_div's path
        result = report["results"][name]
        assert result["loss_diff"] < 1e-5 and result["max_abs_grad_diff"] < 1e-5, name
    assert report["results"]["materialized"]["loss"] > 0.01  # two different heads: a KL that can be wrong
    out = capsys.readouterr().out
    assert out.startswith("KL(p || q) fwd+bwd through the LM head")
    # --profile: where each step's time goes, logitless's KL function among the operators of its step
    assert all("Self CPU time total" in result["profile"] for result in report["results"].values())
    assert "LinearStats" in report["results"]["logitless@5"]["profile"]
    assert "where the time of logitless@5's step goes (torch.profiler)" in out


def test_bench_lmhead_reports_a_failing_peer_and_measures_the_others(tmp_path, capsys, monkeypatch,
                                                                     lmhead_in_process):
    """A peer whose worker fails (a kernel that does not build on this machine) is reported with its error, and the
    run still measures and writes the rest; a yardstick that fails ends the run, as every row needs it."""
    from logitless.bench import lmhead

    spawn = lmhead._spawn

    def spawn_where_trl_breaks(implementation, *args):
        if implementation == "trl":
            raise RuntimeError("logitless.bench.lmhead_steps --worker trl failed:\nCompilationError: no kernel")
        return spawn(implementation, *args)

    monkeypatch.setattr(lmhead, "_spawn", spawn_where_trl_breaks)
    argv = ["bench", "lmhead", "-B", "1", "-T", "8", "-H", "8", "-V", "101", "--repeats", "1", "--impl", "trl",
            "logitless", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["results"]) == {"materialized", "materialized_minimal", "logitless"}
    assert "CompilationError: no kernel" in report["failed"]["trl"]
    assert report["results"]["logitless"]["loss_diff"] < 1e-5
    captured = capsys.readouterr()
    assert captured.out.startswith("GRPO loss fwd+bwd through the LM head")  # the table; progress goes to stderr
    assert "trl: failed: CompilationError: no kernel" in captured.out
    assert "bench lmhead: trl failed, the others go on" in captured.err

    def spawn_broken(implementation, *args):
        raise RuntimeError(f"{implementation} broke")

    monkeypatch.setattr(lmhead, "_spawn", spawn_broken)
    with pytest.raises(RuntimeError, match="materialized broke"):
        main(argv)


@pytest.mark.slow
def test_bench_lmhead_block_curve_with_a_busy_process_beside_it(tmp_path, capsys, lmhead_in_process):
    """--block-tokens with several values: logitless once per value, each row with the chunk it ran and the logits
    it held; --busy: every implementation measured with busy processes beside it."""
    out_json = tmp_path / "curve.json"
    assert main(["bench", "lmhead", "-B", "2", "-T", "16", "-H", "8", "-V", "1009", "--repeats", "1",
                 "--impl", "gemm", "logitless", "--block-tokens", "4", "32", "--busy", "1",
                 "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["busy"] == 1
    assert set(report["results"]) == {"materialized", "materialized_minimal", "gemm", "logitless@4", "logitless@32"}
    curve = {name: report["results"][name] for name in ("logitless@4", "logitless@32")}
    assert [row["chunk_tokens"] for row in curve.values()] == [4, 32]
    assert [row["logits_mb"] for row in curve.values()] == [4 * 1009 * 4 / 2**20, 32 * 1009 * 4 / 2**20]
    assert all(row["loss_diff"] < 1e-5 and row["max_abs_grad_diff"] < 1e-5 for row in curve.values())
    out = capsys.readouterr().out
    assert "1 busy processes beside it" in out and "logitless@32: 32 tokens per row chunk" in out


@pytest.mark.parametrize("argv, match", [
    (["--loss", "ce"], "--loss: expected one of"),
    (["--busy", "-1"], "--busy: must be >= 0"),
    (["--block-tokens", "0"], "--block-tokens"),
    (["--dtype", "float16"], "--dtype"),
    (["--impl", "mine"], "--impl"),
    (["-B", "0"], "--batch"),
    (["--device", "cuda"], "--device: CUDA"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--masked-fraction", "1"], "--masked-fraction"),
    (["--json", "/proc/nowhere/r.json"], "--json: cannot write"),
])
def test_bench_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "lmhead", *argv])


@pytest.mark.slow
def test_bench_trl_small(tmp_path):
    """A trainer that does not generate and three that do (distillation at short completions, GRPO with RLPR's reward:
    the fused one against the obvious one with logits; VeriFree against GRPO with VeriFree's reward read from the
    logits), stock TRL and logitless, at a tiny size: the same losses (VeriFree's objective is not GRPO's: the same
    reward at the first step, before the two updates part), and every time and peak measured
    (tests/trl/test_trl_trainers.py checks each trainer's step against stock TRL's)."""
    out_json = tmp_path / "t.json"
    assert main(["bench", "trl", "--steps", "2", "--batch", "2", "--seq", "8", "--completions", "4",
                 "--completion-length", "16", "--short-completion-length", "3", "--rounds", "1", "--trainers", "sft",
                 "distill_short", "rlpr", "verifree", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert list(report["results"]) == ["sft", "distill_short", "rlpr", "verifree"]
    assert report["config"]["short_completion_length"] == 3
    for name, results in report["results"].items():
        assert set(results) == {"trl", "logitless"}, name
        for result in results.values():
            assert result["step_s"] > result["loss_backward_s"] > 0 and result["peak_mb"] > 0, name
            assert len(result["losses"]) == 2 and len(result["rounds_step_s"]) == 1
        if name != "verifree":
            assert results["logitless"]["losses"] == pytest.approx(results["trl"]["losses"], rel=1e-5, abs=1e-6), name
    rlpr = report["results"]["rlpr"]  # the mean reward of each step: the fused RLPR reward equals the obvious one
    assert len(rlpr["trl"]["rewards"]) == 2 and any(reward > 0 for reward in rlpr["trl"]["rewards"])
    assert rlpr["logitless"]["rewards"] == pytest.approx(rlpr["trl"]["rewards"], rel=1e-3, abs=0)  # they are ~1e-7
    verifree = report["results"]["verifree"]  # R = pi(y* | x, z) of the same tagged completions, read two ways
    assert verifree["trl"]["rewards"][0] > 0
    assert verifree["logitless"]["rewards"][0] == pytest.approx(verifree["trl"]["rewards"][0], rel=1e-3, abs=0)


@pytest.mark.slow
def test_bench_grpo_small(tmp_path, capsys):
    """On a model directory of the user's (a tokenizer-sized vocabulary, so the report must read it from there)."""
    from logitless.models import qwen_tokenizer, save_model_and_tokenizer, tiny_qwen2

    model_dir = save_model_and_tokenizer(tiny_qwen2(vocab_size=151646, hidden_size=16, intermediate_size=32),
                                         qwen_tokenizer(), tmp_path / "model")
    out_json = tmp_path / "g.json"
    assert main(["bench", "grpo", "--completions", "4", "--completion-length", "6", "--num-generations", "2",
                 "--steps", "1", "--setups", "default", "lora", "--model", str(model_dir), "--json",
                 str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["vocab_size"] == 151646 and report["config"]["device"] == "cpu"
    assert set(report["results"]) == {"default", "lora"}
    for results in report["results"].values():
        assert set(results) == {"trl", "logitless"}
        for result in results.values():
            assert result["time_s"] > result["loss_backward_s"] > 0 and result["peak_mb"] > 0
            assert len(result["losses"]) == 1
        # both trainers saw the same completions and computed the same loss and gradient (the loss of an on-policy
        # step can be 0 while its gradient is not)
        assert results["logitless"]["losses"] == pytest.approx(results["trl"]["losses"], abs=1e-6)
        assert results["trl"]["grad_norms"][0] > 0
        assert results["logitless"]["grad_norms"] == pytest.approx(results["trl"]["grad_norms"], rel=1e-4)
        assert results["logitless"]["mean_completion_length"] == results["trl"]["mean_completion_length"]
    with pytest.raises(SystemExit, match="--num-generations"):
        main(["bench", "grpo", "--completions", "5", "--num-generations", "2"])


@pytest.mark.parametrize("argv, match", [
    (["grpo", "--device", "cuda:1"], "--device: expected cpu or cuda, got 'cuda:1'"),
    (["grpo", "--device", "tpu"], "--device"),
    (["grpo", "--model", "/nowhere/model"], "--model: '/nowhere/model' is neither"),
    (["grade", "--device", "cuda:x"], r"--device: expected cpu or cuda\[:N\]"),
    (["grade", "--model", "qwen-huge"], "--model"),
    (["lmhead", "--device", "gpu"], "--device"),
])
def test_bench_device_and_model_options_name_the_option(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", *argv])


@pytest.mark.slow
def test_bench_reward_logits_path_makes_no_policy_forward(tmp_path):
    out_json = tmp_path / "r.json"
    assert main(["bench", "reward", "--completions", "4", "--completion-length", "12", "--num-generations", "2",
                 "--steps", "1", "--warm-start-steps", "3", "--json", str(out_json)]) == 0
    results = json.loads(out_json.read_text())["results"]
    assert results["logits"]["policy_forwards"] == 0
    assert results["fallback"]["policy_forwards"] == 4  # one per completion
    # the same generations and the same rewards either way
    assert results["logits"]["mean_reward"] == pytest.approx(results["fallback"]["mean_reward"], abs=1e-5)


def test_a_reference_peak_below_resolution_gives_no_ratio(tmp_path):
    # tiny shapes can leave the reference's CPU peak at 0 MB (its work fits in pages already resident)
    from logitless.bench import lmhead
    from logitless.bench.ratios import add_ratios

    def result(time_s, peak_mb):
        return dict(time_s=time_s, peak_mb=peak_mb, peak_with_grads_mb=peak_mb, loss_diff=0.0,
                    max_abs_grad_diff=0.0, tokens_per_s=1.0, tflops=1.0)

    results = {"materialized": result(2.0, 0.0), "materialized_minimal": result(1.6, 0.0), "gemm": result(0.5, 0.0),
               "logitless": result(1.0, 0.5)}
    lmhead.add_report_ratios(results)
    assert results["logitless"]["time_ratio"] == 0.5 and results["logitless"]["bound_fraction"] == 0.5
    assert results["logitless"]["peak_ratio"] is None and results["materialized"]["peak_ratio"] is None
    assert results["logitless"]["peak_ratio_minimal"] is None
    report = {"shape": {"batch": 1, "seq": 1, "hidden": 1, "vocab": 2, "dtype": "float32", "device": "cpu",
                        "loss": "grpo"},
              "tokens": 1, "results": results}
    assert lmhead.format_table(report).splitlines()[-2].split()[7] == "n/a"
    assert lmhead.plot(report, tmp_path / "p.png").stat().st_size > 5000

    results = {"materialized": result(2.0, 40.0), "logitless": result(1.0, 4.0)}
    add_ratios(results, "materialized")
    assert results["logitless"]["peak_ratio"] == 0.1
