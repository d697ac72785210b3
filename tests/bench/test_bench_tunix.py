"""`logitless bench tunix` at a tiny size: the report's rows for each learner and head, the fused head's smaller
compiled temporaries where the logits dominate, the seed-shape row compiled only, and bad options."""

import json

import pytest

from logitless.cli import main


@pytest.mark.slow
def test_bench_tunix_reports_each_learner_stock_and_fused_and_the_seed_shape(tmp_path, capsys):
    """The PEFT trainer's step at V=4096 (B=2, T=32, hidden 32: the logits are most of its temporaries): fused's
    temporaries are below a half of stock's and no array of fused's is as large as the logits (B, T, V) fp32; both
    timed. The GRPO step's scoring at a shrunk seed shape, compiled only: fused's temporaries below a half of
    stock's too."""
    out_json = tmp_path / "r.json"
    assert main(["bench", "tunix", "--learners", "peft", "-B", "2", "-T", "32", "-V", "4096",
                 "--seed-shape", "1,64,16,4096,bfloat16", "--repeats", "2", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["learners"] == ["peft"] and report["repeats"] == 2
    assert report["sizes"] == {"batch": 2, "seq": 32, "vocab": 4096}
    assert report["seed_shape"]["seq"] == 64 and report["seed_shape"]["dtype"] == "bfloat16"
    logits_bytes = 2 * 32 * 4096 * 4
    assert set(report["results"]["run"]) == {"peft"}
    for learner, by_head in report["results"]["run"].items():
        stock, fused = by_head["stock"], by_head["fused"]
        assert fused["temp_size_in_bytes"] < 0.5 * stock["temp_size_in_bytes"], learner
        assert fused["temp_ratio"] == pytest.approx(fused["temp_size_in_bytes"] / stock["temp_size_in_bytes"])
        assert stock["largest_array_bytes"] >= logits_bytes > fused["largest_array_bytes"], learner
        for row in (stock, fused):
            assert len(row["times_s"]) == 2 and row["time_s"] > 0 and row["compile_s"] > 0
        assert fused["time_ratio"] == pytest.approx(fused["time_s"] / stock["time_s"])
    seed = report["results"]["seed"]["grpo"]
    assert "time_s" not in seed["stock"]
    assert seed["fused"]["temp_size_in_bytes"] < 0.5 * seed["stock"]["temp_size_in_bytes"]
    out = capsys.readouterr().out
    assert "compile only: the GRPO step's scoring at B=1 T=64 H=16 V=4096 bfloat16" in out


@pytest.mark.parametrize("argv, match", [
    (["--learners", "sft"], r"--learners: expected some of grpo, dpo, orpo, peft, distillation, got .sft."),
    (["--seq", "4"], r"--seq: must be >= 8"),
    (["--seed-shape", "1,64,16"], r"--seed-shape: expected B,T,H,V,DTYPE"),
    (["--repeats", "0"], r"--repeats: must be >= 1, got 0"),
])
def test_bench_tunix_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "tunix", *argv])


def test_bench_tunix_help_documents_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "tunix", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option, default in (("--learners", "grpo dpo orpo peft distillation"), ("--batch", "2"), ("--seq", "128"),
                            ("--vocab", "151936"), ("--seed-shape", "1,8192,4096,151936,bfloat16"),
                            ("--repeats", "3"), ("--json", "not written")):
        assert option in out and f"(default: {default}" in out, option
